//! The reference WAN consumer's pure state machines.
//!
//! A consumer keeps independent views per relay: catalog, one filter replica per pool,
//! readiness, load. This module holds the parts that need no network: a filter replica that
//! installs a snapshot only once it is complete and valid and applies only contiguous deltas.

mod replica;

pub use replica::{FilterFrame, FilterReplica, ReplicaFault, ReplicaProgress};
