//! The NATS event plane (`DYN_EVENT_PLANE=nats`; dynamo-live §9.2).
//!
//! Workers publish each message on `namespace.{ns}.component.{c}.endpoint.{e}.{topic}`, every
//! segment percent-encoded with only `[A-Za-z0-9_-]` literal, the body being the MessagePack
//! envelope. The relay subscribes, per watched namespace (or for all namespaces), to
//! `namespace.{ns}.component.*.endpoint.*.kv-events` and `...kv_metrics`, takes the endpoint
//! from the subject of each message, and decodes the body with the shared decoders.
//!
//! Connection management is the client's own: [`run_nats_event_plane`] starts even when the
//! server is not up yet (`retry_on_initial_connect`), and after a lost connection the client
//! reconnects forever, waiting at most [`NATS_RECONNECT_DELAY_MAX`] between attempts, and
//! re-subscribes on its own (verified by `relay/tests/event_plane.rs`, which restarts a real
//! `nats-server`). Core NATS has no replay: messages published while disconnected are lost and
//! show up downstream as `sequence` gaps.
//!
//! Security comes from [`NatsSecurity`] (the `NATS_AUTH_*` / `NATS_TLS_*` variables, validated
//! at start-up by [`super::nats_auth`]). Until the first connection succeeds, a server that
//! refuses the credentials (authorization violation, a nonce that cannot be signed) or a TLS
//! setup the client cannot build ends the plane with [`EventPlaneError::NatsRefused`] instead of
//! retrying forever; after it, such failures are the client's to retry (a credential rotation in
//! progress). A TLS handshake the peer fails (an untrusted certificate either way) reaches the
//! client as an I/O error, like a server that is down: it is retried and counted as a connect
//! failure, and nothing is delivered.
//!
//! Bounds. The plane takes every message off the client's subscription queues as soon as it
//! can and decodes it into its own backlog ([`super::backlog`]), which holds at most
//! `subscription_bytes_max` bytes of decoded inputs (plus the one that passes it) while the
//! node's queue is full, shared fairly between endpoints; past the budget the heaviest
//! endpoint's newest message is dropped (the arriving one, if it is the heaviest's) and counted
//! in [`backlog_drops`](super::EventPlaneStats::backlog_drops), and shows downstream as a
//! `sequence` gap, so its rank recovers (core NATS has no flow control to push back on).
//!
//! The client's own queues are bounded only in messages (`subscription_capacity`, fixed when
//! the client is built), and the client pushes every message of a poll of its connection (until
//! the socket is empty, or tokio's budget of 128 reads is spent) into them before the plane can
//! run. The plane therefore empties them at every wake-up, outside tokio's budget, into its
//! backlog: on the relay's one-thread runtime the plane runs between two polls of the
//! connection, so the queues hold at most one poll's reads, whatever their capacity. The
//! capacity must hold a poll's worth of small messages (at 200,000 events/s a few milliseconds
//! without a poll fill the socket with thousands): it is `subscription_bytes_max / max_payload`
//! (the message count whose largest legal messages fit the budget), but never below
//! [`NATS_SUBSCRIPTION_CAPACITY_MIN`] and never above `subscription_capacity`
//! ([`nats_subscription_capacity`]: 16,384 messages at the defaults). Only a plane starved of CPU
//! over several polls while the server sends messages near `max_payload` could let them hold up
//! to capacity × `max_payload`. At the capacity the client drops (the slow-consumer behaviour)
//! and notifies the plane, which counts it in
//! [`client_drops`](super::EventPlaneStats::client_drops). The client hands notices over
//! through a queue of 128 events, so a burst of drops faster than they are handed over can be
//! under-counted; the gaps still show every lost event.
//!
//! The first client is built for NATS's default [`NATS_MAX_PAYLOAD_DEFAULT`]; once it is
//! connected, and before it subscribes, the plane reads the server's `max_payload` and, if the
//! capacity derived from it differs, replaces the client by one built for it (nothing can be
//! lost yet). While subscribed, the plane compares the client's `max_payload` with the one its
//! capacity was derived from at every (re)connection notice and every message wake-up: a server
//! advertising more (a reconnection to a differently configured server) whose capacity is
//! smaller makes it replace the client the same way, losing what was queued (sequence gaps,
//! hence recovery). Any other `max_payload` keeps the client. Each replacement counts in
//! [`client_rebuilds`](super::EventPlaneStats::client_rebuilds); the figures in effect are in
//! [`EventPlaneStats`](super::EventPlaneStats) and `/metrics`, and logged when the plane
//! subscribes.

use crate::node::{InputPermit, InputSender};
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;
use std::time::Duration;

use async_nats::{Client, ClientError, ConnectOptions, Event};
use futures::StreamExt;
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::EventPlaneError;
use super::backlog::Backlog;
use super::counters::{EventPlaneCounters, increment};
use super::nats_auth::NatsSecurity;
use kvrelay_core::inputs::{
    DcInput, InputError, KV_EVENTS_TOPIC, KV_METRICS_TOPIC, SubjectCache, decode_kv_events_message,
    decode_kv_metrics_message, event_subject_prefix,
};
use kvrelay_core::model::identity::EndpointPath;

