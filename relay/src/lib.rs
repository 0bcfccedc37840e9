//! kvrelay: a per-data-center KV relay for disaggregated LLM serving.
//!
//! Data flows top to bottom (see DESIGN.md): typed DC inputs become exact per-pool block
//! ownership, which drives one cuckoo filter (CKF) per pool, published as CBI1 snapshot and
//! delta frames next to a pool catalog, serving readiness and pool load.
//!
//! - Pure cores (values in, values and commands out; no tasks, clocks or I/O): `identity`,
//!   `hashing`, `ckf`, `cbi1`, `kv_events`, `inputs` (facts and decoders), `discovery`,
//!   `sources`, `registry`, `readiness`, `topology`, `load`, `control` (their composition),
//!   `pool` (ownership and publisher), `consumer::replica`, `wire`, `config`, `workload`.
//! - Effects (tokio tasks, sockets) live in a handful of shells: `pool::actor`, `publication`,
//!   `node`, `wan`, `demo`, the consumer client, and the production transports
//!   `discovery_plane`, `event_plane`, `request_plane`, wired together by `serve` (with `ops`, the
//!   operations HTTP surface over pure renderers). Time and blocking work enter through the
//!   `runtime` seams, randomness through `rng`.

pub mod cbi1;
pub mod ckf;
pub mod config;
pub mod consumer;
pub mod control;
pub mod demo;
pub mod discovery;
pub mod discovery_plane;
pub mod event_plane;
pub mod hashing;
pub mod identity;
pub mod inputs;
pub mod journal;
pub mod kv_events;
pub mod load;
pub mod node;
pub mod ops;
pub mod pem_files;
pub mod pool;
pub mod publication;
pub mod readiness;
pub mod registry;
pub mod request_plane;
pub mod rng;
pub mod runtime;
pub mod serve;
pub mod sources;
pub mod topology;
pub mod wan;
pub mod wire;
pub mod workload;
