//! One pool's producer state, sans-IO: exact ownership driving the cuckoo filter, the
//! publisher that numbers publication batches under a lease, and the machine that composes them
//! with the publication cadence, its timer and the journal's publication points.

mod machine;
mod ownership;
mod publisher;
mod script;
mod tables;

pub use machine::{
    CadenceConfig, DeltaOutlet, HoldId, PoolDigest, PoolEffect, PoolFault, PoolMachine, PoolStats,
    SubscribeStep, filter_words_digest,
};
pub use ownership::{
    ApplyError, ApplyOutcome, FailureDisposition, OwnershipCounters, PoolOwnership,
    RankReplacement, SequenceFault,
};
pub use publisher::{
    Delta, FenceReason, PUBLICATION_DELAY_MS, PUBLICATION_THRESHOLD_EVENTS, PublicationCadence,
    PublishError, PublishOutcome, Publisher, Snapshot,
};
pub use script::{
    LeaseRecord, PublicationPoint, PublicationRole, PublicationScript, PublicationStep,
    ScriptPosition,
};
pub use tables::{OWNERS_MAX, OwnerState, TableKey};