/// The server used when `NATS_SERVER` is not set (Dynamo's default).
pub const DEFAULT_NATS_SERVER: &str = "nats://127.0.0.1:4222";

/// Most messages one subscription's queue inside the client holds, however small they are (the
/// item bound beside the byte budget; async-nats' own default, and Dynamo's).
pub const NATS_SUBSCRIPTION_CAPACITY_DEFAULT: usize = 65_536;

/// Fewest messages one subscription's queue inside the client holds: a poll of the client's
/// connection's worth of small messages (it queues every message of a poll before the plane
/// runs; 16,384 Dynamo messages of about 370 bytes on the wire are 6 MiB, the most a Linux
/// socket buffers by default, and 80 ms of a 200,000 events/s stream).
pub const NATS_SUBSCRIPTION_CAPACITY_MIN: usize = 16_384;

/// Default byte budget of the plane's backlog, and the bytes of largest messages one
/// subscription's queue inside the client is sized for (64 messages at NATS's default
/// `max_payload`, raised to [`NATS_SUBSCRIPTION_CAPACITY_MIN`]: the plane empties the queue at
/// every wake-up, so what it holds is one poll's reads). Normal messages are a few hundred bytes.
pub const NATS_SUBSCRIPTION_BYTES_MAX_DEFAULT: usize = 64 << 20;

/// NATS's default `max_payload` (1 MiB): the message size a client's capacity is derived from
/// until a server advertises its own, and the smallest byte budget accepted.
pub const NATS_MAX_PAYLOAD_DEFAULT: usize = 1 << 20;

/// Messages one subscription's queue holds: `bytes_max / max_payload` (so that its largest
/// legal messages fit `bytes_max`), at least [`NATS_SUBSCRIPTION_CAPACITY_MIN`] and at most
/// `messages_max` (which wins over the minimum; at least 1). Total for any input: a
/// `max_payload` of 0 counts as 1.
#[must_use]
pub fn nats_subscription_capacity(
    bytes_max: usize,
    max_payload: usize,
    messages_max: usize,
) -> usize {
    let messages_max = messages_max.max(1);
    (bytes_max / max_payload.max(1))
        .clamp(NATS_SUBSCRIPTION_CAPACITY_MIN.min(messages_max), messages_max)
}

/// Longest wait between two reconnection attempts.
pub const NATS_RECONNECT_DELAY_MAX: Duration = Duration::from_secs(4);

/// First wait between reconnection attempts; it doubles per failed attempt.
const NATS_RECONNECT_DELAY_INITIAL: Duration = Duration::from_millis(50);

/// Which namespaces to watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NatsNamespaces {
    /// Every namespace (`namespace.*....`).
    All,
    /// Exactly these namespaces (unescaped names, e.g. `dynamo`). Must not be empty.
    Only(BTreeSet<String>),
}

/// Configuration of [`run_nats_event_plane`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsEventPlaneConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`.
    pub server_url: String,
    /// Namespaces to watch.
    pub namespaces: NatsNamespaces,
    /// Most messages one subscription's queue inside the client holds (at least 1).
    pub subscription_capacity: usize,
    /// The plane's backlog budget in bytes (at least [`NATS_MAX_PAYLOAD_DEFAULT`]); the client's
    /// capacity in messages is derived from it and the server's `max_payload`, within
    /// [`NATS_SUBSCRIPTION_CAPACITY_MIN`] and `subscription_capacity` (see the module
    /// documentation: at the floor the client's queues are bounded by the drain, not by it).
    pub subscription_bytes_max: usize,
    /// Connection name shown by the server.
    pub client_name: String,
    /// Timeout of one connection attempt.
    pub connection_timeout: Duration,
    /// Credentials and TLS (`NATS_AUTH_*`, `NATS_TLS_*`); the default is anonymous plaintext.
    pub security: NatsSecurity,
}

impl NatsEventPlaneConfig {
    /// A configuration for `server_url` with the defaults of this module.
    #[must_use]
    pub fn new(server_url: impl Into<String>, namespaces: NatsNamespaces) -> Self {
        NatsEventPlaneConfig {
            server_url: server_url.into(),
            namespaces,
            subscription_capacity: NATS_SUBSCRIPTION_CAPACITY_DEFAULT,
            subscription_bytes_max: NATS_SUBSCRIPTION_BYTES_MAX_DEFAULT,
            client_name: "kvrelay-event-plane".to_owned(),
            connection_timeout: Duration::from_secs(5),
            security: NatsSecurity::default(),
        }
    }

    /// The server from the `NATS_SERVER` environment variable (as Dynamo reads it), else
    /// [`DEFAULT_NATS_SERVER`].
    #[must_use]
    pub fn from_env(namespaces: NatsNamespaces) -> Self {
        let server = std::env::var("NATS_SERVER")
            .ok()
            .filter(|value| !value.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_NATS_SERVER.to_owned());
        Self::new(server, namespaces)
    }

