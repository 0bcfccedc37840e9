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
//! binary (streams end with UNAVAILABLE, exit status 0); and a `--record` directory that cannot
//! be created. A recorded run of this setup is replayed by the simulator in
//! `sim/tests/production_replay.rs`.
//!
//! Every wait is bounded; servers are killed by PID when their guards drop.

mod fake_worker;
mod serve_setup;
mod servers;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use kvrelay::discovery_plane::EtcdClient;
use kvrelay::serve::RunningRelay;
use kvrelay_consumer::ConsumerSnapshot;
use kvrelay_core::inputs::{KV_EVENTS_TOPIC, KV_METRICS_TOPIC};
use kvrelay_core::readiness::ReadinessState;
use serve_setup::*;
use servers::{EtcdProcess, NatsServer, etcd_options, free_port};

// ---------------------------------------------------------------------------------------------
// The relay.

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
fn readiness_of(snapshot: &ConsumerSnapshot, namespace: &str) -> Option<ReadinessState> {
    snapshot.readiness.iter().find(|entry| entry.namespace == namespace).map(|entry| entry.state)
}

/// The value of one unlabelled or labelled sample in a Prometheus exposition.
// ---------------------------------------------------------------------------------------------
// Scenarios.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_follows_real_workers_through_departure_restart_gaps_and_garbage() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let a = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
        let b = Worker::live_only("dynamo", WORKER_B, PUBLISHER_B);
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
        // Re-sent under a fresh event id each time until the NATS subscription is up.
        let pace = Duration::from_millis(200);
        store_until_matched(&client, &consumer, &a, &prompt_a, pace, "worker A's blocks").await;
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
        let pace = Duration::from_millis(300);
        let what = "the restarted publisher's blocks";
        store_until_matched(&client, &consumer, &restarted, &prompt_a2, pace, what).await;
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
        let dynamo = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
        let ver = Worker::live_only("ver", WORKER_C, PUBLISHER_C);
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
        assert_eq!(state["mode"], "from-file");
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
                    assert_eq!(state["sources"]["desiredRevision"], serde_json::Value::Null);
                    let (_, health) = http_get_async(ops, "/health").await;
                    let health: serde_json::Value = serde_json::from_str(&health).unwrap();
                    assert_eq!(health["sources"]["appliedRevision"], first_revision.as_str());
                    assert_eq!(health["sources"]["desiredRevision"], serde_json::Value::Null);
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
        let worker = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
        worker.register(&store);
        // The memory budgets' settings reach the node, the pools and the event plane.
        let discovery = [
            ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
            ("DYN_FILE_KV", store.root.display().to_string()),
        ];
        let budgets = [
            ("DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX", (8u64 << 20).to_string()),
            ("DYN_RELAY_INPUT_QUEUE_BYTES_MAX", (16u64 << 20).to_string()),
            ("DYN_RELAY_NATS_BACKLOG_BYTES_MAX", (2u64 << 20).to_string()),
            ("DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX", (4u64 << 20).to_string()),
            ("DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX", (12u64 << 20).to_string()),
        ];
        let config = relay_config(&discovery, &nats, None, None, &budgets);
        let relay = kvrelay::serve::start(config, start_options(7)).await.unwrap();
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
        assert_eq!(metric(&text, "kvrelay_pool_exact_state_bytes_max"), Some(8 << 20));
        assert_eq!(metric(&text, "kvrelay_input_queue_bytes_max"), Some(16 << 20));
        assert_eq!(metric(&text, "kvrelay_recovery_answer_bytes_max"), Some(12 << 20));
        assert_eq!(
            metric(&text, "kvrelay_event_plane_subscription_bytes_max{plane=\"nats\"}"),
            Some(2 << 20)
        );
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
        let worker = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
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
            if let Ok(connected) = kvrelay_consumer::connect(&wan.to_string()).await {
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
async fn a_sources_file_that_appears_later_is_applied_and_watches_nothing_until_then() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let worker = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
        worker.register(&store);
        let sources_dir = tempfile::tempdir().unwrap();
        let sources = sources_dir.path().join("sources.json");
        let relay = start_relay(&store, &nats, Some(sources.clone()), None).await;
        let ops = relay.ops_address.unwrap();
        let consumer = start_consumer(&relay);

        // No file: an explicitly empty selection, reported as such, and not ready.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(consumer.snapshot().pools.is_empty(), "no namespace is watched yet");
        let (_, state) = http_get_async(ops, "/engine/state").await;
        let state: serde_json::Value = serde_json::from_str(&state).unwrap();
        assert_eq!(state["mode"], "from-file");
        assert_eq!(state["ready"], false);
        assert_eq!(state["sources"]["count"], 0);
        assert_eq!(state["sources"]["appliedRevision"], serde_json::Value::Null);
        assert_eq!(state["sources"]["desiredRevision"], serde_json::Value::Null);
        assert!(state["sources"]["lastError"].as_str().unwrap().contains("unavailable"));
        assert_eq!(http_get_async(ops, "/ready").await.0, 503);

        // The file appears: it is applied and the pool comes.
        std::fs::write(&sources, r#"{"version":1,"sources":[{"namespace":"dynamo"}]}"#).unwrap();
        converge(&consumer, "the dynamo pool", pool_ready).await;
        let (_, state) = http_get_async(ops, "/engine/state").await;
        let state: serde_json::Value = serde_json::from_str(&state).unwrap();
        assert_eq!(state["sources"]["count"], 1);
        assert_eq!(state["sources"]["lastError"], serde_json::Value::Null);
        assert_eq!(state["sources"]["desiredRevision"], state["sources"]["appliedRevision"]);
        let (_, health) = http_get_async(ops, "/health").await;
        let health: serde_json::Value = serde_json::from_str(&health).unwrap();
        assert_eq!(health["sources"], state["sources"], "/health carries the same sources");

        consumer.shutdown().await;
        relay.shutdown().await.unwrap();
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
        let dynamo = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
        let ver = Worker::live_only("ver", WORKER_C, PUBLISHER_C);
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

/// A record directory that cannot be created (its parent is a file) disables recording, and
/// the relay serves regardless; `/metrics` says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recording_that_cannot_start_does_not_stop_serving() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let worker = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_says_not_serving_first_then_withdraws_the_pools_then_ends_the_streams() {
    use kvrelay_proto::v1 as proto;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let worker = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
        worker.register(&store);
        let relay = start_relay(&store, &nats, None, None).await;
        let wan = relay.wan_address.unwrap();
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{wan}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut client = proto::kv_event_relay_client::KvEventRelayClient::new(channel.clone());
        let request = proto::WatchKvPoolCatalogRequest {
            subscriber_id: "shutdown-order".into(),
            contract_marker: kvrelay_proto::CONTRACT_MARKER,
        };
        let mut catalog = client.watch_kv_pool_catalog(request).await.unwrap().into_inner();
        let pools = |update: &proto::KvPoolCatalogUpdate| {
            update.snapshot.as_ref().map_or(0, |snapshot| snapshot.pools.len())
        };
        while pools(&catalog.message().await.unwrap().unwrap()) != 1 {}
        let mut health = HealthClient::new(channel);
        let mut watch =
            health.watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
        let mut last = watch.message().await.unwrap().map(|update| update.status);
        let stopping = kvrelay::runtime::spawn(relay.shutdown());
        let mut withdrawn = false;
        let status = loop {
            match catalog.message().await {
                Ok(Some(update)) if pools(&update) == 0 && !withdrawn => {
                    withdrawn = true;
                    // Same connection, frames in order: the watch ended before the withdrawal
                    // was sent, so its end is already here.
                    let mut ended = false;
                    while let Some(next) = futures::FutureExt::now_or_never(watch.message()) {
                        match next {
                            Ok(Some(update)) => last = Some(update.status),
                            Ok(None) | Err(_) => {
                                ended = true;
                                break;
                            }
                        }
                    }
                    assert!(ended, "the health watch was still open at the pool withdrawal");
                    assert_eq!(last, Some(ServingStatus::NotServing as i32));
                }
                Ok(Some(_)) => {}
                Ok(None) => panic!("the catalog stream ended without a status"),
                Err(status) => break status,
            }
        };
        assert!(withdrawn, "the pool was not withdrawn before the catalog stream ended");
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        stopping.await.unwrap().unwrap();
    })
    .await;
}

