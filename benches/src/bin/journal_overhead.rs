//! CPU cost of recording a journal: a node fed the demo DC's KV traffic at a fixed rate of stored
//! events per second, measured with and without a recorder (process CPU time from
//! `/proc/self/stat`, so Linux only).
//!
//! Run: `cargo run --release -p kvrelay-benches --bin journal_overhead -- [SECONDS] [RATE] [ROUNDS]`
//! (defaults 10 s, 5,000 stored events/s, 2 rounds; each round runs both modes, alternating).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay::demo::SharedDc;
use kvrelay::journal::{RecorderConfig, RecorderStats, start_recorder};
use kvrelay::node::{NodeConfig, RecoveryTransport, start_node_with_tap};
use kvrelay::pool::PoolConfig;
use kvrelay::publication::HubConfig;
use kvrelay::runtime::{BlockingExecutor, SystemWallClock, TokioBlockingExecutor, WallClock};
use kvrelay_core::control::ControlConfig;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::DcInput;
use kvrelay_core::model::identity::{RelayIdentity, stable_dc_id};
use kvrelay_core::model::kv_events::KvCacheEventData;
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_dc::{Deployment, SimulatedDc, TrafficConfig};
use tokio::time::Instant;

const SEED: u64 = 5;

fn node_config() -> NodeConfig {
    let mut rng = rng_from_seed(derive_seed(SEED, "overhead/relay"));
    let relay = RelayIdentity::start(0x0b0b_0000_0000_0001, &mut rng);
    let scope = DiscoveryScope::new(Vec::new(), Vec::new(), true).expect("watch-all is valid");
    let mut control = ControlConfig::new(relay, stable_dc_id("overhead-dc").expect("valid"), scope);
    control.expected_unique_blocks = 1 << 20;
    NodeConfig {
        control,
        pool: PoolConfig::default(),
        hub: HubConfig::default(),
        max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(SEED, "overhead/node"),
        load_window: Duration::from_secs(1),
        input_queue_capacity: 4096,
        load_fanout_capacity: 16,
        input_queue_bytes_max: kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT,
    }
}

/// Process CPU time (user + system), from `/proc/self/stat` in clock ticks of 10 ms.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields after the name start at `state` (field 3); utime and stime are fields 14 and 15.
    let ticks = |index: usize| fields.get(index - 3).and_then(|v| v.parse::<u64>().ok());
    let total = ticks(14).unwrap_or(0) + ticks(15).unwrap_or(0);
    Duration::from_millis(total * 10)
}

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap_or(0)
}

fn stored_events(fact: &DcInput) -> u64 {
    match fact {
        DcInput::KvEvents(batch) => batch
            .events
            .iter()
            .filter(|event| matches!(event.event.data, KvCacheEventData::Stored(_)))
            .count() as u64,
        _ => 0,
    }
}

struct Outcome {
    cpu: Duration,
    wall: Duration,
    stored: u64,
    recorder: Option<(RecorderStats, u64)>,
}