    /// Check the bounds and the namespaces.
    pub fn validate(&self) -> Result<(), EventPlaneError> {
        if self.subscription_capacity == 0 {
            return Err(EventPlaneError::InvalidConfig("subscription_capacity must be at least 1"));
        }
        if self.subscription_bytes_max < NATS_MAX_PAYLOAD_DEFAULT {
            return Err(EventPlaneError::InvalidConfig(
                "subscription_bytes_max must hold one message of NATS's default max_payload (1 MiB)",
            ));
        }
        self.subjects().map(drop)
    }

    /// The subjects to subscribe to, in a deterministic order.
    pub fn subjects(&self) -> Result<Vec<String>, EventPlaneError> {
        let namespaces: Vec<Option<&str>> = match &self.namespaces {
            NatsNamespaces::All => vec![None],
            NatsNamespaces::Only(names) if names.is_empty() => {
                return Err(EventPlaneError::InvalidConfig("no namespace to watch"));
            }
            NatsNamespaces::Only(names) => names.iter().map(|name| Some(name.as_str())).collect(),
        };
        let mut subjects = Vec::with_capacity(namespaces.len() * 2);
        for namespace in namespaces {
            for topic in [KV_EVENTS_TOPIC, KV_METRICS_TOPIC] {
                subjects.push(nats_wildcard_subject(namespace, topic)?);
            }
        }
        Ok(subjects)
    }
}

/// `namespace.{ns}.component.*.endpoint.*.{topic}`, or `namespace.*....` when `namespace` is
/// `None`.
///
/// The namespace is escaped exactly as publishers escape it (the rule of
/// [`event_subject_prefix`]), so a namespace like `team.a` is watched as `team%2Ea`. `topic` must
/// be one of the literal topics ([`KV_EVENTS_TOPIC`], [`KV_METRICS_TOPIC`]).
pub fn nats_wildcard_subject(
    namespace: Option<&str>,
    topic: &str,
) -> Result<String, EventPlaneError> {
    let namespace_segment = match namespace {
        None => "*".to_owned(),
        Some(name) => escaped_namespace(name)?,
    };
    Ok(format!("namespace.{namespace_segment}.component.*.endpoint.*.{topic}"))
}

/// The subject segment of `namespace`, derived through the shared subject encoder.
fn escaped_namespace(namespace: &str) -> Result<String, EventPlaneError> {
    let invalid = |reason: String| EventPlaneError::InvalidNamespace {
        namespace: namespace.to_owned(),
        reason,
    };
    let probe =
        EndpointPath::new(namespace, "c", "e").map_err(|error| invalid(error.to_string()))?;
    event_subject_prefix(&probe)
        .strip_prefix("namespace.")
        .and_then(|rest| rest.strip_suffix(".component.c.endpoint.e"))
        .map(str::to_owned)
        .ok_or_else(|| invalid("the shared subject encoder changed its layout".to_owned()))
}

/// Decode one NATS message into a fact: the endpoint comes from `subject` (parsed once per
/// subject, through `subjects`), the fact from `body`.
pub(crate) fn decode_nats_message(
    subjects: &mut SubjectCache,
    subject: &str,
    body: &[u8],
) -> Result<DcInput, InputError> {
    let parsed = subjects.parse(subject)?;
    let endpoint = parsed.endpoint.clone();
    match parsed.topic.as_str() {
        KV_EVENTS_TOPIC => decode_kv_events_message(endpoint, body).map(DcInput::KvEvents),
        KV_METRICS_TOPIC => decode_kv_metrics_message(body)
            .map(|observation| DcInput::Load { endpoint, observation }),
        other => Err(InputError::UnexpectedTopic {
            expected: KV_EVENTS_TOPIC,
            found: other.chars().take(64).collect(),
        }),
    }
}

/// Wait before reconnection attempt number `attempts` (1-based): 0 for the first, then
/// doubling from [`NATS_RECONNECT_DELAY_INITIAL`] up to [`NATS_RECONNECT_DELAY_MAX`].
fn reconnect_delay(attempts: usize) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let doublings = u32::try_from(attempts - 2).unwrap_or(u32::MAX).min(16);
    NATS_RECONNECT_DELAY_INITIAL.saturating_mul(1u32 << doublings).min(NATS_RECONNECT_DELAY_MAX)
}

/// Subscribe to the watched `kv-events` and `kv_metrics` subjects and send every decoded message
/// into `sink` until `cancel` fires.
///
/// Returns `Ok(())` when cancelled; an error when the configuration is invalid, the client cannot
/// be created, a subscription is refused, the client closes for good, or `sink` is closed.
/// Malformed messages never stop the loop: they are counted in `counters` and dropped. Sending
/// into `sink` awaits capacity (backpressure), while cancellation stays prompt.
pub async fn run_nats_event_plane(
    config: NatsEventPlaneConfig,
    sink: InputSender,
    counters: EventPlaneCounters,
    cancel: CancellationToken,
) -> Result<(), EventPlaneError> {
    config.validate()?;
    let subjects = config.subjects()?;
    counters.bump(|stats| {
        stats.subscription_bytes_max =
            u64::try_from(config.subscription_bytes_max).unwrap_or(u64::MAX);
        stats.subscriptions = u64::try_from(subjects.len()).unwrap_or(u64::MAX);
    });
    // Whether any client of this plane has connected: refusals before that end the plane.
    let connected_once = Arc::new(AtomicBool::new(false));
    let mut payload_bytes_max = NATS_MAX_PAYLOAD_DEFAULT;
    let mut first_client = true;
    loop {
        let session = ClientSession {
            config: &config,
            subjects: &subjects,
            payload_bytes_max,
            first_client,
            connected_once: &connected_once,
            counters: &counters,
        };
        match session.run(&sink, &cancel).await? {
            SessionEnd::Cancelled => return Ok(()),
            SessionEnd::Rebuild { max_payload } => {
                counters.bump(|stats| increment(&mut stats.client_rebuilds));
                if first_client {
                    info!(
                        max_payload,
                        previous = payload_bytes_max,
                        "NATS server's max_payload differs from the default; rebuilding the client before subscribing"
                    );
                } else {
                    warn!(
                        max_payload,
                        previous = payload_bytes_max,
                        "NATS server advertises a larger max_payload; rebuilding the client (queued messages are lost)"
                    );
                }
                payload_bytes_max = max_payload;
                first_client = false;
            }
        }
    }
}

