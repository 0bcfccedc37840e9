//! The async reference WAN consumer: a thin shell that moves `dynamo.kvrelay.v1` messages into
//! [`ConsumerState`] and carries out what it decides.
//!
//! [`RelayConsumer::start`] takes a ready [`Channel`] — built by [`connect`] for TCP, or by the
//! caller from any connector (the simulator passes one over its own network) — and spawns, all
//! on one [`TaskTracker`]:
//!
//! - the **catalog task** (`WatchKvPoolCatalog`): applies every message to the catalog view and
//!   starts or stops one **filter task** per catalogued producer (a new producer for a known
//!   pool stops the old task before the new one starts);
//! - each **filter task** (`SubscribeKvPool` with the exact `expected_producer`): assembles the
//!   snapshot outside the shared state, installs the replica only once it is complete and
//!   valid, then applies deltas and heartbeats to the installed replica;
//! - the **readiness task** and the **load task**.
//!
//! Every stream end goes through [`policy::reaction`](super::policy::reaction): retry after a
//! jittered, bounded backoff ([`Backoff`]), reopen from scratch, wait for the catalog, park until
//! the catalog replaces the producer, stop the plane, or halt the whole consumer (contract
//! mismatch). Jitter comes from generators derived from one injected seed, per task label, so a
//! simulated run repeats exactly.
//!
//! Invariants: the state lives behind one `std::sync::Mutex` that is never held across an
//! `.await`; every change bumps a `watch` counter ([`RelayConsumer::changes`]); every
//! `tokio::select!` is `biased;` with cancellation first; time is `tokio::time` only; every task
//! ends when the consumer's [`CancellationToken`] is cancelled ([`RelayConsumer::stop`], drop,
//! or a halt). Bounds: one task per plane plus one per catalogued pool; one stream per task;
//! messages no larger than [`ConsumerConfig::max_decoding_message_bytes`].

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures::future::BoxFuture;
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient;
use rand_core::Rng;
use thiserror::Error;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status, Streaming};

use super::backoff::{Backoff, BackoffPolicy, BackoffPolicyError};
use super::policy::{FaultKind, Plane, Reaction, StreamEnd, reaction};
use super::query::QueryAnswer;
use super::state::{
    ConsumerHalt, ConsumerSnapshot, ConsumerState, FilterCopy, FilterStatus, FrameStep, PlaneStatus,
};
use kvrelay_core::filter::cbi1::MAX_FRAME_BYTES;
use kvrelay_core::filter::{FilterReplica, ReplicaProgress};
use kvrelay_core::model::identity::{PoolId, ProducerIdentity};
use kvrelay_core::rng::{RelayRng, derive_seed, rng_from_seed};
use kvrelay_core::wire::{FilterStreamFault, FilterStreamGuard, SubscriberId, encode};

/// Default decoding limit: a full 4 MiB snapshot chunk plus its envelope (relay-facts §3.8).
pub const DEFAULT_MAX_DECODING_MESSAGE_BYTES: usize = 8 << 20;

/// The smallest accepted decoding limit: one largest CBI1 frame plus 64 KiB of envelope.
pub const MIN_DECODING_MESSAGE_BYTES: usize = MAX_FRAME_BYTES + (64 << 10);

/// HTTP/2 keepalive ping interval of [`endpoint`] (the relay's own default).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);

/// HTTP/2 keepalive ping timeout of [`endpoint`].
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// TCP connect timeout of [`endpoint`].
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long each stream may stay silent before the consumer gives up on it and reconnects.
/// `None` waits forever (HTTP/2 keepalive still detects a dead connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleTimeouts {
    /// Catalog stream. Dynamo's relay sends no catalog heartbeat, so none by default.
    pub catalog: Option<Duration>,
    /// Each pool stream (heartbeat every 10 s by default).
    pub filter: Option<Duration>,
    /// Readiness stream (heartbeat every 10 s by default).
    pub readiness: Option<Duration>,
    /// Load stream (one window per second by default).
    pub load: Option<Duration>,
}

impl Default for IdleTimeouts {
    /// No catalog timeout; 35 s (three and a half default heartbeats) for the others.
    fn default() -> Self {
        let heartbeats = Some(Duration::from_secs(35));
        IdleTimeouts { catalog: None, filter: heartbeats, readiness: heartbeats, load: heartbeats }
    }
}

