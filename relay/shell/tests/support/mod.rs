//! Plumbing shared by the loopback WAN tests: a real relay service on 127.0.0.1 whose pool
//! actors the test drives directly (no DC, no control plane), and the pool identities, catalog
//! descriptors, KV events and requests the tests feed it.
//!
//! Each test binary uses a different part of this module.
#![allow(dead_code, reason = "each test binary that includes this module uses a part of it")]

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;

use kvrelay::config::WanTuning;
use kvrelay::pool::{
    FaultSink, PoolConfig, PublicationMode, StandalonePool, spawn_standalone_pool,
};
use kvrelay::publication::{HubConfig, PoolPublications};
use kvrelay::runtime::{ManualWallClock, TokioBlockingExecutor};
use kvrelay::wan::{RelayService, WanPublisher, serve, wan_channels};
use kvrelay_core::discovery::{ModelRegistration, ModelTarget, QuerySemantics, WorkerRole};
use kvrelay_core::filter::FilterReplica;
use kvrelay_core::filter::ckf::{CkfFormat, DEFAULT_SEED, MAX_KICKS_DEFAULT};
use kvrelay_core::host::{CatalogSnapshot, PoolDescriptor};
use kvrelay_core::model::hashing::{ExternalBlockHash, HashFormat, LocalBlockHash};
use kvrelay_core::model::identity::{
    EndpointPath, PoolId, ProducerIdentity, RelayIdentity, resolve_indexer_domain, stable_dc_id,
};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RemoveData, RouterEvent, StorageTier, StoreData, StoredBlock,
};
use kvrelay_core::pool::{PoolFault, PoolOwnership};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::wire::encode;
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Channel;

/// The model every test pool serves.
pub const MODEL: &str = "tiny-llm";
/// Tokens per KV block of every test pool.
pub const BLOCK: u32 = 16;
/// The serving endpoint of the tests' main pool.
pub const ENDPOINT: &str = "dynamo/backend/generate";
/// The DC every test pool belongs to.
pub const DC: &str = "dc-a";
/// Largest gRPC message a test client decodes (a full snapshot chunk plus headers).
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;

/// Actor faults are not under test here.
#[derive(Debug)]
pub struct IgnoreFaults;

impl FaultSink for IgnoreFaults {
    fn report(&self, _fault: PoolFault) {}

    fn refused(&self, _fault: PoolFault) {}
}

/// The producer of `endpoint`'s pool at `generation` with a filter of `buckets` buckets.
pub fn producer(endpoint: &str, generation: u64, buckets: u64) -> ProducerIdentity {
    let endpoint: EndpointPath = endpoint.parse().unwrap();
    let domain =
        resolve_indexer_domain(MODEL, BLOCK, HashFormat::StandardV1, &endpoint, None).unwrap();
    let pool_id = PoolId { indexer_domain: domain, dc_id: stable_dc_id(DC).unwrap() };
    ProducerIdentity::new(pool_id, 0x1234, generation, CkfFormat::v1(DEFAULT_SEED, buckets))
        .unwrap()
}

/// A catalog entry serving the base model on `endpoint`.
pub fn base_descriptor(producer: ProducerIdentity, endpoint: &str) -> PoolDescriptor {
    PoolDescriptor {
        producer,
        serving_endpoint: endpoint.parse().unwrap(),
        registrations: vec![ModelRegistration {
            canonical_model_id: MODEL.into(),
            target: ModelTarget::Base { base_model: MODEL.into() },
            aliases: BTreeSet::new(),
        }],
        query_semantics: QuerySemantics {
            kv_block_size: BLOCK,
            hash_format: HashFormat::StandardV1,
        },
        pool_roles: BTreeSet::from([WorkerRole::Aggregated]),
    }
}

fn event(data: KvCacheEventData) -> RouterEvent {
    RouterEvent {
        worker_id: 1,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent { event_id: 0, dp_rank: 0, data },
    }
}

