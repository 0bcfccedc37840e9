//! The `kvrelay serve` test setup shared by the relay's production tests and the simulator's
//! replay of a real run: Dynamo 1.6.1-format workers in a file-discovery directory
//! (dynamo-live §9.1) publishing Dynamo-format envelopes on a real `nats-server`, the relay
//! configured and wired as the binary does ([`kvrelay::serve::start`]), the reference consumer
//! and the operations endpoints that observe it, and a recorded run ([`record_serve_run`]).
//!
//! A test binary includes it beside `servers` and `fake_worker` (`mod fake_worker; mod
//! serve_setup; mod servers;` at its root; from another crate with `#[path]`). Every wait is
//! bounded.
#![allow(dead_code, reason = "each test binary that includes this module uses a part of it")]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use kvrelay::config::{self, CliValues};
use kvrelay::request_plane::PayloadCodec;
use kvrelay::request_plane::answer::answer_stream;
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor, WallClock};
use kvrelay::serve::{RunningRelay, ServeOptions};
use kvrelay_consumer::{ConsumerConfig, ConsumerSnapshot, FilterStatus, RelayConsumer};
use kvrelay_core::inputs::{
    EventEnvelope, KV_EVENTS_TOPIC, KV_METRICS_TOPIC, LoadObservation, encode_active_load,
    encode_event_envelope, encode_kv_events_payload,
};
use kvrelay_core::model::hashing::{
    ExternalBlockHash, HashFormat, LocalBlockHash, block_hash_seed, local_block_hashes,
};
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RouterEvent, SourceKey, StorageTier, StoreData, StoredBlock,
};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::sources::{RecoveryResponse, TreeDumpScope};

use crate::fake_worker::{FakeWorker, Reply, two_part};
use crate::servers::NatsServer;

/// Bound of every test.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound of one convergence.
pub const CONVERGE: Duration = Duration::from_secs(30);
pub const BLOCK: usize = 16;
pub const MODEL: &str = "tiny-llm";

pub const WORKER_A: u64 = 0x0a0a_0000_0000_0001;
pub const WORKER_B: u64 = 0x0b0b_0000_0000_0002;
pub const WORKER_C: u64 = 0x0c0c_0000_0000_0003;
pub const PUBLISHER_A: u64 = 0x1a_0000_0000_00a1;
pub const PUBLISHER_B: u64 = 0x1b_0000_0000_00b1;
pub const PUBLISHER_C: u64 = 0x1c_0000_0000_00c1;
pub const PUBLISHER_A_RESTARTED: u64 = 0x1a_0000_0000_00a2;

pub async fn bounded<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test).await.expect("test exceeded its time bound")
}

// ---------------------------------------------------------------------------------------------
// Dynamo-format discovery records in a file-discovery directory (dynamo-live §9.1).

pub fn now_us() -> u64 {
    SystemWallClock.now_unix_us()
}

/// A file-discovery root; a refresher task re-touches every live file each 500 ms, as the
/// owning Dynamo processes do, until the file is let go.
pub struct FileStore {
    _dir: tempfile::TempDir,
    pub root: PathBuf,
    live: Arc<Mutex<BTreeMap<PathBuf, ()>>>,
    refresher: tokio::task::JoinHandle<()>,
}

impl FileStore {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kvstore");
        std::fs::create_dir_all(&root).unwrap();
        let live: Arc<Mutex<BTreeMap<PathBuf, ()>>> = Arc::default();
        let refreshed = Arc::clone(&live);
        let refresher = kvrelay::runtime::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let paths: Vec<PathBuf> = refreshed.lock().unwrap().keys().cloned().collect();
                for path in paths {
                    touch(&path, now_us());
                }
            }
        });
        FileStore { _dir: dir, root, live, refresher }
    }

    pub fn write(&self, relative: &str, contents: &str) {
        let path = self.root.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, contents).unwrap();
        self.live.lock().unwrap().insert(path, ());
    }

    /// Stop refreshing `relative` and age it to 9 s: it expires within about a second, as the
    /// files of a worker killed with -9 do.
    pub fn abandon(&self, relative: &str) {
        let path = self.root.join(relative);
        self.live.lock().unwrap().remove(&path);
        touch(&path, now_us() - 9_000_000);
    }

    pub fn remove(&self, relative: &str) {
        let path = self.root.join(relative);
        self.live.lock().unwrap().remove(&path);
        let _ = std::fs::remove_file(path);
    }
}

