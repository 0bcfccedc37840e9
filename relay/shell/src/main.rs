//! The `kvrelay` binary: `serve` beside a real deployment, `demo` with an in-process simulated
//! DC, `watch` and `query` against any relay.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kvrelay::config::{self, CliValues};
use kvrelay::demo::{Demo, DemoOptions};
use kvrelay::runtime::os_seed;
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor, WallClock};
use kvrelay::screen::Screen;
use kvrelay::serve::ServeOptions;
use kvrelay::wan::serve;
use kvrelay_consumer::{ConsumerConfig, RelayConsumer, render, render_json, render_table};
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "kvrelay",
    version = kvrelay::build_info::VERSION_LINE,
    about = "Per-data-center KV relay (dynamo.kvrelay.v1)"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run beside a real deployment: discovery, event plane and recovery from the environment
    /// (DYN_DISCOVERY_BACKEND, DYN_FILE_KV, ETCD_ENDPOINTS, ETCD_AUTH_*, DYN_EVENT_PLANE,
    /// NATS_SERVER, NATS_AUTH_*, NATS_TLS_*).
    /// SIGTERM or Ctrl-C: gRPC health NOT_SERVING, every WAN stream ends with UNAVAILABLE,
    /// the pools are withdrawn, the journal syncs, and the process exits 0 within
    /// DYN_RELAY_SHUTDOWN_TIMEOUT_MS (default 10 s) whatever the clients do.
    Serve(ServeArgs),
    /// Run the relay on an in-process simulated DC and print what a WAN consumer sees.
    Demo(DemoArgs),
    /// Follow a relay's catalog, readiness, load and filters.
    Watch(RemoteArgs),
    /// Longest cached prefix per pool for a prompt.
    Query(QueryArgs),
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// The DC's stable name (DYN_DC_ID).
    #[arg(long)]
    dc_id: Option<String>,
    /// Watched namespaces, comma separated (DYN_RELAY_NAMESPACES).
    #[arg(long)]
    namespaces: Option<String>,
    /// Watch every namespace (DYN_RELAY_WATCH_ALL).
    #[arg(long)]
    watch_all: bool,
    /// Whole-segment endpoint prefix, repeatable (DYN_RELAY_ENDPOINT_PREFIXES).
    #[arg(long = "endpoint-prefix")]
    endpoint_prefixes: Vec<String>,
    /// Expected unique blocks per pool (DYN_RELAY_EXPECTED_UNIQUE_BLOCKS).
    #[arg(long)]
    expected_unique_blocks: Option<String>,
    /// WAN listener, numeric IP:port (DYN_RELAY_BIND).
    #[arg(long)]
    bind: Option<String>,
    /// Live-reloaded namespace source list: JSON `{"version":1,"connectionRevision"?:..,
    /// "sources":[{"namespace":..}]}`, read every second; an invalid update keeps the last good
    /// list. Excludes --namespaces and --watch-all; with DYN_RELAY_CONNECTION_REVISION set, the
    /// file's connectionRevision must equal it.
    #[arg(long)]
    sources_file: Option<PathBuf>,
    /// Operations HTTP listener (/metrics, /health, /live, /ready, /engine/state), numeric
    /// IP:port or `off` (DYN_RELAY_OPS_BIND; default 127.0.0.1:9090, loopback only).
    #[arg(long)]
    ops_bind: Option<String>,
    /// Journal every input into a fresh subdirectory of DIR for replay with `kvrelay-sim
    /// replay` (DYN_RELAY_RECORD_DIR). A recording that cannot start or write never stops
    /// serving; its losses are counted in /metrics.
    #[arg(long, value_name = "DIR")]
    record: Option<PathBuf>,
    /// Bound on the recording's total size in bytes, at least 1 MiB
    /// (DYN_RELAY_RECORD_MAX_BYTES; default 1 GiB).
    #[arg(long, value_name = "N")]
    record_max_bytes: Option<String>,
    /// Close a journal segment once it spans this many seconds
    /// (DYN_RELAY_RECORD_MAX_AGE_SECS; default 3600).
    #[arg(long, value_name = "SECS")]
    record_max_age: Option<String>,
    /// Legacy single-namespace discovery filter; the same as --namespaces with one value.
    #[arg(long)]
    namespace_filter: Option<String>,
    /// Print the resolved configuration as JSON and exit 0, or name the bad setting and exit 2;
    /// nothing is started.
    #[arg(long)]
    check_config: bool,
    #[command(flatten)]
    tls: ServeTlsArgs,
}

