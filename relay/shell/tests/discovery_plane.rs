//! The discovery-plane transports against real stores: a file-discovery directory laid out
//! exactly as Dynamo 1.6.1 writes it (dynamo-live §9.1), and a real etcd server (Debian's
//! `etcd-server`, 3.4) started on 127.0.0.1 with random free ports and a temporary data dir.
//!
//! Two etcds are secured: one serving TLS with `--client-cert-auth` (certificates made in the
//! test by `rcgen`), one with authentication turned on through etcd's Auth API; the relay's
//! settings come from the `ETCD_AUTH_*` names it reads from its environment.
//!
//! Every wait is bounded; nothing talks to anything but 127.0.0.1. The etcd tests need the
//! `etcd` binary and fail with an install hint when it is missing.

mod pki;
mod servers;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use kvrelay::discovery_plane::{
    ChannelChange, DiscoveryOutput, DiscoveryPlaneError, DiscoverySink, DiscoveryStats, EtcdClient,
    EtcdDiscoveryConfig, FileDiscovery, FileDiscoveryConfig, FileScanError, WatchBatch,
    run_etcd_discovery, run_file_discovery,
};
use kvrelay::runtime::{ManualWallClock, WallClock};
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::{CardInstanceId, DcInput, EndpointInstances, InputErrorKind};
use kvrelay_core::model::identity::EndpointPath;
use servers::{EtcdProcess, etcd_options, free_port};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------------------------------------
// Dynamo-shaped records (dynamo-live §9.1), with the ids of the captured aggregated worker.

const INSTANCE: u64 = 13_864_542_646_465_346_627; // 0xc068c01457d23c43
const PUBLISHER: u64 = 7_327_664_155_944_878; // 0x1a0878c30c67ae

fn backend() -> EndpointPath {
    EndpointPath::new("dynamo", "backend", "generate").unwrap()
}

fn instance_record(instance: u64) -> String {
    format!(
        r#"{{"type":"Endpoint","component":"backend","endpoint":"generate","namespace":"dynamo","instance_id":{instance},"transport":{{"tcp":"127.0.0.1:34229/{instance:x}/dynamo/backend/generate"}},"device_type":"cuda","request_plane_codec":"msgpack"}}"#
    )
}

