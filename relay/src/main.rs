//! The `kvrelay` binary: `serve` beside a real deployment, `demo` with an in-process simulated
//! DC, `watch` and `query` against any relay.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use futures::future::BoxFuture;
use kvrelay::config::{self, CliValues, EventPlane, RelayConfig};
use kvrelay::consumer::{self, ConsumerConfig, RelayConsumer, render};
use kvrelay::control::ControlConfig;
use kvrelay::demo::{Demo, DemoOptions};
use kvrelay::discovery::NamespaceSelection;
use kvrelay::discovery_plane::{self, DiscoverySink};
use kvrelay::event_plane::{self, EventPlaneCounters, NatsEventPlaneConfig, NatsNamespaces};
use kvrelay::identity::RelayIdentity;
use kvrelay::inputs::RecoveryTarget;
use kvrelay::node::{NodeConfig, RecoveryTransport, start_node};
use kvrelay::pool::ActorConfig;
use kvrelay::publication::HubConfig;
use kvrelay::request_plane::{RecoveryClient, RecoveryClientConfig};
use kvrelay::rng::{derive_seed, rng_from_seed};
use kvrelay::runtime::{BlockingExecutor, SystemWallClock, TokioBlockingExecutor, WallClock};
use kvrelay::sources::{RecoveryRequest, RecoveryResponse};
use kvrelay::wan::{RelayService, serve};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(name = "kvrelay", version, about = "Per-data-center KV relay (dynamo.kvrelay.v1)")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run beside a real deployment: discovery, event plane and recovery from the environment
    /// (DYN_DISCOVERY_BACKEND, DYN_FILE_KV, ETCD_ENDPOINTS, DYN_EVENT_PLANE, NATS_SERVER).
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
    /// Live-reloaded namespace source list (not supported yet).
    #[arg(long)]
    sources_file: Option<PathBuf>,
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
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        match cli.command {
            Command::Serve(args) => serve_command(args).await,
            Command::Demo(args) => demo_command(args).await,
            Command::Watch(args) => watch_command(args).await,
            Command::Query(args) => query_command(args).await,
        }
    })
}

/// Production seeds come from the OS once, here; everything else derives from them.
fn os_seed() -> u64 {
    use std::io::Read;
    let mut bytes = [0u8; 8];
    match std::fs::File::open("/dev/urandom").and_then(|mut random| random.read_exact(&mut bytes)) {
        Ok(()) => u64::from_le_bytes(bytes),
        Err(_) => fallback_seed(),
    }
}

#[allow(clippy::disallowed_methods, reason = "seed fallback when the OS offers no random device")]
fn fallback_seed() -> u64 {
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    (now.as_nanos() as u64) ^ u64::from(std::process::id()).rotate_left(32)
}

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

#[derive(Debug)]
struct TcpRecovery(Arc<RecoveryClient>);

impl RecoveryTransport for TcpRecovery {
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, String>> {
        let client = Arc::clone(&self.0);
        Box::pin(async move {
            client.query(&target, request, timeout).await.map_err(|error| error.to_string())
        })
    }
}

