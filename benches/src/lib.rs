//! Shared workloads for the kvrelay criterion benchmarks.

pub mod ingest;