/// TLS on the WAN listener (plaintext without these); the files are re-read every 5 s and a
/// changed certificate is served to new connections.
#[derive(Debug, clap::Args)]
struct ServeTlsArgs {
    /// PEM certificate chain of the WAN listener; with --tls-key turns TLS on
    /// (DYN_RELAY_TLS_CERT).
    #[arg(long, value_name = "PEM")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert (DYN_RELAY_TLS_KEY).
    #[arg(long, value_name = "PEM")]
    tls_key: Option<PathBuf>,
    /// PEM roots client certificates must chain to: requires a client certificate of every
    /// consumer (mTLS) (DYN_RELAY_TLS_CLIENT_CA).
    #[arg(long, value_name = "PEM")]
    tls_client_ca: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct DemoArgs {
    /// WAN listener.
    #[arg(long, default_value = "127.0.0.1:5561")]
    listen: SocketAddr,
    /// The seed everything derives from.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Stop after this many seconds (default: run until Ctrl-C).
    #[arg(long)]
    duration_secs: Option<u64>,
    /// Requests served per 50 ms tick.
    #[arg(long, default_value_t = 8)]
    requests_per_tick: usize,
}

#[derive(Debug, clap::Args)]
struct RemoteArgs {
    /// The relay's address (host:port).
    #[arg(long, default_value = "127.0.0.1:5561")]
    relay: String,
    /// Stop after this many seconds.
    #[arg(long)]
    duration_secs: Option<u64>,
    /// Print the relay's state as JSON, one object per line: the whole consumer snapshot
    /// (`"type":"snapshot"`) at start and after every visible change.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    tls: kvrelay_consumer::ClientTlsArgs,
}

#[derive(Debug, clap::Args)]
struct QueryArgs {
    /// The relay's address (host:port).
    #[arg(long, default_value = "127.0.0.1:5561")]
    relay: String,
    /// Request-facing model name (canonical id, alias or LoRA served name).
    #[arg(long)]
    model: String,
    /// Prompt token ids, comma separated.
    #[arg(long, value_delimiter = ',')]
    tokens: Vec<u32>,
    /// How long to let the replicas converge first.
    #[arg(long, default_value_t = 3)]
    settle_secs: u64,
    /// Print the answers as one JSON object (`"type":"query"`) on one line.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    tls: kvrelay_consumer::ClientTlsArgs,
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("kvrelay: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    // Before any thread starts or any large block is freed (see kvrelay_allocator).
    let threshold = kvrelay_allocator::pin_mmap_threshold(
        std::env::var_os(kvrelay_allocator::THRESHOLD_ENV).is_some(),
    );
    kvrelay::logging::init();
    tracing::debug!(?threshold, "malloc mmap threshold");
    let cli = Cli::parse();
    let runtime = runtime_builder(|name| std::env::var(name).ok())?.enable_all().build()?;
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve_command(args).await,
            Command::Demo(args) => demo_command(args).await,
            Command::Watch(args) => watch_command(args).await,
            Command::Query(args) => query_command(args).await,
        }
    });
    // A blocking read stuck on a hung mount must not hold the exit: tasks left after the
    // bounded shutdown get this long, then the process exits regardless.
    runtime.shutdown_timeout(RUNTIME_EXIT_GRACE);
    result
}

/// The async runtime's worker threads when neither `DYN_RELAY_WORKER_THREADS` nor tokio's own
/// `TOKIO_WORKER_THREADS` is set. The relay's hot path is a pipeline of tasks (event plane,
/// node with its pools, publication, streams) handing each event on; on one thread a hand-off is a
/// queue push, on several it often wakes a parked thread. Measured with `scripts/ingest-cpu.sh`
/// (README, "Ingest cost"): about a quarter less CPU per event at 5,000 events/s. Snapshot
/// encoding and filter allocation run on the blocking pool either way.
const WORKER_THREADS_DEFAULT: usize = 1;

/// Most worker threads `DYN_RELAY_WORKER_THREADS` accepts.
const WORKER_THREADS_MAX: usize = 1024;

/// A multi-thread runtime builder with the worker count of the environment (`lookup` reads a
/// variable): `DYN_RELAY_WORKER_THREADS` (1 to 1,024), else `TOKIO_WORKER_THREADS` as tokio
/// reads it, else [`WORKER_THREADS_DEFAULT`].
fn runtime_builder(lookup: impl Fn(&str) -> Option<String>) -> Result<tokio::runtime::Builder> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    match lookup("DYN_RELAY_WORKER_THREADS") {
        Some(text) => {
            let threads = text
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|threads| (1..=WORKER_THREADS_MAX).contains(threads))
                .with_context(|| {
                    format!("DYN_RELAY_WORKER_THREADS={text:?}: expected 1 to {WORKER_THREADS_MAX}")
                })?;
            builder.worker_threads(threads);
        }
        None if lookup("TOKIO_WORKER_THREADS").is_some() => {}
        None => {
            builder.worker_threads(WORKER_THREADS_DEFAULT);
        }
    }
    Ok(builder)
}

