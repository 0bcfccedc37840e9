//! The ZMQ event plane (`DYN_EVENT_PLANE=zmq`, direct mode; dynamo-planes-wire §B).
//!
//! Every worker publisher binds its own PUB socket per topic and advertises it in an
//! EventChannel discovery record. The discovery transport turns those records into
//! [`ChannelChange`]s; [`run_zmq_event_plane`] keeps exactly one subscription task per
//! advertised channel:
//!
//! - the task connects to the channel's endpoint (`tcp://host:port`) over TCP and speaks ZMTP
//!   as a SUB itself ([`super::zmtp`]): greeting, `READY`, then a subscription to the channel's
//!   topic (a byte-prefix filter on frame 0: `kv-events` or `kv_metrics`), in the `SUBSCRIBE`
//!   command form for a ZMTP 3.1 peer and the `0x01`+topic message form for a 3.0 peer;
//! - each 4-frame message `[topic, publisher_id u64 BE, sequence u64 BE, event frame]` is decoded
//!   with [`decode_zmq_event_message`], and the envelope must name the channel's publisher
//!   (otherwise it is counted in `publisher_mismatches` and dropped, which keeps a lingering
//!   record of a dead incarnation from duplicating a new incarnation's events);
//! - the endpoint of the fact is the channel's scope.
//!
//! A publisher that is not up yet (or has gone away) is retried: each connection attempt (TCP
//! connect, handshake, subscription) is bounded by
//! [`connect_timeout`](ZmqEventPlaneConfig::connect_timeout), and failed attempts back off
//! exponentially from [`ZMQ_RECONNECT_BACKOFF_INITIAL`] to [`ZMQ_RECONNECT_BACKOFF_MAX`]. A
//! session that ends (reset, close, protocol violation) is reopened the same way; the backoff
//! only restarts from its initial wait after a session that carried at least one message, so a
//! publisher that breaks the protocol at once is retried ever more slowly. Removing the channel
//! (or cancelling) stops its task.
//!
//! Bounds: at most [`ZMQ_CHANNELS_MAX`] channels at once (further upserts are refused and
//! counted). Every frame size a publisher declares is checked against
//! [`limits`](ZmqEventPlaneConfig::limits) before its body is read, and a multipart message is
//! bounded in frames and bytes as it grows; a violation is counted per kind in
//! [`zmtp_errors`](super::EventPlaneStats::zmtp_errors) and ends the session. PUB/SUB has no
//! replay and the publisher drops at its high-water mark, so loss shows up downstream as
//! `sequence` gaps.

use crate::node::InputSender;
use std::collections::BTreeMap;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::EventPlaneError;
use super::counters::{EventPlaneCounters, increment};
use super::zmtp::{
    ZmtpError, ZmtpEvent, ZmtpLimits, ZmtpSubDecoder, encode_greeting, encode_pong, encode_ready,
    encode_subscribe,
};
use kvrelay_core::inputs::{
    DcInput, EventChannelRecord, EventRecordKey, EventTransport, InputError, KV_EVENTS_TOPIC,
    KV_METRICS_TOPIC, decode_kv_event_batch, decode_load_observation, decode_zmq_event_message,
};

/// Most channels subscribed at once: 2 topics per worker rank publisher, so 2048 ranks.
pub const ZMQ_CHANNELS_MAX: usize = 4096;

/// Default bound of one connection attempt (TCP connect plus ZMTP handshake).
pub const ZMQ_CONNECT_TIMEOUT_DEFAULT: Duration = Duration::from_secs(2);

/// First wait after a failed connection attempt; it doubles per further failure.
pub const ZMQ_RECONNECT_BACKOFF_INITIAL: Duration = Duration::from_millis(100);

/// Longest wait between two connection attempts.
pub const ZMQ_RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// A change of the advertised ZMQ event channels, from the discovery transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelChange {
    /// A channel record was added or replaced. Records with another transport than ZMQ, or a
    /// topic other than `kv-events` / `kv_metrics`, are ignored (and counted).
    Upsert(EventChannelRecord),
    /// The channel record with this key went away.
    Remove(EventRecordKey),
}

/// Configuration of [`run_zmq_event_plane`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZmqEventPlaneConfig {
    /// Bound of one connection attempt (non-zero).
    pub connect_timeout: Duration,
    /// First wait after a failed attempt (non-zero).
    pub reconnect_backoff_initial: Duration,
    /// Longest wait between attempts (at least the initial wait).
    pub reconnect_backoff_max: Duration,
    /// Most channels at once (at most [`ZMQ_CHANNELS_MAX`]).
    pub channels_max: usize,
    /// Bounds on what a publisher may declare and send (frames, messages).
    pub limits: ZmtpLimits,
}