/// The consumer's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConsumerConfig {
    /// The diagnostic label sent with every subscription (1–128 bytes, no control characters).
    pub subscriber_id: String,
    /// Reconnect pacing of every stream.
    pub backoff: BackoffPolicy,
    /// Largest message accepted from the relay; at least [`MIN_DECODING_MESSAGE_BYTES`].
    pub max_decoding_message_bytes: usize,
    /// Per-plane silence limits.
    pub idle_timeouts: IdleTimeouts,
}

impl Default for ConsumerConfig {
    fn default() -> Self {
        ConsumerConfig {
            subscriber_id: "kvrelay-consumer".to_owned(),
            backoff: BackoffPolicy::default(),
            max_decoding_message_bytes: DEFAULT_MAX_DECODING_MESSAGE_BYTES,
            idle_timeouts: IdleTimeouts::default(),
        }
    }
}

impl ConsumerConfig {
    /// Check every setting.
    pub fn validate(&self) -> Result<(), ConsumerError> {
        SubscriberId::parse(&self.subscriber_id)
            .map_err(|status| ConsumerError::SubscriberId(status.message))?;
        self.backoff.validate()?;
        if self.max_decoding_message_bytes < MIN_DECODING_MESSAGE_BYTES {
            return Err(ConsumerError::MessageLimit(self.max_decoding_message_bytes));
        }
        let timeouts = self.idle_timeouts;
        for (plane, timeout) in [
            (Plane::Catalog, timeouts.catalog),
            (Plane::Filter, timeouts.filter),
            (Plane::Readiness, timeouts.readiness),
            (Plane::Load, timeouts.load),
        ] {
            if timeout.is_some_and(|timeout| timeout.is_zero()) {
                return Err(ConsumerError::ZeroIdleTimeout(plane));
            }
        }
        Ok(())
    }
}

/// Why a consumer could not be set up.
#[derive(Debug, Error)]
pub enum ConsumerError {
    /// The subscriber id would be refused by the relay.
    #[error("invalid subscriber id: {0}")]
    SubscriberId(String),
    /// The backoff policy is unusable.
    #[error(transparent)]
    Backoff(#[from] BackoffPolicyError),
    /// The decoding limit cannot hold a full snapshot chunk.
    #[error("decoding limit {0} bytes cannot hold a snapshot chunk")]
    MessageLimit(usize),
    /// An idle timeout of zero would end every stream at once.
    #[error("the {0} idle timeout must be nonzero")]
    ZeroIdleTimeout(Plane),
    /// The address is not a URI.
    #[error("invalid relay address {address}: {source}")]
    Address {
        /// The address as given.
        address: String,
        /// Why it does not parse.
        #[source]
        source: tonic::transport::Error,
    },
    /// The connection could not be established.
    #[error("cannot connect to {address}: {source}")]
    Connect {
        /// The address as given.
        address: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
}

/// The consumer stopped (or halted) before a waited-for condition held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("the consumer stopped before the condition held (halt: {halted:?})")]
pub struct ConsumerStopped {
    /// Why it halted, if it halted rather than being stopped.
    pub halted: Option<ConsumerHalt>,
}

/// A plaintext HTTP/2 endpoint for `address` (`host:port`, or a full `http://` URI) with the
/// relay's keepalive and a connect timeout. Build a [`Channel`] from it with any connector.
pub fn endpoint(address: &str) -> Result<Endpoint, ConsumerError> {
    let uri =
        if address.contains("://") { address.to_owned() } else { format!("http://{address}") };
    let endpoint = Endpoint::from_shared(uri)
        .map_err(|source| ConsumerError::Address { address: address.to_owned(), source })?;
    Ok(endpoint
        .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT)
        .keep_alive_while_idle(true)
        .connect_timeout(CONNECT_TIMEOUT))
}

/// Connect to a relay over TCP now (the channel reconnects by itself afterwards).
pub async fn connect(address: &str) -> Result<Channel, ConsumerError> {
    endpoint(address)?
        .connect()
        .await
        .map_err(|source| ConsumerError::Connect { address: address.to_owned(), source })
}

/// A TCP channel that connects on first use (a relay that is down is retried by the streams).
pub fn connect_lazy(address: &str) -> Result<Channel, ConsumerError> {
    Ok(endpoint(address)?.connect_lazy())
}

// ---- shared state -----------------------------------------------------------------------------

#[derive(Debug)]
struct Shared {
    state: Mutex<ConsumerState>,
    /// Bumped after every state change.
    changes: watch::Sender<u64>,
    /// Bumped after every valid catalog message (filter tasks waiting for the catalog).
    catalog_epoch: watch::Sender<u64>,
    /// Cancels every task.
    cancel: CancellationToken,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, ConsumerState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Change the state, then tell the watchers. The lock is released before anyone wakes.
    fn update<R>(&self, change: impl FnOnce(&mut ConsumerState) -> R) -> R {
        let result = change(&mut self.lock());
        self.changes.send_modify(|version| *version = version.wrapping_add(1));
        result
    }

