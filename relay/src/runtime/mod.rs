//! Runtime seams: the only places where the relay touches the wall clock or a blocking thread
//! pool. Production and simulation plug different implementations into the same code.

mod clock;
mod executor;

pub use clock::{ManualWallClock, SystemWallClock, WallClock};
pub use executor::{
    BlockingExecutor, ExecutorError, InlineExecutor, TokioBlockingExecutor, run_blocking,
};
