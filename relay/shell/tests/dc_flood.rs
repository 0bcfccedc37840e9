//! A hostile DC against the built `kvrelay serve` (a real `nats-server`, file discovery): many
//! endpoints asking for pools beyond the filter budget, workers publishing KV events near the
//! NATS payload limit as fast as the server takes them, and recovery answers at and over the
//! response bound, all at once. The relay runs with small byte budgets; the test samples its
//! resident memory throughout and asserts it stays under [`RSS_BOUND_KIB`], that every refusal
//! is counted in `/metrics`, and that a healthy pool admitted before the flood stays catalogued
//! and ready and follows its worker again once the flood ends.
//!
//! Every wait is bounded; the relay and the server are killed by PID when their guards drop.

mod fake_worker;
mod relay_process;
mod serve_setup;
mod servers;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use kvrelay::request_plane::PayloadCodec;
use kvrelay::request_plane::answer::answer_stream;
use kvrelay_consumer::{ConsumerConfig, FilterStatus, RelayConsumer};
use kvrelay_core::inputs::KV_EVENTS_TOPIC;
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::kv_events::{RouterEvent, StoredBlock};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::sources::{RecoveryResponse, TreeDumpScope};
use relay_process::RelayProcess;
use serve_setup::{
    BLOCK, FileStore, Worker, http_get_async, local_indexer, metric, metric_seconds, prompt,
};
use servers::NatsServer;
use tokio::time::Instant;

/// The relay's budgets for this test (bytes).
const FILTER_BYTES: u64 = 4 << 20; // the default format's filter (1,048,576 expected blocks)
const POOLS_ADMITTED: u64 = 4;
const EXACT_STATE_BYTES: u64 = 16 << 20;
const INPUT_QUEUE_BYTES: u64 = 8 << 20;
const NATS_BACKLOG_BYTES: u64 = 8 << 20;
const RECOVERY_RESPONSE_BYTES: u64 = 8 << 20;
const RECOVERY_ANSWERS_BYTES: u64 = 16 << 20;
/// Each subscriber stream's queue (the smallest accepted: one snapshot chunk and a frame).
const PUBLICATION_QUEUE_BYTES: u64 = 4_194_624;

/// The bound on the relay's resident memory during and after the flood. The budgets above
/// come to 152 MiB: four filters (16 MiB) and their exact state (64 MiB), the input queue (8),
/// the NATS backlog (8), the recovery answers being read (16) and the consumer's four pool
/// streams' queues (16), plus 24 MiB for the snapshots of four generations being encoded
/// beside their filters. With the process's own ~30 MiB that is about 206 MiB; the rest is
/// room for what is weighed only approximately (decoded copies between stages, the NATS
/// client's read buffer) and for the allocator's retention of freed memory: the peak measured
/// 206 to 272 MiB over ten runs on a 2-core machine.
const RSS_BOUND_KIB: u64 = 320 * 1024;

/// Endpoints that ask for a pool once the budget is taken.
const WAITING_ENDPOINTS: usize = 40;
/// How long the hostile workers publish.
const FLOOD: Duration = Duration::from_secs(8);
/// Every wait of the test.
const WAIT: Duration = Duration::from_secs(60);

