//! Pools in the shell: what it keeps beside each pool machine (the link that answers
//! subscriptions and journals points, the broadcast its deltas go to, the handle requests reach
//! it through), and a standalone task around one machine for tests and benches.

mod link;
mod mode;
mod standalone;
mod totals;

pub use link::{
    ApplySegment, BroadcastOutlet, GenerationKey, PoolAsk, PoolConfig, PoolGone, PoolHandle,
    PoolLink, PoolRequest, SubscribeError, Subscription, pool_machine,
};
pub use mode::{PublicationMode, PublicationSink};
pub use standalone::{FaultSink, StandaloneExit, StandalonePool, spawn_standalone_pool};
pub use totals::PoolTotals;
