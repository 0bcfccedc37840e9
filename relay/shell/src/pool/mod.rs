//! The pool actor: the task that owns one pool's ownership state and publisher (both from
//! `kvrelay_core::pool`), and the publication script a replayed actor follows.

mod actor;
mod script;

pub use actor::{
    ActorConfig, ActorExit, ActorFault, ActorGone, ActorStats, FaultSink, PoolActorHandle,
    PoolDigest, PoolTotals, SubscribeError, Subscription, filter_words_digest, spawn_pool_actor,
    spawn_pool_actor_with,
};
pub use script::{
    LeaseRecord, PublicationMode, PublicationPoint, PublicationScript, PublicationSink,
    PublicationStep, ScriptPosition,
};