impl Drop for FileStore {
    fn drop(&mut self) {
        self.refresher.abort();
    }
}

pub fn touch(path: &Path, modified_us: u64) {
    if let Ok(file) = std::fs::File::options().write(true).open(path) {
        let _ = file.set_modified(UNIX_EPOCH + Duration::from_micros(modified_us));
    }
}

/// One aggregated worker of `tiny-llm` at `namespace/backend/generate`.
#[derive(Clone, Copy)]
pub struct Worker {
    pub namespace: &'static str,
    pub instance: u64,
    pub publisher: u64,
    /// The request-plane address of its local indexer; `None`: no local indexer, the worker is
    /// live-only (its advert carries no recovery target).
    pub recovery: Option<SocketAddr>,
}

impl Worker {
    /// A worker without a local indexer.
    pub fn live_only(namespace: &'static str, instance: u64, publisher: u64) -> Self {
        Worker { namespace, instance, publisher, recovery: None }
    }

    /// The request-plane path of the recovery endpoint (dynamo-planes-wire §A.2).
    fn recovery_path(&self) -> String {
        format!(
            "{i:x}/{n}/backend/worker_kv_query_source_{p:x}",
            i = self.instance,
            n = self.namespace,
            p = self.publisher
        )
    }

    /// `,"recovery_target":{…}` for a worker with a local indexer, else nothing.
    fn recovery_target_field(&self) -> String {
        let Some(address) = self.recovery else { return String::new() };
        format!(
            r#","recovery_target":{{"component":"backend","endpoint":"worker_kv_query_source_{p:x}","namespace":"{n}","instance_id":{i},"transport":{{"tcp":"{address}/{path}"}},"device_type":"cuda","request_plane_codec":"msgpack"}}"#,
            p = self.publisher,
            n = self.namespace,
            i = self.instance,
            path = self.recovery_path()
        )
    }

    pub fn instance_file(&self) -> String {
        format!("v1/instances/{}%2Fbackend%2Fgenerate%2F{:x}", self.namespace, self.instance)
    }

    pub fn card_file(&self) -> String {
        format!("v1/mdc/{}%2Fbackend%2Fgenerate%2F{:x}", self.namespace, self.instance)
    }

    pub fn source_file(&self) -> String {
        format!(
            "v1/event_sources/namespace%2F{}%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F{:x}",
            self.namespace, self.publisher
        )
    }

    /// The NATS event channel real workers advertise beside their event source.
    pub fn channel_file(&self) -> String {
        format!(
            "v1/event_channels/namespace%2F{}%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F{:x}",
            self.namespace, self.publisher
        )
    }

    pub fn channel_record(&self) -> String {
        format!(
            r#"{{"type":"EventChannel","scope":{{"kind":"endpoint","endpoint":{{"namespace":"{n}","component":"backend","name":"generate"}}}},"topic":"kv-events","instance_id":{p},"transport":{{"kind":"Nats","config":{{"subject_prefix":"namespace.{n}.component.backend.endpoint.generate"}}}}}}"#,
            n = self.namespace,
            p = self.publisher
        )
    }

    pub fn instance_record(&self) -> String {
        format!(
            r#"{{"type":"Endpoint","component":"backend","endpoint":"generate","namespace":"{n}","instance_id":{i},"transport":{{"tcp":"127.0.0.1:9/{i:x}/{n}/backend/generate"}},"device_type":"cuda","request_plane_codec":"msgpack"}}"#,
            n = self.namespace,
            i = self.instance
        )
    }

