//! The seam through which the node asks workers for recovery dumps and event ranges.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::task::AbortHandle;

use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::sources::{
    RecoveryFailure, RecoveryRequest, RecoveryRequestId, RecoveryResponse,
};

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

/// The node's recovery calls in flight, each abortable.
///
/// A request id is unique only within its pool generation's tracker, so a call is named by the
/// generation and the id together: cancelling one pool's call never touches another pool's call
/// that happens to carry the same id.
#[derive(Debug, Default)]
pub(crate) struct RecoveryCalls {
    calls: BTreeMap<(PoolId, u64, RecoveryRequestId), AbortHandle>,
}

impl RecoveryCalls {
    /// Track `call`, the task carrying request `id` of generation `(pool_id, generation)`;
    /// finished calls are forgotten on the way.
    pub(crate) fn insert(
        &mut self,
        pool_id: PoolId,
        generation: u64,
        id: RecoveryRequestId,
        call: AbortHandle,
    ) {
        self.calls.retain(|_, handle| !handle.is_finished());
        self.calls.insert((pool_id, generation, id), call);
    }

    /// Abort the call `id` of generation `(pool_id, generation)`, if it is still tracked.
    pub(crate) fn cancel(&mut self, pool_id: PoolId, generation: u64, id: RecoveryRequestId) {
        if let Some(call) = self.calls.remove(&(pool_id, generation, id)) {
            call.abort();
        }
    }

    /// Abort every call (shutdown).
    pub(crate) fn abort_all(&mut self) {
        for (_, call) in std::mem::take(&mut self.calls) {
            call.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::model::hashing::HashFormat;
    use kvrelay_core::model::identity::{DcId, EndpointPath, resolve_indexer_domain};

    fn pool(endpoint: &str) -> PoolId {
        let endpoint: EndpointPath = endpoint.parse().unwrap();
        let indexer_domain =
            resolve_indexer_domain("model", 16, HashFormat::StandardV1, &endpoint, None).unwrap();
        PoolId { indexer_domain, dc_id: DcId(3) }
    }

    #[tokio::test]
    async fn a_cancel_aborts_only_the_call_of_its_own_generation() {
        let (a, b) = (pool("ns/a/generate"), pool("ns/b/generate"));
        let same_id = RecoveryRequestId(1);
        let mut calls = RecoveryCalls::default();
        let call_a = crate::runtime::spawn(std::future::pending::<()>());
        let call_b = crate::runtime::spawn(std::future::pending::<()>());
        calls.insert(a, 1, same_id, call_a.abort_handle());
        calls.insert(b, 1, same_id, call_b.abort_handle());
        calls.cancel(a, 1, same_id);
        tokio::task::yield_now().await;
        assert!(call_a.is_finished(), "the cancelled call ends");
        assert!(!call_b.is_finished(), "the other pool's call with the same id keeps running");
        assert!(call_a.await.unwrap_err().is_cancelled());
        calls.cancel(b, 2, same_id);
        tokio::task::yield_now().await;
        assert!(!call_b.is_finished(), "nor does a cancel of another generation reach it");
        calls.abort_all();
        assert!(call_b.await.unwrap_err().is_cancelled());
    }
}
