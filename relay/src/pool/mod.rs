//! One pool's producer state, sans-IO: exact ownership driving the cuckoo filter, and the
//! publisher that numbers publication batches under a lease. The async pool actor (a later
//! layer) only moves commands in and carries deltas and snapshots out.

mod actor;
mod ownership;
mod publisher;
mod script;
mod tables;

pub use actor::{
    ActorConfig, ActorExit, ActorFault, ActorGone, ActorStats, FaultSink, PoolActorHandle,
    PoolDigest, PoolTotals, SubscribeError, Subscription, filter_words_digest, spawn_pool_actor,
    spawn_pool_actor_with,
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
    LeaseRecord, PublicationMode, PublicationPoint, PublicationScript, PublicationSink,
    PublicationStep, ScriptPosition,
};
pub use tables::{OWNERS_MAX, OwnerState};