/// A store event of `blocks` synthetic blocks, distinct per `salt`, from `worker`.
fn wide_event(worker: &Worker, event_id: u64, salt: u64, blocks: usize) -> RouterEvent {
    let blocks = (0..blocks as u64)
        .map(|index| StoredBlock {
            block_hash: ExternalBlockHash(salt << 32 | index),
            tokens_hash: LocalBlockHash((salt << 32 | index).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        })
        .collect();
    serve_setup::stored_event(worker, event_id, blocks)
}

/// Bytes of `answer`'s response stream as a worker writes it (what the response bound counts).
fn response_bytes(answer: &RecoveryResponse) -> u64 {
    answer_stream(PayloadCodec::MsgPack, answer)
        .unwrap()
        .iter()
        .map(|message| fake_worker::two_part(&message.header, &message.body).len() as u64)
        .sum()
}

/// A tree dump of `worker`'s rank whose response stream is within 1 % under `bytes` long.
fn dump_of(worker: &Worker, bytes: u64) -> RecoveryResponse {
    let dump = |events: u64| RecoveryResponse::TreeDump {
        events: (0..events).map(|salt| wide_event(worker, 0, 1000 + salt, 1_000)).collect(),
        last_event_id: 1,
        reset_scope: TreeDumpScope::Rank,
    };
    let per_event = response_bytes(&dump(2)) - response_bytes(&dump(1));
    let mut events = bytes / per_event;
    while response_bytes(&dump(events)) > bytes {
        events -= 1;
    }
    let answer = dump(events);
    let size = response_bytes(&answer);
    assert!(size <= bytes && size >= bytes - bytes / 100, "{size} bytes for {bytes}");
    answer
}

/// Blocks of a wide live event whose envelope is just under 1,000,000 bytes (NATS's default
/// `max_payload` is 1 MiB).
fn flood_event_blocks(worker: &Worker) -> usize {
    // Every salt from 1 up gives 64-bit hashes: the widest encoding.
    let size = |blocks| {
        serve_setup::kv_events_envelope(worker, 1, &[wide_event(worker, 1, 1, blocks)]).len()
    };
    let per_thousand = size(2_000) - size(1_000);
    let blocks = 1_000 + (1_000_000 - size(1_000)) * 1_000 / per_thousand;
    assert!(size(blocks) <= 1_000_000, "{} bytes for {blocks} blocks", size(blocks));
    blocks
}

/// Leading blocks of `tokens` the healthy pool's replica holds (`None`: no ready replica).
fn healthy_matched(consumer: &RelayConsumer, tokens: &[u32]) -> Option<usize> {
    consumer
        .query(tokens, serve_setup::MODEL)
        .iter()
        .find(|answer| answer.endpoint.to_string().starts_with("healthy/") && answer.replica_ready)
        .map(|answer| answer.matched_blocks)
}

fn healthy_ready(snapshot: &kvrelay_consumer::ConsumerSnapshot) -> bool {
    snapshot.pools.iter().any(|pool| {
        pool.descriptor.serving_endpoint.to_string() == "healthy/backend/generate"
            && pool.status == FilterStatus::Ready
    })
}

async fn metrics(relay: &RelayProcess) -> String {
    let (status, text) = http_get_async(relay.ops, "/metrics").await;
    assert_eq!(status, 200);
    text
}

/// Publish `worker`'s stores of `tokens` (one event per attempt, ids from `*event_id`) until
/// the healthy replica holds them all.
async fn store_until_visible(
    client: &async_nats::Client,
    consumer: &RelayConsumer,
    worker: &Worker,
    tokens: &[u32],
    event_id: &mut u64,
) {
    let blocks = tokens.len() / BLOCK;
    tokio::time::timeout(WAIT, async {
        while healthy_matched(consumer, tokens) != Some(blocks) {
            *event_id += 1;
            let bytes = serve_setup::store_envelope(worker, *event_id, *event_id, tokens);
            serve_setup::publish(client, worker.subject(KV_EVENTS_TOPIC), bytes).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the healthy worker's blocks never reached the consumer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_dc_cannot_grow_the_relay_past_its_budgets_and_a_healthy_pool_keeps_publishing() {
    tokio::time::timeout(Duration::from_secs(240), async {
        let nats = NatsServer::start().await;
        let store = FileStore::new();
        let healthy = Worker::live_only("healthy", 0x4ea1_0000_0000_0001, 0x4ea1_0000_0000_00a1);
        healthy.register(&store);
        let budgets = [
            ("DYN_EVENT_PLANE", "nats".to_owned()),
            ("NATS_SERVER", nats.url()),
            ("DYN_RELAY_POOL_FILTER_BYTES_MAX", (FILTER_BYTES * POOLS_ADMITTED).to_string()),
            ("DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX", EXACT_STATE_BYTES.to_string()),
            ("DYN_RELAY_INPUT_QUEUE_BYTES_MAX", INPUT_QUEUE_BYTES.to_string()),
            ("DYN_RELAY_NATS_BACKLOG_BYTES_MAX", NATS_BACKLOG_BYTES.to_string()),
            ("DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX", RECOVERY_RESPONSE_BYTES.to_string()),
            ("DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX", RECOVERY_ANSWERS_BYTES.to_string()),
            ("DYN_RELAY_RECOVERY_ATTEMPT_TIMEOUT_MS", "5000".to_owned()),
            ("DYN_RELAY_PUBLICATION_QUEUE_BYTES", PUBLICATION_QUEUE_BYTES.to_string()),
        ];
        let env: Vec<(&str, &str)> =
            budgets.iter().map(|(name, value)| (*name, value.as_str())).collect();
        let mut relay = RelayProcess::spawn(&store.root, &env);
        relay.wait_listening().await;
        let consumer = RelayConsumer::start(
            kvrelay_consumer::connect_lazy(&relay.wan.to_string()).unwrap(),
            ConsumerConfig::default(),
            &mut rng_from_seed(11),
        )
        .unwrap();
        let client = async_nats::connect(nats.url()).await.unwrap();
        tokio::time::timeout(WAIT, consumer.wait_until(healthy_ready))
            .await
            .expect("the healthy pool never became ready")
            .unwrap();
        let mut healthy_event = 0;
        let before = prompt(1, 4);
        store_until_visible(&client, &consumer, &healthy, &before, &mut healthy_event).await;
        let idle_rss = relay.rss_kib();

        // Resident memory, sampled every 50 ms from now on.
        let peak_rss = Arc::new(AtomicU64::new(idle_rss));
        let sampling = Arc::new(AtomicBool::new(true));
        let sampler = {
            let (peak, sampling) = (Arc::clone(&peak_rss), Arc::clone(&sampling));
            let path = format!("/proc/{}/status", relay.child.id());
            kvrelay::runtime::spawn(async move {
                while sampling.load(Ordering::Relaxed) {
                    peak.fetch_max(relay_process::rss_kib_of(&path), Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
        };

        // Three hostile endpoints take the rest of the pool budget: one worker's tree dump
        // is just under the response bound, another's is over it (refused, retried), and all
        // three publish wide events throughout the flood.
        let mut hostile = Vec::new();
        let mut indexers = Vec::new();
        for (index, dump_bytes) in [(0u64, RECOVERY_RESPONSE_BYTES * 15 / 16), (1, 0), (2, 0)] {
            let namespace: &'static str = Box::leak(format!("hostile-{index}").into_boxed_str());
            let mut worker = Worker::live_only(
                namespace,
                0x0bad_0000_0000_0000 | index,
                0x0bad_0000_0000_1000 | index,
            );
            let dump_bytes = if index == 1 { RECOVERY_RESPONSE_BYTES * 9 / 8 } else { dump_bytes };
            if dump_bytes > 0 {
                let indexer = local_indexer(&dump_of(&worker, dump_bytes)).await;
                worker.recovery = Some(indexer.address);
                indexers.push(indexer);
            }
            worker.register(&store);
            hostile.push(worker);
        }
        let catalogued = tokio::time::timeout(WAIT, async {
            loop {
                let text = metrics(&relay).await;
                if metric(&text, "kv_dc_relay_catalog_pool_count") == Some(POOLS_ADMITTED) {
                    return text;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await
        .expect("the hostile endpoints never took the pool budget");
        assert_eq!(metric(&catalogued, "kvrelay_pools_max"), Some(POOLS_ADMITTED));
        // The rest ask for pools the budget has no room for: they wait, counted.
        for index in 0..WAITING_ENDPOINTS as u64 {
            let namespace: &'static str = Box::leak(format!("waiting-{index}").into_boxed_str());
            let worker = Worker::live_only(
                namespace,
                0x0a17_0000_0000_0000 | index,
                0x0a17_0000_0000_1000 | index,
            );
            worker.register(&store);
            hostile.push(worker);
        }

        // The flood: every hostile worker publishes wide events as fast as the server takes
        // them, while the healthy worker keeps storing one short chain every 250 ms.
        let flood_end = Instant::now() + FLOOD;
        let mut floods = Vec::new();
        for (task, worker) in hostile.iter().enumerate() {
            let worker = *worker;
            let client = client.clone();
            floods.push(kvrelay::runtime::spawn(async move {
                let blocks = flood_event_blocks(&worker);
                let mut sent = 0u64;
                let mut event_id = 1;
                while Instant::now() < flood_end {
                    let salt = (task as u64 + 1) << 20 | event_id;
                    let event = wide_event(&worker, event_id, salt, blocks);
                    let bytes = serve_setup::kv_events_envelope(&worker, event_id, &[event]);
                    let bytes_len = bytes.len() as u64;
                    client
                        .publish(worker.subject(KV_EVENTS_TOPIC), Bytes::from(bytes))
                        .await
                        .expect("the server takes every wide event");
                    sent += bytes_len;
                    event_id += 1;
                    if event_id % 16 == 0 {
                        let _ = client.flush().await;
                    }
                }
                sent
            }));
        }
        let mut stored_during = Vec::new();
        while Instant::now() < flood_end {
            healthy_event += 1;
            let tokens = prompt(100 + healthy_event as u32, 2);
            let bytes =
                serve_setup::store_envelope(&healthy, healthy_event, healthy_event, &tokens);
            let _ = client.publish(healthy.subject(KV_EVENTS_TOPIC), Bytes::from(bytes)).await;
            stored_during.push(tokens);
            tokio::time::sleep(Duration::from_millis(250)).await;
            let snapshot = consumer.snapshot();
            assert!(healthy_ready(&snapshot), "the healthy pool left: {snapshot:#?}");
        }
        let mut published = 0;
        for flood in floods {
            published += flood.await.unwrap();
        }
        let _ = client.flush().await;

        // After the flood the healthy pool follows its worker again.
        let after = prompt(7, 3);
        let recovered_at = Instant::now();
        store_until_visible(&client, &consumer, &healthy, &after, &mut healthy_event).await;
        let recovered_in = recovered_at.elapsed();
        // The healthy worker's stores of the flood were queued before this one (one subject).
        let visible_after = stored_during
            .iter()
            .filter(|tokens| healthy_matched(&consumer, tokens) == Some(2))
            .count();
        tokio::time::sleep(Duration::from_secs(1)).await;
        sampling.store(false, Ordering::Relaxed);
        sampler.await.unwrap();
        let peak = peak_rss.load(Ordering::Relaxed);
        let text = metrics(&relay).await;
        let value = |sample: &str| metric(&text, sample).unwrap_or(0);
        let wakeup_max = metric_seconds(&text, "kvrelay_node_wakeup_seconds_max").unwrap_or(0.0);
        eprintln!(
            "dc flood: {} MiB of wide events published; relay VmRSS idle {idle_rss} KiB, \
             peak {peak} KiB, after {} KiB; healthy stores of the flood visible \
             {visible_after} of {}, a store after it within {recovered_in:?}; backlog drops {}, \
             client drops {}, NATS connects {}, input queue byte waits {}, recovery queries {} \
             answered {} failed {}, answer bytes peak {}, backlog bytes peak {}, exact-state bytes {}, \
             exact-state refusals {}, fenced endpoints {}, longest wake-up {wakeup_max} s, \
             slow wake-ups {}",
            published >> 20,
            relay.rss_kib(),
            stored_during.len(),
            value("kvrelay_event_plane_backlog_drops_total{plane=\"nats\"}"),
            value("kvrelay_event_plane_client_drops_total{plane=\"nats\"}"),
            value("kvrelay_event_plane_connects_total{plane=\"nats\"}"),
            value("kvrelay_input_queue_byte_waits_total"),
            value("kvrelay_recovery_queries_total"),
            value("kvrelay_recovery_answered_total"),
            value("kvrelay_recovery_failed_total"),
            value("kvrelay_recovery_answer_bytes_peak"),
            value("kvrelay_event_plane_backlog_bytes_peak{plane=\"nats\"}"),
            value("kvrelay_pool_exact_state_bytes"),
            value("kvrelay_pool_exact_state_budget_refusals"),
            value("kvrelay_fenced_endpoint_count"),
            value("kvrelay_node_slow_wakeups_total"),
        );
        // The node times its wake-ups on the process's real clock.
        assert!(wakeup_max > 0.0 && wakeup_max < 240.0, "{text}");
        assert!(peak > 0 && peak < RSS_BOUND_KIB, "relay VmRSS peaked at {peak} KiB");
        // The backlog's fair shares: the flooding endpoints lose their own newest messages,
        // the healthy endpoint (far lighter) loses none.
        assert_eq!(
            visible_after,
            stored_during.len(),
            "{visible_after} of the healthy worker's {} stores of the flood arrived",
            stored_during.len()
        );
        assert_eq!(value("kvrelay_healthy"), 1, "{text}");
        assert_eq!(value("kvrelay_pool_budget_waiting_endpoint_count"), WAITING_ENDPOINTS as u64);
        assert_eq!(value("kv_dc_relay_catalog_pool_count"), POOLS_ADMITTED, "{text}");
        assert!(value("kvrelay_recovery_answered_total") >= 1, "the dump at the bound: {text}");
        assert!(value("kvrelay_recovery_failed_total") >= 1, "the dump over the bound: {text}");
        assert!(value("kvrelay_recovery_answer_bytes_peak") <= RECOVERY_ANSWERS_BYTES);
        let catalog: BTreeSet<String> = consumer
            .snapshot()
            .pools
            .iter()
            .map(|pool| pool.descriptor.serving_endpoint.to_string())
            .collect();
        assert!(catalog.contains("healthy/backend/generate"), "{catalog:?}");
        assert!(relay.child.try_wait().unwrap().is_none(), "the relay exited");
        consumer.shutdown().await;
        drop(indexers);
    })
    .await
    .expect("the flood test overran its bound");
}
