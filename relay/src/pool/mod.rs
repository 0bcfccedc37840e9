//! One pool's producer state, sans-IO: exact ownership driving the cuckoo filter, and the
//! publisher that numbers publication batches under a lease.

mod ownership;
mod tables;

pub use ownership::{
    ApplyError, ApplyOutcome, FailureDisposition, OwnershipCounters, PoolOwnership,
    RankReplacement, SequenceFault,
};
pub use tables::{OWNERS_MAX, OwnerState};