    fn read<R>(&self, read: impl FnOnce(&ConsumerState) -> R) -> R {
        read(&self.lock())
    }

    fn halt(&self, plane: Plane, cause: FaultKind) {
        self.update(|state| state.halt(plane, cause));
        self.cancel.cancel();
    }
}

/// How a session ended, and whether its fault was already counted by the state.
#[derive(Debug, Clone, Copy)]
struct Ended {
    end: StreamEnd,
    counted: bool,
}

impl From<StreamEnd> for Ended {
    fn from(end: StreamEnd) -> Self {
        Ended { end, counted: false }
    }
}

impl Ended {
    fn fault(kind: FaultKind) -> Self {
        StreamEnd::Fault(kind).into()
    }

    fn uncounted_fault(self) -> Option<FaultKind> {
        if self.counted { None } else { self.end.fault() }
    }
}

/// Everything a task needs.
#[derive(Debug, Clone)]
struct Context {
    shared: Arc<Shared>,
    channel: Channel,
    config: Arc<ConsumerConfig>,
    tracker: TaskTracker,
    seed: u64,
}

type Client = KvEventRelayClient<Channel>;

impl Context {
    fn client(&self) -> Client {
        KvEventRelayClient::new(self.channel.clone())
            .max_decoding_message_size(self.config.max_decoding_message_bytes)
    }

    /// The jitter generator of the task named `label`.
    fn rng(&self, label: &str) -> RelayRng {
        rng_from_seed(derive_seed(self.seed, label))
    }

