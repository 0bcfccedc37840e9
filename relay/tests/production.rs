//! `kvrelay serve` against real servers, end to end: a real `nats-server` (Debian's package;
//! `.ci/run` installs it) on a free 127.0.0.1 port, a file-discovery directory written the way
//! Dynamo 1.6.1 writes it (dynamo-live §9.1), Dynamo-format MessagePack envelopes published on
//! Dynamo's subjects, and the relay wired exactly as the binary wires it
//! ([`kvrelay::serve::start`]). What the relay serves is read through the gRPC API with the
//! reference consumer, and the operations endpoints over HTTP.
//!
//! Covered: catalog, readiness, load and filter contents; a worker leaving by TTL expiry of its
//! discovery files; a publisher restart (new incarnation); an event-id gap; malformed discovery
//! records and malformed envelopes (counted and skipped, nothing else disturbed); the
//! live-reloaded `--sources-file`; `/metrics`, `/health`, `/ready`; SIGTERM of the built
//! binary (streams end with UNAVAILABLE, exit status 0); and `--record`: a recorded run replays
//! in the simulator reproducing every input-determined part of its checkpoints.
//!
//! Every wait is bounded; servers are killed by PID when their guards drop.

mod servers;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use bytes::Bytes;
use kvrelay::config::{self, CliValues};
use kvrelay::consumer::{self, ConsumerConfig, ConsumerSnapshot, FilterStatus, RelayConsumer};
use kvrelay::discovery_plane::EtcdClient;
use kvrelay::hashing::{
    ExternalBlockHash, HashFormat, LocalBlockHash, block_hash_seed, local_block_hashes,
};
use kvrelay::inputs::{
    EventEnvelope, KV_EVENTS_TOPIC, KV_METRICS_TOPIC, LoadObservation, encode_active_load,
    encode_event_envelope, encode_kv_events_payload,
};
use kvrelay::kv_events::{
    KvCacheEvent, KvCacheEventData, RouterEvent, SourceKey, StorageTier, StoreData, StoredBlock,
};
use kvrelay::readiness::ReadinessState;
use kvrelay::rng::rng_from_seed;
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor, WallClock};
use kvrelay::serve::{RunningRelay, ServeOptions};
use servers::{EtcdProcess, NatsServer, etcd_options, free_port};

/// Bound of every test.
const TEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound of one convergence.
const CONVERGE: Duration = Duration::from_secs(30);
const BLOCK: usize = 16;
const MODEL: &str = "tiny-llm";

const WORKER_A: u64 = 0x0a0a_0000_0000_0001;
const WORKER_B: u64 = 0x0b0b_0000_0000_0002;
const WORKER_C: u64 = 0x0c0c_0000_0000_0003;
const PUBLISHER_A: u64 = 0x1a_0000_0000_00a1;
const PUBLISHER_B: u64 = 0x1b_0000_0000_00b1;
const PUBLISHER_C: u64 = 0x1c_0000_0000_00c1;
const PUBLISHER_A_RESTARTED: u64 = 0x1a_0000_0000_00a2;

// ---------------------------------------------------------------------------------------------
// Servers.

async fn bounded<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_TIMEOUT, test).await.expect("test exceeded its time bound")
}

// ---------------------------------------------------------------------------------------------
// Dynamo-format discovery records in a file-discovery directory (dynamo-live §9.1).

fn now_us() -> u64 {
    SystemWallClock.now_unix_us()
}

/// A file-discovery root; a refresher task re-touches every live file each 500 ms, as the
/// owning Dynamo processes do, until the file is let go.
struct FileStore {
    _dir: tempfile::TempDir,
    root: PathBuf,
    live: Arc<Mutex<BTreeMap<PathBuf, ()>>>,
    refresher: tokio::task::JoinHandle<()>,
}