/// Why one client's session ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SessionEnd {
    /// `cancel` fired: the plane stops.
    Cancelled,
    /// The server advertises a `max_payload` the client's capacity was not derived from: a
    /// client built for it replaces this one.
    Rebuild {
        /// The advertised `max_payload`.
        max_payload: usize,
    },
}

/// One client of the plane, built for one `max_payload`.
struct ClientSession<'a> {
    config: &'a NatsEventPlaneConfig,
    subjects: &'a [String],
    /// The `max_payload` this client's capacity is derived from.
    payload_bytes_max: usize,
    /// The plane's first client: a server whose `max_payload` calls for another capacity
    /// rebuilds it (later clients rebuild only for a larger one, so the rebuilds are bounded).
    first_client: bool,
    connected_once: &'a Arc<AtomicBool>,
    counters: &'a EventPlaneCounters,
}

impl ClientSession<'_> {
    /// Connect, wait for the server's `INFO`, subscribe and deliver until cancelled, until an
    /// error, or until the server's `max_payload` calls for a rebuilt client.
    async fn run(
        &self,
        sink: &InputSender,
        cancel: &CancellationToken,
    ) -> Result<SessionEnd, EventPlaneError> {
        let config = self.config;
        let capacity = self.capacity_for(self.payload_bytes_max);
        // The first refusal before any connection succeeded; later ones are the client's to retry.
        let (refused_tx, mut refused) = mpsc::channel::<String>(1);
        let connected = Arc::new(Notify::new());
        let event_counters = self.counters.clone();
        let connected_once = Arc::clone(self.connected_once);
        let connected_notice = Arc::clone(&connected);
        let options = ConnectOptions::new()
            .name(&config.client_name)
            .retry_on_initial_connect()
            .subscription_capacity(capacity)
            .connection_timeout(config.connection_timeout)
            .reconnect_delay_callback(reconnect_delay)
            .event_callback(move |event| {
                let counters = event_counters.clone();
                let refused_tx = refused_tx.clone();
                let connected_once = Arc::clone(&connected_once);
                let connected_notice = Arc::clone(&connected_notice);
                async move {
                    if matches!(event, Event::Connected) {
                        connected_once.store(true, Ordering::Relaxed);
                        connected_notice.notify_one();
                    }
                    if let Some(reason) = refusal(&event)
                        && !connected_once.load(Ordering::Relaxed)
                    {
                        let _ = refused_tx.try_send(reason);
                    }
                    note_client_event(&counters, &event);
                }
            });
        let options = config.security.apply(options)?;
        let connecting = tokio::select! {
            biased;
            () = cancel.cancelled() => return Ok(SessionEnd::Cancelled),
            connecting = options.connect(config.server_url.as_str()) => connecting,
        };
        let client = connecting.map_err(|error| EventPlaneError::NatsConnect {
            server: config.server_url.clone(),
            detail: error.to_string(),
        })?;
        // A flush completes once the client is connected, after it has stored the server's INFO.
        tokio::select! {
            biased;
            () = cancel.cancelled() => return Ok(SessionEnd::Cancelled),
            Some(reason) = refused.recv() => return Err(self.refused(reason)),
            flushed = client.flush() => flushed.map_err(|error| EventPlaneError::NatsConnect {
                server: config.server_url.clone(),
                detail: error.to_string(),
            })?,
        }
        let max_payload = client.server_info().max_payload;
        let differs = if self.first_client {
            self.capacity_for(max_payload) != capacity
        } else {
            self.shrinks(max_payload, capacity)
        };
        if differs {
            return Ok(SessionEnd::Rebuild { max_payload });
        }
        self.counters.bump(|stats| {
            stats.subscription_capacity = u64::try_from(capacity).unwrap_or(u64::MAX);
            stats.server_max_payload_bytes = u64::try_from(max_payload).unwrap_or(u64::MAX);
        });

        let mut subscriptions = Vec::with_capacity(self.subjects.len());
        for subject in self.subjects {
            let subscriber = client.subscribe(subject.clone()).await.map_err(|error| {
                EventPlaneError::NatsSubscribe {
                    subject: subject.clone(),
                    detail: error.to_string(),
                }
            })?;
            subscriptions.push(subscriber);
        }
        info!(server = %config.server_url, subjects = ?self.subjects, auth = config.security.auth.method(),
            tls = config.security.tls.is_some() || config.server_url.starts_with("tls://"),
            subscription_capacity = capacity, subscription_bytes_max = config.subscription_bytes_max,
            max_payload, "NATS event plane subscribed");
        // Fair across subjects: a busy kv-events stream cannot starve kv_metrics.
        let drain_limit = capacity.saturating_mul(subscriptions.len());
        let mut messages = futures::stream::select_all(subscriptions);
        // Messages keep being taken while the node's queue is full: the client's queues are
        // emptied at every wake-up, and past the backlog's budget messages are dropped here,
        // counted.
        let mut intake = Intake {
            counters: self.counters,
            backlog: Backlog::new(config.subscription_bytes_max),
            backlog_peak: 0,
            subjects: SubjectCache::new(),
        };
        loop {
            let front_weight = intake.backlog.front_weight();
            tokio::select! {
                biased;
                () = cancel.cancelled() => return Ok(SessionEnd::Cancelled),
                Some(reason) = refused.recv() => return Err(self.refused(reason)),
                () = connected.notified() => {
                    if let Some(rebuild) = self.grown(&client, capacity) {
                        return Ok(rebuild);
                    }
                    // A reconnection that keeps the client: the server in effect may differ.
                    let max_payload = u64::try_from(client.max_payload()).unwrap_or(u64::MAX);
                    self.counters.bump(|stats| stats.server_max_payload_bytes = max_payload);
                }
                // Cancel-safe: a reservation that loses the race holds nothing, and the input
                // stays in the backlog.
                room = sink.reserve(front_weight.unwrap_or(0)), if front_weight.is_some() => {
                    let Ok(room) = room else { return Err(EventPlaneError::SinkClosed) };
                    intake.feed(Some(room), sink)?;
                }
                message = messages.next() => {
                    let Some(message) = message else {
                        warn!("NATS subscriptions ended");
                        return Err(EventPlaneError::SubscriptionsClosed);
                    };
                    if let Some(rebuild) = self.grown(&client, capacity) {
                        return Ok(rebuild);
                    }
                    intake.take(&message, sink)?;
                    // Everything else the client has queued: it fills its queues from a whole
                    // poll of its socket before the plane runs, so emptying them at every
                    // wake-up is what bounds them by a poll's reads rather than by their
                    // capacity in messages. At most the queues' capacity per turn, so that a
                    // client filling them from another thread as fast as they drain cannot keep
                    // the plane from its cancellation.
                    let (_, ended) = drain_ready(&mut messages, drain_limit, |message| {
                        intake.take(&message, sink)
                    })
                    .await?;
                    if ended {
                        warn!("NATS subscriptions ended");
                        return Err(EventPlaneError::SubscriptionsClosed);
                    }
                    if let Some(rebuild) = self.grown(&client, capacity) {
                        return Ok(rebuild);
                    }
                }
            }
        }
    }

    /// A rebuild, if the client's server now advertises a larger `max_payload` than this
    /// client's `capacity` was derived from, and the capacity derived from it is smaller (after
    /// a reconnection).
    fn grown(&self, client: &Client, capacity: usize) -> Option<SessionEnd> {
        let max_payload = client.max_payload();
        self.shrinks(max_payload, capacity).then_some(SessionEnd::Rebuild { max_payload })
    }

    /// The subscription capacity a client built for `max_payload` gets.
    fn capacity_for(&self, max_payload: usize) -> usize {
        let config = self.config;
        nats_subscription_capacity(
            config.subscription_bytes_max,
            max_payload,
            config.subscription_capacity,
        )
    }

    /// Whether a server advertising `max_payload` calls for a smaller capacity than `capacity`
    /// (only a larger `max_payload` can: the rebuilds are bounded).
    fn shrinks(&self, max_payload: usize, capacity: usize) -> bool {
        max_payload > self.payload_bytes_max && self.capacity_for(max_payload) < capacity
    }

    fn refused(&self, reason: String) -> EventPlaneError {
        let config = self.config;
        warn!(server = %config.server_url, %reason, auth = config.security.auth.method(),
            "NATS refused the connection");
        EventPlaneError::NatsRefused { server: config.server_url.clone(), reason }
    }
}