    fn set_plane(&self, plane: Plane, status: PlaneStatus) {
        self.shared.update(|state| state.set_plane(plane, status));
    }
}

/// `future`, or `None` if it takes longer than `limit`.
async fn within<F: Future>(limit: Option<Duration>, future: F) -> Option<F::Output> {
    match limit {
        None => Some(future.await),
        Some(limit) => tokio::time::timeout(limit, future).await.ok(),
    }
}

/// Open a stream: the relay's answer, bounded by the plane's idle timeout.
async fn open<T>(
    idle: Option<Duration>,
    call: impl Future<Output = Result<Response<Streaming<T>>, Status>>,
) -> Result<Streaming<T>, Ended> {
    match within(idle, call).await {
        None => Err(Ended::fault(FaultKind::IdleTimeout)),
        Some(Ok(response)) => Ok(response.into_inner()),
        Some(Err(status)) => Err(StreamEnd::from_status(&status).into()),
    }
}

/// The next message, or how the stream ended.
async fn next<T>(stream: &mut Streaming<T>, idle: Option<Duration>) -> Result<T, Ended> {
    match within(idle, stream.message()).await {
        None => Err(Ended::fault(FaultKind::IdleTimeout)),
        Some(Ok(Some(message))) => Ok(message),
        Some(Ok(None)) => Err(Ended::fault(FaultKind::StreamEnded)),
        Some(Err(status)) => Err(StreamEnd::from_status(&status).into()),
    }
}

/// Sleep `delay` unless cancelled first; `true` if the sleep completed.
async fn sleep_unless_cancelled(cancel: &CancellationToken, delay: Duration) -> bool {
    tokio::select! {
        biased;
        () = cancel.cancelled() => false,
        () = tokio::time::sleep(delay) => true,
    }
}

/// Carry out a catalog, readiness or load stream's reaction; `false` when its task must end.
async fn pace(
    context: &Context,
    plane: Plane,
    end: StreamEnd,
    backoff: &mut Backoff,
    rng: &mut RelayRng,
) -> bool {
    let delay = match reaction(plane, end) {
        Reaction::Halt => {
            context.shared.halt(plane, end.fault().unwrap_or(FaultKind::ContractMismatch));
            return false;
        }
        Reaction::StopPlane | Reaction::AwaitNewProducer => {
            context.set_plane(plane, PlaneStatus::Stopped);
            return false;
        }
        Reaction::Reopen => {
            backoff.reset();
            backoff.next_delay(rng)
        }
        Reaction::Retry | Reaction::AwaitCatalog => backoff.next_delay(rng),
    };
    context.set_plane(plane, PlaneStatus::Backoff);
    sleep_unless_cancelled(&context.shared.cancel, delay).await
}

// ---- catalog ----------------------------------------------------------------------------------

/// Cancellation tokens of the running filter tasks, by producer.
type FilterTasks = BTreeMap<ProducerIdentity, CancellationToken>;

fn stop_filters(tasks: &mut FilterTasks, producers: &[ProducerIdentity]) {
    for producer in producers {
        if let Some(token) = tasks.remove(producer) {
            token.cancel();
        }
    }
}

fn start_filter(context: &Context, tasks: &mut FilterTasks, producer: ProducerIdentity) {
    let token = context.shared.cancel.child_token();
    if let Some(previous) = tasks.insert(producer, token.clone()) {
        // The state starts a producer only when it has no slot, so this is a leftover.
        previous.cancel();
    }
    let label = format!(
        "consumer/filter/{}/{}/{}",
        producer.pool_id(),
        producer.producer_incarnation(),
        producer.layout_generation()
    );
    let rng = context.rng(&label);
    context.tracker.spawn(run_filter(context.clone(), producer, token, rng));
}

async fn run_catalog(context: Context) {
    let mut rng = context.rng("consumer/catalog");
    let mut backoff = Backoff::new(context.config.backoff);
    let mut tasks = FilterTasks::new();
    loop {
        context.set_plane(Plane::Catalog, PlaneStatus::Connecting);
        let ended = tokio::select! {
            biased;
            () = context.shared.cancel.cancelled() => break,
            ended = catalog_session(&context, &mut backoff, &mut tasks) => ended,
        };
        let stop = context.shared.update(|state| state.catalog_lost(ended.uncounted_fault()));
        stop_filters(&mut tasks, &stop);
        debug_assert!(tasks.is_empty(), "losing the catalog withdraws every pool");
        for (_, token) in std::mem::take(&mut tasks) {
            token.cancel();
        }
        if !pace(&context, Plane::Catalog, ended.end, &mut backoff, &mut rng).await {
            break;
        }
    }
    // Filter tokens are children of the consumer's token; cancel them anyway if this plane
    // stopped on its own.
    for token in tasks.values() {
        token.cancel();
    }
}

async fn catalog_session(
    context: &Context,
    backoff: &mut Backoff,
    tasks: &mut FilterTasks,
) -> Ended {
    let idle = context.config.idle_timeouts.catalog;
    let request = proto::WatchKvPoolCatalogRequest {
        subscriber_id: context.config.subscriber_id.clone(),
        contract_marker: CONTRACT_MARKER,
    };
    let mut client = context.client();
    let mut stream = match open(idle, client.watch_kv_pool_catalog(request)).await {
        Ok(stream) => stream,
        Err(ended) => return ended,
    };
    context.set_plane(Plane::Catalog, PlaneStatus::Streaming);
    loop {
        let update = match next(&mut stream, idle).await {
            Ok(update) => update,
            Err(ended) => return ended,
        };
        let step = context.shared.update(|state| state.apply_catalog(&update));
        // Stop superseded tasks before starting their successors.
        stop_filters(tasks, &step.stop);
        for producer in step.start {
            start_filter(context, tasks, producer);
        }
        match step.fault {
            None => {
                backoff.reset();
                context.shared.catalog_epoch.send_modify(|epoch| *epoch = epoch.wrapping_add(1));
            }
            Some(FaultKind::ContractMismatch) => {
                return Ended { end: StreamEnd::Fault(FaultKind::ContractMismatch), counted: true };
            }
            // The view is empty until the next complete message rebuilds it.
            Some(_) => {}
        }
    }
}

// ---- filters ----------------------------------------------------------------------------------

async fn run_filter(
    context: Context,
    producer: ProducerIdentity,
    cancel: CancellationToken,
    mut rng: RelayRng,
) {
    let mut backoff = Backoff::new(context.config.backoff);
    let mut catalog = context.shared.catalog_epoch.subscribe();
    let mut attempts: u64 = 0;
    loop {
        if attempts > 0 {
            context.shared.update(ConsumerState::count_resubscribe);
        }
        attempts = attempts.saturating_add(1);
        // Any catalog message from now on counts as the refresh a stale producer waits for.
        catalog.borrow_and_update();
        let ended = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            ended = filter_session(&context, &producer, &mut backoff) => ended,
        };
        let reaction = reaction(Plane::Filter, ended.end);
        let next_status = match reaction {
            Reaction::Retry | Reaction::Reopen => FilterStatus::Backoff,
            Reaction::AwaitCatalog => FilterStatus::AwaitingCatalog,
            Reaction::AwaitNewProducer | Reaction::StopPlane | Reaction::Halt => {
                FilterStatus::Stopped
            }
        };
        context
            .shared
            .update(|state| state.filter_ended(&producer, ended.uncounted_fault(), next_status));
        let proceed = match reaction {
            Reaction::Halt => {
                let cause = ended.end.fault().unwrap_or(FaultKind::ContractMismatch);
                context.shared.halt(Plane::Filter, cause);
                false
            }
            Reaction::AwaitNewProducer | Reaction::StopPlane => {
                // Park: only the catalog (replacing or withdrawing the producer) ends this.
                cancel.cancelled().await;
                false
            }
            Reaction::Retry => {
                let delay = backoff.next_delay(&mut rng);
                sleep_unless_cancelled(&cancel, delay).await
            }
            Reaction::Reopen => {
                backoff.reset();
                let delay = backoff.next_delay(&mut rng);
                sleep_unless_cancelled(&cancel, delay).await
            }
            Reaction::AwaitCatalog => {
                // Wait for the catalog to speak; retry after the backoff ceiling regardless,
                // so a relay whose catalog and publications disagree is still converged on.
                let ceiling = context.config.backoff.max;
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => false,
                    changed = catalog.changed() => changed.is_ok(),
                    () = tokio::time::sleep(ceiling) => true,
                }
            }
        };
        if !proceed {
            return;
        }
    }
}