/// Block `external` with a token hash derived from it.
fn block(external: u64) -> StoredBlock {
    StoredBlock {
        block_hash: ExternalBlockHash(external),
        tokens_hash: LocalBlockHash(external.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
    }
}

/// Worker 1 stores `blocks` as one chain under `parent` (a root chain if none).
pub fn stored(parent: Option<u64>, blocks: Vec<StoredBlock>) -> RouterEvent {
    event(KvCacheEventData::Stored(StoreData {
        parent_hash: parent.map(ExternalBlockHash),
        start_position: None,
        blocks,
    }))
}

/// Worker 1 stores block `external` (under `parent`, if any).
pub fn store(external: u64, parent: Option<u64>) -> RouterEvent {
    stored(parent, vec![block(external)])
}

/// Worker 1 stores `externals` as one root chain in one event.
pub fn store_run(externals: std::ops::Range<u64>) -> RouterEvent {
    stored(None, externals.map(block).collect())
}

/// Worker 1 removes `blocks`.
pub fn remove(blocks: impl IntoIterator<Item = u64>) -> RouterEvent {
    event(KvCacheEventData::Removed(RemoveData {
        block_hashes: blocks.into_iter().map(ExternalBlockHash).collect(),
    }))
}

/// A pool subscription for exactly `producer`.
pub fn pool_request(
    producer: &ProducerIdentity,
    subscriber_id: &str,
) -> proto::SubscribeKvPoolRequest {
    proto::SubscribeKvPoolRequest {
        subscriber_id: subscriber_id.into(),
        expected_producer: Some(encode::producer(producer)),
        contract_marker: CONTRACT_MARKER,
    }
}

/// Occupied fingerprint slots of a replica (four 16-bit slots per bucket word).
pub fn occupied_slots(replica: &FilterReplica) -> u64 {
    replica
        .words()
        .unwrap()
        .iter()
        .map(|word| (0..4).filter(|slot| (word >> (16 * slot)) & 0xFFFF != 0).count() as u64)
        .sum()
}

/// A real relay service on loopback over pools the test activates. Dropping it stops the
/// server.
pub struct LoopbackRelay {
    /// Where it listens.
    pub address: SocketAddr,
    /// Its identity.
    pub relay: RelayIdentity,
    /// The host's end of the catalog, readiness and load channels.
    pub publisher: WanPublisher,
    /// The pools' publications.
    pub publications: Arc<PoolPublications>,
    /// The served service (a clone shares its counters).
    pub service: RelayService,
    executor: Arc<TokioBlockingExecutor>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl LoopbackRelay {
    /// Serve with `tuning` (its publication bounds included) on an ephemeral loopback port.
    pub async fn start(tuning: WanTuning) -> LoopbackRelay {
        let relay = RelayIdentity { drt_instance_id: 0x1111, relay_incarnation: 0x1234 };
        let executor = Arc::new(TokioBlockingExecutor);
        let publications =
            Arc::new(PoolPublications::new(HubConfig::from_tuning(&tuning), executor.clone()));
        let (publisher, views) = wan_channels(&relay, tuning.load_fanout_capacity);
        let clock = Arc::new(ManualWallClock::new(1_796_038_252_716_000));
        let service = RelayService::new(relay, views, Arc::clone(&publications), clock, tuning);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (shutdown, stop) = tokio::sync::oneshot::channel::<()>();
        let served = service.clone();
        kvrelay::runtime::spawn(async move {
            serve(served, TcpListenerStream::new(listener), &tuning, async {
                let _ = stop.await;
            })
            .await
            .unwrap();
        });
        LoopbackRelay {
            address,
            relay,
            publisher,
            publications,
            service,
            executor,
            shutdown: Some(shutdown),
        }
    }

    /// Start a standalone pool for `producer` (kick choices from `seed`) and make it
    /// subscribable.
    pub fn activate(&self, producer: ProducerIdentity, seed: u64) -> StandalonePool {
        let pool =
            PoolOwnership::new(producer.format(), MAX_KICKS_DEFAULT, rng_from_seed(seed)).unwrap();
        let (actor, _) = spawn_standalone_pool(
            (producer.pool_id(), producer.layout_generation()),
            pool,
            PoolConfig::default(),
            Arc::new(IgnoreFaults),
            PublicationMode::Free,
        );
        self.publications.activate(producer, actor.handle().clone());
        actor
    }

    /// Publish a complete catalog.
    pub fn publish_catalog(&self, revision: u64, pools: Vec<PoolDescriptor>) {
        self.publisher.publish_catalog(encode::catalog_update(
            &self.relay,
            &CatalogSnapshot { revision, pools },
        ));
    }

    /// A client on its own connection.
    pub async fn client(&self) -> KvEventRelayClient<Channel> {
        KvEventRelayClient::connect(format!("http://{}", self.address))
            .await
            .unwrap()
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Begin the server's shutdown (open streams end, connections drain).
    pub fn stop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
    }
}
