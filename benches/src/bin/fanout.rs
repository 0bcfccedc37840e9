//! Fan-out of pool deltas over loopback gRPC to 1, 16 and 64 subscribers: frames/s and CPU
//! seconds per frame.
//!
//! Run: `cargo run --release -p kvrelay-benches --bin fanout`.
//!
//! Setup: one standalone pool (filter sized for 65,536 blocks, warmed to that live set) fed the
//! steady ingest mix of `kvrelay_benches::ingest`, 16 events per delta (the pool's publication
//! threshold); the real `PoolPublications` and `RelayService` on 127.0.0.1; N raw tonic
//! subscribers, each on its own HTTP/2 connection, that check every frame against the expected
//! producer and apply it to a `FilterReplica`, as a consumer does. The producer stays at most
//! [`WINDOW`] deltas ahead of the slowest subscriber (below the 16-frame queue bound), so nobody
//! lags: the figure is the rate at which every subscriber applies every delta.
//!
//! The relay side (pool, hub, gRPC server) runs on one runtime thread and the subscribers on
//! another, so the machine's two cores are both used; CPU is read per thread from
//! `/proc/self/task/*/stat` (10 ms ticks) and for the whole process from `/proc/self/stat`.
//! Relay CPU includes applying the 16 events of every delta (reported per delta, too).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvrelay::config::WanTuning;
use kvrelay::pool::{
    FaultSink, PoolConfig, PublicationMode, StandalonePool, spawn_standalone_pool,
};
use kvrelay::publication::{HubConfig, PoolPublications};
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor};
use kvrelay::wan::{RelayService, wan_channels};
use kvrelay_benches::ingest::generate;
use kvrelay_benches::loopback::{
    CLIENT_THREADS, CpuSample, PoolFollower, RELAY_THREADS, client, runtime, serve_loopback,
};
use kvrelay_core::filter::ckf::{CkfFormat, MAX_KICKS_DEFAULT};
use kvrelay_core::model::hashing::HashFormat;
use kvrelay_core::model::identity::{EndpointPath, PoolId, ProducerIdentity, RelayIdentity};
use kvrelay_core::model::identity::{resolve_indexer_domain, stable_dc_id};
use kvrelay_core::model::kv_events::RouterEvent;
use kvrelay_core::pool::{PoolFault, PoolOwnership};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_core::sources::RankFence;
use tokio::sync::Notify;

/// Live blocks of the pool (and its filter sizing).
const LIVE_BLOCKS: usize = 65_536;
/// Events per delta: the pool's publication threshold.
const EVENTS_PER_DELTA: usize = 16;
/// Most deltas the producer runs ahead of the slowest subscriber.
const WINDOW: u64 = 8;
/// Deltas before measuring.
const WARMUP_DELTAS: usize = 200;
/// Subscriber counts measured, each with the deltas it is measured over (enough frames and
/// seconds for CPU ticks of 10 ms to resolve).
const RUNS: [(usize, usize); 3] = [(1, 20_000), (16, 4_000), (64, 2_000)];

/// Counts refused events: the ingest mix is valid, so the `refused` column must read 0 (a
/// refused event would publish less than the row claims).
#[derive(Debug, Default)]
struct CountFaults(AtomicU64);

impl FaultSink for CountFaults {
    fn report(&self, _fault: PoolFault) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    fn refused(&self, _fault: PoolFault) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

fn producer(format: CkfFormat) -> ProducerIdentity {
    let endpoint: EndpointPath = "bench/backend/generate".parse().expect("a valid endpoint");
    let domain = resolve_indexer_domain("bench-llm", 16, HashFormat::StandardV1, &endpoint, None)
        .expect("a valid domain");
    let pool_id = PoolId { indexer_domain: domain, dc_id: stable_dc_id("bench").expect("a dc") };
    ProducerIdentity::new(pool_id, 1, 1, format).expect("a valid producer")
}

/// Progress of every subscriber: the sequence each has applied.
struct Progress {
    applied: Vec<AtomicU64>,
    payload_bytes: AtomicUsize,
    /// Why a subscriber stopped, if one did.
    failure: Mutex<Option<String>>,
    changed: Notify,
}

impl Progress {
    fn slowest(&self) -> u64 {
        self.applied.iter().map(|sequence| sequence.load(Ordering::Acquire)).min().unwrap_or(0)
    }

