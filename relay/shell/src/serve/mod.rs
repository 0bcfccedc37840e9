//! `kvrelay serve`: the production wiring, shared by the binary and the real-server tests.
//!
//! [`start`] builds, in order: the recovery client (TCP request plane), the node, the input
//! planes ([`start_input_planes`]: discovery, event plane, and the `--sources-file` poller), the
//! WAN listener (whose gRPC health is SERVING exactly while `/ready` holds) and the operations
//! listener. [`RunningRelay::shutdown`] stops them in this order:
//!
//! 1. mark the relay as shutting down (`/health` and `/ready` answer 503 and gRPC health
//!    NOT_SERVING from then on; open health `Watch` streams send NOT_SERVING and end, and get
//!    up to 500 ms to do so before anything else changes);
//! 2. cancel the input planes and wait for them, so no fact is half-delivered;
//! 3. shut the node down: pools are withdrawn from the catalog (catalog streams receive the
//!    withdrawal) and every pool stops after its last complete publication (nothing
//!    half-published; pool streams end with UNAVAILABLE);
//! 4. stop the WAN listener: every open stream ends with UNAVAILABLE and the connections drain (those still open after the drain
//!    timeout are closed);
//! 5. with `--record`, finish the journal (queued records written, a final gap for losses,
//!    fsync);
//! 6. stop the operations listener.
//!
//! The whole sequence is bounded by `DYN_RELAY_SHUTDOWN_TIMEOUT_MS` (default 10 s): step 2
//! gives up (logged) after a fifth of the bound (a hung discovery read), step 3 after another
//! fifth; the WAN listener closes connections still open after its drain timeout (capped at
//! half the bound) and is abandoned at nine tenths; the journal has until the bound. A step
//! that gives up leaves its tasks behind for the process exit to end.
//!
//! With `--record`, a [`journal::Recorder`] taps the node (every input and recovery answer,
//! periodic checkpoints) into a fresh subdirectory of the record root; a recorder that cannot
//! start is logged and the relay serves without recording.
//!
//! The input planes take the node's input boundary (an `InputSender`) as a parameter,
//! so a recorder can put its own channel in between.

pub mod sources_file;
mod sources_poller;

use crate::node::InputSender;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{EventPlane, RecordSettings, RelayConfig};
use crate::discovery_plane::{self, DiscoverySink, DiscoveryStats, NamespaceLimit};
use crate::event_plane::{self, EventPlaneCounters, NatsEventPlaneConfig, NatsNamespaces};
use crate::journal::{self, NodeTap, Recorder, RecorderProbe};
use crate::node::{NodeConfig, NodeHandle, RecoveryTransport, start_node_with_tap};
use crate::ops::{
    self, OpsSnapshot, RecordingSnapshot, SourcesSnapshot, TopologyCounts, WanSnapshot,
};
use crate::pool::{PoolConfig, PoolTotals};
use crate::publication::{HubConfig, PoolPublications};
use crate::request_plane::{RecoveryClient, RecoveryClientConfig, RecoveryError};
use crate::runtime::{BlockingExecutor, WallClock};
use crate::wan::{RelayService, ServeError as WanServeError};
use kvrelay_core::control::{ControlConfig, ControlError};
use kvrelay_core::discovery::NamespaceSelection;
use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::model::identity::RelayIdentity;
use kvrelay_core::rng::{derive_seed, rng_from_seed};
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};

pub use sources_file::{SourceList, SourcesFileError, SourcesReport, SourcesState};
pub use sources_poller::{SourcesPollerConfig, read_sources_file, run_sources_poller};