impl Default for ZmqEventPlaneConfig {
    fn default() -> Self {
        ZmqEventPlaneConfig {
            connect_timeout: ZMQ_CONNECT_TIMEOUT_DEFAULT,
            reconnect_backoff_initial: ZMQ_RECONNECT_BACKOFF_INITIAL,
            reconnect_backoff_max: ZMQ_RECONNECT_BACKOFF_MAX,
            channels_max: ZMQ_CHANNELS_MAX,
            limits: ZmtpLimits::default(),
        }
    }
}

impl ZmqEventPlaneConfig {
    fn validate(&self) -> Result<(), EventPlaneError> {
        if self.connect_timeout.is_zero() || self.reconnect_backoff_initial.is_zero() {
            return Err(EventPlaneError::InvalidConfig(
                "ZMQ timeouts and backoff must be non-zero",
            ));
        }
        if self.reconnect_backoff_max < self.reconnect_backoff_initial {
            return Err(EventPlaneError::InvalidConfig(
                "ZMQ backoff maximum below its initial wait",
            ));
        }
        if self.channels_max == 0 || self.channels_max > ZMQ_CHANNELS_MAX {
            return Err(EventPlaneError::InvalidConfig("ZMQ channels_max out of range"));
        }
        if self.limits.message_frames_max == 0 || self.limits.message_bytes_max == 0 {
            return Err(EventPlaneError::InvalidConfig("ZMQ message limits must be non-zero"));
        }
        Ok(())
    }
}

/// One running subscription task.
struct Subscription {
    endpoint: String,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

/// Keep one subscription per advertised ZMQ channel, as told by `changes`, and send every decoded
/// message into `sink` until `cancel` fires or `changes` closes.
///
/// Upserting a known channel with the same endpoint is a no-op; with another endpoint the old
/// subscription is replaced. Returns `Ok(())` after stopping every subscription (on cancellation
/// or when the discovery side closes `changes`); [`EventPlaneError::SinkClosed`] after stopping
/// them when the sink's receiver is dropped; or an error for an invalid configuration.
pub async fn run_zmq_event_plane(
    config: ZmqEventPlaneConfig,
    mut changes: mpsc::Receiver<ChannelChange>,
    sink: InputSender,
    counters: EventPlaneCounters,
    cancel: CancellationToken,
) -> Result<(), EventPlaneError> {
    config.validate()?;
    let mut subscriptions: BTreeMap<EventRecordKey, Subscription> = BTreeMap::new();
    loop {
        let change = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            () = sink.closed() => {
                stop_all(&mut subscriptions).await;
                return Err(EventPlaneError::SinkClosed);
            }
            change = changes.recv() => change,
        };
        let Some(change) = change else {
            info!("ZMQ channel changes closed; stopping the ZMQ event plane");
            break;
        };
        // Reap tasks that ended on their own (only a closed sink ends them early).
        subscriptions.retain(|_, subscription| !subscription.task.is_finished());
        match change {
            ChannelChange::Remove(key) => {
                if let Some(subscription) = subscriptions.remove(&key) {
                    info!(endpoint = %subscription.endpoint, topic = %key.topic, "ZMQ channel removed");
                    stop(subscription).await;
                }
            }
            ChannelChange::Upsert(record) => {
                let EventTransport::Zmq { endpoint } = &record.transport else {
                    counters.bump(|stats| increment(&mut stats.channels_ignored));
                    continue;
                };
                if record.topic != KV_EVENTS_TOPIC && record.topic != KV_METRICS_TOPIC {
                    counters.bump(|stats| increment(&mut stats.channels_ignored));
                    continue;
                }
                let key = EventRecordKey {
                    scope: record.scope.clone(),
                    topic: record.topic.clone(),
                    publisher_id: record.publisher_id,
                };
                if let Some(existing) = subscriptions.get(&key) {
                    if existing.endpoint == *endpoint {
                        continue;
                    }
                    if let Some(replaced) = subscriptions.remove(&key) {
                        stop(replaced).await;
                    }
                }
                if subscriptions.len() >= config.channels_max {
                    warn!(%endpoint, "ZMQ channel table full; channel refused");
                    counters.bump(|stats| increment(&mut stats.channels_refused));
                    continue;
                }
                info!(%endpoint, topic = %key.topic, publisher_id = key.publisher_id,
                      "connecting to ZMQ publisher");
                let stop_token = cancel.child_token();
                let task = crate::runtime::spawn(subscribe_channel(
                    config,
                    key.clone(),
                    endpoint.clone(),
                    sink.clone(),
                    counters.clone(),
                    stop_token.clone(),
                ));
                subscriptions.insert(
                    key,
                    Subscription { endpoint: endpoint.clone(), stop: stop_token, task },
                );
            }
        }
    }
    stop_all(&mut subscriptions).await;
    Ok(())
}