/// `DYN_RELAY_POOL_FILTER_BYTES_MAX` room for one filter: a second pool waits (counted, the
/// relay stays ready and keeps serving the first), and gets the budget once the first goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_beyond_the_filter_budget_wait_and_the_relay_stays_ready() {
    bounded(async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let dynamo = Worker::live_only("dynamo", WORKER_A, PUBLISHER_A);
        dynamo.register(&store);
        let discovery = [
            ("DYN_DISCOVERY_BACKEND", "file".to_owned()),
            ("DYN_FILE_KV", store.root.display().to_string()),
        ];
        let mut config = relay_config(&discovery, &nats, None, None, &[]);
        config.pool_filter_bytes_max = config.ckf_format.filter_bytes();
        let relay = kvrelay::serve::start(config, start_options(7)).await.unwrap();
        let ops = relay.ops_address.unwrap();
        let consumer = start_consumer(&relay);
        converge(&consumer, "the first pool", pool_ready).await;

        let ver = Worker::live_only("ver", WORKER_C, PUBLISHER_C);
        ver.register(&store);
        let waiting = tokio::time::timeout(CONVERGE, async {
            loop {
                let (_, text) = http_get_async(ops, "/metrics").await;
                if metric(&text, "kvrelay_pool_budget_waiting_endpoint_count") == Some(1) {
                    return text;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .expect("the second pool was never counted as waiting for the budget");
        assert_eq!(metric(&waiting, "kvrelay_pools_max"), Some(1));
        assert_eq!(metric(&waiting, "kv_dc_relay_catalog_pool_count"), Some(1));
        assert_eq!(metric(&waiting, "kvrelay_healthy"), Some(1));
        assert_eq!(http_get_async(ops, "/ready").await.0, 200);

        dynamo.unregister(&store);
        converge(&consumer, "the second pool in the freed budget", |snapshot| {
            pool_ready(snapshot)
                && snapshot.pools[0].descriptor.serving_endpoint.to_string()
                    == "ver/backend/generate"
        })
        .await;
        consumer.shutdown().await;
        relay.shutdown().await.unwrap();
    })
    .await;
}
