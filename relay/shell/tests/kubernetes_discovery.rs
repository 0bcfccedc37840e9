//! The Kubernetes discovery backend against a local API-server emulator (`emulator.rs`) on
//! 127.0.0.1: no cluster runs here, so these tests show the backend's behaviour against the
//! list/watch protocol as the emulator speaks it (resource versions, pagination, bookmarks,
//! `410 Gone`, label selectors, bearer tokens, TLS), not against a real API server.
//!
//! Workers are registered the way Dynamo's operator and workers lay them out: one
//! `DynamoWorkerMetadata` per pod holding the worker's records, and an `EndpointSlice` with the
//! discovery labels listing which pods are ready. Every wait is bounded. The last test runs the
//! built `kvrelay serve` binary against the emulator and a real `nats-server`.

#[path = "kubernetes_discovery/emulator.rs"]
mod emulator;
mod pki;
mod servers;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use emulator::Emulator;
use kvrelay::discovery_plane::{
    DiscoveryPlaneError, DiscoverySink, DiscoveryStats, KubeApiConfig, KubeDiscoveryConfig,
    run_kube_discovery,
};
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::{CardInstanceId, DcInput, EndpointInstances};
use kvrelay_core::model::identity::EndpointPath;
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

const NAMESPACE: &str = "dynamo";
const TOKEN: &str = "emulator-token-7";
const METADATA: &str = "/apis/nvidia.com/v1alpha1/namespaces/dynamo/dynamoworkermetadatas";
const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/dynamo/endpointslices";

// ---------------------------------------------------------------------------------------------
// Dynamo-shaped records (the same shapes the file and etcd tests use).

fn backend() -> EndpointPath {
    EndpointPath::new("dynamo", "backend", "generate").unwrap()
}

fn instance_record(instance: u64) -> Value {
    json!({"type": "Endpoint", "component": "backend", "endpoint": "generate", "namespace": "dynamo",
        "instance_id": instance,
        "transport": {"tcp": format!("127.0.0.1:34229/{instance:x}/dynamo/backend/generate")},
        "device_type": "cuda", "request_plane_codec": "msgpack"})
}

fn model_record(instance: u64) -> Value {
    json!({"type": "Model", "namespace": "dynamo", "component": "backend", "endpoint": "generate",
        "instance_id": instance,
        "card_json": {"display_name": "tiny-llm", "slug": "tiny-llm",
            "source_path": "/tmp/dynlive/models/tiny-llm", "kv_cache_block_size": 16,
            "context_length": 8192, "model_type": "Chat | Completions", "model_input": "Tokens",
            "worker_type": "aggregated", "needs": [],
            "runtime_config": {"total_kv_blocks": 16384, "max_num_seqs": 256,
                "max_num_batched_tokens": 8192, "data_parallel_start_rank": 0,
                "data_parallel_size": 1, "enable_local_indexer": false,
                "kv_event_publishing_enabled": true, "enable_eagle": false},
            "migration_limit": 0}})
}

fn event_source_record(instance: u64, publisher: u64) -> Value {
    let endpoint = json!({"namespace": "dynamo", "component": "backend", "name": "generate"});
    json!({"type": "EventSource", "scope": {"kind": "endpoint", "endpoint": endpoint},
        "topic": "kv-events", "publisher_id": publisher,
        "metadata": {"kv_state_endpoint": endpoint, "worker": {"worker_id": instance, "dp_rank": 0},
            "publisher_id": publisher}})
}

/// The `DynamoWorkerMetadata` of pod `pod` whose worker is `instance` publishing as `publisher`.
fn worker_metadata(pod: &str, instance: u64, publisher: u64) -> Value {
    let path = format!("dynamo/backend/generate/{instance:x}");
    let topic = format!(
        "namespace/dynamo/component/backend/endpoint/generate/topic/kv-events/{publisher:x}"
    );
    json!({
        "apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoWorkerMetadata",
        "metadata": {"name": pod, "namespace": NAMESPACE},
        "spec": {"data": {
            "endpoints": {path.clone(): instance_record(instance)},
            "model_cards": {path: model_record(instance)},
            "event_channels": {},
            "event_sources": {topic: event_source_record(instance, publisher)},
        }},
    })
}

