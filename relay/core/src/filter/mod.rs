//! The lossy half of a pool: the cuckoo filter (exact layout and bounded kicks), its CBI1 wire
//! frames, the words a publication hub mirrors, and the replica a consumer keeps by applying
//! those frames.

pub mod cbi1;
pub mod ckf;
mod mirror;
mod replica;

pub use mirror::MirrorWords;
pub use replica::{FilterFrame, FilterReplica, ReplicaFault, ReplicaProgress};
