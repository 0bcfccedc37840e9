//! The lossy half of a pool: the cuckoo filter (exact layout and bounded kicks), its CBI1 wire
//! frames, and the replica a consumer keeps by applying those frames.

pub mod cbi1;
pub mod ckf;
mod replica;

pub use replica::{FilterFrame, FilterReplica, ReplicaFault, ReplicaProgress};