    pub fn card_record(&self) -> String {
        format!(
            r#"{{"type":"Model","namespace":"{n}","component":"backend","endpoint":"generate","instance_id":{i},"card_json":{{"display_name":"{MODEL}","slug":"{MODEL}","source_path":"/tmp/dynlive/models/tiny-llm","kv_cache_block_size":{BLOCK},"context_length":8192,"model_type":"Chat | Completions","model_input":"Tokens","worker_type":"aggregated","needs":[],"runtime_config":{{"total_kv_blocks":1000,"max_num_seqs":256,"max_num_batched_tokens":8192,"data_parallel_start_rank":0,"data_parallel_size":1,"enable_local_indexer":{indexer},"kv_event_publishing_enabled":true,"enable_eagle":false}},"migration_limit":0}}}}"#,
            n = self.namespace,
            i = self.instance,
            indexer = self.recovery.is_some()
        )
    }

    pub fn source_record(&self) -> String {
        format!(
            r#"{{"type":"EventSource","scope":{{"kind":"endpoint","endpoint":{{"namespace":"{n}","component":"backend","name":"generate"}}}},"topic":"kv-events","publisher_id":{p},"metadata":{{"kv_state_endpoint":{{"namespace":"{n}","component":"backend","name":"generate"}},"worker":{{"worker_id":{i},"dp_rank":0}},"publisher_id":{p}{recovery}}}}}"#,
            recovery = self.recovery_target_field(),
            n = self.namespace,
            i = self.instance,
            p = self.publisher
        )
    }

    pub fn register(&self, store: &FileStore) {
        store.write(&self.card_file(), &self.card_record());
        store.write(&self.source_file(), &self.source_record());
        store.write(&self.channel_file(), &self.channel_record());
        store.write(&self.instance_file(), &self.instance_record());
    }

    pub fn files(&self) -> [String; 4] {
        [self.instance_file(), self.card_file(), self.source_file(), self.channel_file()]
    }

    pub fn abandon(&self, store: &FileStore) {
        for file in self.files() {
            store.abandon(&file);
        }
    }

    pub fn unregister(&self, store: &FileStore) {
        for file in self.files() {
            store.remove(&file);
        }
    }

    /// The logical (etcd) keys and values, as Dynamo writes them under a lease.
    pub fn etcd_entries(&self) -> [(String, String); 3] {
        let n = self.namespace;
        [
            (format!("v1/mdc/{n}/backend/generate/{:x}", self.instance), self.card_record()),
            (
                format!(
                    "v1/event_sources/namespace/{n}/component/backend/endpoint/generate/topic/kv-events/{:x}",
                    self.publisher
                ),
                self.source_record(),
            ),
            (
                format!("v1/instances/{n}/backend/generate/{:x}", self.instance),
                self.instance_record(),
            ),
        ]
    }