/// A Model record; `lora` makes it an adapter card with that suffix; `extra_runtime` is spliced
/// into the runtime config (e.g. taints).
fn model_record(instance: u64, lora: Option<&str>, extra_runtime: &str) -> String {
    let (suffix, lora_field, display) = match lora {
        Some(name) => (
            format!(r#""model_suffix":"{name}","#),
            format!(r#""lora":{{"name":"{name}","max_gpu_lora_count":4}},"#),
            name.to_owned(),
        ),
        None => (String::new(), String::new(), "tiny-llm".to_owned()),
    };
    format!(
        r#"{{"type":"Model","namespace":"dynamo","component":"backend","endpoint":"generate","instance_id":{instance},{suffix}"card_json":{{"display_name":"{display}","slug":"{display}","source_path":"/tmp/dynlive/models/tiny-llm","kv_cache_block_size":16,"context_length":8192,"model_type":"Chat | Completions","model_input":"Tokens","worker_type":"aggregated","needs":[],{lora_field}"runtime_config":{{"total_kv_blocks":16384,"max_num_seqs":256,"max_num_batched_tokens":8192,"data_parallel_start_rank":0,"data_parallel_size":1,"enable_local_indexer":false,"kv_event_publishing_enabled":true,"enable_eagle":false{extra_runtime}}},"migration_limit":0}}}}"#
    )
}

fn event_source_record(instance: u64, publisher: u64) -> String {
    format!(
        r#"{{"type":"EventSource","scope":{{"kind":"endpoint","endpoint":{{"namespace":"dynamo","component":"backend","name":"generate"}}}},"topic":"kv-events","publisher_id":{publisher},"metadata":{{"kv_state_endpoint":{{"namespace":"dynamo","component":"backend","name":"generate"}},"worker":{{"worker_id":{instance},"dp_rank":0}},"publisher_id":{publisher}}}}}"#
    )
}

fn event_channel_record(publisher: u64) -> String {
    format!(
        r#"{{"type":"EventChannel","scope":{{"kind":"endpoint","endpoint":{{"namespace":"dynamo","component":"backend","name":"generate"}}}},"topic":"kv-events","instance_id":{publisher},"transport":{{"kind":"Nats","config":{{"subject_prefix":"namespace.dynamo.component.backend.endpoint.generate"}}}}}}"#
    )
}

fn card_id(instance: u64, suffix: Option<&str>) -> CardInstanceId {
    CardInstanceId {
        endpoint: backend(),
        instance_id: instance,
        model_suffix: suffix.map(str::to_owned),
    }
}

fn live(workers: &[u64]) -> DcInput {
    DcInput::Instances(EndpointInstances {
        endpoint: backend(),
        live_workers: Some(workers.iter().copied().collect::<BTreeSet<_>>()),
    })
}

fn withdrawn(publisher: u64) -> DcInput {
    DcInput::SourceWithdrawn { kv_state_endpoint: backend(), publisher_id: publisher }
}

fn facts(outputs: &[DiscoveryOutput]) -> Vec<DcInput> {
    outputs
        .iter()
        .filter_map(|output| match output {
            DiscoveryOutput::Fact(fact) => Some(fact.clone()),
            DiscoveryOutput::Channel(_) => None,
        })
        .collect()
}

fn listed_ids(fact: &DcInput) -> Vec<CardInstanceId> {
    match fact {
        DcInput::CardsListed { cards } => cards.iter().map(|(id, _)| id.clone()).collect(),
        other => panic!("expected CardsListed, got {other:?}"),
    }
}

/// Receive facts until `done` holds for everything received; panics after `within`.
async fn receive_until(
    facts: &mut kvrelay::node::InputReceiver,
    within: Duration,
    what: &str,
    done: impl Fn(&[DcInput]) -> bool,
) -> Vec<DcInput> {
    let mut received = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while !done(&received) {
        match tokio::time::timeout_at(deadline, facts.recv_input()).await {
            Ok(Some(fact)) => received.push(fact),
            Ok(None) => panic!("{what}: the transport ended; received {received:#?}"),
            Err(_) => panic!("{what}: not within {within:?}; received {received:#?}"),
        }
    }
    received
}

// ---------------------------------------------------------------------------------------------
// File backend.

const T0_US: u64 = 1_800_000_000_000_000;

/// A file-discovery root written the way Dynamo's file store writes it.
struct FileStore {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

impl FileStore {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("kvstore");
        std::fs::create_dir_all(&root).unwrap();
        FileStore { _dir: dir, root }
    }

    fn path(&self, relative: &str) -> PathBuf {
        self.root.join(relative)
    }

    /// Write `contents` at `relative` with modification time `modified_us`.
    fn write(&self, relative: &str, contents: &str, modified_us: u64) {
        let path = self.path(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, contents).unwrap();
        touch(&path, modified_us);
    }

    fn remove(&self, relative: &str) {
        std::fs::remove_file(self.path(relative)).unwrap();
    }
}

/// Set a file's modification time, as a Dynamo owner's refresh does.
fn touch(path: &Path, modified_us: u64) {
    let file = std::fs::File::options().write(true).open(path).unwrap();
    file.set_modified(UNIX_EPOCH + Duration::from_micros(modified_us)).unwrap();
}

// The key file names of the aggregated worker, percent-encoded as captured.
const INSTANCE_FILE: &str = "v1/instances/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43";
const CARD_FILE: &str = "v1/mdc/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43";
const ADAPTER_FILE: &str = "v1/mdc/dynamo%2Fbackend%2Fgenerate%2Fc068c01457d23c43%2Fad%2D1";
const SOURCE_FILE: &str = "v1/event_sources/namespace%2Fdynamo%2Fcomponent%2Fbackend%2Fendpoint\
                           %2Fgenerate%2Ftopic%2Fkv%2Devents%2F1a0878c30c67ae";
const CHANNEL_FILE: &str = "v1/event_channels/namespace%2Fdynamo%2Fcomponent%2Fbackend%2Fendpoint\
                            %2Fgenerate%2Ftopic%2Fkv%2Devents%2F1a0878c30c67ae";

fn write_worker(store: &FileStore, modified_us: u64) {
    store.write(INSTANCE_FILE, &instance_record(INSTANCE), modified_us);
    store.write(CARD_FILE, &model_record(INSTANCE, None, ""), modified_us);
    store.write(ADAPTER_FILE, &model_record(INSTANCE, Some("ad-1"), ""), modified_us);
    store.write(SOURCE_FILE, &event_source_record(INSTANCE, PUBLISHER), modified_us);
    store.write(CHANNEL_FILE, &event_channel_record(PUBLISHER), modified_us);
}

fn watch_all() -> DiscoveryScope {
    DiscoveryScope::watch_all(Vec::new()).unwrap()
}

#[tokio::test]
async fn file_backend_follows_registration_refresh_expiry_and_removal() {
    let store = FileStore::new();
    let clock = Arc::new(ManualWallClock::new(T0_US));
    let config =
        FileDiscoveryConfig { record_bytes_max: 64 << 10, ..FileDiscoveryConfig::new(&store.root) };
    let mut backend = FileDiscovery::new(config, watch_all(), clock.clone()).unwrap();

    // A worker registers: the first poll reports everything, authoritatively.
    write_worker(&store, T0_US);
    let outputs = backend.poll_once().await.unwrap();
    let first = facts(&outputs);
    assert_eq!(first.len(), 3, "{first:#?}");
    assert_eq!(
        listed_ids(&first[0]),
        vec![card_id(INSTANCE, None), card_id(INSTANCE, Some("ad-1"))]
    );
    assert_eq!(first[1], live(&[INSTANCE]));
    let DcInput::SourceAdvertised(advert) = &first[2] else { panic!("{first:#?}") };
    assert_eq!((advert.source.worker_id, advert.publisher_id), (INSTANCE, PUBLISHER));
    assert!(matches!(
        outputs.last(),
        Some(DiscoveryOutput::Channel(ChannelChange::Upsert(channel))) if channel.publisher_id == PUBLISHER
    ));

    // The owner refreshes every ~3.3 s: nothing changes.
    for step in 1..=3 {
        clock.advance_us(3_300_000);
        let now = clock.now_unix_us();
        for file in [INSTANCE_FILE, CARD_FILE, ADAPTER_FILE, SOURCE_FILE, CHANNEL_FILE] {
            touch(&store.path(file), now);
        }
        assert!(backend.poll_once().await.unwrap().is_empty(), "refresh {step}");
    }

    // The instance file stops being refreshed: still live at 10 s of age, expired after.
    let instance_touched = clock.now_unix_us();
    clock.advance_us(10_000_000);
    for file in [CARD_FILE, ADAPTER_FILE, SOURCE_FILE, CHANNEL_FILE] {
        touch(&store.path(file), clock.now_unix_us());
    }
    assert!(backend.poll_once().await.unwrap().is_empty());
    clock.set_unix_us(instance_touched + 10_000_001);
    assert_eq!(facts(&backend.poll_once().await.unwrap()), vec![live(&[])]);

    // A taint-only rewrite of the base card.
    let now = clock.now_unix_us();
    store.write(
        CARD_FILE,
        &model_record(INSTANCE, None, r#","taints":[{"key":"gpu","effect":"NoSchedule"}]"#),
        now,
    );
    assert_eq!(
        facts(&backend.poll_once().await.unwrap()),
        vec![DcInput::CardTaintsUpdated {
            id: card_id(INSTANCE, None),
            taints_json: Some(r#"[{"effect":"NoSchedule","key":"gpu"}]"#.into()),
        }]
    );

    // The adapter is unloaded (its file deleted).
    store.remove(ADAPTER_FILE);
    assert_eq!(
        facts(&backend.poll_once().await.unwrap()),
        vec![DcInput::CardRemoved { id: card_id(INSTANCE, Some("ad-1")) }]
    );

    // Junk is skipped and counted once: a torn file, an oversized file, a name of unknown
    // layout; temporary (dot) files and subdirectories are ignored.
    store.write("v1/mdc/dynamo%2Fbackend%2Fgenerate%2F1f", r#"{"type":"Model","namesp"#, now);
    store.write("v1/mdc/dynamo%2Fbackend%2Fgenerate%2F2f", &" ".repeat((64 << 10) + 1), now);
    store.write("v1/instances/not-a-key", "{}", now);
    store.write("v1/instances/.tmp-write", "{}", now);
    std::fs::create_dir_all(store.path("v1/instances/subdir")).unwrap();
    for _ in 0..2 {
        assert!(backend.poll_once().await.unwrap().is_empty());
    }
    let counters = &backend.stats().records;
    assert_eq!(counters.rejected(InputErrorKind::Json), 1);
    assert_eq!(counters.rejected(InputErrorKind::TooLarge), 1);
    assert_eq!(counters.rejected(InputErrorKind::MalformedKey), 1);

    // The publisher stops: its source and channel files go.
    store.remove(SOURCE_FILE);
    store.remove(CHANNEL_FILE);
    let outputs = backend.poll_once().await.unwrap();
    assert_eq!(facts(&outputs), vec![withdrawn(PUBLISHER)]);
    assert!(matches!(
        outputs.last(),
        Some(DiscoveryOutput::Channel(ChannelChange::Remove(key))) if key.publisher_id == PUBLISHER
    ));

    // A missing root fails the poll as a whole and changes nothing.
    std::fs::rename(&store.root, store.root.with_extension("moved")).unwrap();
    assert!(matches!(backend.poll_once().await, Err(FileScanError::RootMissing { .. })));
    assert_eq!(backend.stats().transport_errors, 1);
}

#[tokio::test(start_paused = true)]
async fn file_discovery_loop_delivers_facts_and_expires_a_dead_worker() {
    let store = FileStore::new();
    let clock = Arc::new(ManualWallClock::new(T0_US));
    write_worker(&store, T0_US);
    let (facts_tx, mut facts_rx) =
        kvrelay::node::input_queue(4, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
    let (channels_tx, mut channels_rx) = mpsc::channel(4);
    let (stats_tx, stats_rx) = watch::channel(DiscoveryStats::default());
    let sink = DiscoverySink::new(facts_tx).with_channels(channels_tx).with_stats(stats_tx);
    let cancel = CancellationToken::new();
    let clock_seam: Arc<dyn WallClock> = clock.clone();
    let task = kvrelay::runtime::spawn(run_file_discovery(
        FileDiscoveryConfig::new(&store.root),
        watch_all(),
        sink,
        clock_seam,
        cancel.clone(),
    ));

    let first = receive_until(&mut facts_rx, Duration::from_secs(30), "first poll", |facts| {
        facts.len() >= 3
    })
    .await;
    assert_eq!(first[1], live(&[INSTANCE]));
    let channel = channels_rx.recv().await.unwrap();
    assert!(
        matches!(channel, ChannelChange::Upsert(ref record) if record.publisher_id == PUBLISHER)
    );

    // The worker is killed: nobody refreshes its files, and 10 s later they are expired.
    clock.advance_us(10_000_001);
    let gone =
        receive_until(&mut facts_rx, Duration::from_secs(30), "expiry", |facts| facts.len() >= 4)
            .await;
    assert_eq!(
        gone,
        vec![
            DcInput::CardRemoved { id: card_id(INSTANCE, None) },
            DcInput::CardRemoved { id: card_id(INSTANCE, Some("ad-1")) },
            live(&[]),
            withdrawn(PUBLISHER),
        ]
    );
    assert!(matches!(channels_rx.recv().await, Some(ChannelChange::Remove(_))));
    assert!(stats_rx.borrow().listings >= 2);

    cancel.cancel();
    assert!(task.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn file_discovery_loop_ends_when_the_fact_receiver_is_gone() {
    let store = FileStore::new();
    write_worker(&store, T0_US);
    let (facts_tx, facts_rx) =
        kvrelay::node::input_queue(1, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
    drop(facts_rx);
    let result = run_file_discovery(
        FileDiscoveryConfig::new(&store.root),
        watch_all(),
        DiscoverySink::new(facts_tx),
        Arc::new(ManualWallClock::new(T0_US)),
        CancellationToken::new(),
    )
    .await;
    assert!(matches!(result, Err(DiscoveryPlaneError::SinkClosed)));
}

// ---------------------------------------------------------------------------------------------
// etcd backend.

fn relay_config(url: String) -> EtcdDiscoveryConfig {
    EtcdDiscoveryConfig {
        connect: etcd_options(),
        reconnect_backoff_max: Duration::from_millis(500),
        ..EtcdDiscoveryConfig::new(vec![url])
    }
}

/// The logical (etcd) keys of one worker whose instance id is its lease id, as Dynamo writes
/// them (dc-inputs §1.3).
fn worker_keys(instance: u64, publisher: u64) -> [(String, String); 4] {
    let topic_path = "namespace/dynamo/component/backend/endpoint/generate/topic/kv-events";
    [
        (format!("v1/instances/dynamo/backend/generate/{instance:x}"), instance_record(instance)),
        (format!("v1/mdc/dynamo/backend/generate/{instance:x}"), model_record(instance, None, "")),
        (
            format!("v1/event_sources/{topic_path}/{publisher:x}"),
            event_source_record(instance, publisher),
        ),
        (format!("v1/event_channels/{topic_path}/{publisher:x}"), event_channel_record(publisher)),
    ]
}

/// Register a worker the way Dynamo does with etcd: a lease, and every key attached to it.
async fn register_worker(client: &mut EtcdClient, publisher: u64) -> u64 {
    let lease = client.lease_grant(120).await.unwrap();
    let instance = u64::try_from(lease).unwrap();
    for (key, value) in worker_keys(instance, publisher) {
        client.put(key.as_bytes(), value.as_bytes(), lease).await.unwrap();
    }
    instance
}

struct RelayUnderTest {
    facts: kvrelay::node::InputReceiver,
    channels: mpsc::Receiver<ChannelChange>,
    stats: watch::Receiver<DiscoveryStats>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), DiscoveryPlaneError>>,
}

impl RelayUnderTest {
    fn start(config: EtcdDiscoveryConfig) -> Self {
        Self::start_scoped(config, watch_all())
    }

    fn start_scoped(config: EtcdDiscoveryConfig, scope: DiscoveryScope) -> Self {
        let (facts_tx, facts) =
            kvrelay::node::input_queue(64, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
        let (channels_tx, channels) = mpsc::channel(64);
        let (stats_tx, stats) = watch::channel(DiscoveryStats::default());
        let sink = DiscoverySink::new(facts_tx).with_channels(channels_tx).with_stats(stats_tx);
        let cancel = CancellationToken::new();
        let task = kvrelay::runtime::spawn(run_etcd_discovery(config, scope, sink, cancel.clone()));
        RelayUnderTest { facts, channels, stats, cancel, task }
    }

    /// Wait until the published stats satisfy `done`.
    async fn stats_until(&self, what: &str, done: impl Fn(&DiscoveryStats) -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !done(&self.stats.borrow()) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within 30 s; stats {:?}",
                self.stats.borrow()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn until(&mut self, what: &str, done: impl Fn(&[DcInput]) -> bool) -> Vec<DcInput> {
        receive_until(&mut self.facts, Duration::from_secs(30), what, done).await
    }

    async fn stop(self) -> DiscoveryStats {
        self.cancel.cancel();
        let result = tokio::time::timeout(Duration::from_secs(10), self.task).await;
        assert!(matches!(result, Ok(Ok(Ok(())))), "relay did not stop cleanly: {result:?}");
        self.stats.borrow().clone()
    }
}

fn contains(facts: &[DcInput], fact: &DcInput) -> bool {
    facts.contains(fact)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_backend_lists_watches_leases_and_rewatches_across_a_restart() {
    let mut etcd = EtcdProcess::start().await;
    let mut client = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
    let first = register_worker(&mut client, PUBLISHER).await;

    // The initial listing: cards, the authoritative instance set, the source, the channel.
    let mut relay = RelayUnderTest::start(relay_config(etcd.url()));
    let listed = relay.until("initial listing", |facts| facts.len() >= 3).await;
    assert_eq!(listed_ids(&listed[0]), vec![card_id(first, None)]);
    assert_eq!(listed[1], live(&[first]));
    assert!(matches!(&listed[2], DcInput::SourceAdvertised(advert)
        if advert.source.worker_id == first && advert.publisher_id == PUBLISHER));
    assert!(matches!(relay.channels.recv().await, Some(ChannelChange::Upsert(_))));

    // A second worker registers; the watch reports it.
    let second = register_worker(&mut client, PUBLISHER + 1).await;
    let joined = relay
        .until("second worker", |facts| {
            contains(facts, &live(&[first, second]))
                && facts.iter().any(|fact| {
                    matches!(fact, DcInput::SourceAdvertised(advert)
                    if advert.source.worker_id == second)
                })
        })
        .await;
    assert!(joined.iter().any(|fact| matches!(fact, DcInput::CardUpserted { id, .. }
        if *id == card_id(second, None))));

    // Its card gets a taint: only the taints are reported.
    let (card_key, _) = &worker_keys(second, PUBLISHER + 1)[1];
    let tainted = model_record(second, None, r#","taints":[{"key":"maintenance"}]"#);
    client
        .put(card_key.as_bytes(), tainted.as_bytes(), i64::try_from(second).unwrap())
        .await
        .unwrap();
    let update = relay.until("taint update", |facts| !facts.is_empty()).await;
    assert_eq!(
        update,
        vec![DcInput::CardTaintsUpdated {
            id: card_id(second, None),
            taints_json: Some(r#"[{"key":"maintenance"}]"#.into()),
        }]
    );

    // Its lease ends (process exit): etcd deletes every key of it.
    client.lease_revoke(i64::try_from(second).unwrap()).await.unwrap();
    relay
        .until("lease revoked", |facts| {
            contains(facts, &live(&[first]))
                && contains(facts, &DcInput::CardRemoved { id: card_id(second, None) })
                && contains(facts, &withdrawn(PUBLISHER + 1))
        })
        .await;

    // etcd restarts. A worker registers right after; the relay re-watches from its last
    // revision and misses nothing.
    etcd.kill();
    etcd.spawn(etcd.client_port).await;
    // The stats show the new watch before any record changes (a quiet store sends nothing).
    relay
        .stats_until("watching again after the restart", |stats| {
            stats.reconnects >= 1 && stats.watch_streams == 1
        })
        .await;
    let mut client = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
    let third = register_worker(&mut client, PUBLISHER + 2).await;
    relay
        .until("worker registered across the restart", |facts| {
            contains(facts, &live(&[first, third]))
                && facts.iter().any(|fact| {
                    matches!(fact, DcInput::CardUpserted { id, .. }
                    if *id == card_id(third, None))
                })
        })
        .await;
    client.lease_revoke(i64::try_from(first).unwrap()).await.unwrap();
    relay
        .until("first worker gone", |facts| {
            contains(facts, &live(&[third]))
                && contains(facts, &DcInput::CardRemoved { id: card_id(first, None) })
        })
        .await;

    let stats = relay.stop().await;
    assert!(stats.reconnects >= 1, "{stats:?}");
    assert!(stats.transport_errors >= 1, "{stats:?}");
    // The restart was bridged by re-watching from the last revision, not by a relist.
    assert_eq!(stats.compactions, 0, "{stats:?}");
    assert_eq!(stats.listings, 1, "{stats:?}");
    assert_eq!(stats.records.rejected_total(), 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_compaction_past_the_watch_revision_forces_a_relist() {
    let mut etcd = EtcdProcess::start().await;
    let relay_port = etcd.client_port;
    let mut client = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
    let first = register_worker(&mut client, PUBLISHER).await;
    let mut relay = RelayUnderTest::start(relay_config(etcd.url()));
    relay.until("initial listing", |facts| facts.len() >= 3).await;

    // While the relay cannot reach etcd (it serves another port), the first worker leaves, a
    // second one registers and the history is compacted.
    etcd.kill();
    let hidden_port = free_port();
    etcd.spawn(hidden_port).await;
    let mut hidden =
        EtcdClient::connect(&format!("http://127.0.0.1:{hidden_port}"), &etcd_options())
            .await
            .unwrap();
    hidden.lease_revoke(i64::try_from(first).unwrap()).await.unwrap();
    let second = register_worker(&mut hidden, PUBLISHER + 1).await;
    // Another subsystem's key (ignored) and a record key of unknown layout (counted).
    hidden.put(b"v1/other_subsystem/marker", b"", 0).await.unwrap();
    let revision = hidden.put(b"v1/instances/not-a-key", b"{}", 0).await.unwrap();
    hidden.compact(revision).await.unwrap();

    // etcd 3.4 answers a watch from a compacted revision with `created`, then `canceled` with
    // the compact revision: the client reports it as a compaction.
    let mut stale = hidden.watch_prefix(b"v1/", 1).await.unwrap();
    let batch = tokio::time::timeout(Duration::from_secs(10), stale.next()).await.unwrap().unwrap();
    assert_eq!(batch, WatchBatch::Compacted { compact_revision: revision });
    drop(stale);
    drop(hidden);
    etcd.kill();

    // Back on the relay's port: its watch revision is gone, so it relists.
    etcd.spawn(relay_port).await;
    let relisted = relay
        .until("relist after compaction", |facts| {
            facts.iter().any(|fact| matches!(fact, DcInput::CardsListed { .. }))
                && contains(facts, &live(&[second]))
                && contains(facts, &withdrawn(PUBLISHER))
                && facts.iter().any(|fact| {
                    matches!(fact, DcInput::SourceAdvertised(advert)
                    if advert.publisher_id == PUBLISHER + 1)
                })
        })
        .await;
    let listing = relisted.iter().find(|fact| matches!(fact, DcInput::CardsListed { .. })).unwrap();
    assert_eq!(listed_ids(listing), vec![card_id(second, None)]);

    let stats = relay.stop().await;
    assert!(stats.compactions >= 1, "{stats:?}");
    assert!(stats.listings >= 2, "{stats:?}");
    assert_eq!(stats.records.rejected(InputErrorKind::MalformedKey), 1, "{stats:?}");
    assert_eq!(stats.records.rejected_total(), 1, "{stats:?}");
}

// ---------------------------------------------------------------------------------------------
// Secured etcd.

fn etcd_security(pairs: &[(&str, &str)]) -> kvrelay::discovery_plane::EtcdSecurity {
    let map: std::collections::BTreeMap<String, String> =
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    kvrelay::discovery_plane::EtcdSecurity::from_lookup(|name| map.get(name).cloned()).unwrap()
}

fn secured_options(
    security: kvrelay::discovery_plane::EtcdSecurity,
) -> kvrelay::discovery_plane::EtcdConnectOptions {
    kvrelay::discovery_plane::EtcdConnectOptions { security, ..etcd_options() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_over_tls_with_a_client_certificate_discovers_and_refuses_clients_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let ca = pki::TestCa::new(dir.path(), "etcd");
    let server = ca.server(dir.path(), "etcd-server");
    let client_leaf = ca.client(dir.path(), "relay");
    let with_cert = secured_options(etcd_security(&[
        ("ETCD_AUTH_CA", pki::text(&ca.cert_path)),
        ("ETCD_AUTH_CLIENT_CERT", pki::text(&client_leaf.cert_path)),
        ("ETCD_AUTH_CLIENT_KEY", pki::text(&client_leaf.key_path)),
    ]));
    let etcd = EtcdProcess::start_tls(
        &ca.cert_path,
        &server.cert_path,
        &server.key_path,
        with_cert.clone(),
    )
    .await;
    assert!(etcd.url().starts_with("https://"));
    let mut worker = EtcdClient::connect(&etcd.url(), &with_cert).await.unwrap();
    let instance = register_worker(&mut worker, PUBLISHER).await;
    let mut relay = RelayUnderTest::start(EtcdDiscoveryConfig {
        connect: with_cert.clone(),
        ..relay_config(etcd.url())
    });
    let listed = relay.until("listing over TLS", |facts| facts.len() >= 2).await;
    assert_eq!(listed[1], live(&[instance]));
    relay.stop().await;

    // Without a client certificate etcd ends the handshake: no call succeeds.
    let ca_only = secured_options(etcd_security(&[("ETCD_AUTH_CA", pki::text(&ca.cert_path))]));
    let refused = match EtcdClient::connect(&etcd.url(), &ca_only).await {
        Err(error) => error.to_string(),
        Ok(mut client) => client.range_prefix(b"v1/", 16, 1 << 10).await.unwrap_err().to_string(),
    };
    assert!(!refused.is_empty());
    // A CA that did not sign etcd's certificate: the client refuses the server.
    let other = pki::TestCa::new(dir.path(), "other");
    let untrusted = secured_options(etcd_security(&[
        ("ETCD_AUTH_CA", pki::text(&other.cert_path)),
        ("ETCD_AUTH_CLIENT_CERT", pki::text(&client_leaf.cert_path)),
        ("ETCD_AUTH_CLIENT_KEY", pki::text(&client_leaf.key_path)),
    ]));
    let untrusted = match EtcdClient::connect(&etcd.url(), &untrusted).await {
        Err(error) => error,
        Ok(mut client) => client.range_prefix(b"v1/", 16, 1 << 10).await.unwrap_err(),
    };
    assert!(
        matches!(
            untrusted,
            kvrelay::discovery_plane::EtcdError::Connect { .. }
                | kvrelay::discovery_plane::EtcdError::Rpc { .. }
        ),
        "{untrusted}"
    );
    // Plaintext to the TLS port never lists either.
    let mut plain =
        EtcdClient::connect(&etcd.url().replace("https", "http"), &etcd_options()).await.unwrap();
    assert!(plain.range_prefix(b"v1/", 16, 1 << 10).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_with_authentication_discovers_with_the_password_and_refuses_a_wrong_one() {
    let etcd = EtcdProcess::start().await;
    let mut admin = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
    admin.enable_root_auth("root-pw").await.unwrap();
    let good = secured_options(etcd_security(&[
        ("ETCD_AUTH_USERNAME", "root"),
        ("ETCD_AUTH_PASSWORD", "root-pw"),
    ]));
    let mut worker = EtcdClient::connect(&etcd.url(), &good).await.unwrap();
    let instance = register_worker(&mut worker, PUBLISHER).await;
    let mut relay = RelayUnderTest::start(EtcdDiscoveryConfig {
        connect: good.clone(),
        ..relay_config(etcd.url())
    });
    let listed = relay.until("listing with a token", |facts| facts.len() >= 2).await;
    assert_eq!(listed[1], live(&[instance]));
    relay.stop().await;

    // A wrong password is refused when the connection authenticates.
    let wrong = secured_options(etcd_security(&[
        ("ETCD_AUTH_USERNAME", "root"),
        ("ETCD_AUTH_PASSWORD", "not-it"),
    ]));
    let error = EtcdClient::connect(&etcd.url(), &wrong).await.unwrap_err();
    assert!(error.to_string().contains("authenticate"), "{error}");
    assert!(error.to_string().contains("authentication failed"), "{error}");
    // The relay's loop keeps retrying, counting each refusal, and delivers nothing.
    let mut refused =
        RelayUnderTest::start(EtcdDiscoveryConfig { connect: wrong, ..relay_config(etcd.url()) });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while refused.stats.borrow().transport_errors < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no refusal counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let last = refused.stats.borrow().last_error.clone().unwrap();
    assert!(last.contains("authentication failed"), "{last}");
    assert!(refused.facts.try_recv_input().is_err());
    refused.stop().await;
    // Anonymous calls are refused once authentication is on.
    assert!(admin.range_prefix(b"v1/", 16, 1 << 10).await.is_err());
}

// ---------------------------------------------------------------------------------------------
// etcd: one query per configured namespace.

/// `worker_keys` of a worker registered in `namespace` instead of `dynamo`.
fn worker_keys_in(namespace: &str, instance: u64, publisher: u64) -> Vec<(String, String)> {
    worker_keys(instance, publisher)
        .into_iter()
        .map(|(key, value)| {
            (
                key.replace("/dynamo/", &format!("/{namespace}/")),
                value.replace("\"dynamo\"", &format!("\"{namespace}\"")),
            )
        })
        .collect()
}

async fn register_worker_in(client: &mut EtcdClient, namespace: &str, publisher: u64) -> u64 {
    let lease = client.lease_grant(120).await.unwrap();
    let instance = u64::try_from(lease).unwrap();
    for (key, value) in worker_keys_in(namespace, instance, publisher) {
        client.put(key.as_bytes(), value.as_bytes(), lease).await.unwrap();
    }
    instance
}

fn live_in(namespace: &str, workers: &[u64]) -> DcInput {
    DcInput::Instances(EndpointInstances {
        endpoint: EndpointPath::new(namespace, "backend", "generate").unwrap(),
        live_workers: Some(workers.iter().copied().collect()),
    })
}

fn alpha_and_beta() -> DiscoveryScope {
    DiscoveryScope::namespaces(vec!["alpha".into(), "beta".into()], Vec::new()).unwrap()
}

/// A gauge of etcd's own `/metrics` (served on its plaintext client port).
async fn etcd_gauge(port: u16, name: &str) -> Option<f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.ok()?;
    let request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut body = String::new();
    tokio::time::timeout(Duration::from_secs(5), stream.read_to_string(&mut body))
        .await
        .ok()?
        .ok()?;
    body.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_queries_each_configured_namespace_and_never_reads_the_others() {
    let etcd = EtcdProcess::start().await;
    let mut client = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
    let alpha = register_worker_in(&mut client, "alpha", PUBLISHER).await;
    let beta = register_worker_in(&mut client, "beta", PUBLISHER + 1).await;
    let gamma = register_worker_in(&mut client, "gamma", PUBLISHER + 2).await;
    let mut relay = RelayUnderTest::start_scoped(relay_config(etcd.url()), alpha_and_beta());
    let listed = relay
        .until("initial listing", |facts| {
            contains(facts, &live_in("alpha", &[alpha]))
                && contains(facts, &live_in("beta", &[beta]))
        })
        .await;
    let DcInput::CardsListed { cards } = &listed[0] else { panic!("{listed:#?}") };
    let namespaces: Vec<&str> = cards.iter().map(|(id, _)| id.endpoint.namespace()).collect();
    assert_eq!(namespaces, vec!["alpha", "beta"]);
    assert!(!listed.iter().any(|fact| format!("{fact:?}").contains(&format!("{gamma}"))));
    relay.stats_until("two namespace streams", |stats| stats.watch_streams == 2).await;
    // etcd itself holds one watch stream per namespace, with one watcher per record prefix.
    assert_eq!(
        etcd_gauge(etcd.client_port, "etcd_debugging_mvcc_watch_stream_total").await,
        Some(2.0)
    );
    assert_eq!(etcd_gauge(etcd.client_port, "etcd_debugging_mvcc_watcher_total").await, Some(8.0));

    // Registrations in gamma are never sent to the relay; beta's are.
    for publisher in 0..5 {
        register_worker_in(&mut client, "gamma", PUBLISHER + 10 + publisher).await;
    }
    let second_beta = register_worker_in(&mut client, "beta", PUBLISHER + 3).await;
    relay
        .until("second beta worker", |facts| {
            contains(facts, &live_in("beta", &[beta, second_beta]))
        })
        .await;
    relay.stats_until("beta's four events", |stats| stats.watch_events >= 4).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(relay.stats.borrow().watch_events, 4, "{:?}", relay.stats.borrow());

    // An adapter card without its base card is a soft error, listed by name.
    let orphan_key = format!("v1/mdc/alpha/backend/generate/{:x}/ad-1", alpha + 1);
    let orphan = model_record(alpha + 1, Some("ad-1"), "").replace("\"dynamo\"", "\"alpha\"");
    client.put(orphan_key.as_bytes(), orphan.as_bytes(), 0).await.unwrap();
    relay
        .stats_until("orphan adapter reported", |stats| stats.soft_errors.current_total == 1)
        .await;
    let soft = relay.stats.borrow().soft_errors.clone();
    assert_eq!(soft.listed[0].key, format!("alpha/backend/generate/{:x}/ad-1", alpha + 1));
    assert_eq!(soft.listed[0].kind, kvrelay_core::discovery::SoftErrorKind::OrphanAdapter);

    let stats = relay.stop().await;
    assert_eq!((stats.rebinds, stats.reconnects, stats.transport_errors), (0, 0, 0), "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_reconciling_relists_of_an_unchanged_store_emit_nothing() {
    let etcd = EtcdProcess::start().await;
    let mut client = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
    let alpha = register_worker_in(&mut client, "alpha", PUBLISHER).await;
    let beta = register_worker_in(&mut client, "beta", PUBLISHER + 1).await;
    for scope in [watch_all(), alpha_and_beta()] {
        let config = EtcdDiscoveryConfig {
            reconcile_interval: Duration::from_millis(200),
            ..relay_config(etcd.url())
        };
        let mut relay = RelayUnderTest::start_scoped(config, scope.clone());
        // The whole listing: cards, both instance sets, both sources.
        relay
            .until("initial listing", |facts| {
                contains(facts, &live_in("alpha", &[alpha]))
                    && contains(facts, &live_in("beta", &[beta]))
                    && facts.iter().filter(|f| matches!(f, DcInput::SourceAdvertised(_))).count()
                        == 2
            })
            .await;
        relay.stats_until("three reconciling relists", |stats| stats.relists >= 3).await;
        assert!(
            relay.facts.try_recv_input().is_err(),
            "{scope:?}: a relist of the same state emitted"
        );
        // A change between relists still arrives once (by the watch or by the next relist).
        let late = register_worker_in(
            &mut client,
            "alpha",
            PUBLISHER + 2 + scope.endpoint_prefixes().len() as u64,
        )
        .await;
        let arrived = relay
            .until("late worker", |facts| {
                facts.iter().any(|fact| {
                    matches!(fact, DcInput::Instances(set)
                    if set.live_workers.as_ref().is_some_and(|live| live.contains(&late)))
                })
            })
            .await;
        relay.stats_until("two more relists", |stats| stats.relists >= 5).await;
        let mut again = Vec::new();
        while let Ok(fact) = relay.facts.try_recv_input() {
            again.push(fact);
        }
        assert!(
            !again.iter().chain(&arrived).any(|fact| matches!(fact, DcInput::CardsListed { .. })),
            "{scope:?}: {again:#?}"
        );
        let stats = relay.stop().await;
        assert_eq!(stats.transport_errors, 0, "{stats:?}");
        client.lease_revoke(i64::try_from(late).unwrap()).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_one_namespace_stream_ends_every_query_is_relisted_and_rewatched() {
    let etcd = EtcdProcess::start().await;
    let mut client = EtcdClient::connect(&etcd.url(), &etcd_options()).await.unwrap();
    let alpha = register_worker_in(&mut client, "alpha", PUBLISHER).await;
    let beta = register_worker_in(&mut client, "beta", PUBLISHER + 1).await;
    // The relay decodes messages of at most 64 KiB: a larger event breaks the stream that
    // carries it (beta's) and no other.
    let mut config = relay_config(etcd.url());
    config.connect.message_bytes_max = 64 << 10;
    let mut relay = RelayUnderTest::start_scoped(config, alpha_and_beta());
    relay
        .until("initial listing", |facts| {
            contains(facts, &live_in("alpha", &[alpha]))
                && contains(facts, &live_in("beta", &[beta]))
        })
        .await;
    relay.stats_until("two namespace streams", |stats| stats.watch_streams == 2).await;

    let big_key = b"v1/mdc/beta/backend/generate/ffff";
    client.put(big_key, &vec![b' '; 100 << 10], 0).await.unwrap();
    client.delete(big_key).await.unwrap();
    relay.stats_until("rebound", |stats| stats.rebinds == 1 && stats.watch_streams == 2).await;
    let stats = relay.stats.borrow().clone();
    assert_eq!(stats.reconnects, 0, "rebound on the same connection: {stats:?}");
    assert_eq!(stats.transport_errors, 1, "{stats:?}");
    assert!(stats.last_error.as_deref().unwrap_or("").contains("watch"), "{stats:?}");
    // Both queries were listed again (one relist of both) and both streams work.
    assert_eq!(stats.listings, 2, "{stats:?}");
    let late_alpha = register_worker_in(&mut client, "alpha", PUBLISHER + 2).await;
    let late_beta = register_worker_in(&mut client, "beta", PUBLISHER + 3).await;
    let after = relay
        .until("both namespaces after the rebind", |facts| {
            contains(facts, &live_in("alpha", &[alpha, late_alpha]))
                && contains(facts, &live_in("beta", &[beta, late_beta]))
        })
        .await;
    // The relist found nothing new, so nothing was re-announced.
    assert!(!after.iter().any(|fact| matches!(fact, DcInput::CardsListed { .. })), "{after:#?}");
    relay.stop().await;
}

// ---------------------------------------------------------------------------------------------
// File backend: reads only what changed, reconciles every relist interval.

#[tokio::test(start_paused = true)]
async fn file_backend_reads_changed_files_only_and_a_relist_finds_exactly_the_drift() {
    let store = FileStore::new();
    let clock = Arc::new(ManualWallClock::new(T0_US));
    let config = FileDiscoveryConfig {
        relist_interval: Duration::from_secs(30),
        ..FileDiscoveryConfig::new(&store.root)
    };
    let mut backend = FileDiscovery::new(config, watch_all(), clock.clone()).unwrap();
    write_worker(&store, T0_US);
    assert_eq!(facts(&backend.poll_once().await.unwrap()).len(), 3);

    // The card is rewritten with the same size and modification time (a rewrite within the
    // time's granularity): polls trust the unchanged stamp and do not read it.
    let rewritten = model_record(INSTANCE, None, "").replace("16384", "32768");
    store.write(CARD_FILE, &rewritten, T0_US);
    for _ in 0..3 {
        tokio::time::advance(Duration::from_secs(1)).await;
        assert!(backend.poll_once().await.unwrap().is_empty());
    }
    assert_eq!(backend.stats().relists, 0);

    // The reconciling relist reads every file and reports exactly the drift.
    tokio::time::advance(Duration::from_secs(30)).await;
    let drift = facts(&backend.poll_once().await.unwrap());
    assert_eq!(drift.len(), 1, "{drift:#?}");
    assert!(matches!(&drift[0], DcInput::CardUpserted { id, card }
        if *id == card_id(INSTANCE, None) && card.runtime_config.total_kv_blocks == Some(32768)));
    assert_eq!(backend.stats().relists, 1);
    // The next relist finds the same state and reports nothing.
    tokio::time::advance(Duration::from_secs(30)).await;
    assert!(backend.poll_once().await.unwrap().is_empty());
    assert_eq!(backend.stats().relists, 2);

    // A changed stamp is read at once, without waiting for a relist.
    store.write(CARD_FILE, &model_record(INSTANCE, None, ""), T0_US + 1);
    let changed = facts(&backend.poll_once().await.unwrap());
    assert!(
        matches!(&changed[..], [DcInput::CardUpserted { card, .. }]
        if card.runtime_config.total_kv_blocks == Some(16384)),
        "{changed:#?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_widened_namespace_selection_is_read_at_once_not_at_the_next_relist() {
    let store = FileStore::new();
    write_worker(&store, T0_US);
    let (facts_tx, mut facts_rx) =
        kvrelay::node::input_queue(16, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
    let (limit_tx, limit_rx) = watch::channel(Some(BTreeSet::new()));
    let sink = DiscoverySink::new(facts_tx).with_namespace_limit(limit_rx);
    let cancel = CancellationToken::new();
    let task = kvrelay::runtime::spawn(run_file_discovery(
        FileDiscoveryConfig::new(&store.root),
        watch_all(),
        sink,
        Arc::new(ManualWallClock::new(T0_US)),
        cancel.clone(),
    ));
    // Nothing is selected: the first poll lists no card (the files are read and stamped).
    let empty = receive_until(&mut facts_rx, Duration::from_secs(5), "empty listing", |facts| {
        !facts.is_empty()
    })
    .await;
    assert_eq!(empty, vec![DcInput::CardsListed { cards: Vec::new() }]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The selection widens: the unchanged files are read again by the next poll, not 30 s on.
    let widened = tokio::time::Instant::now();
    limit_tx.send_replace(Some(["dynamo".to_owned()].into_iter().collect()));
    let arrived =
        receive_until(&mut facts_rx, Duration::from_secs(5), "widened", |facts| facts.len() >= 3)
            .await;
    assert!(widened.elapsed() <= Duration::from_secs(2), "{:?}", widened.elapsed());
    assert!(arrived.contains(&live(&[INSTANCE])), "{arrived:#?}");
    cancel.cancel();
    assert!(task.await.unwrap().is_ok());
}
