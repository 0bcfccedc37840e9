//! The pool actor: the task that drives one pool's `kvrelay_core::pool::PoolMachine`, and how
//! it journals.

mod actor;
mod mode;

pub use actor::{
    ActorConfig, ActorExit, ActorGone, ApplySegment, FaultSink, PoolActorHandle, PoolTotals,
    SubscribeError, Subscription, spawn_pool_actor, spawn_pool_actor_with,
};
pub use mode::{PublicationMode, PublicationSink};
