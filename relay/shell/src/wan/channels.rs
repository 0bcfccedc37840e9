//! The channels between the host and the WAN streams.

use std::sync::Arc;

use kvrelay_proto::v1 as proto;
use tokio::sync::{broadcast, watch};

use kvrelay_core::host::CatalogSnapshot;
use kvrelay_core::model::identity::RelayIdentity;
use kvrelay_core::wire::encode;

/// The host's end: publish complete updates.
#[derive(Debug, Clone)]
pub struct WanPublisher {
    catalog: watch::Sender<Arc<proto::KvPoolCatalogUpdate>>,
    readiness: watch::Sender<Arc<proto::ServingReadinessUpdate>>,
    load_current: watch::Sender<Arc<proto::KvPoolLoadUpdate>>,
    load: broadcast::Sender<Arc<proto::KvPoolLoadUpdate>>,
}

/// The streams' end: read the latest and follow changes.
#[derive(Debug, Clone)]
pub struct WanViews {
    pub(crate) catalog: watch::Receiver<Arc<proto::KvPoolCatalogUpdate>>,
    pub(crate) readiness: watch::Receiver<Arc<proto::ServingReadinessUpdate>>,
    pub(crate) load_current: watch::Receiver<Arc<proto::KvPoolLoadUpdate>>,
    pub(crate) load: broadcast::Sender<Arc<proto::KvPoolLoadUpdate>>,
}

/// Channels starting from the empty catalog (revision 0), empty readiness (revision 1) and the
/// empty load window 0. `load_fanout_capacity` bounds the windows buffered per load stream.
#[must_use]
pub fn wan_channels(
    relay: &RelayIdentity,
    load_fanout_capacity: usize,
) -> (WanPublisher, WanViews) {
    let (catalog, catalog_rx) = watch::channel(Arc::new(encode::catalog_update(
        relay,
        &CatalogSnapshot { revision: 0, pools: Vec::new() },
    )));
    let (readiness, readiness_rx) =
        watch::channel(Arc::new(encode::readiness_update(relay, 1, &[])));
    let empty_window = proto::KvPoolLoadUpdate {
        protocol_version: kvrelay_proto::PROTOCOL_VERSION,
        relay: Some(encode::relay_identity(relay)),
        window_sequence: 0,
        observed_ms: 0,
        window_ms: 0,
        pools: Vec::new(),
        contract_marker: kvrelay_proto::CONTRACT_MARKER,
    };
    let (load_current, load_current_rx) = watch::channel(Arc::new(empty_window));
    let (load, _) = broadcast::channel(load_fanout_capacity.max(1));
    (
        WanPublisher { catalog, readiness, load_current, load: load.clone() },
        WanViews {
            catalog: catalog_rx,
            readiness: readiness_rx,
            load_current: load_current_rx,
            load,
        },
    )
}

impl WanViews {
    /// The catalog update currently published (what a new catalog stream starts from).
    #[must_use]
    pub fn current_catalog(&self) -> Arc<proto::KvPoolCatalogUpdate> {
        Arc::clone(&self.catalog.borrow())
    }

    /// The readiness update currently published.
    #[must_use]
    pub fn current_readiness(&self) -> Arc<proto::ServingReadinessUpdate> {
        Arc::clone(&self.readiness.borrow())
    }

    /// The load window currently published (the last complete one).
    #[must_use]
    pub fn current_load(&self) -> Arc<proto::KvPoolLoadUpdate> {
        Arc::clone(&self.load_current.borrow())
    }
}

impl WanPublisher {
    /// Publish a complete catalog.
    pub fn publish_catalog(&self, update: proto::KvPoolCatalogUpdate) {
        self.catalog.send_replace(Arc::new(update));
    }

    /// Publish complete readiness.
    pub fn publish_readiness(&self, update: proto::ServingReadinessUpdate) {
        self.readiness.send_replace(Arc::new(update));
    }

    /// Publish one load window.
    pub fn publish_load(&self, update: proto::KvPoolLoadUpdate) {
        let update = Arc::new(update);
        self.load_current.send_replace(Arc::clone(&update));
        let _ = self.load.send(update);
    }
}