/// Stop every subscription, in key order.
async fn stop_all(subscriptions: &mut BTreeMap<EventRecordKey, Subscription>) {
    for (_, subscription) in std::mem::take(subscriptions) {
        stop(subscription).await;
    }
}

/// Stop one subscription and wait for its task (prompt: every await in it watches `stop`).
async fn stop(subscription: Subscription) {
    subscription.stop.cancel();
    if let Err(error) = subscription.task.await {
        warn!(endpoint = %subscription.endpoint, %error, "ZMQ subscription task failed");
    }
}

/// Most bytes asked of the socket per read: the input buffer grows with what the peer actually
/// sent, never with what it declared.
const READ_CHUNK_BYTES: usize = 64 << 10;

/// Why a session could not be opened or went on no longer.
#[derive(Debug)]
enum SessionError {
    /// The endpoint is not `tcp://host:port`.
    Endpoint,
    /// The connection failed or was reset.
    Io(std::io::Error),
    /// The peer closed the connection.
    Closed,
    /// The peer broke the protocol or a limit.
    Protocol(ZmtpError),
}

impl From<std::io::Error> for SessionError {
    fn from(error: std::io::Error) -> Self {
        SessionError::Io(error)
    }
}

impl From<ZmtpError> for SessionError {
    fn from(error: ZmtpError) -> Self {
        SessionError::Protocol(error)
    }
}

impl std::fmt::Display for SessionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SessionError::Endpoint => f.write_str("endpoint is not tcp://host:port"),
            SessionError::Io(error) => write!(f, "{error}"),
            SessionError::Closed => f.write_str("peer closed the connection"),
            SessionError::Protocol(error) => write!(f, "{error}"),
        }
    }
}

/// One TCP connection to a publisher speaking ZMTP, as a SUB.
struct ZmtpSession {
    stream: TcpStream,
    decoder: ZmtpSubDecoder,
    input: BytesMut,
}

impl ZmtpSession {
    /// Connect to `endpoint`, do the handshake and subscribe to `topic`.
    async fn open(endpoint: &str, topic: &str, limits: ZmtpLimits) -> Result<Self, SessionError> {
        let address = endpoint.strip_prefix("tcp://").ok_or(SessionError::Endpoint)?;
        let mut stream = TcpStream::connect(address).await?;
        let mut hello = encode_greeting().to_vec();
        hello.extend(encode_ready(b"SUB"));
        stream.write_all(&hello).await?;
        let mut session =
            ZmtpSession { stream, decoder: ZmtpSubDecoder::new(limits), input: BytesMut::new() };
        // Before its READY the decoder yields nothing else.
        let ZmtpEvent::Ready { subscribe_command } = session.next_event().await? else {
            return Err(SessionError::Protocol(ZmtpError::UnexpectedFrame));
        };
        let subscription = encode_subscribe(topic.as_bytes(), subscribe_command);
        session.stream.write_all(&subscription).await?;
        Ok(session)
    }

    /// The next event from the peer (cancel-safe: bytes read stay in the input buffer).
    async fn next_event(&mut self) -> Result<ZmtpEvent, SessionError> {
        loop {
            if let Some(event) = self.decoder.decode(&mut self.input)? {
                return Ok(event);
            }
            self.input.reserve(READ_CHUNK_BYTES);
            if self.stream.read_buf(&mut self.input).await? == 0 {
                return Err(SessionError::Closed);
            }
        }
    }
}

/// Why a connected session ended.
enum SessionEnd {
    /// The channel was stopped.
    Stopped,
    /// The connection failed; `delivered` when it had carried at least one message.
    Failed { delivered: bool },
}

