//! `loadgen`: a load generator that registers like Dynamo workers and publishes their
//! `kv-events` and `kv_metrics` on NATS at a set rate and shape, for finding a relay's ceiling
//! (the highest stored-event rate it follows with no loss).
//!
//! Run (debug builds are far slower than the relay's ceiling; measure with a release build):
//!
//! ```text
//! loadgen --discovery-dir /tmp/kv --nats nats://127.0.0.1:4222 --pools 2 --workers-per-pool 4 \
//!     --ranks 2 --rate 5000 --blocks-per-event 4 --chain-share 0.5 --live-cap 4096 \
//!     --duration-secs 30 --trace /tmp/trace.json --verify 127.0.0.1:50051
//! loadgen --verify-only --verify 127.0.0.1:50051 --trace /tmp/trace.json
//! ```
//!
//! `--verify-only --trace-wait-secs N` subscribes first and waits for another run's trace, so
//! the checked consumer has followed the relay through that run (`scripts/chaos.sh`). SIGTERM
//! or Ctrl-C during `--linger-secs` ends the linger early; the workers then unregister.
//!
//! Pools are endpoints `{namespace}/backend/generate{i}` serving `loadgen-model-{i}` (block size
//! 16); each worker writes an instance, a base card (`data_parallel_size` = `--ranks`, no local
//! indexer), and per rank an event source and event channel. Every id and block comes from the
//! seed. Exit codes: 0 verified (or not asked to), 1 false negatives, 4 removed keys present
//! beyond the false-positive bound, 3 a failure (with its cause on stderr), 2 bad flags.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Result, bail, ensure};
use clap::Parser;

#[path = "../loadgen/mod.rs"]
mod loadgen;

use loadgen::shape::Shape;
use loadgen::trace::Trace;
use loadgen::verify::VerifyOptions;
use loadgen::{Discovery, RunConfig};

/// Publish Dynamo-shaped KV load on NATS and check a relay against what was published.
#[derive(Debug, Parser)]
#[command(name = "loadgen", version)]
struct Args {
    /// NATS server URL.
    #[arg(long, default_value = "nats://127.0.0.1:4222")]
    nats: String,
    /// File discovery root (the relay's `DYN_FILE_KV`).
    #[arg(long, value_name = "DIR", conflicts_with = "etcd")]
    discovery_dir: Option<PathBuf>,
    /// etcd endpoint (`http://127.0.0.1:2379`); keys live under one lease whose TTL covers the
    /// run (warm-up + duration + linger + verify timeout + 60 s).
    #[arg(long, value_name = "URL")]
    etcd: Option<String>,
    /// Dynamo namespace of every pool.
    #[arg(long, default_value = "dynamo")]
    namespace: String,
    /// Distinct pools (one endpoint and model each).
    #[arg(long, default_value_t = 1)]
    pools: usize,
    /// Workers per pool.
    #[arg(long, default_value_t = 2)]
    workers_per_pool: usize,
    /// Data-parallel ranks per worker (one event publisher each).
    #[arg(long, default_value_t = 1)]
    ranks: u32,
    /// Stored events per second, in total over every rank.
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Blocks per stored event.
    #[arg(long, default_value_t = 4)]
    blocks_per_event: usize,
    /// Share (0..=1) of stores whose parent is the previous store's last block of that rank.
    #[arg(long, default_value_t = 0.5)]
    chain_share: f64,
    /// Live blocks per rank; above it the oldest are removed (`Removed` events).
    #[arg(long, default_value_t = 1024)]
    live_cap: usize,
    /// Publishing time, seconds.
    #[arg(long, default_value_t = 10.0)]
    duration_secs: f64,
    /// Period of the per-rank `kv_metrics` reports, milliseconds.
    #[arg(long, default_value_t = 1000)]
    load_interval_ms: u64,
    /// Most the generator may run behind schedule before skipping events (counted), ms.
    #[arg(long, default_value_t = 200)]
    max_lag_ms: u64,
    /// Wait after registering before the first event (discovery and subscription), ms.
    #[arg(long, default_value_t = 3000)]
    warmup_ms: u64,
    /// Keep the workers registered this long after publishing (and verifying), seconds.
    #[arg(long, default_value_t = 0)]
    linger_secs: u64,
    /// Seed of every id and block.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Where the trace is written (or read, with `--verify-only`).
    #[arg(long, default_value = "loadgen-trace.json")]
    trace: PathBuf,
    /// Removed keys kept per pool in the trace before sampling thins them.
    #[arg(long, default_value_t = 1_000_000)]
    trace_removed_max: usize,
    /// Verify the relay at this gRPC address (`host:port`) against the trace after publishing.
    #[arg(long, value_name = "RELAY_ADDR")]
    verify: Option<String>,
    /// Publish nothing: read `--trace` and verify it against `--verify`.
    #[arg(long, requires = "verify")]
    verify_only: bool,
    /// With `--verify-only`: subscribe at once, follow the relay and wait up to this long for
    /// `--trace` to appear (another run writes it), then verify with the same consumer.
    #[arg(long, value_name = "SECS", requires = "verify_only")]
    trace_wait_secs: Option<u64>,
    /// Bound of the verification's wait, seconds.
    #[arg(long, default_value_t = 60)]
    verify_timeout_secs: u64,
    /// How long every replica must stay unchanged before it is checked, ms.
    #[arg(long, default_value_t = 1500)]
    quiet_ms: u64,
}