/// Take every item `stream` has ready now, at most `limit`, through `take`, outside tokio's
/// cooperative budget (which would end the turn after 128 items of a tokio channel). Returns
/// how many were taken and whether the stream ended, or the first error of `take`.
async fn drain_ready<S, E>(
    stream: &mut S,
    limit: usize,
    mut take: impl FnMut(S::Item) -> Result<(), E>,
) -> Result<(usize, bool), E>
where
    S: futures::Stream + Unpin,
{
    let mut taken = 0;
    tokio::task::unconstrained(std::future::poll_fn(|cx| {
        loop {
            if taken >= limit {
                return Poll::Ready(Ok((taken, false)));
            }
            match stream.poll_next_unpin(cx) {
                Poll::Ready(Some(item)) => {
                    if let Err(error) = take(item) {
                        return Poll::Ready(Err(error));
                    }
                    taken += 1;
                }
                Poll::Ready(None) => return Poll::Ready(Ok((taken, true))),
                Poll::Pending => return Poll::Ready(Ok((taken, false))),
            }
        }
    }))
    .await
}

/// What the plane does with each message it takes off the client: decode it, then hand it to
/// the node, or hold it in the byte-bounded backlog while the node's queue is full.
struct Intake<'a> {
    counters: &'a EventPlaneCounters,
    backlog: Backlog,
    backlog_peak: usize,
    subjects: SubjectCache,
}