    pub fn subject(&self, topic: &str) -> String {
        format!("namespace.{}.component.backend.endpoint.generate.{topic}", self.namespace)
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamo-format envelopes.

/// A prompt of `blocks` full blocks, distinct per `salt`.
pub fn prompt(salt: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32).map(|index| salt * 100_000 + index).collect()
}

/// A `kv-events` envelope storing the blocks of `tokens` as one chain (event `event_id`).
pub fn store_envelope(worker: &Worker, sequence: u64, event_id: u64, tokens: &[u32]) -> Vec<u8> {
    kv_events_envelope(worker, sequence, &[store_event(worker, event_id, tokens)])
}

/// A `kv-events` envelope of `worker` carrying `events` (message number `sequence`).
pub fn kv_events_envelope(worker: &Worker, sequence: u64, events: &[RouterEvent]) -> Vec<u8> {
    let payload = encode_kv_events_payload(events).unwrap();
    encode_event_envelope(&EventEnvelope {
        publisher_id: worker.publisher,
        sequence,
        published_at_ms: SystemWallClock.now_unix_ms(),
        topic: KV_EVENTS_TOPIC,
        payload: &payload,
    })
    .unwrap()
}

/// The event storing the blocks of `tokens` as one chain.
pub fn store_event(worker: &Worker, event_id: u64, tokens: &[u32]) -> RouterEvent {
    let local =
        local_block_hashes(tokens, BLOCK, HashFormat::StandardV1, block_hash_seed(None, None));
    let blocks = local
        .iter()
        .enumerate()
        .map(|(index, hash)| StoredBlock {
            block_hash: ExternalBlockHash(hash.0 ^ (index as u64 + 1)),
            tokens_hash: LocalBlockHash(hash.0),
        })
        .collect();
    stored_event(worker, event_id, blocks)
}

/// The event storing `blocks` as one chain from the root.
pub fn stored_event(worker: &Worker, event_id: u64, blocks: Vec<StoredBlock>) -> RouterEvent {
    RouterEvent {
        worker_id: worker.instance,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id,
            dp_rank: 0,
            data: KvCacheEventData::Stored(StoreData {
                parent_hash: None,
                start_position: None,
                blocks,
            }),
        },
    }
}

pub fn load_envelope(worker: &Worker, sequence: u64, kv_used_blocks: u64) -> Vec<u8> {
    let payload = encode_active_load(&LoadObservation {
        source: SourceKey { worker_id: worker.instance, dp_rank: 0 },
        kv_used_blocks: Some(kv_used_blocks),
        active_decode_blocks: Some(0),
        active_prefill_tokens: None,
    })
    .unwrap();
    encode_event_envelope(&EventEnvelope {
        publisher_id: worker.publisher,
        sequence,
        published_at_ms: SystemWallClock.now_unix_ms(),
        topic: KV_METRICS_TOPIC,
        payload: &payload,
    })
    .unwrap()
}

