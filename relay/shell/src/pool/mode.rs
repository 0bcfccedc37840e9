//! How a pool journals its publication points (the points themselves and the
//! machine that performs a script are in `kvrelay_core::pool`).

use std::fmt::Debug;
use std::sync::Arc;

use tokio::time::Instant;

use kvrelay_core::pool::PublicationPoint;

/// Where a reporting pool sends its points. Called from the loop that drives the pool; must
/// not block.
pub trait PublicationSink: Send + Sync + Debug + 'static {
    /// Record one point.
    fn point(&self, point: PublicationPoint);
}

/// How a pool decides when to publish.
#[derive(Debug, Clone, Default)]
pub enum PublicationMode {
    /// Production: the threshold, the delay timer, a barrier per subscription.
    #[default]
    Free,
    /// As [`PublicationMode::Free`], and every point goes to the sink.
    Reported(Arc<dyn PublicationSink>),
    /// Replay: the recorded points are performed after the same commands until `until`, then
    /// the pool runs free (`kvrelay_core::pool::PoolMachine` says how subscribers are held).
    Scripted {
        /// The points in recorded order (delivery failures included).
        points: Vec<PublicationPoint>,
        /// When the recording ends.
        until: Instant,
    },
}
