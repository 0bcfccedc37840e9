//! The reference WAN consumer.
//!
//! A consumer keeps independent views per relay: catalog, one filter replica per pool,
//! readiness, load. The parts that need no network are pure: a filter replica that installs a
//! snapshot only once it is complete and valid and applies only contiguous deltas
//! ([`replica`](FilterReplica)), the consumer state that reconciles pools with the catalog
//! ([`state`]), the reaction to every way a stream can end ([`policy`]), reconnect pacing
//! ([`backoff`]), longest-prefix queries ([`query`]) and CLI text ([`render`]). The async shell
//! that moves messages between a relay and that state is [`client`]; it is the only module here
//! that spawns tasks.

pub mod backoff;
pub mod client;
pub mod compare;
pub mod pem_files;
pub mod policy;
pub mod query;
pub mod render;
pub mod render_json;
pub mod render_table;
pub mod state;
pub mod tls;

pub use backoff::{Backoff, BackoffPolicy, BackoffPolicyError};
pub use client::{
    ConsumerConfig, ConsumerError, ConsumerStopped, IdleTimeouts, RelayConsumer, connect,
    connect_lazy, endpoint,
};
pub use policy::{FaultKind, Plane, Reaction, StreamEnd};
pub use query::{QueryAnswer, QueryPool, Resolution};
pub use state::{
    ConsumerCounters, ConsumerHalt, ConsumerSnapshot, ConsumerState, FilterCopy, FilterStatus,
    PlaneStatus, PoolReplicaState,
};
pub use tls::{ClientTlsArgs, ClientTlsError};
