//! One pool's producer state, sans-IO: exact ownership driving the cuckoo filter, and the
//! publisher that numbers publication batches under a lease.

mod ownership;
mod publisher;
mod tables;

pub use ownership::{
    ApplyError, ApplyOutcome, FailureDisposition, OwnershipCounters, PoolOwnership,
    RankReplacement, SequenceFault,
};
pub use publisher::{
    Delta, FenceReason, PUBLICATION_DELAY_MS, PUBLICATION_THRESHOLD_EVENTS, PublicationCadence,
    PublishError, PublishOutcome, Publisher, Snapshot,
};
pub use tables::{OWNERS_MAX, OwnerState, TableKey};
