//! Shared workloads for the kvrelay criterion benchmarks.
