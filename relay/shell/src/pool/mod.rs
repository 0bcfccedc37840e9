//! Pools in the shell: the driver that carries one pool machine's effects out (the node owns
//! one per pool generation), the handle requests reach it through, how it journals, and a
//! standalone task around one driver for tests and benches.

mod driver;
mod mode;
mod standalone;
mod totals;

pub use driver::{
    ApplySegment, FaultSink, GenerationKey, PoolAsk, PoolConfig, PoolDriver, PoolGone, PoolHandle,
    PoolRequest, SubscribeError, Subscription,
};
pub use mode::{PublicationMode, PublicationSink};
pub use standalone::{StandaloneExit, StandalonePool, spawn_standalone_pool};
pub use totals::PoolTotals;