impl Intake<'_> {
    /// Decode `message` and deliver it, or hold it; a malformed message is counted and dropped.
    fn take(
        &mut self,
        message: &async_nats::Message,
        sink: &InputSender,
    ) -> Result<(), EventPlaneError> {
        let decoded =
            decode_nats_message(&mut self.subjects, message.subject.as_str(), &message.payload);
        self.counters.record(&decoded);
        let input = match decoded {
            Ok(input) => input,
            Err(error) => {
                debug!(subject = %message.subject, %error, "dropping malformed NATS message");
                return Ok(());
            }
        };
        // Nothing waiting and room in the node's queue: straight through.
        if self.backlog.bytes() == 0 {
            let Ok(room) = sink.try_reserve(input.weight_bytes()) else {
                return Err(EventPlaneError::SinkClosed);
            };
            if let Some(room) = room {
                room.send(input);
                self.counters.bump(|stats| increment(&mut stats.delivered));
                return Ok(());
            }
        }
        let dropped = self.backlog.offer(input);
        if dropped > 0 {
            self.counters.bump(|stats| {
                stats.backlog_drops = stats.backlog_drops.saturating_add(dropped);
            });
        }
        if self.backlog.bytes() > self.backlog_peak {
            self.backlog_peak = self.backlog.bytes();
            let peak = u64::try_from(self.backlog_peak).unwrap_or(u64::MAX);
            self.counters.bump(|stats| {
                stats.backlog_bytes_peak = stats.backlog_bytes_peak.max(peak);
            });
        }
        Ok(())
    }

    /// Move held inputs into the node's queue, in the backlog's order, while it has room: the
    /// first into `reserved` (room already reserved for the backlog's front), if given.
    fn feed(
        &mut self,
        mut reserved: Option<InputPermit<'_>>,
        sink: &InputSender,
    ) -> Result<(), EventPlaneError> {
        while let Some(weight) = self.backlog.front_weight() {
            let room = match reserved.take() {
                Some(room) => room,
                None => match sink.try_reserve(weight) {
                    Ok(Some(room)) => room,
                    Ok(None) => return Ok(()),
                    Err(_) => return Err(EventPlaneError::SinkClosed),
                },
            };
            if let Some(input) = self.backlog.pop() {
                room.send(input);
                self.counters.bump(|stats| increment(&mut stats.delivered));
            }
        }
        Ok(())
    }
}

/// The reason of a client event that means the server will not take these credentials or this
/// TLS setup (as opposed to a server that is down).
fn refusal(event: &Event) -> Option<String> {
    let text = match event {
        Event::ClientError(ClientError::Other(text)) => text.as_str(),
        Event::ServerError(async_nats::ServerError::AuthorizationViolation) => {
            "authorization violation"
        }
        _ => return None,
    };
    let refused = ["authorization violation", "failed signing nonce", "TLS error"]
        .iter()
        .any(|kind| text.contains(kind));
    refused.then(|| text.chars().take(256).collect())
}