/// Why `serve` could not start or stopped with an error. The cause is the error's `source()`
/// (printed by `{:#}` of anyhow, as the binary does).
#[derive(Debug, Error)]
pub enum ServeError {
    /// The sources file is unusable at start-up.
    #[error("--sources-file {path}")]
    SourcesFile {
        /// The file.
        path: String,
        /// Why it was refused.
        #[source]
        error: SourcesFileError,
    },
    /// The recovery client could not start.
    #[error("recovery request plane")]
    Recovery(#[from] RecoveryError),
    /// The node refused its configuration.
    #[error("relay node")]
    Node(#[from] ControlError),
    /// A listener could not be bound.
    #[error("binding {setting} {address}")]
    Bind {
        /// The flag.
        setting: &'static str,
        /// The address.
        address: SocketAddr,
        /// The I/O error.
        #[source]
        error: std::io::Error,
    },
    /// The WAN listener failed.
    #[error("WAN listener")]
    Wan(#[from] WanServeError),
    /// The WAN listener's TLS configuration cannot be built.
    #[error("WAN TLS")]
    WanTls(#[from] crate::wan::WanTlsError),
}

/// What `serve` needs besides its configuration.
#[derive(Clone)]
pub struct ServeOptions {
    /// The seed everything random derives from.
    pub seed: u64,
    /// Blocking work.
    pub executor: Arc<dyn BlockingExecutor>,
    /// Wall time (file-discovery expiry, timestamps).
    pub clock: Arc<dyn WallClock>,
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("ServeOptions").field("seed", &self.seed).finish_non_exhaustive()
    }
}

/// The recovery transport of a production relay: Dynamo's TCP request plane.
#[derive(Debug)]
struct TcpRecovery(Arc<RecoveryClient>);

impl RecoveryTransport for TcpRecovery {
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>> {
        let client = Arc::clone(&self.0);
        Box::pin(async move { Ok(client.query(&target, request, timeout).await?) })
    }
}

/// The node configuration `serve` runs with.
#[must_use]
pub fn node_config(config: &RelayConfig, relay: RelayIdentity, seed: u64) -> NodeConfig {
    let mut control = ControlConfig::new(relay, config.dc_id, config.scope.clone());
    control.expected_unique_blocks = config.expected_unique_blocks;
    control.pool_filter_bytes_max = config.pool_filter_bytes_max;
    control.load_window_ms =
        std::num::NonZeroU64::new(config.wan.load_window.as_millis().max(1) as u64)
            .unwrap_or(std::num::NonZeroU64::MIN);
    NodeConfig {
        control,
        pool: PoolConfig {
            publication_threshold_events: config.producer.publication_threshold_events,
            publication_delay: config.producer.publication_delay,
            exact_state_bytes_max: Some(config.memory.pool_exact_state_bytes_max),
            precise_timer: config.producer.precise_publication_timer,
            ..PoolConfig::default()
        },
        hub: HubConfig::from_tuning(&config.wan),
        max_kicks: kvrelay_core::filter::ckf::MAX_KICKS_DEFAULT,
        rng_seed: derive_seed(seed, "node"),
        load_window: config.wan.load_window,
        input_queue_capacity: 4096,
        load_fanout_capacity: config.wan.load_fanout_capacity,
        input_queue_bytes_max: config.memory.input_queue_bytes_max,
    }
}

/// A validated sources file read at start-up, ready to be followed.
#[derive(Debug, Clone)]
pub struct SourcesSetup {
    /// Where and how to poll.
    pub poller: SourcesPollerConfig,
    /// The state after the first read.
    pub state: SourcesState,
}

/// Read the sources file of `config` once, if it has one; refuse an unusable file. A file that
/// does not exist yet is not refused: the relay starts with an explicitly empty selection and
/// the poller applies the file when it appears.
pub async fn read_initial_sources(
    config: &RelayConfig,
) -> Result<Option<SourcesSetup>, ServeError> {
    let Some(path) = &config.sources_file else {
        return Ok(None);
    };
    let poller = SourcesPollerConfig::new(path.clone(), config.connection_revision.clone());
    let mut state = SourcesState::new();
    match read_sources_file(&poller).await {
        Ok(list) => {
            let _ = state.apply(Ok(list));
        }
        Err(SourcesFileError::Missing) => {
            warn!(path = %path.display(), "sources file does not exist yet; watching no namespace until it appears");
            let _ = state.apply(Err(SourcesFileError::Missing));
        }
        Err(error) => {
            return Err(ServeError::SourcesFile { path: path.display().to_string(), error });
        }
    }
    Ok(Some(SourcesSetup { poller, state }))
}

/// The running input planes and their counters.
#[derive(Debug)]
pub struct InputPlanes {
    /// The discovery transport's counters, after every step.
    pub discovery: watch::Receiver<DiscoveryStats>,
    /// The event plane's counters.
    pub events: EventPlaneCounters,
    /// The sources file state, in file mode.
    pub sources: Option<watch::Receiver<SourcesState>>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl InputPlanes {
    /// Stop every plane and wait for it: no fact is sent after this returns.
    pub async fn stop(self) {
        self.cancel.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Start discovery, the event plane and (with `sources`) the sources-file poller, all sending
/// facts to `inputs` — the node's input boundary, or a recorder in front of it.
#[must_use]
pub fn start_input_planes(
    config: &RelayConfig,
    inputs: InputSender,
    clock: Arc<dyn WallClock>,
    sources: Option<SourcesSetup>,
) -> InputPlanes {
    let cancel = CancellationToken::new();
    let mut tasks = Vec::new();
    let (stats_tx, stats_rx) = watch::channel(DiscoveryStats::default());
    let (channels_tx, channels_rx) = mpsc::channel(1024);
    let mut sink = DiscoverySink::new(inputs.clone()).with_stats(stats_tx);
    // Only the ZMQ plane follows advertised event channels; with NATS nobody reads them, and a
    // sink whose channel receiver is gone would end discovery at the first advertisement.
    if config.event_plane == EventPlane::Zmq {
        sink = sink.with_channels(channels_tx);
    }
    let mut sources_report = None;
    if let Some(setup) = sources {
        let initial: NamespaceLimit = setup.state.applied().map(|list| list.namespaces.clone());
        let (limit_tx, limit_rx) = watch::channel(initial.or_else(|| Some(Default::default())));
        let (report_tx, report_rx) = watch::channel(setup.state.clone());
        sink = sink.with_namespace_limit(limit_rx);
        sources_report = Some(report_rx);
        tasks.push(crate::runtime::spawn(run_sources_poller(
            setup.poller,
            setup.state,
            limit_tx,
            report_tx,
            cancel.clone(),
        )));
    }
    let discovery = discovery_plane::run_discovery(
        config.discovery.clone(),
        config.scope.clone(),
        sink,
        clock,
        cancel.clone(),
    );
    tasks.push(crate::runtime::spawn(async move {
        if let Err(error) = discovery.await {
            warn!(%error, "discovery transport ended");
        }
    }));
    let events = EventPlaneCounters::new();
    let event_task = match &config.event_plane {
        EventPlane::Nats { url, security } => {
            let namespaces = match config.scope.namespace_selection() {
                NamespaceSelection::All => NatsNamespaces::All,
                NamespaceSelection::Namespaces(names) => NatsNamespaces::Only(names.clone()),
            };
            let plane = event_plane::run_nats_event_plane(
                NatsEventPlaneConfig {
                    security: security.clone(),
                    subscription_bytes_max: config.memory.nats_backlog_bytes_max,
                    ..NatsEventPlaneConfig::new(url.clone(), namespaces)
                },
                inputs,
                events.clone(),
                cancel.clone(),
            );
            crate::runtime::spawn(async move {
                if let Err(error) = plane.await {
                    warn!(%error, "NATS event plane ended");
                }
            })
        }
        EventPlane::Zmq => {
            let plane = event_plane::run_zmq_event_plane(
                event_plane::ZmqEventPlaneConfig::default(),
                channels_rx,
                inputs,
                events.clone(),
                cancel.clone(),
            );
            crate::runtime::spawn(async move {
                if let Err(error) = plane.await {
                    warn!(%error, "ZMQ event plane ended");
                }
            })
        }
    };
    tasks.push(event_task);
    InputPlanes { discovery: stats_rx, events, sources: sources_report, cancel, tasks }
}

/// The WAN listener's state, as `/health` reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct WanState {
    serving: bool,
    last_error: Option<String>,
}

/// A started relay.
#[derive(Debug)]
pub struct RunningRelay {
    /// This start's identity.
    pub relay: RelayIdentity,
    /// The WAN listener's bound address (`--bind`).
    pub wan_address: Option<SocketAddr>,
    /// The operations listener's bound address (`--ops-bind`).
    pub ops_address: Option<SocketAddr>,
    stop: CancellationToken,
    task: JoinHandle<Result<(), ServeError>>,
}

impl RunningRelay {
    /// Shut down in the documented order and wait for it.
    pub async fn shutdown(self) -> Result<(), ServeError> {
        self.stop.cancel();
        self.join().await
    }

    /// Wait until the relay stops: after [`RunningRelay::shutdown`], or by itself when the WAN
    /// listener fails.
    pub async fn join(self) -> Result<(), ServeError> {
        match self.task.await {
            Ok(result) => result,
            Err(error) => {
                warn!(%error, "serve task ended abnormally");
                Ok(())
            }
        }
    }

    /// A token that starts the shutdown when cancelled.
    #[must_use]
    pub fn stop_token(&self) -> CancellationToken {
        self.stop.clone()
    }
}

/// Start `serve` with a validated configuration.
pub async fn start(config: RelayConfig, options: ServeOptions) -> Result<RunningRelay, ServeError> {
    let sources = read_initial_sources(&config).await?;
    let seed = options.seed;
    let mut rng = rng_from_seed(derive_seed(seed, "relay"));
    let relay = RelayIdentity::start(derive_seed(seed, "drt"), &mut rng);
    let mut recovery_config = RecoveryClientConfig::from_env(derive_seed(seed, "recovery"))?;
    recovery_config.response_bytes_max = config.memory.recovery_response_bytes_max;
    recovery_config.answers_bytes_max = config.memory.recovery_answers_bytes_max;
    let recovery =
        Arc::new(RecoveryClient::bind(recovery_config, Arc::clone(&options.executor)).await?);
    let wan_tls = config.wan_tls.clone().map(crate::wan::WanTls::load).transpose()?;
    let wan_listener = match config.bind {
        Some(address) => Some(bind("--bind", address).await?),
        None => None,
    };
    let ops_listener = match config.ops_bind {
        Some(address) => Some(bind("--ops-bind", address).await?),
        None => None,
    };
    let wan_address = wan_listener.as_ref().and_then(|listener| listener.local_addr().ok());
    let ops_address = ops_listener.as_ref().and_then(|listener| listener.local_addr().ok());
    let node_config = node_config(&config, relay, seed);
    let transport: Arc<dyn RecoveryTransport> = Arc::new(TcpRecovery(Arc::clone(&recovery)));
    let (transport, tap, recorder) = match &config.record {
        Some(settings) => start_recording(
            settings,
            config.memory.journal_queue_bytes_max,
            &node_config,
            &options,
            transport,
        ),
        None => (transport, None, None),
    };
    let recording = config.record.as_ref().map(|_| recorder.as_ref().map(Recorder::probe));
    let node = start_node_with_tap(
        node_config,
        Arc::clone(&options.executor),
        Arc::clone(&options.clock),
        transport,
        tap,
    )?;
    info!(dc = %config.dc_name, dc_id = %config.dc_id, incarnation = relay.relay_incarnation,
        wan = ?wan_address, ops = ?ops_address, "relay started");
    let planes =
        start_input_planes(&config, node.inputs.clone(), Arc::clone(&options.clock), sources);
    // The WAN drain fits in the shutdown bound: at most half of it.
    let mut wan_tuning = config.wan;
    wan_tuning.limits.drain_timeout =
        wan_tuning.limits.drain_timeout.min(config.shutdown_timeout / 2);
    let service = node.relay_service(Arc::clone(&options.clock), wan_tuning);
    let (shutting_down_tx, shutting_down) = watch::channel(false);
    let (wan_state_tx, wan_state) = watch::channel(WanState::default());
    let stop = CancellationToken::new();
    let wan_stop = CancellationToken::new();
    let ops_stop = CancellationToken::new();
    let (pool_totals_tx, pool_totals) = watch::channel(PoolTotals::default());
    if ops_listener.is_some() {
        let publications = Arc::clone(&node.publications);
        crate::runtime::spawn(poll_pool_totals(publications, pool_totals_tx, ops_stop.clone()));
    }
    let source = snapshot_source(SnapshotInputs {
        node: &node,
        pool_totals,
        service: service.clone(),
        wan_address,
        wan_state,
        shutting_down,
        planes: &planes,
        recovery,
        event_plane: match config.event_plane {
            EventPlane::Nats { .. } => "nats",
            EventPlane::Zmq => "zmq",
        },
        connection_revision: config.connection_revision.clone(),
        recording,
        pod_uid: config.pod_uid.clone(),
        wan_tls: wan_tls.clone(),
    });
    // gRPC health tells what `/ready` tells: SERVING only while the relay is ready.
    let ready: crate::wan::ReadinessProbe = {
        let source = Arc::clone(&source);
        Arc::new(move || ops::readiness(&source()).ready)
    };
    let health = crate::wan::HealthService::new(ready);
    let wan_task = wan_listener.map(|listener| {
        let service = service.clone();
        let tuning = wan_tuning;
        let health = health.clone();
        let wan_stop = wan_stop.clone();
        wan_state_tx.send_replace(WanState { serving: true, last_error: None });
        let state = wan_state_tx.clone();
        crate::runtime::spawn(async move {
            let result = match wan_tls {
                None => {
                    crate::wan::serve_with_health(
                        service,
                        TcpListenerStream::new(listener),
                        &tuning,
                        health,
                        wan_stop.cancelled_owned(),
                    )
                    .await
                }
                Some(tls) => {
                    let incoming = crate::wan::tls_incoming(listener, tls, wan_stop.clone());
                    let shutdown = wan_stop.cancelled_owned();
                    crate::wan::serve_with_health(service, incoming, &tuning, health, shutdown)
                        .await
                }
            };
            state.send_replace(WanState {
                serving: false,
                last_error: result.as_ref().err().map(ToString::to_string),
            });
            result
        })
    });
    let ops_task = ops_listener.map(|listener| {
        let ops_stop = ops_stop.clone();
        crate::runtime::spawn(async move {
            if let Err(error) = ops::serve_ops(listener, source, ops_stop.cancelled_owned()).await {
                warn!(%error, "operations listener ended");
            }
        })
    });
    let task_stop = stop.clone();
    let shutdown_timeout = config.shutdown_timeout;
    let watched = service.clone();
    let task = crate::runtime::spawn(async move {
        let mut wan_task = wan_task;
        let wan_result = match &mut wan_task {
            Some(handle) => {
                tokio::select! {
                    biased;
                    () = task_stop.cancelled() => None,
                    ended = handle => Some(ended),
                }
            }
            None => {
                task_stop.cancelled().await;
                None
            }
        };
        info!("relay shutting down");
        let bound = shutdown_timeout;
        let started = tokio::time::Instant::now();
        let deadline = started + bound;
        // Each step has its share of the bound; the journal's sync keeps the rest.
        let planes_until = started + bound / 5;
        let node_until = planes_until + bound / 5;
        let wan_until = deadline - bound / 10;
        // 1. Health NOT_SERVING: /ready reads this flag; gRPC health answers NOT_SERVING and
        // its open Watch streams say so and end.
        shutting_down_tx.send_replace(true);
        health.begin_shutdown();
        // Let the watchers hear it before anything else changes (bounded: a watcher that
        // reads nothing is not waited for).
        let settle = tokio::time::Instant::now() + HEALTH_WATCH_SETTLE.min(bound / 10);
        while watched.stats().listener.health_watch_open > 0 && tokio::time::Instant::now() < settle
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task_stop.cancel();
        // 2. No new facts.
        if tokio::time::timeout_at(planes_until, planes.stop()).await.is_err() {
            warn!(
                "input planes did not stop within the shutdown bound (a hung discovery read?); abandoned"
            );
        }
        // 3. Pools withdrawn from the catalog, pools stopped (pool streams end UNAVAILABLE).
        if tokio::time::timeout_at(node_until, node.shutdown()).await.is_err() {
            warn!("pools did not stop within the shutdown bound; abandoned");
        }
        // 4. Every remaining stream ends UNAVAILABLE; connections drain or are closed.
        wan_stop.cancel();
        let wan_result = match (wan_result, wan_task) {
            (Some(ended), _) => Some(ended),
            (None, Some(mut handle)) => {
                match tokio::time::timeout_at(wan_until, &mut handle).await {
                    Ok(ended) => Some(ended),
                    Err(_) => {
                        warn!("WAN listener did not stop within the shutdown bound; abandoned");
                        handle.abort();
                        None
                    }
                }
            }
            (None, None) => None,
        };
        if let Some(recorder) = recorder {
            match tokio::time::timeout_at(deadline, recorder.finish()).await {
                Ok(stats) => info!(?stats, "journal closed"),
                Err(_) => warn!("journal did not finish within the shutdown bound"),
            }
        }
        ops_stop.cancel();
        if let Some(mut ops_task) = ops_task
            && tokio::time::timeout_at(deadline, &mut ops_task).await.is_err()
        {
            warn!("operations listener did not stop within the shutdown bound; abandoned");
            ops_task.abort();
        }
        info!("relay stopped");
        match wan_result {
            Some(Ok(result)) => result.map_err(ServeError::from),
            _ => Ok(()),
        }
    });
    Ok(RunningRelay { relay, wan_address, ops_address, stop, task })
}

/// At shutdown, how long open health `Watch` streams get to deliver NOT_SERVING and end before
/// the pools are withdrawn (at most a tenth of the shutdown bound).
const HEALTH_WATCH_SETTLE: Duration = Duration::from_millis(500);

/// What [`start_recording`] hands the node: the recovery transport (wrapped when recording),
/// the tap and the recorder.
type Recording = (Arc<dyn RecoveryTransport>, Option<Arc<dyn NodeTap>>, Option<Recorder>);

/// Start the journal for `node` in a fresh subdirectory of `settings.root`; on failure log it
/// and go on without recording (a recording must never stop serving).
fn start_recording(
    settings: &RecordSettings,
    queue_bytes_max: usize,
    node: &NodeConfig,
    options: &ServeOptions,
    transport: Arc<dyn RecoveryTransport>,
) -> Recording {
    let dir = journal::recording_dir(
        &settings.root,
        options.clock.now_unix_us(),
        node.control.relay.relay_incarnation,
    );
    let mut recording = journal::RecorderConfig::new(
        dir.clone(),
        settings.max_total_bytes,
        settings.max_segment_age,
    );
    recording.checkpoint_every_inputs = settings.checkpoint_every_inputs;
    recording.checkpoint_interval = settings.checkpoint_interval;
    recording.queue_bytes_max = queue_bytes_max;
    match journal::start_recorder(
        &recording,
        node,
        Arc::clone(&options.clock),
        Arc::clone(&options.executor),
    ) {
        Ok(recorder) => {
            info!(dir = %dir.display(), max_bytes = settings.max_total_bytes,
                max_segment_age = ?settings.max_segment_age, "recording inputs");
            (recorder.recovery(transport), Some(recorder.tap()), Some(recorder))
        }
        Err(error) => {
            tracing::error!(%error, dir = %dir.display(), "recording disabled: the journal could not start");
            (transport, None, None)
        }
    }
}

async fn bind(setting: &'static str, address: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(address).await.map_err(|error| ServeError::Bind { setting, address, error })
}

/// How often the pool gauges of `/metrics` are refreshed from the pools.
const POOL_TOTALS_INTERVAL: Duration = Duration::from_secs(1);

/// Keep `totals` current until `stop`: each round asks every active pool for its counters
/// (behind the commands already queued to it), so the metrics page itself never waits on them.
async fn poll_pool_totals(
    publications: Arc<PoolPublications>,
    totals: watch::Sender<PoolTotals>,
    stop: CancellationToken,
) {
    loop {
        let reading = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            reading = publications.pool_totals() => reading,
        };
        totals.send_replace(reading);
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = tokio::time::sleep(POOL_TOTALS_INTERVAL) => {}
        }
    }
}

struct SnapshotInputs<'a> {
    node: &'a NodeHandle,
    pool_totals: watch::Receiver<PoolTotals>,
    service: RelayService,
    wan_address: Option<SocketAddr>,
    wan_state: watch::Receiver<WanState>,
    shutting_down: watch::Receiver<bool>,
    planes: &'a InputPlanes,
    recovery: Arc<RecoveryClient>,
    event_plane: &'static str,
    connection_revision: Option<String>,
    /// `None` without `--record`; `Some(None)` when the recorder could not start.
    recording: Option<Option<RecorderProbe>>,
    pod_uid: Option<String>,
    /// The WAN listener's TLS configuration, for its counters (`None`: plaintext).
    wan_tls: Option<crate::wan::WanTls>,
}

/// A closure reading the running relay's state for the operations endpoints.
fn snapshot_source(inputs: SnapshotInputs<'_>) -> ops::SnapshotSource {
    let status = inputs.node.status.clone();
    let input_queue = inputs.node.inputs.clone();
    let views = inputs.node.views.clone();
    let publications = Arc::clone(&inputs.node.publications);
    let discovery = inputs.planes.discovery.clone();
    let events = inputs.planes.events.clone();
    let sources = inputs.planes.sources.clone();
    let SnapshotInputs {
        pool_totals,
        service,
        wan_address,
        wan_state,
        shutting_down,
        recovery,
        event_plane,
        connection_revision,
        recording,
        pod_uid,
        wan_tls,
        ..
    } = inputs;
    Arc::new(move || {
        let catalog_pool_count =
            views.catalog.borrow().snapshot.as_ref().map_or(0, |snapshot| snapshot.pools.len());
        let mut topology = TopologyCounts::default();
        let mut namespaces = std::collections::BTreeSet::new();
        for entry in &views.readiness.borrow().entries {
            namespaces.insert(entry.namespace.clone());
            match entry.state {
                2 => topology.ready += 1,
                1 => topology.unavailable += 1,
                _ => topology.unknown += 1,
            }
        }
        let wan = wan_address.map(|bound_address| {
            let state = wan_state.borrow().clone();
            WanSnapshot {
                bound_address,
                serving: state.serving,
                last_error: state.last_error,
                open_streams: service.open_streams(),
                stats: service.stats(),
                tls: wan_tls.as_ref().map(crate::wan::WanTls::stats),
            }
        });
        OpsSnapshot {
            shutting_down: *shutting_down.borrow(),
            node: status.borrow().clone(),
            input_queue: input_queue.stats(),
            wan,
            catalog_pool_count,
            topology,
            hubs: publications.hub_counts(),
            pools: *pool_totals.borrow(),
            discovery: discovery.borrow().clone(),
            event_plane,
            events: events.snapshot(),
            recovery: recovery.stats(),
            sources: sources.as_ref().map(|state| {
                let state = state.borrow();
                SourcesSnapshot {
                    report: state.report(),
                    connection_revision: connection_revision.clone(),
                    reloads: state.reloads(),
                    refusals: state.refusals(),
                }
            }),
            recording: recording.as_ref().map(|probe| RecordingSnapshot {
                active: probe.is_some(),
                stats: probe.as_ref().map(RecorderProbe::stats).unwrap_or_default(),
            }),
            pod_uid: pod_uid.clone(),
            discovered_namespaces: namespaces.len(),
        }
    })
}