fn node_config(config: &RelayConfig, relay: RelayIdentity, seed: u64) -> NodeConfig {
    let mut control = ControlConfig::new(relay, config.dc_id, config.scope.clone());
    control.expected_unique_blocks = config.expected_unique_blocks;
    control.load_window_ms =
        std::num::NonZeroU64::new(config.wan.load_window.as_millis().max(1) as u64)
            .unwrap_or(std::num::NonZeroU64::MIN);
    NodeConfig {
        control,
        actor: ActorConfig {
            publication_threshold_events: config.producer.publication_threshold_events,
            publication_delay: config.producer.publication_delay,
            ..ActorConfig::default()
        },
        hub: HubConfig {
            subscriber_queue_frames: config.wan.publication_queue_frames,
            subscriber_queue_bytes: config.wan.publication_queue_bytes,
            subscribers_per_pool_max: config.wan.max_subscribers_per_pool,
            initialized_hubs_max: config.wan.max_initialized_pool_hubs,
            snapshot_progress_timeout: config.wan.snapshot_progress_timeout,
            ..HubConfig::default()
        },
        max_kicks: kvrelay::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(seed, "node"),
        load_window: config.wan.load_window,
        input_queue_capacity: 4096,
        load_fanout_capacity: config.wan.load_fanout_capacity,
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
    };
    let config = config::resolve(&cli, &environment).context("invalid configuration")?;
    if let Some(path) = &config.sources_file {
        bail!(
            "--sources-file {}: live-reloaded source lists are not supported yet; use --namespaces or --watch-all",
            path.display()
        );
    }
    let seed = os_seed();
    let mut rng = rng_from_seed(derive_seed(seed, "relay"));
    let relay = RelayIdentity::start(derive_seed(seed, "drt"), &mut rng);
    let executor: Arc<dyn BlockingExecutor> = Arc::new(TokioBlockingExecutor);
    let clock: Arc<dyn WallClock> = Arc::new(SystemWallClock);
    let recovery = RecoveryClient::bind(
        RecoveryClientConfig::from_env(derive_seed(seed, "recovery"))?,
        Arc::clone(&executor),
    )
    .await
    .context("binding the recovery response listener")?;
    let node = start_node(
        node_config(&config, relay, seed),
        Arc::clone(&executor),
        Arc::clone(&clock),
        Arc::new(TcpRecovery(Arc::new(recovery))),
    )?;
    tracing::info!(dc = %config.dc_name, dc_id = %config.dc_id, incarnation = relay.relay_incarnation, "relay started");
    let cancel = CancellationToken::new();
    let (channels_tx, channels_rx) = tokio::sync::mpsc::channel(1024);
    let backend = config.discovery.clone();
    let sink = DiscoverySink::new(node.inputs.clone()).with_channels(channels_tx);
    let discovery = tokio::spawn(discovery_plane::run_discovery(
        backend,
        config.scope.clone(),
        sink,
        Arc::clone(&clock),
        cancel.clone(),
    ));
    let counters = EventPlaneCounters::new();
    let events = match &config.event_plane {
        EventPlane::Nats { url } => {
            let namespaces = match config.scope.namespace_selection() {
                NamespaceSelection::All => NatsNamespaces::All,
                NamespaceSelection::Namespaces(names) => NatsNamespaces::Only(names.clone()),
            };
            let nats = NatsEventPlaneConfig::new(url.clone(), namespaces);
            tokio::spawn(event_plane::run_nats_event_plane(
                nats,
                node.inputs.clone(),
                counters.clone(),
                cancel.clone(),
            ))
        }
        EventPlane::Zmq => tokio::spawn(event_plane::run_zmq_event_plane(
            event_plane::ZmqEventPlaneConfig::default(),
            channels_rx,
            node.inputs.clone(),
            counters.clone(),
            cancel.clone(),
        )),
    };
    let service = RelayService::new(
        node.relay,
        node.views.clone(),
        Arc::clone(&node.publications),
        Arc::clone(&clock),
        config.wan,
    );
    match config.bind {
        Some(address) => {
            let listener = TcpListener::bind(address)
                .await
                .with_context(|| format!("binding --bind {address}"))?;
            tracing::info!(%address, "serving dynamo.kvrelay.v1");
            serve(service, TcpListenerStream::new(listener), &config.wan, shutdown_signal(None))
                .await?;
        }
        None => {
            tracing::info!("no --bind: local producer only");
            shutdown_signal(None).await;
        }
    }
    cancel.cancel();
    let _ = discovery.await;
    let _ = events.await;
    node.shutdown().await;
    Ok(())
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
    let service = RelayService::new(
        demo.node.relay,
        demo.node.views.clone(),
        Arc::clone(&demo.node.publications),
        clock,
        tuning,
    );
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    println!(
        "kvrelay demo: relay on {} (seed {}), simulated DC: tiny-llm (aggregated, 2 workers), pd-llm (prefill + decode), base-llm (LoRA adapter-a, adapter-b)",
        args.listen, args.seed
    );
    let stop = CancellationToken::new();
    let server_stop = stop.clone();
    let server = tokio::spawn(async move {
        serve(service, TcpListenerStream::new(listener), &tuning, server_stop.cancelled_owned())
            .await
    });
    let consumer = RelayConsumer::start(
        consumer::connect_lazy(&args.listen.to_string())?,
        ConsumerConfig::default(),
        &mut rng_from_seed(derive_seed(args.seed, "demo/consumer")),
    )?;
    let prompt = demo.dc.with(|dc| dc.traffic().prefixes()[0].clone());
    let deadline = shutdown_signal(args.duration_secs);
    tokio::pin!(deadline);
    let mut summaries = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            biased;
            () = &mut deadline => break,
            _ = summaries.tick() => {
                let snapshot = consumer.snapshot();
                println!("---");
                for line in render::snapshot_lines(&snapshot) {
                    println!("{line}");
                }
                for line in render::answer_lines("tiny-llm", &consumer.query(&prompt, "tiny-llm")) {
                    println!("{line}");
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
        consumer::connect_lazy(&args.relay)?,
        ConsumerConfig::default(),
        &mut rng_from_seed(os_seed()),
    )?;
    let mut changes = consumer.changes();
    let mut previous = consumer.snapshot();
    for line in render::snapshot_lines(&previous) {
        println!("{line}");
    }
    let deadline = shutdown_signal(args.duration_secs);
    tokio::pin!(deadline);
    loop {
        tokio::select! {
            biased;
            () = &mut deadline => break,
            changed = changes.changed() => {
                if changed.is_err() {
                    break;
                }
                let current = consumer.snapshot();
                for line in render::change_lines(Some(&previous), &current) {
                    println!("{line}");
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
        consumer::connect_lazy(&args.relay)?,
        ConsumerConfig::default(),
        &mut rng_from_seed(os_seed()),
    )?;
    tokio::time::sleep(Duration::from_secs(args.settle_secs)).await;
    for line in render::answer_lines(&args.model, &consumer.query(&args.tokens, &args.model)) {
        println!("{line}");
    }
    consumer.shutdown().await;
    Ok(())
}