async fn filter_session(
    context: &Context,
    producer: &ProducerIdentity,
    backoff: &mut Backoff,
) -> Ended {
    let idle = context.config.idle_timeouts.filter;
    if !context.shared.update(|state| state.set_filter_status(producer, FilterStatus::Connecting)) {
        return StreamEnd::Superseded.into();
    }
    let request = proto::SubscribeKvPoolRequest {
        subscriber_id: context.config.subscriber_id.clone(),
        expected_producer: Some(encode::producer(producer)),
        contract_marker: CONTRACT_MARKER,
    };
    let mut client = context.client();
    let mut stream = match open(idle, client.subscribe_kv_pool(request)).await {
        Ok(stream) => stream,
        Err(ended) => return ended,
    };
    if !context.shared.update(|state| state.filter_opened(producer)) {
        return StreamEnd::Superseded.into();
    }
    let mut guard = FilterStreamGuard::new(*producer);
    // Assembled here, outside the shared state, and installed only once complete.
    let mut assembling = match FilterReplica::new(producer.format(), producer.pool_id().dc_id.0) {
        Ok(replica) => Some(replica),
        // The format came from a validated catalog descriptor, so this cannot happen.
        Err(_) => return Ended::fault(FaultKind::Replica),
    };
    loop {
        let update = match next(&mut stream, idle).await {
            Ok(update) => update,
            Err(ended) => return ended,
        };
        let frame = match guard.check(&update) {
            Ok(envelope) => envelope.frame,
            Err(FilterStreamFault::Wire(error)) if error.is_contract_mismatch() => {
                return Ended::fault(FaultKind::ContractMismatch);
            }
            Err(_) => return Ended::fault(FaultKind::StreamGuard),
        };
        if let Some(replica) = assembling.as_mut() {
            match replica.accept(frame) {
                Err(_) => return Ended::fault(FaultKind::Replica),
                Ok(ReplicaProgress::Installed { .. }) => {}
                Ok(_) => {
                    context.shared.update(ConsumerState::count_filter_frame);
                    continue;
                }
            }
            let Some(complete) = assembling.take() else {
                continue;
            };
            match context.shared.update(|state| state.install(producer, complete)) {
                FrameStep::Accepted => backoff.reset(),
                FrameStep::Superseded => return StreamEnd::Superseded.into(),
                FrameStep::Rejected => return Ended::fault(FaultKind::Replica),
            }
            continue;
        }
        match context.shared.update(|state| state.apply_frame(producer, frame)) {
            FrameStep::Accepted => {}
            FrameStep::Superseded => return StreamEnd::Superseded.into(),
            FrameStep::Rejected => return Ended::fault(FaultKind::Replica),
        }
    }
}