/// The operator's labelled `EndpointSlice` listing `pods` with their readiness.
fn slice(name: &str, pods: &[(&str, bool)]) -> Value {
    let endpoints: Vec<Value> = pods
        .iter()
        .map(|(pod, ready)| {
            json!({"addresses": ["10.0.0.1"], "conditions": {"ready": ready},
                "targetRef": {"kind": "Pod", "name": pod, "namespace": NAMESPACE}})
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {
            "nvidia.com/dynamo-discovery-backend": "kubernetes",
            "nvidia.com/dynamo-discovery-enabled": "true",
        }},
        "endpoints": endpoints,
    })
}

fn live(workers: &[u64]) -> DcInput {
    DcInput::Instances(EndpointInstances {
        endpoint: backend(),
        live_workers: Some(workers.iter().copied().collect::<BTreeSet<_>>()),
    })
}

fn card(instance: u64) -> CardInstanceId {
    CardInstanceId { endpoint: backend(), instance_id: instance, model_suffix: None }
}

fn lists_cards(fact: &DcInput, instances: &[u64]) -> bool {
    match fact {
        DcInput::CardsListed { cards } => {
            cards.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>()
                == instances.iter().map(|i| card(*i)).collect::<Vec<_>>()
        }
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// The relay side.

struct Relay {
    facts: kvrelay::node::InputReceiver,
    stats: watch::Receiver<DiscoveryStats>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), DiscoveryPlaneError>>,
    _dir: tempfile::TempDir,
}

fn config(url: &str, token_file: PathBuf, ca_file: Option<PathBuf>) -> KubeDiscoveryConfig {
    let api = KubeApiConfig {
        token_file: Some(token_file),
        ca_file,
        connect_timeout: Duration::from_secs(2),
        request_timeout: Duration::from_secs(5),
        ..KubeApiConfig::new(url)
    };
    KubeDiscoveryConfig {
        // One item per page: every listing is paginated.
        page_limit: 1,
        reconnect_backoff_max: Duration::from_millis(200),
        ..KubeDiscoveryConfig::new(api, NAMESPACE)
    }
}

impl Relay {
    /// Start the backend against `emulator` with `token`; `adjust` edits the configuration.
    fn start(
        emulator: &Emulator,
        token: &str,
        adjust: impl FnOnce(&mut KubeDiscoveryConfig),
    ) -> Relay {
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, format!("{token}\n")).unwrap();
        let mut config = config(&emulator.url(), token_file, None);
        adjust(&mut config);
        Relay::run(config, dir)
    }

    fn run(config: KubeDiscoveryConfig, dir: tempfile::TempDir) -> Relay {
        let (facts_tx, facts) =
            kvrelay::node::input_queue(256, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
        let (stats_tx, stats) = watch::channel(DiscoveryStats::default());
        let sink = DiscoverySink::new(facts_tx).with_stats(stats_tx);
        let cancel = CancellationToken::new();
        let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).unwrap();
        let task = kvrelay::runtime::spawn(run_kube_discovery(config, scope, sink, cancel.clone()));
        Relay { facts, stats, cancel, task, _dir: dir }
    }

    /// Receive facts until `done` holds for what was received since the call.
    async fn until(&mut self, what: &str, done: impl Fn(&[DcInput]) -> bool) -> Vec<DcInput> {
        let mut received = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !done(&received) {
            match tokio::time::timeout_at(deadline, self.facts.recv_input()).await {
                Ok(Some(fact)) => received.push(fact),
                Ok(None) => panic!("{what}: the backend ended; received {received:#?}"),
                Err(_) => panic!("{what}: not within 20 s; received {received:#?}"),
            }
        }
        received
    }

    /// Wait until the published stats satisfy `done`.
    async fn stats_until(
        &mut self,
        what: &str,
        done: impl Fn(&DiscoveryStats) -> bool,
    ) -> DiscoveryStats {
        let matched = {
            let wait = self.stats.wait_for(|stats| done(stats));
            match tokio::time::timeout(Duration::from_secs(20), wait).await {
                Ok(Ok(stats)) => Some(stats.clone()),
                _ => None,
            }
        };
        matched.unwrap_or_else(|| {
            panic!("{what}: stats never matched; last {:?}", self.stats.borrow())
        })
    }

    async fn stop(self) -> DiscoveryStats {
        self.cancel.cancel();
        let result = tokio::time::timeout(Duration::from_secs(10), self.task).await;
        assert!(matches!(result, Ok(Ok(Ok(())))), "backend did not stop cleanly: {result:?}");
        self.stats.borrow().clone()
    }
}