pub async fn publish(client: &async_nats::Client, subject: String, bytes: Vec<u8>) {
    client.publish(subject, Bytes::from(bytes)).await.unwrap();
    client.flush().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// The relay and its observers.

pub fn start_options(seed: u64) -> ServeOptions {
    ServeOptions {
        seed,
        executor: Arc::new(TokioBlockingExecutor),
        clock: Arc::new(SystemWallClock),
    }
}

pub fn relay_config(
    discovery: &[(&str, String)],
    nats: &NatsServer,
    sources_file: Option<PathBuf>,
    guard: Option<&str>,
    extra: &[(&str, String)],
) -> config::RelayConfig {
    let cli = CliValues {
        dc_id: Some("dc-a".into()),
        bind: Some("127.0.0.1:0".into()),
        ops_bind: Some("127.0.0.1:0".into()),
        sources_file,
        ..CliValues::default()
    };
    let mut environment: BTreeMap<String, String> = [
        ("DYN_EVENT_PLANE", "nats".to_owned()),
        ("NATS_SERVER", nats.url()),
        ("DYN_RELAY_LOAD_WINDOW_MS", "200".to_owned()),
    ]
    .into_iter()
    .chain(discovery.iter().cloned())
    .chain(extra.iter().cloned())
    .map(|(name, value)| (name.to_owned(), value))
    .collect();
    if let Some(guard) = guard {
        environment.insert("DYN_RELAY_CONNECTION_REVISION".into(), guard.to_owned());
    }
    config::resolve(&cli, &environment).unwrap()
}

pub fn start_consumer(relay: &RunningRelay) -> RelayConsumer {
    let address = relay.wan_address.unwrap().to_string();
    RelayConsumer::start(
        kvrelay_consumer::connect_lazy(&address).unwrap(),
        ConsumerConfig::default(),
        &mut rng_from_seed(11),
    )
    .unwrap()
}

pub async fn converge(
    consumer: &RelayConsumer,
    what: &str,
    predicate: impl FnMut(&ConsumerSnapshot) -> bool,
) -> ConsumerSnapshot {
    converge_within(consumer, what, CONVERGE, predicate).await
}

pub async fn converge_within(
    consumer: &RelayConsumer,
    what: &str,
    bound: Duration,
    predicate: impl FnMut(&ConsumerSnapshot) -> bool,
) -> ConsumerSnapshot {
    match tokio::time::timeout(bound, consumer.wait_until(predicate)).await {
        Ok(Ok(snapshot)) => snapshot,
        Ok(Err(stopped)) => panic!("{what}: the consumer stopped: {stopped:?}"),
        Err(_) => panic!("{what}: not within {bound:?}; last snapshot {:#?}", consumer.snapshot()),
    }
}

/// Publishes `worker`'s store of `tokens` on its `kv-events` subject, under event ids 1, 2, ...
/// (each copy continues the rank's cursor), every `pace`, until the consumer matches all of
/// `tokens`' blocks: the NATS subscription may not be up when the first copy is sent.
pub async fn store_until_matched(
    client: &async_nats::Client,
    consumer: &RelayConsumer,
    worker: &Worker,
    tokens: &[u32],
    pace: Duration,
    what: &str,
) {
    let blocks = tokens.len() / BLOCK;
    tokio::time::timeout(CONVERGE, async {
        let mut event_id = 0;
        while matched(consumer, tokens) != Some(blocks) {
            event_id += 1;
            let envelope = store_envelope(worker, event_id, event_id, tokens);
            publish(client, worker.subject(KV_EVENTS_TOPIC), envelope).await;
            tokio::time::sleep(pace).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} never reached the consumer"));
}

/// Leading blocks of `tokens` the consumer's (complete) replica holds for `MODEL`.
pub fn matched(consumer: &RelayConsumer, tokens: &[u32]) -> Option<usize> {
    let answers = consumer.query(tokens, MODEL);
    answers.iter().find(|answer| answer.replica_ready).map(|answer| answer.matched_blocks)
}

pub fn pool_ready(snapshot: &ConsumerSnapshot) -> bool {
    snapshot.pools.len() == 1 && snapshot.pools[0].status == FilterStatus::Ready
}

pub fn metric(text: &str, sample: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == sample).then(|| value.parse().ok()).flatten()
    })
}

/// A sample's value in seconds (a gauge such as `kvrelay_node_wakeup_seconds_max`).
pub fn metric_seconds(text: &str, sample: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == sample).then(|| value.parse().ok()).flatten()
    })
}

/// A plain HTTP/1.1 GET on loopback: (status code, body).
pub async fn http_get_async(address: SocketAddr, path: &'static str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut response))
        .await
        .expect("HTTP response in time")
        .unwrap();
    let response = String::from_utf8_lossy(&response).into_owned();
    let status = response.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).unwrap_or_default();
    (status, body)
}

// ---------------------------------------------------------------------------------------------
// A recorded run.

/// A worker's local indexer on the request plane that answers every recovery query with
/// `answer`, written as a Dynamo worker's response stream.
pub async fn local_indexer(answer: &RecoveryResponse) -> FakeWorker {
    let frames: Vec<Vec<u8>> = answer_stream(PayloadCodec::MsgPack, answer)
        .unwrap()
        .iter()
        .map(|message| two_part(&message.header, &message.body))
        .collect();
    FakeWorker::start(Arc::new(move |_| Reply {
        ack: Some(Vec::new()),
        call_home: Some(frames.clone()),
        ..Reply::default()
    }))
    .await
}