/// The life of one channel: connect (bounded, with backoff), subscribe, receive until stopped.
///
/// The backoff grows over failed attempts and over sessions that ended before carrying a
/// message (e.g. a publisher that breaks a limit at once), and restarts from its initial wait
/// after a session that carried messages.
async fn subscribe_channel(
    config: ZmqEventPlaneConfig,
    key: EventRecordKey,
    endpoint: String,
    sink: InputSender,
    counters: EventPlaneCounters,
    stop: CancellationToken,
) {
    let mut backoff = config.reconnect_backoff_initial;
    loop {
        let opened = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            opened = tokio::time::timeout(
                config.connect_timeout,
                ZmtpSession::open(&endpoint, &key.topic, config.limits),
            ) => opened,
        };
        match opened {
            Ok(Ok(mut session)) => {
                counters.bump(|stats| increment(&mut stats.connects));
                debug!(%endpoint, topic = %key.topic, "ZMQ subscription established");
                match receive(&mut session, &config, &key, &sink, &counters, &stop).await {
                    Ok(SessionEnd::Stopped) | Err(SinkGone) => return,
                    Ok(SessionEnd::Failed { delivered }) => {
                        counters.bump(|stats| increment(&mut stats.disconnects));
                        if delivered {
                            backoff = config.reconnect_backoff_initial;
                        }
                    }
                }
            }
            Ok(Err(error)) => {
                debug!(%endpoint, %error, "ZMQ connection attempt failed");
                counters.bump(|stats| {
                    increment(&mut stats.connect_failures);
                    if let SessionError::Protocol(error) = &error {
                        stats.zmtp_errors.record(error);
                    }
                });
            }
            Err(_elapsed) => {
                debug!(%endpoint, "ZMQ connection attempt timed out");
                counters.bump(|stats| increment(&mut stats.connect_failures));
            }
        }
        tokio::select! {
            biased;
            () = stop.cancelled() => return,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = backoff.saturating_mul(2).min(config.reconnect_backoff_max);
    }
}

/// The sink's receiver is gone: nothing more to do.
struct SinkGone;

/// Receive, decode and forward messages until stopped or the session fails.
async fn receive(
    session: &mut ZmtpSession,
    config: &ZmqEventPlaneConfig,
    key: &EventRecordKey,
    sink: &InputSender,
    counters: &EventPlaneCounters,
    stop: &CancellationToken,
) -> Result<SessionEnd, SinkGone> {
    let mut delivered = false;
    loop {
        let received = tokio::select! {
            biased;
            () = stop.cancelled() => return Ok(SessionEnd::Stopped),
            received = session.next_event() => received,
        };
        let frames = match received {
            Ok(ZmtpEvent::Message(frames)) => frames,
            Ok(ZmtpEvent::Ping { context }) => {
                // A peer that does not read its PONGs is dropped after the connect bound.
                let pong = encode_pong(&context);
                let written = tokio::select! {
                    biased;
                    () = stop.cancelled() => return Ok(SessionEnd::Stopped),
                    written = tokio::time::timeout(
                        config.connect_timeout,
                        session.stream.write_all(&pong),
                    ) => written,
                };
                if !matches!(written, Ok(Ok(()))) {
                    counters.bump(|stats| increment(&mut stats.receive_errors));
                    return Ok(SessionEnd::Failed { delivered });
                }
                continue;
            }
            Ok(ZmtpEvent::Ready { .. }) => continue,
            Err(error) => {
                debug!(topic = %key.topic, %error, "ZMQ session ended; reconnecting");
                counters.bump(|stats| {
                    increment(&mut stats.receive_errors);
                    if let SessionError::Protocol(error) = &error {
                        stats.zmtp_errors.record(error);
                    }
                });
                return Ok(SessionEnd::Failed { delivered });
            }
        };
        delivered = true;
        let decoded = decode_channel_message(key, &frames);
        let input = match decoded {
            Ok(Some(input)) => {
                counters.record::<()>(&Ok(()));
                input
            }
            Ok(None) => {
                counters.bump(|stats| increment(&mut stats.publisher_mismatches));
                continue;
            }
            Err(error) => {
                debug!(topic = %key.topic, %error, "dropping malformed ZMQ message");
                counters.record::<()>(&Err(error));
                continue;
            }
        };
        tokio::select! {
            biased;
            () = stop.cancelled() => return Ok(SessionEnd::Stopped),
            sent = sink.send(input) => {
                if sent.is_err() {
                    return Err(SinkGone);
                }
                counters.bump(|stats| increment(&mut stats.delivered));
            }
        }
    }
}