/// Wait until the emulator serves `count` live watches.
async fn wait_for_watches(emulator: &Emulator, count: usize) {
    for _ in 0..200 {
        if emulator.watch_count() >= count {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the relay did not open {count} watches");
}

// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_appear_change_and_disappear_through_list_and_watch() {
    let emulator = Emulator::start(TOKEN, None).await;
    emulator.put(METADATA, worker_metadata("worker-0", 0xa0, 0x1a0));
    emulator.put(METADATA, worker_metadata("worker-1", 0xb0, 0x1b0));
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true), ("worker-1", false)]));
    // Unlabelled slices are not the operator's: the selector keeps them out.
    let mut stray = slice("stray", &[("worker-1", true)]);
    stray["metadata"]["labels"] = json!({});
    emulator.put(SLICES, stray);

    let mut relay = Relay::start(&emulator, TOKEN, |_| {});
    let first = relay
        .until("first listing", |facts| {
            facts.contains(&live(&[0xa0]))
                && facts.iter().any(|f| matches!(f, DcInput::SourceAdvertised(_)))
        })
        .await;
    assert!(lists_cards(&first[0], &[0xa0]), "only the ready worker's card: {first:#?}");

    // worker-1 becomes ready: a watch event on the slice.
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true), ("worker-1", true)]));
    let joined = relay.until("worker-1 ready", |facts| facts.contains(&live(&[0xa0, 0xb0]))).await;
    assert!(
        joined.iter().any(|f| matches!(f, DcInput::CardUpserted { id, .. } if *id == card(0xb0)))
    );

    // worker-0's pod restarts its container: same worker id, new publisher id.
    emulator.put(METADATA, worker_metadata("worker-0", 0xa0, 0x2a0));
    let restarted = relay
        .until("new publisher", |facts| {
            facts.iter().any(|f| matches!(f, DcInput::SourceWithdrawn { publisher_id: 0x1a0, .. }))
                && facts.iter().any(|f| matches!(f, DcInput::SourceAdvertised { .. }))
        })
        .await;
    assert!(!restarted.iter().any(|f| matches!(f, DcInput::CardRemoved { .. })), "{restarted:#?}");

    // A bookmark moves nothing; worker-0 goes unready, then worker-1's resource is deleted.
    emulator.bookmark();
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", false), ("worker-1", true)]));
    let unready = relay.until("worker-0 unready", |facts| facts.contains(&live(&[0xb0]))).await;
    assert!(unready.iter().any(|f| matches!(f, DcInput::CardRemoved { id } if *id == card(0xa0))));
    emulator.delete(METADATA, "worker-1");
    relay.until("worker-1 gone", |facts| facts.contains(&live(&[]))).await;

    let stats = relay.stop().await;
    assert_eq!(stats.listings, 1, "no relist was needed: {stats:?}");
    assert_eq!(stats.watch_events, 4, "two slice updates, one update, one delete: {stats:?}");
    assert_eq!((stats.rejected_objects, stats.transport_errors), (0, 0), "{stats:?}");

    let requests = emulator.requests();
    assert!(requests.iter().all(|(_, auth)| auth.as_deref() == Some("Bearer emulator-token-7")));
    let slice_requests: Vec<&String> =
        requests.iter().map(|(path, _)| path).filter(|path| path.starts_with(SLICES)).collect();
    assert!(slice_requests.iter().all(|path| path.contains(
        "labelSelector=nvidia.com%2Fdynamo-discovery-backend%3Dkubernetes%2Cnvidia.com%2Fdynamo-discovery-enabled%3Dtrue"
    )));
    assert!(
        requests.iter().any(|(path, _)| path.starts_with(METADATA) && path.contains("continue=")),
        "one item per page paginates the metadata listing: {requests:#?}"
    );
    assert!(requests.iter().any(|(path, _)| {
        path.contains("watch=true") && path.contains("&allowWatchBookmarks=true")
    }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_relists_both_resources_and_nothing_is_lost() {
    let emulator = Emulator::start(TOKEN, None).await;
    emulator.put(METADATA, worker_metadata("worker-0", 0xa0, 0x1a0));
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true)]));
    let mut relay = Relay::start(&emulator, TOKEN, |_| {});
    relay.until("first listing", |facts| facts.contains(&live(&[0xa0]))).await;

    // The server's watch window closes: watches end with ERROR 410, and the changes made
    // meanwhile can only be learned by relisting.
    emulator.expire(|emulator| {
        emulator.put(METADATA, worker_metadata("worker-1", 0xb0, 0x1b0));
        emulator.put(SLICES, slice("backend-slice", &[("worker-0", false), ("worker-1", true)]));
    });
    let relisted = relay
        .until("relist after 410", |facts| {
            facts.contains(&live(&[0xb0])) && facts.iter().any(|f| lists_cards(f, &[0xb0]))
        })
        .await;
    assert!(
        !relisted.iter().any(|f| lists_cards(f, &[])),
        "never an empty card set: {relisted:#?}"
    );
    let stats = relay.stats_until("relisted", |s| s.listings >= 2 && s.compactions >= 1).await;
    assert_eq!(stats.transport_errors, 0, "a 410 is a relist, not a failure: {stats:?}");

    // The server ends the watches (their timeout): they are reopened from the last version,
    // without a relist, and the next change still arrives.
    let listings = relay.stats.borrow().listings;
    wait_for_watches(&emulator, 2).await;
    emulator.close_watches();
    tokio::time::sleep(Duration::from_millis(300)).await;
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true), ("worker-1", true)]));
    relay.until("change after a closed watch", |facts| facts.contains(&live(&[0xa0, 0xb0]))).await;
    let stats = relay.stop().await;
    assert_eq!(stats.listings, listings, "a closed watch is reopened, not relisted: {stats:?}");
    let watches = emulator.requests().iter().filter(|(p, _)| p.contains("watch=true")).count();
    assert!(watches >= 6, "two watches opened three times, got {watches}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_objects_are_counted_and_skipped() {
    let emulator = Emulator::start(TOKEN, None).await;
    let object_max = 64 * 1024;
    emulator.put(METADATA, worker_metadata("worker-0", 0xa0, 0x1a0));
    // Listed: one resource whose data is not an object, one larger than the object limit.
    let mut garbage = worker_metadata("worker-bad", 0xc0, 0x1c0);
    garbage["spec"]["data"] = json!("not a metadata document");
    emulator.put(METADATA, garbage);
    let mut huge = worker_metadata("worker-huge", 0xd0, 0x1d0);
    huge["spec"]["padding"] = json!("x".repeat(object_max));
    emulator.put(METADATA, huge);
    emulator.put(
        SLICES,
        slice("backend-slice", &[("worker-0", true), ("worker-bad", true), ("worker-huge", true)]),
    );
    let mut relay = Relay::start(&emulator, TOKEN, |config| config.object_bytes_max = object_max);
    let first = relay.until("first listing", |facts| facts.contains(&live(&[0xa0]))).await;
    assert!(lists_cards(&first[0], &[0xa0]), "{first:#?}");
    relay.stats_until("listed rejections", |s| s.rejected_objects == 2).await;
    wait_for_watches(&emulator, 2).await;

    // Watched: a line that is not JSON, a line longer than the limit, an oversized update.
    emulator.send_raw(METADATA, b"{this is not json\n");
    let mut long_line = vec![b'x'; object_max * 3];
    long_line.push(b'\n');
    emulator.send_raw(METADATA, &long_line);
    let mut huge = worker_metadata("worker-0", 0xa0, 0x1a0);
    huge["spec"]["padding"] = json!("y".repeat(object_max));
    emulator.put(METADATA, huge);
    // A record inside a readable resource that does not decode is the differ's to count.
    let mut bad_record = worker_metadata("worker-2", 0xe0, 0x1e0);
    bad_record["spec"]["data"]["model_cards"]["dynamo/backend/generate/e0"] =
        json!({"type": "Model"});
    emulator.put(METADATA, bad_record);
    // ...and the rest keeps working.
    emulator.put(METADATA, worker_metadata("worker-1", 0xb0, 0x1b0));
    emulator.put(
        SLICES,
        slice(
            "backend-slice",
            &[("worker-0", true), ("worker-1", true), ("worker-2", true), ("worker-bad", true)],
        ),
    );
    let later = relay
        .until("worker-1 after the bad objects", |facts| facts.contains(&live(&[0xa0, 0xb0, 0xe0])))
        .await;
    assert!(
        !later.iter().any(|f| matches!(f, DcInput::CardRemoved { id } if *id == card(0xa0))),
        "worker-0 keeps its last readable records: {later:#?}"
    );
    assert!(
        !later.iter().any(|f| matches!(f, DcInput::CardUpserted { id, .. } if *id == card(0xe0)))
    );
    assert_eq!(relay.stats.borrow().rejected_objects, 5, "2 listed + 3 watched");

    // Two relists (forced by 410s): the version of worker-0 too large to list is counted once,
    // the versions counted before are not counted again, and worker-0 keeps its records.
    for round in 1..=2 {
        let before = relay.stats.borrow().listings;
        wait_for_watches(&emulator, 2).await;
        emulator.expire(|_| {});
        relay.stats_until(&format!("relist {round}"), |s| s.listings > before).await;
    }
    let mut after = Vec::new();
    while let Ok(fact) = relay.facts.try_recv_input() {
        after.push(fact);
    }
    assert!(
        !after
            .iter()
            .any(|f| matches!(f, DcInput::CardRemoved { .. } | DcInput::CardsListed { .. })),
        "the relists changed nothing: {after:#?}"
    );
    let stats = relay.stop().await;
    assert_eq!(stats.rejected_objects, 6, "2 listed + 3 watched + 1 relisted: {stats:?}");
    assert!(stats.records.rejected_total() >= 1, "the bad card is counted: {stats:?}");
    assert_eq!(stats.transport_errors, 0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_is_refused_and_counted_and_tls_uses_the_configured_ca() {
    let dir = tempfile::tempdir().unwrap();
    let ca = pki::TestCa::new(dir.path(), "kube");
    let server = ca.server(dir.path(), "apiserver");
    let emulator = Emulator::start(TOKEN, Some((&server.cert_path, &server.key_path))).await;
    emulator.put(METADATA, worker_metadata("worker-0", 0xa0, 0x1a0));
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true)]));

    // The right token over TLS with the cluster CA.
    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let mut relay = Relay::run(
        config(&emulator.url(), token_file.clone(), Some(ca.cert_path.clone())),
        token_dir,
    );
    relay.until("listing over TLS", |facts| facts.contains(&live(&[0xa0]))).await;
    relay.stop().await;

    // A wrong token: 401, counted, retried, nothing delivered.
    let wrong_dir = tempfile::tempdir().unwrap();
    let wrong = wrong_dir.path().join("token");
    std::fs::write(&wrong, "not-the-token").unwrap();
    let mut refused =
        Relay::run(config(&emulator.url(), wrong, Some(ca.cert_path.clone())), wrong_dir);
    let stats = refused.stats_until("401 counted", |s| s.transport_errors >= 2).await;
    assert!(stats.last_error.as_deref().unwrap_or("").contains("401"), "{stats:?}");
    assert!(refused.facts.try_recv_input().is_err(), "nothing is delivered without access");
    refused.stop().await;

    // A CA that did not sign the server's certificate: the handshake fails and is counted.
    let other_ca = pki::TestCa::new(dir.path(), "other");
    let other_dir = tempfile::tempdir().unwrap();
    let other_token = other_dir.path().join("token");
    std::fs::write(&other_token, TOKEN).unwrap();
    let mut untrusted = Relay::run(
        config(&emulator.url(), other_token, Some(other_ca.cert_path.clone())),
        other_dir,
    );
    let stats = untrusted.stats_until("TLS failure counted", |s| s.transport_errors >= 1).await;
    assert!(stats.last_error.as_deref().unwrap_or("").contains("TLS"), "{stats:?}");
    untrusted.stop().await;
    // Both lists of the first relay carried its token; the refused relay sent its own, and
    // nothing reached the server through the untrusted handshake.
    let requests = emulator.requests();
    let with = |token: &str| {
        let header = format!("Bearer {token}");
        requests.iter().filter(|(_, auth)| auth.as_deref() == Some(header.as_str())).count()
    };
    assert!(with(TOKEN) >= 2, "{requests:#?}");
    assert!(with("not-the-token") >= 2, "{requests:#?}");
    assert_eq!(with(TOKEN) + with("not-the-token"), requests.len(), "{requests:#?}");
}