/// Record a `serve` run into a fresh directory under `root`: two workers, blocks, load, a
/// publisher restart, a departure; worker B runs a local indexer and was serving before the
/// relay started, so the relay learns B's cached chain from B's tree dump (a recovery answer
/// in the journal). Returns the configuration and identity a replay needs.
pub async fn record_serve_run(
    root: &Path,
) -> (config::RelayConfig, kvrelay_core::model::identity::RelayIdentity) {
    let nats = NatsServer::start().await;
    let store = FileStore::new();
    let a = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
    let mut b = Worker::live_only("dynamo", WORKER_B, PUBLISHER_B);
    let prompt_b = prompt(2, 3);
    // B's cache as a radix dump (synthetic id 0), consistent with B's live event 1.
    let b_indexer = local_indexer(&RecoveryResponse::TreeDump {
        events: vec![store_event(&b, 0, &prompt_b)],
        last_event_id: 1,
        reset_scope: TreeDumpScope::Rank,
    })
    .await;
    b.recovery = Some(b_indexer.address);
    a.register(&store);
    b.register(&store);
    let discovery = [
        ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
        ("DYN_FILE_KV", store.root.display().to_string()),
    ];
    let recording = [
        ("DYN_RELAY_RECORD_DIR", root.display().to_string()),
        ("DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS", "300".to_owned()),
        ("DYN_RELAY_JOURNAL_QUEUE_BYTES_MAX", (32u64 << 20).to_string()),
    ];
    let config = relay_config(&discovery, &nats, None, None, &recording);
    let relay = kvrelay::serve::start(config.clone(), start_options(7)).await.unwrap();
    let ops = relay.ops_address.unwrap();
    let consumer = start_consumer(&relay);
    let client = async_nats::connect(nats.url()).await.unwrap();
    converge(&consumer, "the pool", pool_ready).await;

    let prompt_a = prompt(1, 4);
    store_until_matched(
        &client,
        &consumer,
        &a,
        &prompt_a,
        Duration::from_millis(200),
        "worker A's blocks",
    )
    .await;
    // B's live event 1 is the one its dump already covers: stale, dropped.
    publish(&client, b.subject(KV_EVENTS_TOPIC), store_envelope(&b, 1, 1, &prompt_b)).await;
    publish(&client, a.subject(KV_METRICS_TOPIC), load_envelope(&a, 1, 30)).await;
    publish(&client, b.subject(KV_METRICS_TOPIC), load_envelope(&b, 1, 12)).await;
    converge(&consumer, "worker B's blocks", |_| matched(&consumer, &prompt_b) == Some(3)).await;

    // Worker A restarts as a new publisher incarnation.
    let restarted = Worker { publisher: PUBLISHER_A_RESTARTED, ..a };
    store.remove(&a.source_file());
    restarted.register(&store);
    let prompt_a2 = prompt(4, 3);
    let pace = Duration::from_millis(300);
    store_until_matched(
        &client,
        &consumer,
        &restarted,
        &prompt_a2,
        pace,
        "the restarted publisher's blocks",
    )
    .await;
    converge(&consumer, "the old incarnation's blocks gone", |_| {
        matched(&consumer, &prompt_a) == Some(0)
    })
    .await;
    // Worker B leaves; a checkpoint interval passes with the last inputs.
    b.unregister(&store);
    converge(&consumer, "worker B gone", |_| matched(&consumer, &prompt_b) == Some(0)).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    publish(&client, restarted.subject(KV_METRICS_TOPIC), load_envelope(&restarted, 1, 7)).await;
    tokio::time::sleep(Duration::from_millis(700)).await;

    let written = tokio::time::timeout(CONVERGE, async {
        loop {
            let (_, text) = http_get_async(ops, "/metrics").await;
            match metric(&text, "kvrelay_journal_records_written_total") {
                Some(written) if written > 0 => return text,
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
    .await
    .expect("the journal counters never moved");
    assert_eq!(metric(&written, "kvrelay_journal_recording"), Some(1));
    assert_eq!(metric(&written, "kvrelay_journal_queue_bytes_max"), Some(32 << 20));
    assert_eq!(metric(&written, "kvrelay_journal_records_dropped_total"), Some(0));
    assert_eq!(metric(&written, "kvrelay_journal_write_errors_total"), Some(0));
    consumer.shutdown().await;
    let identity = relay.relay;
    relay.shutdown().await.unwrap();
    (config, identity)
}
