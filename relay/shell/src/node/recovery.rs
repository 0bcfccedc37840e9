//! The seam through which the node asks workers for recovery dumps and event ranges.

use std::fmt::Debug;
use std::time::Duration;

use futures::future::BoxFuture;

use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};

/// Sends recovery queries to workers (Dynamo's TCP request plane in production, the simulated
/// workers in the simulator and the demo).
pub trait RecoveryTransport: Send + Sync + Debug + 'static {
    /// Ask `target`; resolve within `timeout` or say what failed.
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>>;
}

/// A transport that reaches nobody: every query fails at once (ranks continue live-only).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoRecovery;

impl RecoveryTransport for NoRecovery {
    fn query(
        &self,
        _target: RecoveryTarget,
        _request: RecoveryRequest,
        _timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>> {
        Box::pin(async { Err(RecoveryFailure::NoTransport) })
    }
}