// ---- readiness and load -----------------------------------------------------------------------

type Opened<T> = BoxFuture<'static, Result<Response<Streaming<T>>, Status>>;

/// The parts in which the readiness and load tasks differ.
struct PlaneSpec<T> {
    plane: Plane,
    idle: Option<Duration>,
    open: fn(Client, String) -> Opened<T>,
    /// Apply one message; the fault of an invalid one (already counted).
    apply: fn(&mut ConsumerState, &T) -> Option<FaultKind>,
    /// Invalidate the view after the stream ended, counting the fault given.
    lost: fn(&mut ConsumerState, Option<FaultKind>),
}

fn open_readiness(
    mut client: Client,
    subscriber_id: String,
) -> Opened<proto::ServingReadinessUpdate> {
    Box::pin(async move {
        client
            .subscribe_serving_readiness(proto::SubscribeServingReadinessRequest {
                subscriber_id,
                contract_marker: CONTRACT_MARKER,
            })
            .await
    })
}

fn open_load(mut client: Client, subscriber_id: String) -> Opened<proto::KvPoolLoadUpdate> {
    Box::pin(async move {
        client
            .subscribe_kv_pool_load(proto::SubscribeKvPoolLoadRequest {
                subscriber_id,
                contract_marker: CONTRACT_MARKER,
            })
            .await
    })
}

async fn run_plane<T: Send + 'static>(context: Context, spec: PlaneSpec<T>) {
    let mut rng = context.rng(&format!("consumer/{}", spec.plane));
    let mut backoff = Backoff::new(context.config.backoff);
    loop {
        context.set_plane(spec.plane, PlaneStatus::Connecting);
        let ended = tokio::select! {
            biased;
            () = context.shared.cancel.cancelled() => break,
            ended = plane_session(&context, &spec, &mut backoff) => ended,
        };
        context.shared.update(|state| (spec.lost)(state, ended.uncounted_fault()));
        if !pace(&context, spec.plane, ended.end, &mut backoff, &mut rng).await {
            break;
        }
    }
}

async fn plane_session<T>(context: &Context, spec: &PlaneSpec<T>, backoff: &mut Backoff) -> Ended {
    let opened = (spec.open)(context.client(), context.config.subscriber_id.clone());
    let mut stream = match open(spec.idle, opened).await {
        Ok(stream) => stream,
        Err(ended) => return ended,
    };
    context.set_plane(spec.plane, PlaneStatus::Streaming);
    loop {
        let message = match next(&mut stream, spec.idle).await {
            Ok(message) => message,
            Err(ended) => return ended,
        };
        match context.shared.update(|state| (spec.apply)(state, &message)) {
            None => backoff.reset(),
            Some(FaultKind::ContractMismatch) => {
                return Ended { end: StreamEnd::Fault(FaultKind::ContractMismatch), counted: true };
            }
            // The view is empty until the next valid message replaces it.
            Some(_) => {}
        }
    }
}

// ---- the handle -------------------------------------------------------------------------------

/// A running consumer of one relay. Dropping it stops every task.
#[derive(Debug)]
pub struct RelayConsumer {
    shared: Arc<Shared>,
    tracker: TaskTracker,
}