    /// Wait until every subscriber has applied `sequence`.
    async fn reached(&self, sequence: u64) {
        while self.slowest() < sequence {
            if let Some(failure) = self.failure.lock().expect("not poisoned").as_ref() {
                panic!("a bench subscriber stopped: {failure}");
            }
            self.changed.notified().await;
        }
    }
}

struct Figures {
    subscribers: usize,
    deltas: u64,
    wall: Duration,
    cpu: CpuSample,
    payload_bytes: usize,
    refused_events: u64,
}

#[allow(clippy::disallowed_methods, reason = "a benchmark times itself with the wall clock")]
fn measure(subscribers: usize, warmup: &[RouterEvent], batches: &[Vec<RouterEvent>]) -> Figures {
    let relay_runtime = runtime(RELAY_THREADS);
    let client_runtime = runtime(CLIENT_THREADS);
    let format = CkfFormat::for_expected_blocks(LIVE_BLOCKS as u64).expect("a valid sizing");
    let identity = producer(format);
    let tuning = WanTuning {
        max_subscribers_per_pool: subscribers.max(64),
        max_pool_streams_total: subscribers.max(64),
        ..WanTuning::default()
    };
    let faults = Arc::new(CountFaults::default());
    let (actor, address, _shutdown) = relay_runtime.block_on(async {
        let executor = Arc::new(TokioBlockingExecutor);
        let pool = PoolOwnership::new(format, MAX_KICKS_DEFAULT, rng_from_seed(1)).expect("pool");
        let (actor, _) = spawn_standalone_pool(
            (identity.pool_id(), identity.layout_generation()),
            pool,
            PoolConfig::default(),
            Arc::clone(&faults) as Arc<dyn FaultSink>,
            PublicationMode::Free,
        );
        for chunk in warmup.chunks(256) {
            actor.apply(RankFence(1), chunk.to_vec()).await.expect("the pool runs");
        }
        let publications =
            Arc::new(PoolPublications::new(HubConfig::from_tuning(&tuning), executor));
        publications.activate(identity, actor.handle().clone());
        let relay = RelayIdentity { drt_instance_id: 0xbe, relay_incarnation: 1 };
        let (_publisher, views) = wan_channels(&relay, tuning.load_fanout_capacity);
        let service =
            RelayService::new(relay, views, publications, Arc::new(SystemWallClock), tuning);
        let (address, shutdown) = serve_loopback(service, tuning).await;
        (actor, address, shutdown)
    });
    let progress = Arc::new(Progress {
        applied: (0..subscribers).map(|_| AtomicU64::new(0)).collect(),
        payload_bytes: AtomicUsize::new(0),
        failure: Mutex::new(None),
        changed: Notify::new(),
    });
    for index in 0..subscribers {
        let progress = Arc::clone(&progress);
        let mut follower = client_runtime.block_on(async move {
            let mut client = client(address).await;
            PoolFollower::open(&mut client, &identity, &format!("bench-{index}"))
                .await
                .expect("the relay admits every bench subscriber")
        });
        progress.applied[index].store(follower.sequence(), Ordering::Release);
        client_runtime.spawn(async move {
            loop {
                let bytes = match follower.next().await {
                    Ok(bytes) => bytes,
                    Err(error) => {
                        *progress.failure.lock().expect("not poisoned") =
                            Some(format!("{error:?}"));
                        progress.changed.notify_one();
                        return;
                    }
                };
                if index == 0 {
                    progress.payload_bytes.fetch_add(bytes, Ordering::Relaxed);
                }
                progress.applied[index].store(follower.sequence(), Ordering::Release);
                progress.changed.notify_one();
            }
        });
    }
    relay_runtime.block_on(async {
        let (warmup, measured) = batches.split_at(WARMUP_DELTAS);
        let start_sequence = drive(&actor, &progress, warmup).await;
        let payload_before = progress.payload_bytes.load(Ordering::Relaxed);
        let cpu_before = CpuSample::now();
        let started = Instant::now();
        let end_sequence = drive(&actor, &progress, measured).await;
        let wall = started.elapsed();
        Figures {
            subscribers,
            deltas: end_sequence - start_sequence,
            wall,
            cpu: CpuSample::now().since(&cpu_before),
            payload_bytes: progress.payload_bytes.load(Ordering::Relaxed) - payload_before,
            refused_events: faults.0.load(Ordering::Relaxed),
        }
    })
}

/// Publish every batch as one delta, staying within [`WINDOW`] of the slowest subscriber; the
/// last sequence, once every subscriber has applied it.
async fn drive(actor: &StandalonePool, progress: &Progress, batches: &[Vec<RouterEvent>]) -> u64 {
    let mut sequence = 0;
    for batch in batches {
        actor.apply(RankFence(1), batch.clone()).await.expect("the pool runs");
        sequence = actor.flush().await.expect("the pool runs").expect("publication works");
        progress.reached(sequence.saturating_sub(WINDOW)).await;
    }
    progress.reached(sequence).await;
    sequence
}

fn main() {
    let total = WARMUP_DELTAS + RUNS.iter().map(|&(_, deltas)| deltas).max().unwrap_or(0);
    let workload = generate(7, 8, LIVE_BLOCKS, total * EVENTS_PER_DELTA);
    let batches: Vec<Vec<RouterEvent>> =
        workload.steady.chunks(EVENTS_PER_DELTA).take(total).map(<[RouterEvent]>::to_vec).collect();
    assert_eq!(batches.len(), total, "the workload has enough steady events");
    println!(
        "{:>5} {:>7} {:>10} {:>10} {:>9} {:>15} {:>15} {:>15} {:>15} {:>8}",
        "subs",
        "deltas",
        "frames",
        "frames/s",
        "B/delta",
        "relay us/frame",
        "client us/frame",
        "process us/fr",
        "relay us/delta",
        "refused"
    );
    for (subscribers, deltas) in RUNS {
        let figures = measure(subscribers, &workload.warmup, &batches[..WARMUP_DELTAS + deltas]);
        let frames = figures.deltas as f64 * figures.subscribers as f64;
        let per_frame = |seconds: f64| seconds * 1e6 / frames;
        println!(
            "{:>5} {:>7} {:>10} {:>10.0} {:>9.0} {:>15.2} {:>15.2} {:>15.2} {:>15.1} {:>8}",
            figures.subscribers,
            figures.deltas,
            frames,
            frames / figures.wall.as_secs_f64(),
            figures.payload_bytes as f64 / figures.deltas as f64,
            per_frame(figures.cpu.relay),
            per_frame(figures.cpu.clients),
            per_frame(figures.cpu.process),
            figures.cpu.relay * 1e6 / figures.deltas as f64,
            figures.refused_events,
        );
    }
}