impl Args {
    fn verify_options(&self) -> Result<VerifyOptions> {
        ensure!(self.verify_timeout_secs > 0, "--verify-timeout-secs must be positive");
        ensure!(self.quiet_ms > 0, "--quiet-ms must be positive");
        Ok(VerifyOptions {
            timeout: Duration::from_secs(self.verify_timeout_secs),
            quiet: Duration::from_millis(self.quiet_ms),
            seed: self.seed,
        })
    }

    fn run_config(&self) -> Result<RunConfig> {
        ensure!(
            self.rate.is_finite() && (0.001..=10_000_000.0).contains(&self.rate),
            "--rate must be within 0.001..=10000000 events per second, got {}",
            self.rate
        );
        ensure!(
            (0.0..=1.0).contains(&self.chain_share),
            "--chain-share must be within 0..=1, got {}",
            self.chain_share
        );
        ensure!(self.pools > 0, "--pools must be at least 1");
        ensure!(self.workers_per_pool > 0, "--workers-per-pool must be at least 1");
        ensure!(self.ranks > 0, "--ranks must be at least 1");
        ensure!(
            (1..=8192).contains(&self.blocks_per_event),
            "--blocks-per-event must be within 1..=8192 (a Dynamo message's block bound), got {}",
            self.blocks_per_event
        );
        ensure!(
            self.live_cap >= self.blocks_per_event,
            "--live-cap ({}) must be at least --blocks-per-event ({})",
            self.live_cap,
            self.blocks_per_event
        );
        ensure!(
            self.duration_secs.is_finite()
                && self.duration_secs > 0.0
                && self.duration_secs <= 86_400.0,
            "--duration-secs must be within (0, 86400], got {}",
            self.duration_secs
        );
        ensure!(self.load_interval_ms > 0, "--load-interval-ms must be positive");
        ensure!(self.trace_removed_max > 0, "--trace-removed-max must be positive");
        ensure!(
            !self.namespace.is_empty() && !self.namespace.contains('/'),
            "--namespace must be a non-empty name without '/'"
        );
        let discovery = match (&self.discovery_dir, &self.etcd) {
            (Some(dir), None) => {
                ensure!(dir.is_dir(), "--discovery-dir {} is not a directory", dir.display());
                Discovery::Dir(dir.clone())
            }
            (None, Some(endpoint)) => Discovery::Etcd(endpoint.clone()),
            _ => bail!("give exactly one of --discovery-dir DIR or --etcd URL"),
        };
        let verify = match &self.verify {
            None => None,
            Some(address) => Some((address.clone(), self.verify_options()?)),
        };
        let echo = serde_json::json!({
            "nats": self.nats, "discovery_dir": self.discovery_dir, "etcd": self.etcd,
            "namespace": self.namespace, "pools": self.pools,
            "workers_per_pool": self.workers_per_pool, "ranks": self.ranks, "rate": self.rate,
            "blocks_per_event": self.blocks_per_event, "chain_share": self.chain_share,
            "live_cap": self.live_cap, "duration_secs": self.duration_secs,
            "load_interval_ms": self.load_interval_ms, "max_lag_ms": self.max_lag_ms,
            "warmup_ms": self.warmup_ms, "seed": self.seed,
            "trace_removed_max": self.trace_removed_max,
        });
        Ok(RunConfig {
            nats: self.nats.clone(),
            discovery,
            namespace: self.namespace.clone(),
            shape: Shape {
                pools: self.pools,
                workers_per_pool: self.workers_per_pool,
                ranks: self.ranks,
                blocks_per_event: self.blocks_per_event,
                chain_share: self.chain_share,
                live_cap: self.live_cap,
                removed_keep_max: self.trace_removed_max,
            },
            rate: self.rate,
            duration: Duration::from_secs_f64(self.duration_secs),
            load_interval: Duration::from_millis(self.load_interval_ms),
            max_lag: Duration::from_millis(self.max_lag_ms),
            warmup: Duration::from_millis(self.warmup_ms),
            linger: Duration::from_secs(self.linger_secs),
            seed: self.seed,
            trace: self.trace.clone(),
            verify,
            echo,
        })
    }
}

async fn main_async(args: Args, config: Option<RunConfig>) -> Result<ExitCode> {
    let Some(config) = config else {
        let Some(address) = &args.verify else { bail!("--verify-only needs --verify RELAY_ADDR") };
        let options = args.verify_options()?;
        let verdict = if let Some(wait) = args.trace_wait_secs {
            let wait = Duration::from_secs(wait);
            loadgen::verify::verify_following(address, &args.trace, wait, options).await?
        } else {
            let trace = Trace::read(&args.trace)?;
            loadgen::verify::verify(address, &trace, options).await?
        };
        return Ok(ExitCode::from(loadgen::verify::report(&verdict)));
    };
    let outcome = loadgen::run(config).await?;
    Ok(ExitCode::from(outcome.verdict.as_ref().map_or(0, loadgen::verify::report_code)))
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Bad flags exit 2, as clap's own parse errors do.
    let config = if args.verify_only {
        if let Err(error) = args.verify_options() {
            eprintln!("loadgen: {error:#}");
            return ExitCode::from(2);
        }
        None
    } else {
        match args.run_config() {
            Ok(config) => Some(config),
            Err(error) => {
                eprintln!("loadgen: {error:#}");
                return ExitCode::from(2);
            }
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("loadgen: cannot start the runtime: {error}");
            return ExitCode::from(3);
        }
    };
    match runtime.block_on(main_async(args, config)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("loadgen: {error:#}");
            ExitCode::from(3)
        }
    }
}
