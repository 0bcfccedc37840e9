//! Ingest-to-consumer latency on loopback: from a KV event batch entering the relay node to a
//! consumer applying the delta that carries it; p50 / p90 / p99 / max.
//!
//! Run: `cargo run --release -p kvrelay-benches --bin latency [-- --precise-timer]` (the second
//! waits for publication deadlines on a real-time timer instead of tokio's millisecond wheel).
//!
//! Setup: the demo's relay node (default pool cadence: a delta after 16 events or 1 ms) and its
//! simulated DC (aggregated, P/D and LoRA workers, prefix-sharing traffic), served by the real
//! `RelayService` on 127.0.0.1; one raw tonic subscriber per pool that checks and applies every
//! frame as a consumer does. The bench serves one request at a time on the simulated DC and
//! sends the KV event batch it publishes into the node's input queue (t0), then waits for the
//! subscriber of that batch's pool to apply the next delta (t1); latency is t1 - t0. Batches
//! that change no filter word (all blocks already owned in the pool) publish no delta and are
//! counted apart. The node runs on one runtime thread, the subscribers on another.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrelay::config::WanTuning;
use kvrelay::demo::{Demo, DemoOptions};
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor};
use kvrelay_benches::loopback::{
    CLIENT_THREADS, PoolFollower, RELAY_THREADS, client, quantile, runtime, serve_loopback,
};
use kvrelay_core::inputs::DcInput;
use kvrelay_core::model::identity::ProducerIdentity;
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::wire;
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use tokio::sync::mpsc;

/// Batches sent before recording.
const WARMUP_BATCHES: usize = 300;
/// Batches recorded.
const MEASURED_BATCHES: usize = 5_000;
/// How long a batch may take to show up as a delta before it counts as publishing none.
const DELTA_WAIT: Duration = Duration::from_millis(50);

/// A delta applied by the subscriber of pool `pool` at `at`.
struct Applied {
    pool: usize,
    at: Instant,
}

#[allow(clippy::disallowed_methods, reason = "a benchmark times itself with the wall clock")]
fn now() -> Instant {
    Instant::now()
}

fn main() {
    let relay_runtime = runtime(RELAY_THREADS);
    let client_runtime = runtime(CLIENT_THREADS);
    // The demo's own driver only announces the DC (and its load every 10 ticks): this bench
    // sends every KV event batch itself.
    // `--precise-timer`: publication deadlines on the node's real-time timer
    // (`KVRELAY_PRECISE_PUBLICATION_TIMER` of `kvrelay serve`).
    let precise_timer = std::env::args().skip(1).any(|arg| arg == "--precise-timer");
    let options = DemoOptions {
        requests_per_tick: 0,
        tick: Duration::from_millis(10),
        precise_timer,
        ..DemoOptions::default()
    };
    let (demo, address, _shutdown) = relay_runtime.block_on(async {
        let demo = Demo::start(options, Arc::new(TokioBlockingExecutor), Arc::new(SystemWallClock))
            .expect("the demo node starts");
        let tuning = WanTuning::default();
        let service = demo.node.relay_service(Arc::new(SystemWallClock), tuning);
        let (address, shutdown) = serve_loopback(service, tuning).await;
        (demo, address, shutdown)
    });
    let pools = client_runtime.block_on(catalog(address));
    let (applied_tx, mut applied) = mpsc::unbounded_channel::<Applied>();
    for (index, (producer, _)) in pools.iter().enumerate() {
        let producer = *producer;
        let applied_tx = applied_tx.clone();
        client_runtime.spawn(async move {
            let mut client = client(address).await;
            // The catalog may name a pool a moment before its publication is open.
            let mut follower = None;
            for _ in 0..100 {
                match PoolFollower::open(&mut client, &producer, "latency").await {
                    Ok(opened) => {
                        follower = Some(opened);
                        break;
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
            let mut follower = follower.expect("every pool admits a subscriber");
            let _ = applied_tx.send(Applied { pool: index, at: now() });
            while follower.next().await.is_ok() {
                if applied_tx.send(Applied { pool: index, at: now() }).is_err() {
                    return;
                }
            }
        });
    }
    let (latencies, silent) = relay_runtime.block_on(async {
        for _ in 0..pools.len() {
            applied.recv().await.expect("every pool's snapshot is installed");
        }
        let mut rng = rng_from_seed(0x1a7e);
        let mut latencies = Vec::with_capacity(MEASURED_BATCHES);
        let mut silent = 0usize;
        let mut sent = 0usize;
        while sent < WARMUP_BATCHES + MEASURED_BATCHES {
            for fact in demo.dc.with(|dc| dc.step(1, &mut rng)) {
                let DcInput::KvEvents(batch) = &fact else { continue };
                let pool = pools
                    .iter()
                    .position(|(_, endpoint)| *endpoint == batch.endpoint.to_string())
                    .expect("every batch's endpoint has a pool");
                while applied.try_recv().is_ok() {}
                let started = now();
                demo.node.inputs.send(fact).await.expect("the node runs");
                let delta = tokio::time::timeout(DELTA_WAIT, async {
                    loop {
                        let next = applied.recv().await.expect("the subscribers run");
                        if next.pool == pool {
                            return next.at;
                        }
                    }
                })
                .await;
                sent += 1;
                if sent <= WARMUP_BATCHES {
                    continue;
                }
                match delta {
                    Ok(at) => latencies.push(at.saturating_duration_since(started)),
                    Err(_) => silent += 1,
                }
            }
        }
        (latencies, silent)
    });
    let mut sorted = latencies;
    sorted.sort_unstable();
    let mean = sorted.iter().sum::<Duration>() / u32::try_from(sorted.len().max(1)).unwrap_or(1);
    let timer = if precise_timer { "precise" } else { "tokio" };
    println!(
        "pools {}, batches measured {}, without a delta {silent}, publication timer {timer}",
        pools.len(),
        sorted.len()
    );
    println!(
        "ingest -> consumer applied: p50 {:?}  p90 {:?}  p99 {:?}  max {:?}  mean {:?}",
        quantile(&sorted, 0.50),
        quantile(&sorted, 0.90),
        quantile(&sorted, 0.99),
        quantile(&sorted, 1.0),
        mean,
    );
}

/// The catalog once every demo pool is in it: each pool's producer and serving endpoint.
async fn catalog(address: std::net::SocketAddr) -> Vec<(ProducerIdentity, String)> {
    let mut client = client(address).await;
    let request = proto::WatchKvPoolCatalogRequest {
        subscriber_id: "latency".into(),
        contract_marker: CONTRACT_MARKER,
    };
    let mut updates = client.watch_kv_pool_catalog(request).await.expect("a catalog").into_inner();
    let wait = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let update = updates.message().await.expect("the catalog streams").expect("open");
            let validated = wire::validate_catalog_update(&update).expect("a valid catalog");
            if validated.pools.len() == 4 {
                return validated
                    .pools
                    .into_iter()
                    .map(|pool| (pool.producer, pool.serving_endpoint.to_string()))
                    .collect();
            }
        }
    });
    wait.await.expect("the demo's four pools materialize")
}
