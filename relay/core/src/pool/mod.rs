//! One pool's producer state, sans-IO: exact ownership (within a byte budget) driving the
//! cuckoo filter, the publisher that numbers publication batches under a lease, and the machine
//! that composes them with the publication cadence, its timer and the journal's publication
//! points.

mod growing;
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
    ApplyError, ApplyOutcome, BudgetBelowHeld, EXACT_STATE_BYTES_MIN, EXACT_STATE_BYTES_PER_SLOT,
    FailureDisposition, OwnershipCounters, PoolOwnership, RankReplacement, SequenceFault,
    exact_state_bytes_max_default,
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