/// `GET path` on the ops listener: status and body.
async fn http_get(address: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(address).await else {
        return (0, String::new());
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response).await;
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or(String::new(), |(_, body)| body.to_owned());
    (status, body)
}

fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The child process, killed by PID when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvrelay_serve_discovers_through_the_kubernetes_api_and_gets_ready() {
    let nats = servers::NatsServer::start().await;
    let emulator = Emulator::start(TOKEN, None).await;
    emulator.put(METADATA, worker_metadata("worker-0", 0xa0, 0x1a0));
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true)]));
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let ops_port = servers::free_port();
    let ops: std::net::SocketAddr = format!("127.0.0.1:{ops_port}").parse().unwrap();
    let _relay = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_kvrelay"))
            .args(["serve", "--dc-id", "dc-a"])
            .args(["--bind", &format!("127.0.0.1:{}", servers::free_port())])
            .args(["--ops-bind", &ops.to_string()])
            .env("DYN_DISCOVERY_BACKEND", "kubernetes")
            .env("KVRELAY_KUBE_API_URL", emulator.url())
            .env("KVRELAY_KUBE_TOKEN_FILE", &token_file)
            .env("POD_NAMESPACE", NAMESPACE)
            .env("DYN_EVENT_PLANE", "nats")
            .env("NATS_SERVER", nats.url())
            .env("RUST_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut text = String::new();
    for _ in 0..300 {
        let ready = http_get(ops, "/ready").await.0 == 200;
        text = http_get(ops, "/metrics").await.1;
        if ready && metric(&text, "kv_dc_relay_catalog_pool_count") == Some(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(http_get(ops, "/ready").await.0, 200, "never ready:\n{text}");
    assert_eq!(metric(&text, "kv_dc_relay_catalog_pool_count"), Some(1), "{text}");
    assert!(metric(&text, "kvrelay_discovery_listings_total").unwrap_or(0) >= 1, "{text}");
    assert_eq!(metric(&text, "kvrelay_discovery_rejected_objects_total"), Some(0), "{text}");
    assert_eq!(metric(&text, "kvrelay_discovery_transport_errors_total"), Some(0), "{text}");
    assert!(
        emulator
            .requests()
            .iter()
            .all(|(_, auth)| auth.as_deref() == Some("Bearer emulator-token-7"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciling_relists_of_an_unchanged_cluster_emit_nothing() {
    let emulator = Emulator::start(TOKEN, None).await;
    emulator.put(METADATA, worker_metadata("worker-0", 0xa0, 0x1a0));
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true)]));
    let mut relay = Relay::start(&emulator, TOKEN, |config| {
        config.reconcile_interval = Duration::from_millis(200);
    });
    relay
        .until("first listing", |facts| {
            facts.contains(&live(&[0xa0]))
                && facts.iter().any(|f| matches!(f, DcInput::SourceAdvertised(_)))
        })
        .await;
    relay.stats_until("three reconciling relists", |stats| stats.relists >= 3).await;
    assert!(relay.facts.try_recv_input().is_err(), "a relist of the same cluster emitted facts");
    // A worker that joins between relists arrives once, as differences (never a new listing).
    emulator.put(METADATA, worker_metadata("worker-1", 0xb0, 0x1b0));
    emulator.put(SLICES, slice("backend-slice", &[("worker-0", true), ("worker-1", true)]));
    let joined = relay.until("worker-1", |facts| facts.contains(&live(&[0xa0, 0xb0]))).await;
    relay.stats_until("two more relists", |stats| stats.relists >= 5).await;
    let mut later = Vec::new();
    while let Ok(fact) = relay.facts.try_recv_input() {
        later.push(fact);
    }
    assert!(
        !joined.iter().chain(&later).any(|f| matches!(f, DcInput::CardsListed { .. })),
        "{joined:#?} {later:#?}"
    );
    assert!(
        joined
            .iter()
            .chain(&later)
            .any(|f| matches!(f, DcInput::CardUpserted { id, .. } if *id == card(0xb0)))
    );
    let stats = relay.stop().await;
    assert_eq!(stats.transport_errors, 0, "{stats:?}");
}