async fn run(seconds: u64, rate: u64, record: Option<PathBuf>) -> Outcome {
    let executor: Arc<dyn BlockingExecutor> = Arc::new(TokioBlockingExecutor);
    let clock: Arc<dyn WallClock> = Arc::new(SystemWallClock);
    let mut rng = rng_from_seed(derive_seed(SEED, "overhead/dc"));
    let dc = SharedDc(Arc::new(Mutex::new(SimulatedDc::start(
        &Deployment::demo(),
        TrafficConfig::default(),
        &mut rng,
    ))));
    let discovery = dc.with(|dc| dc.discovery_facts());
    // Everything fed is generated before the measurement.
    let target = rate * seconds;
    let mut traffic = Vec::new();
    let mut generated = 0u64;
    while generated < target {
        for fact in dc.with(|dc| dc.step(8, &mut rng)) {
            generated += stored_events(&fact);
            traffic.push(fact);
        }
    }
    let config = node_config();
    let transport: Arc<dyn RecoveryTransport> = Arc::new(dc.clone());
    let recorder = record.as_ref().map(|dir| {
        let config = RecorderConfig::new(dir.clone(), 1 << 30, Duration::from_secs(3600));
        start_recorder(&config, &node_config(), Arc::clone(&clock), Arc::clone(&executor))
            .expect("recorder starts")
    });
    let (recovery, tap) = match &recorder {
        Some(recorder) => (recorder.recovery(transport), Some(recorder.tap())),
        None => (transport, None),
    };
    let node = start_node_with_tap(config, Arc::clone(&executor), clock, recovery, tap)
        .expect("node starts");
    for fact in discovery {
        node.inputs.send(fact).await.expect("node runs");
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let cpu_start = cpu_time();
    let start = Instant::now();
    let mut ticks = tokio::time::interval(Duration::from_millis(10));
    let mut sent = 0u64;
    let mut facts = traffic.into_iter().peekable();
    while facts.peek().is_some() {
        ticks.tick().await;
        let due = rate * start.elapsed().as_millis() as u64 / 1000;
        while sent < due {
            let Some(fact) = facts.next() else { break };
            sent += stored_events(&fact);
            node.inputs.send(fact).await.expect("node runs");
        }
    }
    let mut status = node.status.clone();
    let _ = status.wait_for(|status| status.inputs_handled > 0).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let wall = start.elapsed();
    let cpu = cpu_time().saturating_sub(cpu_start);
    node.shutdown().await;
    let recorder = match recorder {
        Some(recorder) => {
            let stats = recorder.finish().await;
            let dir = record.expect("recording");
            let bytes = std::fs::read_dir(&dir)
                .map(|entries| {
                    entries
                        .filter_map(Result::ok)
                        .filter_map(|e| e.metadata().ok())
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0);
            let _ = std::fs::remove_dir_all(&dir);
            Some((stats, bytes))
        }
        None => None,
    };
    Outcome { cpu, wall, stored: sent, recorder }
}

fn main() {
    let args: Vec<u64> = std::env::args().skip(1).filter_map(|arg| arg.parse().ok()).collect();
    let seconds = args.first().copied().unwrap_or(10);
    let rate = args.get(1).copied().unwrap_or(5_000);
    let rounds = args.get(2).copied().unwrap_or(2);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!("{seconds} s per run at {rate} stored events/s, {rounds} rounds");
    println!(
        "{:>6} {:>10} {:>9} {:>8} {:>8} {:>12} {:>9} {:>9} {:>8}",
        "round",
        "mode",
        "stored/s",
        "cpu s",
        "cpu %",
        "journal B",
        "B/stored",
        "records",
        "dropped"
    );
    let mut totals = [(Duration::ZERO, Duration::ZERO); 2];
    for round in 0..rounds {
        for (slot, recording) in [(0, false), (1, true)] {
            let dir = recording.then(|| {
                std::env::temp_dir()
                    .join(format!("kvrelay-journal-overhead-{}-{round}", std::process::id()))
            });
            let outcome = runtime.block_on(run(seconds, rate, dir));
            totals[slot].0 += outcome.cpu;
            totals[slot].1 += outcome.wall;
            let (bytes, records, dropped) = outcome.recorder.map_or((0, 0, 0), |(stats, bytes)| {
                (bytes, stats.records_written, stats.records_dropped)
            });
            println!(
                "{round:>6} {:>10} {:>9.0} {:>8.2} {:>8.1} {bytes:>12} {:>9.1} {records:>9} {dropped:>8}",
                if recording { "recording" } else { "baseline" },
                outcome.stored as f64 / outcome.wall.as_secs_f64(),
                outcome.cpu.as_secs_f64(),
                100.0 * outcome.cpu.as_secs_f64() / outcome.wall.as_secs_f64(),
                bytes as f64 / outcome.stored.max(1) as f64,
            );
        }
    }
    let share = |(cpu, wall): (Duration, Duration)| cpu.as_secs_f64() / wall.as_secs_f64();
    let (base, rec) = (share(totals[0]), share(totals[1]));
    println!(
        "cpu share: baseline {:.1} %, recording {:.1} %, extra {:.1} % of baseline; peak RSS {} KiB",
        100.0 * base,
        100.0 * rec,
        100.0 * (rec - base) / base,
        peak_rss_kib()
    );
}