/// Decode one message received on the channel `key`: `Ok(None)` when it is well-formed but
/// published by another incarnation than the channel's.
pub(crate) fn decode_channel_message(
    key: &EventRecordKey,
    message: &[Bytes],
) -> Result<Option<DcInput>, InputError> {
    let [topic, publisher, sequence, event] = message else {
        return Err(InputError::MalformedEventFrame { reason: "expected 4 frames" });
    };
    let frames = [&topic[..], &publisher[..], &sequence[..], &event[..]];
    let envelope = decode_zmq_event_message(&frames)?;
    if envelope.publisher_id != key.publisher_id {
        return Ok(None);
    }
    if key.topic == KV_METRICS_TOPIC {
        let observation = decode_load_observation(&envelope)?;
        return Ok(Some(DcInput::Load { endpoint: key.scope.clone(), observation }));
    }
    let batch = decode_kv_event_batch(key.scope.clone(), &envelope)?;
    Ok(Some(DcInput::KvEvents(batch)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::inputs::{
        EventEnvelope, InputErrorKind, encode_active_load, encode_event_envelope,
        encode_zmq_event_frame,
    };
    use kvrelay_core::model::identity::EndpointPath;

    fn key(topic: &str, publisher_id: u64) -> EventRecordKey {
        EventRecordKey {
            scope: EndpointPath::new("dynamo", "backend", "generate").unwrap(),
            topic: topic.to_owned(),
            publisher_id,
        }
    }

    fn metrics_message(publisher_id: u64) -> Vec<Bytes> {
        let observation = kvrelay_core::inputs::LoadObservation {
            source: kvrelay_core::model::kv_events::SourceKey { worker_id: 4, dp_rank: 0 },
            kv_used_blocks: Some(9),
            active_decode_blocks: None,
            active_prefill_tokens: None,
        };
        let payload = encode_active_load(&observation).unwrap();
        let envelope = encode_event_envelope(&EventEnvelope {
            publisher_id,
            sequence: 3,
            published_at_ms: 1,
            topic: KV_METRICS_TOPIC,
            payload: &payload,
        })
        .unwrap();
        vec![
            Bytes::from_static(b"kv_metrics"),
            Bytes::copy_from_slice(&publisher_id.to_be_bytes()),
            Bytes::copy_from_slice(&3u64.to_be_bytes()),
            Bytes::from(encode_zmq_event_frame(&envelope).unwrap()),
        ]
    }

    #[test]
    fn channel_messages_decode_to_facts_of_the_channel_scope() {
        let decoded = decode_channel_message(&key(KV_METRICS_TOPIC, 11), &metrics_message(11));
        let Ok(Some(DcInput::Load { endpoint, observation })) = decoded else {
            panic!("not a load fact: {decoded:?}");
        };
        assert_eq!(endpoint.to_string(), "dynamo/backend/generate");
        assert_eq!(observation.kv_used_blocks, Some(9));
    }

    #[test]
    fn messages_of_another_publisher_are_set_aside() {
        let decoded = decode_channel_message(&key(KV_METRICS_TOPIC, 12), &metrics_message(11));
        assert_eq!(decoded, Ok(None));
    }

    #[test]
    fn malformed_messages_are_typed_errors() {
        let two = vec![Bytes::from_static(b"kv-events"), Bytes::new()];
        let error = decode_channel_message(&key(KV_EVENTS_TOPIC, 1), &two).unwrap_err();
        assert_eq!(error.kind(), InputErrorKind::MalformedEventFrame);
        // A kv_metrics message arriving on a kv-events channel is the wrong topic.
        let error =
            decode_channel_message(&key(KV_EVENTS_TOPIC, 11), &metrics_message(11)).unwrap_err();
        assert_eq!(error.kind(), InputErrorKind::UnexpectedTopic);
    }

    #[test]
    fn invalid_configurations_are_rejected() {
        let zero = ZmqEventPlaneConfig { connect_timeout: Duration::ZERO, ..Default::default() };
        assert!(zero.validate().is_err());
        let inverted = ZmqEventPlaneConfig {
            reconnect_backoff_max: Duration::from_millis(1),
            ..Default::default()
        };
        assert!(inverted.validate().is_err());
        let too_many =
            ZmqEventPlaneConfig { channels_max: ZMQ_CHANNELS_MAX + 1, ..Default::default() };
        assert!(too_many.validate().is_err());
        assert!(ZmqEventPlaneConfig::default().validate().is_ok());
    }
}
