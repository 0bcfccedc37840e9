//! kvrelay: a per-data-center KV relay for disaggregated LLM serving.
//!
//! Data flows top to bottom through the modules (see DESIGN.md): typed DC inputs become exact
//! per-pool block ownership, which drives one cuckoo filter (CKF) per pool, published as CBI1
//! snapshot and delta frames. The modules declared here are pure: they take values and return
//! values, with no tasks, clocks or I/O, so the production shell and the simulator drive the
//! very same state machines.

pub mod cbi1;
pub mod ckf;
pub mod consumer;
pub mod discovery;
pub mod discovery_plane;
pub mod hashing;
pub mod identity;
pub mod inputs;
pub mod kv_events;
pub mod load;
pub mod pool;
pub mod publication;
pub mod readiness;
pub mod registry;
pub mod rng;
pub mod runtime;
pub mod sources;
pub mod topology;