fn note_client_event(counters: &EventPlaneCounters, event: &Event) {
    match event {
        Event::Connected => {
            info!("NATS event plane connected");
            counters.bump(|stats| increment(&mut stats.connects));
        }
        Event::Disconnected => {
            warn!("NATS event plane disconnected");
            counters.bump(|stats| increment(&mut stats.disconnects));
        }
        Event::SlowConsumer(subscription) => {
            // One notice per dropped message: under an overload that is thousands a second, so
            // the log takes the 1st, 2nd, 4th, ... with the total (the metric has every one).
            let mut drops = 0;
            counters.bump(|stats| {
                increment(&mut stats.client_drops);
                drops = stats.client_drops;
            });
            if drops.is_power_of_two() {
                warn!(
                    subscription,
                    drops, "NATS client dropped a message of a slow subscription (total so far)"
                );
            }
        }
        Event::ClientError(error) => {
            debug!(%error, "NATS client error");
            counters.bump(|stats| increment(&mut stats.connect_failures));
        }
        Event::ServerError(error) => warn!(%error, "NATS server error"),
        Event::LameDuckMode | Event::Draining | Event::Closed => {
            info!(%event, "NATS client state change");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::inputs::{InputErrorKind, event_subject};

    #[test]
    fn wildcard_subjects_escape_namespaces_like_publishers() {
        assert_eq!(
            nats_wildcard_subject(Some("dynamo"), KV_EVENTS_TOPIC).unwrap(),
            "namespace.dynamo.component.*.endpoint.*.kv-events"
        );
        assert_eq!(
            nats_wildcard_subject(None, KV_METRICS_TOPIC).unwrap(),
            "namespace.*.component.*.endpoint.*.kv_metrics"
        );
        let escaped = nats_wildcard_subject(Some("team.a b"), KV_EVENTS_TOPIC).unwrap();
        assert_eq!(escaped, "namespace.team%2Ea%20b.component.*.endpoint.*.kv-events");
        // The publisher's subject for an endpoint of that namespace matches the wildcard.
        let endpoint = EndpointPath::new("team.a b", "backend", "generate").unwrap();
        let published = event_subject(&endpoint, KV_EVENTS_TOPIC);
        assert_eq!(
            published,
            "namespace.team%2Ea%20b.component.backend.endpoint.generate.kv-events"
        );
        assert!(matches!(
            nats_wildcard_subject(Some("a/b"), KV_EVENTS_TOPIC),
            Err(EventPlaneError::InvalidNamespace { .. })
        ));
    }

    #[test]
    fn subjects_cover_both_topics_per_namespace_in_order() {
        let only = NatsNamespaces::Only(["b".to_owned(), "a".to_owned()].into());
        let config = NatsEventPlaneConfig::new(DEFAULT_NATS_SERVER, only);
        assert_eq!(
            config.subjects().unwrap(),
            vec![
                "namespace.a.component.*.endpoint.*.kv-events",
                "namespace.a.component.*.endpoint.*.kv_metrics",
                "namespace.b.component.*.endpoint.*.kv-events",
                "namespace.b.component.*.endpoint.*.kv_metrics",
            ]
        );
        let none = NatsEventPlaneConfig::new(DEFAULT_NATS_SERVER, NatsNamespaces::Only([].into()));
        assert!(matches!(none.subjects(), Err(EventPlaneError::InvalidConfig(_))));
    }

    #[test]
    fn messages_decode_with_the_endpoint_of_their_subject() {
        let payload = rmp_serde::to_vec_named(&serde_json::json!({
            "worker_id": 7, "dp_rank": 1, "kv_used_blocks": 3}))
        .unwrap();
        let envelope =
            kvrelay_core::inputs::encode_event_envelope(&kvrelay_core::inputs::EventEnvelope {
                publisher_id: 1,
                sequence: 0,
                published_at_ms: 0,
                topic: KV_METRICS_TOPIC,
                payload: &payload,
            })
            .unwrap();
        let subject = "namespace.team%2Ea.component.backend.endpoint.generate.kv_metrics";
        let mut subjects = SubjectCache::new();
        let first = decode_nats_message(&mut subjects, subject, &envelope).unwrap();
        let DcInput::Load { endpoint, observation } = &first else {
            panic!("not a load report");
        };
        assert_eq!(*endpoint, EndpointPath::new("team.a", "backend", "generate").unwrap());
        assert_eq!(observation.kv_used_blocks, Some(3));
        // The second message on the subject takes its parse from the cache: the same fact.
        assert_eq!(decode_nats_message(&mut subjects, subject, &envelope).unwrap(), first);
        assert_eq!(subjects.len(), 1);
        // The same body on the kv-events subject is the wrong topic, not a panic, each time.
        let wrong = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
        for _ in 0..2 {
            let error = decode_nats_message(&mut subjects, wrong, &envelope).unwrap_err();
            assert_eq!(error.kind(), InputErrorKind::UnexpectedTopic);
        }
        let error = decode_nats_message(&mut subjects, "namespace.x", &envelope).unwrap_err();
        assert_eq!(error.kind(), InputErrorKind::MalformedSubject);
    }

    /// The plane empties a tokio channel in one turn, past the cooperative budget that ends a
    /// plain poll loop after 128 items; an error of `take` stops it, the limit ends the turn,
    /// and an ended stream is said.
    #[tokio::test(flavor = "current_thread")]
    async fn draining_takes_everything_ready_in_one_turn() {
        let (tx, mut rx) = mpsc::channel::<u32>(2000);
        for item in 0..1000 {
            tx.try_send(item).unwrap();
        }
        // A plain loop under the budget stops early (what the drain exists to avoid).
        let constrained = std::future::poll_fn(|cx| {
            let mut count = 0;
            while let Poll::Ready(Some(_)) = rx.poll_recv(cx) {
                count += 1;
            }
            Poll::Ready(count)
        })
        .await;
        assert!(constrained < 1000, "the budget did not end the loop: {constrained}");
        tokio::task::yield_now().await;
        let mut stream = futures::stream::poll_fn(|cx| rx.poll_recv(cx));
        let mut seen = Vec::new();
        let drained = drain_ready(&mut stream, usize::MAX, |item| {
            seen.push(item);
            Ok::<(), ()>(())
        })
        .await;
        assert_eq!(drained, Ok((1000 - constrained, false)));
        assert_eq!(seen, (constrained as u32..1000).collect::<Vec<_>>(), "in order");

        for item in 0..10 {
            tx.try_send(item).unwrap();
        }
        let failed =
            drain_ready(&mut stream, 100, |item| if item == 3 { Err(item) } else { Ok(()) });
        assert_eq!(failed.await, Err(3), "the first error stops the drain");
        let limited = drain_ready(&mut stream, 4, |_| Ok::<(), ()>(())).await;
        assert_eq!(limited, Ok((4, false)), "no more than the limit in one turn");
        drop(tx);
        let rest = drain_ready(&mut stream, 100, |_| Ok::<(), ()>(())).await;
        assert_eq!(rest, Ok((2, true)), "what was left, then the end");
    }

    #[test]
    fn the_capacity_is_the_byte_budget_over_max_payload_within_its_bounds() {
        let mib = 1 << 20;
        let budget = NATS_SUBSCRIPTION_BYTES_MAX_DEFAULT;
        let messages = NATS_SUBSCRIPTION_CAPACITY_DEFAULT;
        let min = NATS_SUBSCRIPTION_CAPACITY_MIN;
        // NATS's default max_payload and larger ones: a poll's reads of small messages fit.
        assert_eq!(nats_subscription_capacity(budget, NATS_MAX_PAYLOAD_DEFAULT, messages), min);
        assert_eq!(nats_subscription_capacity(budget, 8 * mib, messages), min);
        assert_eq!(nats_subscription_capacity(budget, 64 * mib + 1, messages), min);
        assert_eq!(nats_subscription_capacity(budget, 32 * 1024, messages), min);
        // Small max_payloads under a larger budget: the budget over max_payload, rounded down, up
        // to the message bound.
        let gib = 1 << 30;
        assert_eq!(nats_subscription_capacity(gib, 32 * 1024, messages), 32_768);
        assert_eq!(nats_subscription_capacity(gib, 3 * 10_000, messages), 35_791);
        assert_eq!(nats_subscription_capacity(gib, 1024, messages), messages);
        assert_eq!(nats_subscription_capacity(budget, 0, messages), messages);
        // The message bound wins over the minimum.
        assert_eq!(nats_subscription_capacity(budget, mib, 16), 16);
        assert_eq!(nats_subscription_capacity(budget, usize::MAX, 0), 1);
        for max_payload in [1, 1000, 64 * 1024, mib, 5 * mib, 64 * mib] {
            let capacity = nats_subscription_capacity(budget, max_payload, usize::MAX);
            assert!(capacity >= min, "{max_payload}");
            assert!(capacity == min || capacity * max_payload <= budget, "{max_payload}");
        }
    }

    #[test]
    fn configurations_with_bad_bounds_are_refused() {
        let namespaces = NatsNamespaces::Only(["dynamo".to_owned()].into());
        let config = NatsEventPlaneConfig::new(DEFAULT_NATS_SERVER, namespaces);
        assert!(config.validate().is_ok());
        let refused = |config: NatsEventPlaneConfig| match config.validate() {
            Err(EventPlaneError::InvalidConfig(reason)) => reason,
            other => panic!("accepted: {other:?}"),
        };
        let reason = refused(NatsEventPlaneConfig { subscription_capacity: 0, ..config.clone() });
        assert!(reason.contains("subscription_capacity"), "{reason}");
        for bytes in [0, 1, NATS_MAX_PAYLOAD_DEFAULT - 1] {
            let reason =
                refused(NatsEventPlaneConfig { subscription_bytes_max: bytes, ..config.clone() });
            assert!(reason.contains("subscription_bytes_max"), "{reason}");
        }
        let smallest = NatsEventPlaneConfig {
            subscription_bytes_max: NATS_MAX_PAYLOAD_DEFAULT,
            ..config.clone()
        };
        assert!(smallest.validate().is_ok());
        let nowhere =
            NatsEventPlaneConfig { namespaces: NatsNamespaces::Only([].into()), ..config };
        assert!(matches!(nowhere.validate(), Err(EventPlaneError::InvalidConfig(_))));
    }

    /// Counts the WARN events it sees.
    struct WarnCount(Arc<std::sync::atomic::AtomicU64>);

    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for WarnCount {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if *event.metadata().level() == tracing::Level::WARN {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    #[test]
    fn every_client_drop_is_counted_and_the_log_takes_powers_of_two() {
        use tracing_subscriber::layer::SubscriberExt;
        let warnings = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let subscriber = tracing_subscriber::registry().with(WarnCount(warnings.clone()));
        let counters = EventPlaneCounters::new();
        tracing::subscriber::with_default(subscriber, || {
            for _ in 0..1000 {
                note_client_event(&counters, &Event::SlowConsumer(1));
            }
        });
        assert_eq!(counters.snapshot().client_drops, 1000);
        // 1, 2, 4, ..., 512: ten lines for a thousand drops.
        assert_eq!(warnings.load(Ordering::Relaxed), 10);
    }

    #[test]
    fn reconnect_delays_grow_to_their_bound() {
        assert_eq!(reconnect_delay(0), Duration::ZERO);
        assert_eq!(reconnect_delay(1), Duration::ZERO);
        assert_eq!(reconnect_delay(2), NATS_RECONNECT_DELAY_INITIAL);
        assert_eq!(reconnect_delay(3), NATS_RECONNECT_DELAY_INITIAL * 2);
        assert_eq!(reconnect_delay(usize::MAX), NATS_RECONNECT_DELAY_MAX);
        let mut previous = Duration::ZERO;
        for attempts in 0..64 {
            let delay = reconnect_delay(attempts);
            assert!(delay >= previous && delay <= NATS_RECONNECT_DELAY_MAX);
            previous = delay;
        }
    }
}
