//! The whole relay end to end: a simulated DC feeds a node, the WAN service serves it on
//! loopback, and a client sees the catalog, readiness, load and filters the DC implies.

use std::sync::Arc;
use std::time::Duration;

use kvrelay::config::WanTuning;
use kvrelay::demo::{Demo, DemoOptions};
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor};
use kvrelay::wan::serve;
use kvrelay_core::filter::FilterReplica;
use kvrelay_core::model::hashing::{
    HashFormat, block_hash_seed, local_block_hashes, sequence_hashes,
};
use kvrelay_core::wire::{self, encode};
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_simulated_dc_becomes_a_catalog_readiness_load_and_matching_filters() {
    let options = DemoOptions { tick: Duration::from_millis(5), ..DemoOptions::default() };
    let demo =
        Demo::start(options, Arc::new(TokioBlockingExecutor), Arc::new(SystemWallClock)).unwrap();
    let tuning = WanTuning::default();
    let service = demo.node.relay_service(Arc::new(SystemWallClock), tuning);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let (stop_server, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = kvrelay::runtime::spawn(async move {
        serve(service, TcpListenerStream::new(listener), &tuning, async {
            let _ = stopped.await;
        })
        .await
    });
    let mut client = KvEventRelayClient::connect(format!("http://{address}"))
        .await
        .unwrap()
        .max_decoding_message_size(8 << 20);

    // Catalog: the demo deployment has five KV-publishing endpoints' worth of pools (two
    // aggregated workers share one endpoint): tiny-llm, pd prefill, pd decode, loras.
    let mut catalog = client
        .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
            subscriber_id: "e2e".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let pools = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let update = catalog.message().await.unwrap().unwrap();
            let validated = wire::validate_catalog_update(&update).unwrap();
            if validated.pools.len() == 4 {
                return validated.pools;
            }
        }
    })
    .await
    .expect("four pools materialize");
    let endpoints: Vec<String> = pools.iter().map(|p| p.serving_endpoint.to_string()).collect();
    for expected in [
        "dynamo/backend/generate",
        "disagg/prefill/generate",
        "disagg/backend/generate",
        "loras/backend/generate",
    ] {
        assert!(endpoints.iter().any(|e| e == expected), "{expected} in {endpoints:?}");
    }

    // Readiness: three models, all READY, P/D with both roles present, LoRA adapters nested.
    let mut readiness = client
        .subscribe_serving_readiness(proto::SubscribeServingReadinessRequest {
            subscriber_id: "e2e".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let entries = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let update = readiness.message().await.unwrap().unwrap();
            let ready = update
                .entries
                .iter()
                .filter(|e| e.state == proto::ServingReadinessState::Ready as i32)
                .count();
            if ready == 3 {
                return update.entries;
            }
        }
    })
    .await
    .expect("three READY entries");
    let pd = entries.iter().find(|e| e.canonical_model_id == "pd-llm").unwrap();
    assert_eq!(
        pd.present_roles,
        vec![proto::WorkerRole::Prefill as i32, proto::WorkerRole::Decode as i32]
    );
    let lora = entries.iter().find(|e| e.canonical_model_id == "base-llm").unwrap();
    assert_eq!(lora.adapters.len(), 2);

    // Filter: the tiny-llm pool's replica holds every block the DC's workers cache.
    let tiny =
        pools.iter().find(|p| p.serving_endpoint.to_string() == "dynamo/backend/generate").unwrap();
    let producer = tiny.producer;
    let mut stream = client
        .subscribe_kv_pool(proto::SubscribeKvPoolRequest {
            subscriber_id: "e2e".into(),
            expected_producer: Some(encode::producer(&producer)),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let mut replica = FilterReplica::new(producer.format(), producer.pool_id().dc_id.0).unwrap();
    let mut guard = wire::FilterStreamGuard::new(producer);
    let first = stream.message().await.unwrap().unwrap();
    replica.accept(guard.check(&first).unwrap().frame).unwrap();
    // Let traffic run, then stop the DC and drain to quiescence.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let Demo { node, dc, .. } = demo;
    let cached: Vec<u64> = dc.with(|dc| {
        dc.workers()
            .iter()
            .filter(|w| w.spec().endpoint.to_string() == "dynamo/backend/generate")
            .flat_map(|w| w.ranks().iter().flat_map(|r| r.canonical_hashes().collect::<Vec<_>>()))
            .collect()
    });
    assert!(!cached.is_empty());
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let update = stream.message().await.unwrap().unwrap();
            if update.kind != proto::FilterUpdateKind::Heartbeat as i32 {
                replica.accept(guard.check(&update).unwrap().frame).unwrap();
            }
            let found = cached
                .iter()
                .filter(|h| {
                    replica.contains(kvrelay_core::model::hashing::SequenceHash(**h)) == Some(true)
                })
                .count();
            if found == cached.len() {
                return;
            }
        }
    })
    .await;
    let missing = cached
        .iter()
        .filter(|h| replica.contains(kvrelay_core::model::hashing::SequenceHash(**h)) != Some(true))
        .count();
    // Traffic kept flowing while we snapshotted the DC; allow only blocks evicted since.
    assert!(missing * 10 <= cached.len(), "{missing} of {} cached blocks missing", cached.len());

    // A prefix query from a shared prompt matches several blocks.
    let prefix = dc.with(|dc| dc.traffic().prefixes()[0].clone());
    let hashes = sequence_hashes(&local_block_hashes(
        &prefix,
        16,
        HashFormat::StandardV1,
        block_hash_seed(None, None),
    ));
    assert!(replica.longest_prefix(&hashes).unwrap() > 0);

    // Load windows arrive with the pools.
    let mut load = client
        .subscribe_kv_pool_load(proto::SubscribeKvPoolLoadRequest {
            subscriber_id: "e2e".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let window = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let update = load.message().await.unwrap().unwrap();
            if update.window_sequence > 0 && !update.pools.is_empty() {
                return update;
            }
        }
    })
    .await
    .expect("a load window");
    assert_eq!(window.window_ms, 1000);
    node.shutdown().await;
    let _ = stop_server.send(());
    let _ = server.await;
}