impl FileStore {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kvstore");
        std::fs::create_dir_all(&root).unwrap();
        let live: Arc<Mutex<BTreeMap<PathBuf, ()>>> = Arc::default();
        let refreshed = Arc::clone(&live);
        let refresher = tokio::spawn(async move {
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

    fn write(&self, relative: &str, contents: &str) {
        let path = self.root.join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, contents).unwrap();
        self.live.lock().unwrap().insert(path, ());
    }

    /// Stop refreshing `relative` and age it to 9 s: it expires within about a second, as the
    /// files of a worker killed with -9 do.
    fn abandon(&self, relative: &str) {
        let path = self.root.join(relative);
        self.live.lock().unwrap().remove(&path);
        touch(&path, now_us() - 9_000_000);
    }

    fn remove(&self, relative: &str) {
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

fn touch(path: &Path, modified_us: u64) {
    if let Ok(file) = std::fs::File::options().write(true).open(path) {
        let _ = file.set_modified(UNIX_EPOCH + Duration::from_micros(modified_us));
    }
}

/// One aggregated worker of `tiny-llm` at `namespace/backend/generate`.
#[derive(Clone, Copy)]
struct Worker {
    namespace: &'static str,
    instance: u64,
    publisher: u64,
}

impl Worker {
    fn instance_file(&self) -> String {
        format!("v1/instances/{}%2Fbackend%2Fgenerate%2F{:x}", self.namespace, self.instance)
    }

    fn card_file(&self) -> String {
        format!("v1/mdc/{}%2Fbackend%2Fgenerate%2F{:x}", self.namespace, self.instance)
    }

    fn source_file(&self) -> String {
        format!(
            "v1/event_sources/namespace%2F{}%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F{:x}",
            self.namespace, self.publisher
        )
    }

    /// The NATS event channel real workers advertise beside their event source.
    fn channel_file(&self) -> String {
        format!(
            "v1/event_channels/namespace%2F{}%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F{:x}",
            self.namespace, self.publisher
        )
    }

    fn channel_record(&self) -> String {
        format!(
            r#"{{"type":"EventChannel","scope":{{"kind":"endpoint","endpoint":{{"namespace":"{n}","component":"backend","name":"generate"}}}},"topic":"kv-events","instance_id":{p},"transport":{{"kind":"Nats","config":{{"subject_prefix":"namespace.{n}.component.backend.endpoint.generate"}}}}}}"#,
            n = self.namespace,
            p = self.publisher
        )
    }

    fn instance_record(&self) -> String {
        format!(
            r#"{{"type":"Endpoint","component":"backend","endpoint":"generate","namespace":"{n}","instance_id":{i},"transport":{{"tcp":"127.0.0.1:9/{i:x}/{n}/backend/generate"}},"device_type":"cuda","request_plane_codec":"msgpack"}}"#,
            n = self.namespace,
            i = self.instance
        )
    }

    fn card_record(&self) -> String {
        format!(
            r#"{{"type":"Model","namespace":"{n}","component":"backend","endpoint":"generate","instance_id":{i},"card_json":{{"display_name":"{MODEL}","slug":"{MODEL}","source_path":"/tmp/dynlive/models/tiny-llm","kv_cache_block_size":{BLOCK},"context_length":8192,"model_type":"Chat | Completions","model_input":"Tokens","worker_type":"aggregated","needs":[],"runtime_config":{{"total_kv_blocks":1000,"max_num_seqs":256,"max_num_batched_tokens":8192,"data_parallel_start_rank":0,"data_parallel_size":1,"enable_local_indexer":false,"kv_event_publishing_enabled":true,"enable_eagle":false}},"migration_limit":0}}}}"#,
            n = self.namespace,
            i = self.instance
        )
    }

    fn source_record(&self) -> String {
        format!(
            r#"{{"type":"EventSource","scope":{{"kind":"endpoint","endpoint":{{"namespace":"{n}","component":"backend","name":"generate"}}}},"topic":"kv-events","publisher_id":{p},"metadata":{{"kv_state_endpoint":{{"namespace":"{n}","component":"backend","name":"generate"}},"worker":{{"worker_id":{i},"dp_rank":0}},"publisher_id":{p}}}}}"#,
            n = self.namespace,
            i = self.instance,
            p = self.publisher
        )
    }

    fn register(&self, store: &FileStore) {
        store.write(&self.card_file(), &self.card_record());
        store.write(&self.source_file(), &self.source_record());
        store.write(&self.channel_file(), &self.channel_record());
        store.write(&self.instance_file(), &self.instance_record());
    }

    fn files(&self) -> [String; 4] {
        [self.instance_file(), self.card_file(), self.source_file(), self.channel_file()]
    }

    fn abandon(&self, store: &FileStore) {
        for file in self.files() {
            store.abandon(&file);
        }
    }

    fn unregister(&self, store: &FileStore) {
        for file in self.files() {
            store.remove(&file);
        }
    }

    /// The logical (etcd) keys and values, as Dynamo writes them under a lease.
    fn etcd_entries(&self) -> [(String, String); 3] {
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

    fn subject(&self, topic: &str) -> String {
        format!("namespace.{}.component.backend.endpoint.generate.{topic}", self.namespace)
    }
}

// ---------------------------------------------------------------------------------------------
// Dynamo-format envelopes.

/// A prompt of `blocks` full blocks, distinct per `salt`.
fn prompt(salt: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32).map(|index| salt * 100_000 + index).collect()
}

/// A `kv-events` envelope storing the blocks of `tokens` as one chain (event `event_id`).
fn store_envelope(worker: &Worker, sequence: u64, event_id: u64, tokens: &[u32]) -> Vec<u8> {
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
    let event = RouterEvent {
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
    };
    let payload = encode_kv_events_payload(&[event]).unwrap();
    encode_event_envelope(&EventEnvelope {
        publisher_id: worker.publisher,
        sequence,
        published_at_ms: SystemWallClock.now_unix_ms(),
        topic: KV_EVENTS_TOPIC,
        payload: &payload,
    })
    .unwrap()
}

fn load_envelope(worker: &Worker, sequence: u64, kv_used_blocks: u64) -> Vec<u8> {
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

async fn publish(client: &async_nats::Client, subject: String, bytes: Vec<u8>) {
    client.publish(subject, Bytes::from(bytes)).await.unwrap();
    client.flush().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// The relay and its observers.

fn start_options(seed: u64) -> ServeOptions {
    ServeOptions {
        seed,
        executor: Arc::new(TokioBlockingExecutor),
        clock: Arc::new(SystemWallClock),
    }
}

async fn start_relay(
    store: &FileStore,
    nats: &NatsServer,
    sources_file: Option<PathBuf>,
    guard: Option<&str>,
) -> RunningRelay {
    let discovery = [
        ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
        ("DYN_FILE_KV", store.root.display().to_string()),
    ];
    start_relay_with(&discovery, nats, sources_file, guard).await
}

async fn start_relay_with(
    discovery: &[(&str, String)],
    nats: &NatsServer,
    sources_file: Option<PathBuf>,
    guard: Option<&str>,
) -> RunningRelay {
    let config = relay_config(discovery, nats, sources_file, guard, &[]);
    kvrelay::serve::start(config, start_options(7)).await.unwrap()
}

/// The configuration [`start_relay_with`] starts, with `extra` environment variables.
fn relay_config(
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

fn start_consumer(relay: &RunningRelay) -> RelayConsumer {
    let address = relay.wan_address.unwrap().to_string();
    RelayConsumer::start(
        consumer::connect_lazy(&address).unwrap(),
        ConsumerConfig::default(),
        &mut rng_from_seed(11),
    )
    .unwrap()
}

async fn converge(
    consumer: &RelayConsumer,
    what: &str,
    predicate: impl FnMut(&ConsumerSnapshot) -> bool,
) -> ConsumerSnapshot {
    converge_within(consumer, what, CONVERGE, predicate).await
}

async fn converge_within(
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

/// Leading blocks of `tokens` the consumer's (complete) replica holds for `MODEL`.
fn matched(consumer: &RelayConsumer, tokens: &[u32]) -> Option<usize> {
    let answers = consumer.query(tokens, MODEL);
    answers.iter().find(|answer| answer.replica_ready).map(|answer| answer.matched_blocks)
}

fn pool_ready(snapshot: &ConsumerSnapshot) -> bool {
    snapshot.pools.len() == 1 && snapshot.pools[0].status == FilterStatus::Ready
}

fn readiness_of(snapshot: &ConsumerSnapshot, namespace: &str) -> Option<ReadinessState> {
    snapshot.readiness.iter().find(|entry| entry.namespace == namespace).map(|entry| entry.state)
}

/// The value of one unlabelled or labelled sample in a Prometheus exposition.
fn metric(text: &str, sample: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, value) = line.rsplit_once(' ')?;
        (name == sample).then(|| value.parse().ok()).flatten()
    })
}

/// A plain HTTP/1.1 GET on loopback: (status code, body).
async fn http_get_async(address: SocketAddr, path: &'static str) -> (u16, String) {
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
// Scenarios.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_follows_real_workers_through_departure_restart_gaps_and_garbage() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let a = Worker { namespace: "dynamo", instance: WORKER_A, publisher: PUBLISHER_A };
        let b = Worker { namespace: "dynamo", instance: WORKER_B, publisher: PUBLISHER_B };
        a.register(&store);
        b.register(&store);
        let relay = start_relay(&store, &nats, None, None).await;
        let ops = relay.ops_address.unwrap();
        let consumer = start_consumer(&relay);
        let client = async_nats::connect(nats.url()).await.unwrap();

        // Catalog and readiness: one pool, READY with both workers as members.
        let first = converge(&consumer, "the pool and READY readiness", |snapshot| {
            pool_ready(snapshot) && readiness_of(snapshot, "dynamo") == Some(ReadinessState::Ready)
        })
        .await;
        let pool = &first.pools[0];
        assert_eq!(pool.descriptor.serving_endpoint.to_string(), "dynamo/backend/generate");
        assert_eq!(pool.descriptor.registrations[0].canonical_model_id, MODEL);
        assert_eq!(pool.descriptor.query_semantics.kv_block_size, BLOCK as u32);

        // Filter contents: each worker stores a prompt; the subscription is live once one lands.
        let prompt_a = prompt(1, 4);
        let prompt_b = prompt(2, 3);
        tokio::time::timeout(CONVERGE, async {
            let mut sequence = 0;
            while matched(&consumer, &prompt_a) != Some(4) {
                // Re-sent under a fresh event id each time, in order, until the NATS subscription
                // is up; every copy continues the cursor.
                sequence += 1;
                publish(
                    &client,
                    a.subject(KV_EVENTS_TOPIC),
                    store_envelope(&a, sequence, sequence, &prompt_a),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .expect("worker A's blocks never reached the consumer");
        publish(&client, b.subject(KV_EVENTS_TOPIC), store_envelope(&b, 1, 1, &prompt_b)).await;
        converge(&consumer, "worker B's blocks", |_| matched(&consumer, &prompt_b) == Some(3))
            .await;
        assert_eq!(matched(&consumer, &prompt(9, 2)), Some(0), "an unknown prompt matches nothing");

        // Load: both ranks report, the pool's sum is complete.
        publish(&client, a.subject(KV_METRICS_TOPIC), load_envelope(&a, 1, 30)).await;
        publish(&client, b.subject(KV_METRICS_TOPIC), load_envelope(&b, 1, 12)).await;
        let loaded = converge(&consumer, "complete load", |snapshot| {
            snapshot.load.iter().any(|load| load.kv_used_blocks == Some(42))
        })
        .await;
        assert_eq!(loaded.load[0].kv_expected_ranks, 2);
        assert_eq!(loaded.load[0].total_kv_blocks, Some(2000));

        // Garbage: malformed discovery records and malformed envelopes are counted and skipped.
        let (_, before) = http_get_async(ops, "/metrics").await;
        store.write("v1/mdc/dynamo%2Fbackend%2Fgenerate%2Fdeadbeef", "{\"type\":\"Model\",");
        store.write("v1/instances/not-a-key", &a.instance_record());
        publish(&client, a.subject(KV_EVENTS_TOPIC), b"\xc1 not msgpack".to_vec()).await;
        publish(&client, a.subject(KV_METRICS_TOPIC), vec![0x85, 0xa1]).await;
        tokio::time::timeout(CONVERGE, async {
            loop {
                let (_, text) = http_get_async(ops, "/metrics").await;
                let json = metric(&text, "kvrelay_discovery_records_rejected_total{kind=\"json\"}")
                    .unwrap_or(0);
                let key = metric(
                    &text,
                    "kvrelay_discovery_records_rejected_total{kind=\"malformed_key\"}",
                )
                .unwrap_or(0);
                let envelopes: u64 = text
                    .lines()
                    .filter(|line| line.starts_with("kvrelay_event_plane_messages_rejected_total{"))
                    .filter_map(|line| line.rsplit_once(' ')?.1.parse::<u64>().ok())
                    .sum();
                if json >= 1 && key >= 1 && envelopes >= 2 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .expect("the malformed inputs were not counted");
        assert_eq!(
            metric(&before, "kvrelay_discovery_records_rejected_total{kind=\"json\"}"),
            Some(0)
        );
        assert_eq!(matched(&consumer, &prompt_a), Some(4), "garbage disturbed nothing");
        assert_eq!(matched(&consumer, &prompt_b), Some(3), "garbage disturbed nothing");
        assert!(pool_ready(&consumer.snapshot()));

        // An event-id gap on live-only worker B: the rank resets, the event after the gap
        // applies.
        let prompt_b2 = prompt(3, 2);
        publish(&client, b.subject(KV_EVENTS_TOPIC), store_envelope(&b, 2, 5, &prompt_b2)).await;
        converge(&consumer, "the gap reset", |_| {
            matched(&consumer, &prompt_b2) == Some(2) && matched(&consumer, &prompt_b) == Some(0)
        })
        .await;
        assert_eq!(matched(&consumer, &prompt_a), Some(4), "the gap touches only its rank");

        // Publisher restart: worker A comes back as a new incarnation (new publisher id); its
        // old blocks go, events of the old incarnation are dropped, the new ones apply.
        let restarted = Worker { publisher: PUBLISHER_A_RESTARTED, ..a };
        store.remove(&a.source_file());
        restarted.register(&store);
        let prompt_a2 = prompt(4, 3);
        tokio::time::timeout(CONVERGE, async {
            let mut event_id = 0;
            while matched(&consumer, &prompt_a2) != Some(3) {
                event_id += 1;
                publish(
                    &client,
                    a.subject(KV_EVENTS_TOPIC),
                    store_envelope(&restarted, event_id, event_id, &prompt_a2),
                )
                .await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        })
        .await
        .expect("the restarted publisher's blocks never arrived");
        converge(&consumer, "the old incarnation's blocks gone", |_| {
            matched(&consumer, &prompt_a) == Some(0)
        })
        .await;
        publish(&client, a.subject(KV_EVENTS_TOPIC), store_envelope(&a, 99, 99, &prompt(5, 2)))
            .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(matched(&consumer, &prompt(5, 2)), Some(0), "the old incarnation is fenced off");

        // Departure by TTL: worker B stops refreshing its files; they expire, B's blocks leave
        // the filter and the pool expects one rank, while A keeps serving.
        b.abandon(&store);
        let departed = converge(&consumer, "worker B expired", |snapshot| {
            matched(&consumer, &prompt_b2) == Some(0)
                && snapshot.load.iter().any(|load| load.kv_expected_ranks == 1)
        })
        .await;
        assert_eq!(readiness_of(&departed, "dynamo"), Some(ReadinessState::Ready));
        assert_eq!(matched(&consumer, &prompt_a2), Some(3));

        // The last worker leaves (unregisters): the catalog empties.
        a.unregister(&store);
        converge(&consumer, "the pool withdrawn", |snapshot| snapshot.pools.is_empty()).await;

        let (status, body) = http_get_async(ops, "/health").await;
        assert_eq!(status, 200, "{body}");
        consumer.shutdown().await;
        relay.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sources_file_selects_namespaces_live_and_keeps_the_last_good_list() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let dynamo = Worker { namespace: "dynamo", instance: WORKER_A, publisher: PUBLISHER_A };
        let ver = Worker { namespace: "ver", instance: WORKER_C, publisher: PUBLISHER_C };
        dynamo.register(&store);
        ver.register(&store);
        let sources_dir = tempfile::tempdir().unwrap();
        let sources = sources_dir.path().join("sources.json");
        std::fs::write(&sources, r#"{"version":1,"connectionRevision":"c1","sources":[{"namespace":"ver"}]}"#).unwrap();
        let relay = start_relay(&store, &nats, Some(sources.clone()), Some("c1")).await;
        let ops = relay.ops_address.unwrap();
        let consumer = start_consumer(&relay);

        let only_ver = converge(&consumer, "only the ver pool", |snapshot| {
            pool_ready(snapshot) && readiness_of(snapshot, "ver") == Some(ReadinessState::Ready)
        })
        .await;
        assert_eq!(only_ver.pools[0].descriptor.serving_endpoint.to_string(), "ver/backend/generate");
        assert_eq!(readiness_of(&only_ver, "dynamo"), None);
        let (status, state) = http_get_async(ops, "/engine/state").await;
        assert_eq!(status, 200);
        let state: serde_json::Value = serde_json::from_str(&state).unwrap();
        assert_eq!(state["mode"], "file");
        assert_eq!(state["connectionRevision"], "c1");
        assert_eq!(state["sources"]["count"], 1);
        let first_revision = state["sources"]["appliedRevision"].as_str().unwrap().to_owned();
        assert_eq!(first_revision.len(), 64);

        // A torn write is refused; the last good list stays.
        std::fs::write(&sources, r#"{"version":1,"sources":[{"namesp"#).unwrap();
        tokio::time::timeout(CONVERGE, async {
            loop {
                let (_, state) = http_get_async(ops, "/engine/state").await;
                let state: serde_json::Value = serde_json::from_str(&state).unwrap();
                if state["sources"]["lastError"].is_string() {
                    assert_eq!(state["sources"]["appliedRevision"], first_revision.as_str());
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
        .expect("the torn file was not reported");
        assert_eq!(consumer.snapshot().pools.len(), 1);

        // Adding `dynamo` is picked up live.
        std::fs::write(
            &sources,
            r#"{"version":1,"connectionRevision":"c1","sources":[{"namespace":"ver"},{"namespace":"dynamo"}]}"#,
        )
        .unwrap();
        converge(&consumer, "both pools", |snapshot| {
            snapshot.pools.len() == 2 && readiness_of(snapshot, "dynamo") == Some(ReadinessState::Ready)
        })
        .await;

        // Dropping `ver` withdraws its pool.
        std::fs::write(&sources, r#"{"version":1,"connectionRevision":"c1","sources":[{"namespace":"dynamo"}]}"#).unwrap();
        let narrowed = converge(&consumer, "only the dynamo pool", |snapshot| {
            snapshot.pools.len() == 1 && readiness_of(snapshot, "ver").is_none()
        })
        .await;
        assert_eq!(narrowed.pools[0].descriptor.serving_endpoint.to_string(), "dynamo/backend/generate");

        // A file written for another connection is refused.
        std::fs::write(&sources, r#"{"version":1,"connectionRevision":"c2","sources":[]}"#).unwrap();
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(consumer.snapshot().pools.len(), 1);
        let (_, text) = http_get_async(ops, "/metrics").await;
        assert_eq!(metric(&text, "kvrelay_sources_last_read_refused"), Some(1));
        assert_eq!(metric(&text, "kvrelay_sources_namespace_count"), Some(1));

        consumer.shutdown().await;
        relay.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_health_are_served_over_http() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let worker = Worker { namespace: "dynamo", instance: WORKER_A, publisher: PUBLISHER_A };
        worker.register(&store);
        let relay = start_relay(&store, &nats, None, None).await;
        let ops = relay.ops_address.unwrap();
        let consumer = start_consumer(&relay);
        converge(&consumer, "the pool", pool_ready).await;
        tokio::time::timeout(CONVERGE, async {
            while http_get_async(ops, "/ready").await.0 != 200 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .expect("never ready");
        let (status, text) = http_get_async(ops, "/metrics").await;
        assert_eq!(status, 200);
        assert_eq!(metric(&text, "kv_dc_relay_catalog_pool_count"), Some(1));
        assert_eq!(metric(&text, "kv_dc_relay_serving_topology_count{state=\"ready\"}"), Some(1));
        assert!(
            metric(&text, "kv_dc_relay_subscribers{stream=\"catalog\"}").unwrap() >= 1,
            "{text}"
        );
        assert!(metric(&text, "kvrelay_discovery_listings_total").unwrap() >= 1);
        assert_eq!(metric(&text, "kvrelay_event_plane_connects_total{plane=\"nats\"}"), Some(1));
        assert_eq!(metric(&text, "kvrelay_healthy"), Some(1));
        // The pool gauges are refreshed from the actors every second.
        let text = tokio::time::timeout(CONVERGE, async {
            loop {
                let (_, text) = http_get_async(ops, "/metrics").await;
                if metric(&text, "kvrelay_pool_count") == Some(1) {
                    return text;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .expect("the pool gauges never counted the pool");
        assert_eq!(metric(&text, "kvrelay_pool_owned_blocks"), Some(0));
        assert_eq!(metric(&text, "kvrelay_pool_capacity_omissions"), Some(0));
        let (status, health) = http_get_async(ops, "/health").await;
        assert_eq!(status, 200);
        let health: serde_json::Value = serde_json::from_str(&health).unwrap();
        assert_eq!(health["wan_serving"], true);
        assert_eq!(health["active_endpoint_count"], 1);
        assert_eq!(http_get_async(ops, "/live").await.0, 200);
        assert_eq!(http_get_async(ops, "/nope").await.0, 404);
        consumer.shutdown().await;
        relay.shutdown().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_streams_with_unavailable_and_exits_zero() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let worker = Worker { namespace: "dynamo", instance: WORKER_A, publisher: PUBLISHER_A };
        worker.register(&store);
        let wan_port = free_port();
        let ops_port = free_port();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvrelay"))
            .args(["serve", "--dc-id", "dc-a"])
            .args(["--bind", &format!("127.0.0.1:{wan_port}")])
            .args(["--ops-bind", &format!("127.0.0.1:{ops_port}")])
            .env("DYN_DISCOVERY_BACKEND", "file")
            .env("DYN_FILE_KV", &store.root)
            .env("DYN_EVENT_PLANE", "nats")
            .env("NATS_SERVER", nats.url())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let wan: SocketAddr = format!("127.0.0.1:{wan_port}").parse().unwrap();
        let ops: SocketAddr = format!("127.0.0.1:{ops_port}").parse().unwrap();
        let mut client = None;
        for _ in 0..200 {
            if let Ok(connected) = consumer::connect(&wan.to_string()).await {
                client = Some(connected);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let channel = client.expect("the relay binary never listened");
        let mut relay_client =
            kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient::new(channel);
        let mut stream = relay_client
            .watch_kv_pool_catalog(kvrelay_proto::v1::WatchKvPoolCatalogRequest {
                subscriber_id: "sigterm-test".into(),
                contract_marker: kvrelay_proto::CONTRACT_MARKER,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(stream.message().await.unwrap().is_some(), "the first catalog update");
        assert_eq!(http_get_async(ops, "/health").await.0, 200);

        let pid = child.id().to_string();
        let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(killed.success());
        let ended = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                match stream.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => return None,
                    Err(status) => return Some(status),
                }
            }
        })
        .await
        .expect("the stream did not end after SIGTERM");
        let status = ended.expect("the stream ended without a status");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        let exit = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                if let Some(exit) = child.try_wait().unwrap() {
                    return exit;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await
        .expect("the relay did not exit after SIGTERM");
        assert_eq!(exit.code(), Some(0));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sources_file_narrows_etcd_discovery_by_relisting() {
    bounded(async {
        let nats = NatsServer::start().await;
        let etcd = EtcdProcess::start().await;
        let mut client = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
        let lease = client.lease_grant(120).await.unwrap();
        let dynamo = Worker { namespace: "dynamo", instance: WORKER_A, publisher: PUBLISHER_A };
        let ver = Worker { namespace: "ver", instance: WORKER_C, publisher: PUBLISHER_C };
        for worker in [dynamo, ver] {
            for (key, value) in worker.etcd_entries() {
                client.put(key.as_bytes(), value.as_bytes(), lease).await.unwrap();
            }
        }
        let sources_dir = tempfile::tempdir().unwrap();
        let sources = sources_dir.path().join("sources.json");
        std::fs::write(&sources, r#"{"version":1,"sources":[{"namespace":"dynamo"}]}"#).unwrap();
        let discovery =
            [("DYN_DISCOVERY_BACKEND", "etcd".to_owned()), ("ETCD_ENDPOINTS", etcd.url())];
        let relay = start_relay_with(&discovery, &nats, Some(sources.clone()), None).await;
        let consumer = start_consumer(&relay);
        let only_dynamo = converge(&consumer, "only the dynamo pool", |snapshot| {
            pool_ready(snapshot) && readiness_of(snapshot, "dynamo") == Some(ReadinessState::Ready)
        })
        .await;
        assert_eq!(readiness_of(&only_dynamo, "ver"), None);

        // Widening relists at once: well before the 30 s reconciliation would.
        std::fs::write(
            &sources,
            r#"{"version":1,"sources":[{"namespace":"dynamo"},{"namespace":"ver"}]}"#,
        )
        .unwrap();
        converge_within(&consumer, "both pools", Duration::from_secs(10), |snapshot| {
            snapshot.pools.len() == 2
                && readiness_of(snapshot, "ver") == Some(ReadinessState::Ready)
        })
        .await;
        // An empty list watches nothing.
        std::fs::write(&sources, r#"{"version":1,"sources":[]}"#).unwrap();
        converge(&consumer, "no pool", |snapshot| {
            snapshot.pools.is_empty() && snapshot.readiness.is_empty()
        })
        .await;
        consumer.shutdown().await;
        relay.shutdown().await.unwrap();
    })
    .await;
}

/// Record a `serve` run (two workers, blocks, load, a publisher restart, a departure) into a
/// fresh directory under `root`; returns the configuration and identity a replay needs.
async fn record_serve_run(root: &Path) -> (config::RelayConfig, kvrelay::identity::RelayIdentity) {
    let nats = NatsServer::start().await;
    let store = FileStore::new();
    let a = Worker { namespace: "dynamo", instance: WORKER_A, publisher: PUBLISHER_A };
    let b = Worker { namespace: "dynamo", instance: WORKER_B, publisher: PUBLISHER_B };
    a.register(&store);
    b.register(&store);
    let discovery = [
        ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
        ("DYN_FILE_KV", store.root.display().to_string()),
    ];
    let recording = [
        ("DYN_RELAY_RECORD_DIR", root.display().to_string()),
        ("DYN_RELAY_RECORD_CHECKPOINT_INTERVAL_MS", "300".to_owned()),
    ];
    let config = relay_config(&discovery, &nats, None, None, &recording);
    let relay = kvrelay::serve::start(config.clone(), start_options(7)).await.unwrap();
    let ops = relay.ops_address.unwrap();
    let consumer = start_consumer(&relay);
    let client = async_nats::connect(nats.url()).await.unwrap();
    converge(&consumer, "the pool", pool_ready).await;

    let prompt_a = prompt(1, 4);
    tokio::time::timeout(CONVERGE, async {
        let mut sequence = 0;
        while matched(&consumer, &prompt_a) != Some(4) {
            sequence += 1;
            let envelope = store_envelope(&a, sequence, sequence, &prompt_a);
            publish(&client, a.subject(KV_EVENTS_TOPIC), envelope).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("worker A's blocks never reached the consumer");
    let prompt_b = prompt(2, 3);
    publish(&client, b.subject(KV_EVENTS_TOPIC), store_envelope(&b, 1, 1, &prompt_b)).await;
    publish(&client, a.subject(KV_METRICS_TOPIC), load_envelope(&a, 1, 30)).await;
    publish(&client, b.subject(KV_METRICS_TOPIC), load_envelope(&b, 1, 12)).await;
    converge(&consumer, "worker B's blocks", |_| matched(&consumer, &prompt_b) == Some(3)).await;

    // Worker A restarts as a new publisher incarnation.
    let restarted = Worker { publisher: PUBLISHER_A_RESTARTED, ..a };
    store.remove(&a.source_file());
    restarted.register(&store);
    let prompt_a2 = prompt(4, 3);
    tokio::time::timeout(CONVERGE, async {
        let mut event_id = 0;
        while matched(&consumer, &prompt_a2) != Some(3) {
            event_id += 1;
            let envelope = store_envelope(&restarted, event_id, event_id, &prompt_a2);
            publish(&client, a.subject(KV_EVENTS_TOPIC), envelope).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
    .await
    .expect("the restarted publisher's blocks never arrived");
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
    assert_eq!(metric(&written, "kvrelay_journal_records_dropped_total"), Some(0));
    assert_eq!(metric(&written, "kvrelay_journal_write_errors_total"), Some(0));
    consumer.shutdown().await;
    let identity = relay.relay;
    relay.shutdown().await.unwrap();
    (config, identity)
}

/// `serve --record` journals a real run (NATS + file discovery, a publisher restart); the
/// journal replays in the simulator (paused clock) against the configuration `serve` ran with.
#[test]
fn a_recorded_serve_run_replays_its_checkpoints() {
    use kvrelay::journal::{self, Record, ReplayOptions};
    let root = tempfile::tempdir().unwrap();
    let serving =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (config, identity) = serving.block_on(bounded(record_serve_run(root.path())));
    drop(serving);

    let dirs: Vec<PathBuf> =
        std::fs::read_dir(root.path()).unwrap().map(|entry| entry.unwrap().path()).collect();
    assert_eq!(dirs.len(), 1, "one recording per start: {dirs:?}");
    let (header, records, fault) = journal::read_journal(&dirs[0]).unwrap();
    assert_eq!(fault, None);
    assert_eq!(header.relay_incarnation, identity.relay_incarnation);
    let inputs = records.iter().filter(|record| matches!(record, Record::Input { .. })).count();
    let checkpoints =
        records.iter().filter(|record| matches!(record, Record::Checkpoint { .. })).count();
    assert!(!records.iter().any(|record| matches!(record, Record::Gap { .. })), "nothing lost");
    assert!(inputs >= 10, "{inputs} inputs recorded");
    assert!(checkpoints >= 3, "{checkpoints} checkpoints recorded");

    let replaying = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let node_config = kvrelay::serve::node_config(&config, identity, 7);
    assert_eq!(*header.node, node_config, "the header carries serve's node configuration");
    let report = replaying
        .block_on(journal::replay_journal(
            &dirs[0],
            node_config,
            Arc::new(kvrelay::runtime::InlineExecutor),
            ReplayOptions::default(),
        ))
        .unwrap();
    assert_eq!(report.journal_fault, None);
    assert_eq!(report.inputs_replayed as usize, inputs);
    assert_eq!(report.checkpoints_compared, checkpoints);

    // Everything is reproduced: each checkpoint follows the same input at the same time (the
    // schedule is decided with the input's recorded time), and the pools' published sequences
    // follow the recorded publication points (the actors' timers and the consumer's barriers).
    assert_eq!(report.divergence, None, "{:#?}", report.divergence);
    let recorded: Vec<(Duration, &journal::Checkpoint)> = records
        .iter()
        .filter_map(|record| match record {
            Record::Checkpoint { at, checkpoint } => Some((at.mono(), checkpoint)),
            _ => None,
        })
        .collect();
    assert_eq!(report.checkpoints.len(), recorded.len());
    for ((at, replayed), (recorded_at, checkpoint)) in report.checkpoints.iter().zip(&recorded) {
        assert_eq!((at, replayed), (recorded_at, *checkpoint));
    }
    let publications =
        records.iter().filter(|record| matches!(record, Record::Publication { .. })).count();
    assert!(publications > 0, "the actors' publication points are recorded");
    assert!(
        recorded
            .iter()
            .any(|(_, checkpoint)| checkpoint.pools.iter().any(|pool| pool.sequence > 0)),
        "the consumer's lease made the pools publish: {recorded:?}"
    );
    // The recording ends with a checkpoint after its last input: the final state, blocks,
    // filter and sequence included, is reproduced.
    let (last_at, last) = recorded.last().unwrap();
    assert_eq!(last.inputs_handled as usize, inputs, "the last checkpoint follows every input");
    let (final_at, final_state) = report.final_state.as_ref().expect("a final state");
    assert_eq!((final_at, final_state), (last_at, *last));
    assert!(last.pools.iter().any(|pool| pool.exact_blocks > 0), "{:?}", last.pools);
}

/// A record directory that cannot be created (its parent is a file) disables recording, and
/// the relay serves regardless; `/metrics` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recording_that_cannot_start_does_not_stop_serving() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let worker = Worker { namespace: "dynamo", instance: WORKER_A, publisher: PUBLISHER_A };
        worker.register(&store);
        let blocker = tempfile::NamedTempFile::new().unwrap();
        let discovery = [
            ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
            ("DYN_FILE_KV", store.root.display().to_string()),
        ];
        let record =
            [("DYN_RELAY_RECORD_DIR", blocker.path().join("journal").display().to_string())];
        let config = relay_config(&discovery, &nats, None, None, &record);
        let relay = kvrelay::serve::start(config, start_options(7)).await.unwrap();
        let consumer = start_consumer(&relay);
        converge(&consumer, "the pool", pool_ready).await;
        let (status, text) = http_get_async(relay.ops_address.unwrap(), "/metrics").await;
        assert_eq!(status, 200);
        assert_eq!(metric(&text, "kvrelay_journal_recording"), Some(0), "{text}");
        assert_eq!(metric(&text, "kvrelay_journal_records_written_total"), Some(0));
        assert_eq!(metric(&text, "kvrelay_healthy"), Some(1));
        consumer.shutdown().await;
        relay.shutdown().await.unwrap();
    })
    .await;
}
