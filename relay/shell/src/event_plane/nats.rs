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
//! Bounds: each subscription buffers at most
//! [`subscription_capacity`](NatsEventPlaneConfig::subscription_capacity) messages inside the
//! client; beyond that the client drops messages (counted as
//! [`client_drops`](super::EventPlaneStats::client_drops) slow-consumer notices). The server caps
//! one message at its `max_payload` (1 MiB by default).

use crate::node::InputSender;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_nats::{ClientError, ConnectOptions, Event};
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::EventPlaneError;
use super::counters::{EventPlaneCounters, increment};
use super::nats_auth::NatsSecurity;
use kvrelay_core::inputs::{
    DcInput, InputError, KV_EVENTS_TOPIC, KV_METRICS_TOPIC, decode_kv_events_message,
    decode_kv_metrics_message, event_subject_prefix, parse_event_subject,
};
use kvrelay_core::model::identity::EndpointPath;

/// The server used when `NATS_SERVER` is not set (Dynamo's default).
pub const DEFAULT_NATS_SERVER: &str = "nats://127.0.0.1:4222";

/// Messages buffered per subscription inside the client before it drops (slow consumer).
///
/// Normal messages are a few hundred bytes; the server caps one at 1 MiB, so the buffer holds at
/// most 8 GiB in a pathological burst of maximal messages and a few MiB in practice.
pub const NATS_SUBSCRIPTION_CAPACITY_DEFAULT: usize = 8192;

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
    /// Messages buffered per subscription inside the client (at least 1).
    pub subscription_capacity: usize,
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

/// Decode one NATS message into a fact: the endpoint comes from `subject`, the fact from `body`.
pub(crate) fn decode_nats_message(subject: &str, body: &[u8]) -> Result<DcInput, InputError> {
    let parsed = parse_event_subject(subject)?;
    match parsed.topic.as_str() {
        KV_EVENTS_TOPIC => decode_kv_events_message(parsed.endpoint, body).map(DcInput::KvEvents),
        KV_METRICS_TOPIC => decode_kv_metrics_message(body)
            .map(|observation| DcInput::Load { endpoint: parsed.endpoint, observation }),
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
    if config.subscription_capacity == 0 {
        return Err(EventPlaneError::InvalidConfig("subscription_capacity must be at least 1"));
    }
    let subjects = config.subjects()?;
    let event_counters = counters.clone();
    // The first refusal before any connection succeeded; later ones are the client's to retry.
    let (refused_tx, mut refused) = mpsc::channel::<String>(1);
    let connected_once = Arc::new(AtomicBool::new(false));
    let options = ConnectOptions::new()
        .name(&config.client_name)
        .retry_on_initial_connect()
        .subscription_capacity(config.subscription_capacity)
        .connection_timeout(config.connection_timeout)
        .reconnect_delay_callback(reconnect_delay)
        .event_callback(move |event| {
            let counters = event_counters.clone();
            let refused_tx = refused_tx.clone();
            let connected_once = Arc::clone(&connected_once);
            async move {
                if matches!(event, Event::Connected) {
                    connected_once.store(true, Ordering::Relaxed);
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
    let connected = tokio::select! {
        biased;
        () = cancel.cancelled() => return Ok(()),
        connected = options.connect(config.server_url.as_str()) => connected,
    };
    let client = connected.map_err(|error| EventPlaneError::NatsConnect {
        server: config.server_url.clone(),
        detail: error.to_string(),
    })?;
    let mut subscriptions = Vec::with_capacity(subjects.len());
    for subject in &subjects {
        let subscriber = client.subscribe(subject.clone()).await.map_err(|error| {
            EventPlaneError::NatsSubscribe { subject: subject.clone(), detail: error.to_string() }
        })?;
        subscriptions.push(subscriber);
    }
    info!(server = %config.server_url, ?subjects, auth = config.security.auth.method(),
        tls = config.security.tls.is_some() || config.server_url.starts_with("tls://"),
        "NATS event plane subscribed");
    // Fair across subjects: a busy kv-events stream cannot starve kv_metrics.
    let mut messages = futures::stream::select_all(subscriptions);
    loop {
        let message = tokio::select! {
            biased;
            () = cancel.cancelled() => return Ok(()),
            Some(reason) = refused.recv() => {
                warn!(server = %config.server_url, %reason, auth = config.security.auth.method(),
                    "NATS refused the connection");
                return Err(EventPlaneError::NatsRefused { server: config.server_url.clone(), reason });
            }
            message = messages.next() => message,
        };
        let Some(message) = message else {
            warn!("NATS subscriptions ended");
            return Err(EventPlaneError::SubscriptionsClosed);
        };
        let decoded = decode_nats_message(message.subject.as_str(), &message.payload);
        counters.record(&decoded);
        let input = match decoded {
            Ok(input) => input,
            Err(error) => {
                debug!(subject = %message.subject, %error, "dropping malformed NATS message");
                continue;
            }
        };
        tokio::select! {
            biased;
            () = cancel.cancelled() => return Ok(()),
            sent = sink.send(input) => {
                if sent.is_err() {
                    return Err(EventPlaneError::SinkClosed);
                }
                counters.bump(|stats| increment(&mut stats.delivered));
            }
        }
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
            warn!(subscription, "NATS client dropped messages of a slow subscription");
            counters.bump(|stats| increment(&mut stats.client_drops));
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
        let DcInput::Load { endpoint, observation } =
            decode_nats_message(subject, &envelope).unwrap()
        else {
            panic!("not a load report");
        };
        assert_eq!(endpoint, EndpointPath::new("team.a", "backend", "generate").unwrap());
        assert_eq!(observation.kv_used_blocks, Some(3));
        // The same body on the kv-events subject is the wrong topic, not a panic.
        let wrong = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
        let error = decode_nats_message(wrong, &envelope).unwrap_err();
        assert_eq!(error.kind(), InputErrorKind::UnexpectedTopic);
        let error = decode_nats_message("namespace.x", &envelope).unwrap_err();
        assert_eq!(error.kind(), InputErrorKind::MalformedSubject);
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
