//! A workload model of a Dynamo deployment: workers that serve prefix-sharing requests, keep an
//! LRU KV cache per data-parallel rank and publish exactly the facts a real deployment would —
//! endpoint instances, cards, KV event-source adverts, contiguous KV events per publisher
//! incarnation, and occupancy reports — and answer recovery queries as their local indexers do.
//!
//! One model serves the `demo` command's in-process DC and the simulator's workers. It is pure:
//! every step takes a seeded RNG and returns [`DcInput`](kvrelay_core::inputs::DcInput) facts.

mod dc;
mod local_indexer;
mod traffic;
mod worker;

pub use dc::{Deployment, SimulatedDc};
pub use traffic::{Request, Traffic, TrafficConfig};
pub use worker::{RankCache, SimWorker, WorkerSpec};