impl RelayConsumer {
    /// Validate `config` and start following the relay behind `channel`. Must run inside a
    /// tokio runtime. `rng` is drawn once for the seed every jitter generator derives from.
    pub fn start<R: Rng + ?Sized>(
        channel: Channel,
        config: ConsumerConfig,
        rng: &mut R,
    ) -> Result<Self, ConsumerError> {
        config.validate()?;
        let (changes, _) = watch::channel(0);
        let (catalog_epoch, _) = watch::channel(0);
        let shared = Arc::new(Shared {
            state: Mutex::new(ConsumerState::new()),
            changes,
            catalog_epoch,
            cancel: CancellationToken::new(),
        });
        let tracker = TaskTracker::new();
        let idle = config.idle_timeouts;
        let context = Context {
            shared: Arc::clone(&shared),
            channel,
            config: Arc::new(config),
            tracker: tracker.clone(),
            seed: rng.next_u64(),
        };
        tracker.spawn(run_catalog(context.clone()));
        tracker.spawn(run_plane(
            context.clone(),
            PlaneSpec {
                plane: Plane::Readiness,
                idle: idle.readiness,
                open: open_readiness,
                apply: ConsumerState::apply_readiness,
                lost: ConsumerState::readiness_lost,
            },
        ));
        tracker.spawn(run_plane(
            context,
            PlaneSpec {
                plane: Plane::Load,
                idle: idle.load,
                open: open_load,
                apply: ConsumerState::apply_load,
                lost: ConsumerState::load_lost,
            },
        ));
        // Closing only lets `wait` finish once the tasks are done; filter tasks still spawn.
        tracker.close();
        Ok(RelayConsumer { shared, tracker })
    }

    /// Everything the consumer knows now.
    #[must_use]
    pub fn snapshot(&self) -> ConsumerSnapshot {
        self.shared.read(ConsumerState::snapshot)
    }

    /// A receiver whose value changes after every state change.
    #[must_use]
    pub fn changes(&self) -> watch::Receiver<u64> {
        self.shared.changes.subscribe()
    }

    /// Wait until `predicate` holds for a snapshot and return that snapshot. Fails once the
    /// consumer stopped or halted and the predicate still does not hold. Callers bound the wait
    /// with `tokio::time::timeout`.
    pub async fn wait_until(
        &self,
        mut predicate: impl FnMut(&ConsumerSnapshot) -> bool,
    ) -> Result<ConsumerSnapshot, ConsumerStopped> {
        let mut changes = self.changes();
        loop {
            changes.borrow_and_update();
            let snapshot = self.snapshot();
            if predicate(&snapshot) {
                return Ok(snapshot);
            }
            tokio::select! {
                biased;
                changed = changes.changed() => {
                    if changed.is_err() {
                        return Err(ConsumerStopped { halted: snapshot.halted });
                    }
                }
                () = self.shared.cancel.cancelled() => {
                    return Err(ConsumerStopped { halted: self.halted() });
                }
            }
        }
    }

    /// Per-pool longest prefixes of `tokens` for `model`, best first (see
    /// [`query::answer`](super::query::answer)).
    #[must_use]
    pub fn query(&self, tokens: &[u32], model: &str) -> Vec<QueryAnswer> {
        self.shared.read(|state| state.query(tokens, model))
    }

    /// A copy of `pool_id`'s installed replica (for comparing with the relay's filter).
    #[must_use]
    pub fn filter_copy(&self, pool_id: &PoolId) -> Option<FilterCopy> {
        self.shared.read(|state| state.filter_copy(pool_id))
    }

    /// Why the consumer halted, if it did.
    #[must_use]
    pub fn halted(&self) -> Option<ConsumerHalt> {
        self.shared.read(ConsumerState::halted)
    }

    /// The token that stops every task when cancelled.
    #[must_use]
    pub fn cancellation_token(&self) -> CancellationToken {
        self.shared.cancel.clone()
    }

    /// Ask every task to stop (they end at their next await point).
    pub fn stop(&self) {
        self.shared.cancel.cancel();
    }

    /// Stop every task and wait until all of them ended. The state stays readable.
    pub async fn shutdown(&self) {
        self.stop();
        self.tracker.wait().await;
    }
}

impl Drop for RelayConsumer {
    fn drop(&mut self) {
        self.shared.cancel.cancel();
    }
}