/// How long tasks left behind by the shutdown may run before the process exits.
const RUNTIME_EXIT_GRACE: Duration = Duration::from_millis(500);

async fn shutdown_signal(limit: Option<u64>) {
    match limit {
        Some(seconds) => {
            tokio::select! {
                biased;
                _ = tokio::signal::ctrl_c() => {}
                () = tokio::time::sleep(Duration::from_secs(seconds)) => {}
            }
        }
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

async fn serve_command(args: ServeArgs) -> Result<()> {
    let environment: BTreeMap<String, String> = std::env::vars().collect();
    let cli = CliValues {
        dc_id: args.dc_id,
        namespaces: args.namespaces,
        watch_all: args.watch_all,
        endpoint_prefixes: args.endpoint_prefixes,
        expected_unique_blocks: args.expected_unique_blocks,
        bind: args.bind,
        sources_file: args.sources_file,
        ops_bind: args.ops_bind,
        record: args.record,
        record_max_bytes: args.record_max_bytes,
        record_max_age: args.record_max_age,
        namespace_filter: args.namespace_filter,
        wan_tls: kvrelay::wan::WanTlsValues {
            cert: args.tls.tls_cert,
            key: args.tls.tls_key,
            client_ca: args.tls.tls_client_ca,
        },
    };
    if args.check_config {
        return check_config(&cli, &environment);
    }
    let config = config::resolve(&cli, &environment).context("invalid configuration")?;
    let options = ServeOptions {
        seed: os_seed(),
        executor: Arc::new(TokioBlockingExecutor),
        clock: Arc::new(SystemWallClock),
    };
    let running = kvrelay::serve::start(config, options).await?;
    let stop = running.stop_token();
    tokio::select! {
        biased;
        () = termination_signal() => {}
        () = stop.cancelled() => {}
    }
    running.shutdown().await?;
    Ok(())
}

/// The exit status of `serve --check-config` for a configuration that does not resolve.
const EXIT_BAD_CONFIG: u8 = 2;

/// `serve --check-config`: the resolved configuration as JSON on stdout, or the bad setting on
/// stderr and exit status [`EXIT_BAD_CONFIG`].
fn check_config(cli: &CliValues, environment: &BTreeMap<String, String>) -> Result<()> {
    match config::resolve(cli, environment) {
        Ok(config) => {
            println!("{}", serde_json::to_string_pretty(&config::describe(&config))?);
            Ok(())
        }
        Err(error) => {
            eprintln!("kvrelay: invalid configuration: {error}");
            std::process::exit(i32::from(EXIT_BAD_CONFIG));
        }
    }
}

/// SIGTERM or Ctrl-C (SIGINT).
async fn termination_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut terminate) = signal(SignalKind::terminate()) {
            tokio::select! {
                biased;
                _ = terminate.recv() => tracing::info!("SIGTERM received"),
                _ = tokio::signal::ctrl_c() => tracing::info!("Ctrl-C received"),
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}

async fn demo_command(args: DemoArgs) -> Result<()> {
    let options = DemoOptions {
        seed: args.seed,
        requests_per_tick: args.requests_per_tick,
        ..DemoOptions::default()
    };
    let clock: Arc<dyn WallClock> = Arc::new(SystemWallClock);
    let demo = Demo::start(options, Arc::new(TokioBlockingExecutor), Arc::clone(&clock))?;
    let tuning = config::WanTuning::default();
    let service = demo.node.relay_service(clock, tuning);
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    println!(
        "kvrelay demo: relay on {} (seed {}), simulated DC: tiny-llm (aggregated, 2 workers), pd-llm (prefill + decode), base-llm (LoRA adapter-a, adapter-b)",
        args.listen, args.seed
    );
    let stop = CancellationToken::new();
    let server_stop = stop.clone();
    let server = kvrelay::runtime::spawn(async move {
        serve(service, TcpListenerStream::new(listener), &tuning, server_stop.cancelled_owned())
            .await
    });
    let consumer = RelayConsumer::start(
        kvrelay_consumer::connect_lazy(&args.listen.to_string())?,
        ConsumerConfig::default(),
        &mut rng_from_seed(derive_seed(args.seed, "demo/consumer")),
    )?;
    let prompt = demo.dc.with(|dc| dc.traffic().prefixes()[0].clone());
    let deadline = shutdown_signal(args.duration_secs);
    tokio::pin!(deadline);
    let mut summaries = tokio::time::interval(Duration::from_secs(2));
    let mut screen = Screen::new(true);
    loop {
        tokio::select! {
            biased;
            () = &mut deadline => break,
            _ = summaries.tick() => {
                let snapshot = consumer.snapshot();
                let mut lines = if screen.redraws() {
                    render_table::table_lines(&snapshot)
                } else {
                    let mut lines = vec!["---".to_owned()];
                    lines.extend(render::snapshot_lines(&snapshot));
                    lines
                };
                lines.extend(render::answer_lines("tiny-llm", &consumer.query(&prompt, "tiny-llm")));
                if !screen.frame(&lines)? {
                    break;
                }
            }
        }
    }
    consumer.shutdown().await;
    stop.cancel();
    let _ = server.await;
    demo.stop().await;
    Ok(())
}

async fn watch_command(args: RemoteArgs) -> Result<()> {
    let consumer = RelayConsumer::start(
        args.tls.connect_lazy(&args.relay)?,
        ConsumerConfig::default(),
        &mut rng_from_seed(os_seed()),
    )?;
    let mut changes = consumer.changes();
    let mut previous = consumer.snapshot();
    let mut previous_json = render_json::snapshot_json(&previous);
    // JSON lines are for programs: never redrawn, even on a terminal.
    let mut screen = Screen::new(!args.json);
    let mut reading = if args.json {
        screen.lines(&[previous_json.to_string()])?
    } else if screen.redraws() {
        screen.frame(&render_table::table_lines(&previous))?
    } else {
        screen.lines(&render::snapshot_lines(&previous))?
    };
    let deadline = shutdown_signal(args.duration_secs);
    tokio::pin!(deadline);
    while reading {
        tokio::select! {
            biased;
            () = &mut deadline => break,
            changed = changes.changed() => {
                if changed.is_err() {
                    break;
                }
                let current = consumer.snapshot();
                if args.json {
                    let current_json = render_json::snapshot_json(&current);
                    if current_json != previous_json {
                        reading = screen.lines(&[current_json.to_string()])?;
                        previous_json = current_json;
                    }
                } else if screen.redraws() {
                    reading = screen.frame(&render_table::table_lines(&current))?;
                } else {
                    reading = screen.lines(&render::change_lines(Some(&previous), &current))?;
                }
                previous = current;
            }
        }
        if let Some(halt) = consumer.halted() {
            bail!("consumer halted: {halt:?}");
        }
    }
    consumer.shutdown().await;
    Ok(())
}

async fn query_command(args: QueryArgs) -> Result<()> {
    if args.tokens.is_empty() {
        bail!("--tokens: give the prompt's token ids, comma separated");
    }
    let consumer = RelayConsumer::start(
        args.tls.connect_lazy(&args.relay)?,
        ConsumerConfig::default(),
        &mut rng_from_seed(os_seed()),
    )?;
    tokio::time::sleep(Duration::from_secs(args.settle_secs)).await;
    let answers = consumer.query(&args.tokens, &args.model);
    let lines = if args.json {
        vec![render_json::answers_json(&args.model, &answers).to_string()]
    } else {
        render::answer_lines(&args.model, &answers)
    };
    Screen::new(false).lines(&lines)?;
    consumer.shutdown().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers(vars: &[(&str, &str)]) -> Result<usize> {
        let vars: BTreeMap<&str, &str> = vars.iter().copied().collect();
        let runtime =
            runtime_builder(|name| vars.get(name).map(|&value| value.to_owned()))?.build()?;
        Ok(runtime.metrics().num_workers())
    }

    #[test]
    fn worker_threads_come_from_the_environment_with_one_by_default() {
        assert_eq!(workers(&[]).unwrap(), WORKER_THREADS_DEFAULT);
        assert_eq!(workers(&[("DYN_RELAY_WORKER_THREADS", " 3 ")]).unwrap(), 3);
        let both = [("DYN_RELAY_WORKER_THREADS", "3"), ("TOKIO_WORKER_THREADS", "2")];
        assert_eq!(workers(&both).unwrap(), 3);
        // TOKIO_WORKER_THREADS alone leaves the count to tokio, which reads the process's own
        // environment (where this test did not set it: tokio's default, one per CPU).
        if std::env::var_os("TOKIO_WORKER_THREADS").is_none() {
            let cpus = std::thread::available_parallelism().map_or(1, usize::from);
            assert_eq!(workers(&[("TOKIO_WORKER_THREADS", "5")]).unwrap(), cpus);
        }
        for bad in ["0", "1025", "two", ""] {
            let error = workers(&[("DYN_RELAY_WORKER_THREADS", bad)]).unwrap_err().to_string();
            assert!(error.contains("DYN_RELAY_WORKER_THREADS") && error.contains("1 to 1024"));
        }
    }
}
