//! [`RecoveryClient`]: the async shell that sends recovery queries to workers and receives their
//! call-home answers (dynamo-planes-wire §A.1, §A.7, §A.8).
//!
//! Ownership and concurrency:
//!
//! - The client owns one TCP listener (the response listener, advertised in every request) and
//!   one accept task. The accept task reads each incoming connection's handshake (bounded in
//!   time, at most [`CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX`] at once) and hands the connection to
//!   the pending query whose subject it names; unknown subjects are closed and counted. The
//!   listener is unauthenticated (Dynamo's workers present nothing but the subject), so it
//!   defends by position: a connection while no query is pending is closed at once, and at the
//!   handshake bound the oldest unfinished handshake is closed to admit the new connection. A
//!   worker's call-home sends its handshake as soon as it connects, so connections that never
//!   send one cannot hold the slots an answer needs.
//! - Each worker address (`host:port` of its request-plane server) has one pooled request
//!   connection, and **at most one query in flight**. Decision: Dynamo's worker serves recovery
//!   queries one at a time (a 1-permit semaphore guards tree dumps), so pipelining would only
//!   move the queueing from the relay into the worker while making ACK matching depend on FIFO
//!   order and leaving a stale ACK behind every timed-out query. With one query per connection
//!   at a time, the ACK read after a request always belongs to it; a query that fails before its
//!   ACK has been read drops the connection instead of returning it to the pool. Queries for
//!   several ranks of one worker process therefore queue in the relay, each within its own
//!   timeout.
//! - Dropping the client stops the accept task and closes the listener and pooled connections.
//!
//! Every query runs under its caller's timeout; the error names the phase it was in.
//!
//! Answer bytes, bounded per answer and together:
//!
//! - one answer's frames may total [`RecoveryClientConfig::response_bytes_max`]: each frame's
//!   declared length is checked against what is left of that bound before any of it is buffered
//!   ([`RecoveryError::ResponseTooLarge`] otherwise);
//! - all answers being read at once share [`RecoveryClientConfig::answers_bytes_max`] (default
//!   [`RECOVERY_ANSWERS_BYTES_MAX`]). Invariant: an answer holds at least the buffer capacity it
//!   has allocated for its frames, and reserves each allocation before making it. A frame's
//!   header (checked against [`CONTROL_FRAME_BYTES_MAX`]) is reserved whole; its body, whose
//!   length was checked against the per-answer bound, is reserved step by step as its buffer
//!   grows: at most 1 MiB (`ITEM_READ_CHUNK_BYTES`) before its first byte, then each step at
//!   most what has arrived so far, so a peer that declares a large body and sends little holds
//!   little. The bytes are held until the answer is decoded and handed over, or the call fails
//!   or is dropped (a cancelled call returns them at once).
//! - A reservation is granted only while the free bytes still cover all that the answer holding
//!   the most could still reserve ([`answer_budget`](super::answer_budget) states the rule and
//!   why it cannot deadlock: the answer holding the most never waits). Otherwise the call
//!   **waits** without reading further (the worker's sends back up into TCP); waiting
//!   reservations are granted in arrival order as each passes the rule. The wait counts in
//!   [`RequestPlaneStats::answer_bytes_waits`] and ends when a release lets it pass, or at the
//!   call's own timeout ([`RecoveryError::Timeout`] in [`QueryPhase::ReceivingResponse`]; the
//!   core retries within its attempt bound, then degrades the rank). Not counted: each
//!   call-home's fixed 64 KiB read buffer (bounded by the pending queries), and the decoded
//!   answer once handed over (the caller's); a cancelled call whose body is being decoded on
//!   the executor frees that memory only when the decode ends.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rand_core::Rng;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedMutexGuard, oneshot};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::{debug, warn};

use super::RecoveryError;
use super::answer_budget::{AnswerBudget, AnswerBytes};
use super::frame::{
    Ack, TWO_PART_PREFIX_BYTES, TwoPartPrefix, encode_request_frame, encode_two_part,
};
use super::message::{
    PayloadCodec, QueryIds, decode_control_frame, decode_handshake, decode_item_frame,
    encode_control_message, encode_request_body, encode_request_headers,
};
use super::stream::{FrameKind, ResponseStream, StreamFrame, classify_frame};
use crate::runtime::{BlockingExecutor, run_blocking};
use kvrelay_core::inputs::{RecoveryTarget, RequestPlaneTransport};
use kvrelay_core::rng::{RelayRng, rng_from_seed};
use kvrelay_core::sources::{RecoveryRequest, RecoveryResponse};

/// Default bound of one response stream's bytes (all frames after the handshake).
///
/// A tree dump is one item in one frame: 480,000 blocks took 44.6 MB (about 93 bytes per block)
/// in the 1.6.1 captures, so 128 MiB holds a dump of about 1.4 million blocks. A larger stream
/// fails the query with [`RecoveryError::ResponseTooLarge`] before its excess is buffered.
pub const RECOVERY_RESPONSE_BYTES_MAX: usize = 128 << 20;

/// Default bound of the bytes of all answers being read at once (all frames of every answer not
/// yet handed over): two answers at [`RECOVERY_RESPONSE_BYTES_MAX`]. Without it, the worst case
/// was that bound times [`PENDING_QUERIES_MAX`].
pub const RECOVERY_ANSWERS_BYTES_MAX: usize = 256 << 20;
// The default must hold one answer at the largest bound a setting may give it.
const _: () = assert!(RECOVERY_ANSWERS_BYTES_MAX >= RECOVERY_RESPONSE_BYTES_MAX);

/// Largest header part of any frame (handshake, prologue, sentinel are ~100 bytes).
pub const CONTROL_FRAME_BYTES_MAX: usize = 64 << 10;

/// Largest ACK text (rejections are one line, e.g. 89 bytes for an unknown endpoint).
pub const ACK_TEXT_BYTES_MAX: usize = 64 << 10;

/// Default bound of queries waiting for a call-home at once.
pub const PENDING_QUERIES_MAX: usize = 1024;

/// Default bound of worker addresses with a pooled connection.
pub const WORKER_CONNECTIONS_MAX: usize = 1024;

/// Call-home connections whose handshake is being read at once; at the bound the oldest is
/// closed to make room for the newest.
pub const CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX: usize = 64;

/// Default bound of reading one call-home handshake.
pub const CALL_HOME_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long an answer that arrived before its ACK waits for that ACK before being returned
/// anyway (the connection is then dropped rather than pooled).
pub const ACK_GRACE_AFTER_ANSWER: Duration = Duration::from_secs(1);

/// Growth step of a large item's receive buffer: it grows only as bytes arrive.
const ITEM_READ_CHUNK_BYTES: usize = 1 << 20;

/// Item bodies up to this size are decoded on the calling task; larger ones on the executor.
const INLINE_DECODE_BYTES_MAX: usize = 64 << 10;

/// Longest wait after a failed `accept` (e.g. out of file descriptors).
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What a query was doing when it failed or timed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum QueryPhase {
    /// Waiting for the worker's previous query to finish.
    WaitingForWorker = 0,
    /// Connecting to the worker's request-plane server.
    Connecting = 1,
    /// Writing the request frame.
    Sending = 2,
    /// Waiting for the worker to call home.
    AwaitingCallHome = 3,
    /// Reading the response stream.
    ReceivingResponse = 4,
    /// The answer is in; waiting for the ACK.
    AwaitingAck = 5,
}

impl QueryPhase {
    fn from_u8(value: u8) -> Self {
        match value {
            0 => QueryPhase::WaitingForWorker,
            1 => QueryPhase::Connecting,
            2 => QueryPhase::Sending,
            3 => QueryPhase::AwaitingCallHome,
            4 => QueryPhase::ReceivingResponse,
            _ => QueryPhase::AwaitingAck,
        }
    }
}

impl fmt::Display for QueryPhase {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            QueryPhase::WaitingForWorker => "waiting for the worker's previous query",
            QueryPhase::Connecting => "connecting to the worker",
            QueryPhase::Sending => "sending the request",
            QueryPhase::AwaitingCallHome => "waiting for the worker to call home",
            QueryPhase::ReceivingResponse => "receiving the response stream",
            QueryPhase::AwaitingAck => "waiting for the ACK",
        })
    }
}

/// Configuration of a [`RecoveryClient`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveryClientConfig {
    /// Where the response listener binds (default `127.0.0.1:0`, an OS-assigned port).
    pub listen_address: SocketAddr,
    /// The address advertised to workers; `None` advertises the bound address, which must then
    /// be a specific IP (workers cannot dial `0.0.0.0`).
    pub advertise_address: Option<SocketAddr>,
    /// Bound of one TCP connect to a worker (non-zero).
    pub connect_timeout: Duration,
    /// Bound of one response stream's bytes (at least [`CONTROL_FRAME_BYTES_MAX`]).
    pub response_bytes_max: usize,
    /// Bound of the bytes buffered by all answers being read at once (at least
    /// `response_bytes_max`, so every answer within its own bound can complete alone); a call
    /// whose next reservation would leave too little for the answer holding the most waits
    /// within its timeout (see the module documentation).
    pub answers_bytes_max: usize,
    /// Bound of queries waiting for a call-home at once (at least 1).
    pub pending_queries_max: usize,
    /// Bound of worker addresses with a pooled connection (at least 1).
    pub worker_connections_max: usize,
    /// Bound of reading one call-home handshake (non-zero).
    pub handshake_timeout: Duration,
    /// Seed of the generator of request ids and call-home subjects (from the relay's RNG).
    pub id_seed: u64,
}

impl RecoveryClientConfig {
    /// Loopback listener, default bounds, ids drawn from `id_seed`.
    #[must_use]
    pub fn new(id_seed: u64) -> Self {
        RecoveryClientConfig {
            listen_address: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            advertise_address: None,
            connect_timeout: Duration::from_secs(5),
            response_bytes_max: RECOVERY_RESPONSE_BYTES_MAX,
            answers_bytes_max: RECOVERY_ANSWERS_BYTES_MAX,
            pending_queries_max: PENDING_QUERIES_MAX,
            worker_connections_max: WORKER_CONNECTIONS_MAX,
            handshake_timeout: CALL_HOME_HANDSHAKE_TIMEOUT,
            id_seed,
        }
    }

    /// Like [`new`](Self::new), with the listener taken from Dynamo's variables
    /// `DYN_TCP_RESPONSE_STREAM_HOST` (an IP address; default `127.0.0.1`) and
    /// `DYN_TCP_RESPONSE_STREAM_PORT` (default 0).
    pub fn from_env(id_seed: u64) -> Result<Self, RecoveryError> {
        let mut config = Self::new(id_seed);
        if let Some(host) = non_empty_env("DYN_TCP_RESPONSE_STREAM_HOST") {
            let ip = host.parse::<IpAddr>().map_err(|_| {
                RecoveryError::InvalidConfig("DYN_TCP_RESPONSE_STREAM_HOST is not an IP address")
            })?;
            config.listen_address.set_ip(ip);
        }
        if let Some(port) = non_empty_env("DYN_TCP_RESPONSE_STREAM_PORT") {
            let port = port.parse::<u16>().map_err(|_| {
                RecoveryError::InvalidConfig("DYN_TCP_RESPONSE_STREAM_PORT is not a port")
            })?;
            config.listen_address.set_port(port);
        }
        Ok(config)
    }

    fn validate(&self) -> Result<(), RecoveryError> {
        if self.connect_timeout.is_zero() || self.handshake_timeout.is_zero() {
            return Err(RecoveryError::InvalidConfig("timeouts must be non-zero"));
        }
        if self.response_bytes_max < CONTROL_FRAME_BYTES_MAX {
            return Err(RecoveryError::InvalidConfig("response_bytes_max below one control frame"));
        }
        if self.answers_bytes_max < self.response_bytes_max {
            return Err(RecoveryError::InvalidConfig("answers_bytes_max below response_bytes_max"));
        }
        if self.pending_queries_max == 0 || self.worker_connections_max == 0 {
            return Err(RecoveryError::InvalidConfig("query and connection bounds must be >= 1"));
        }
        if self.advertise_address.is_some_and(|address| address.ip().is_unspecified()) {
            return Err(RecoveryError::InvalidConfig("advertise_address must be a specific IP"));
        }
        Ok(())
    }
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|value| value.trim().to_owned()).filter(|value| !value.is_empty())
}

/// What a [`RecoveryClient`] has done so far. Counts saturate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestPlaneStats {
    /// Queries started.
    pub queries: u64,
    /// Queries that returned an answer.
    pub answered: u64,
    /// Queries that failed, timeouts included.
    pub failed: u64,
    /// Queries that timed out.
    pub timeouts: u64,
    /// Request connections opened.
    pub connections_opened: u64,
    /// Queries sent on a pooled connection.
    pub connections_reused: u64,
    /// Call-home connections whose subject matched no pending query (late or foreign).
    pub call_homes_unmatched: u64,
    /// Call-home connections closed unread because [`CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX`]
    /// newer ones arrived before their handshake did.
    pub call_homes_refused: u64,
    /// Call-home connections with an unreadable or late handshake.
    pub call_homes_malformed: u64,
    /// Times a call reading an answer waited for bytes of the answers' shared budget
    /// ([`RecoveryClientConfig::answers_bytes_max`]).
    pub answer_bytes_waits: u64,
    /// Bytes of the shared answer budget held now.
    pub answer_bytes_in_use: u64,
    /// Most bytes of the shared answer budget ever held at once (never above the budget).
    pub answer_bytes_peak: u64,
    /// The shared answer budget ([`RecoveryClientConfig::answers_bytes_max`]).
    pub answer_bytes_max: u64,
}

/// One worker's pooled request connection; its lock serializes the worker's queries.
type WorkerSlot = Arc<tokio::sync::Mutex<Option<TcpStream>>>;

struct Shared {
    config: RecoveryClientConfig,
    /// The `host:port` put into every request's `connection_info`.
    advertised: String,
    executor: Arc<dyn BlockingExecutor>,
    /// Call-home subject -> the query waiting for that connection.
    pending: Mutex<BTreeMap<String, oneshot::Sender<TcpStream>>>,
    workers: Mutex<BTreeMap<String, WorkerSlot>>,
    ids: Mutex<RelayRng>,
    stats: Mutex<RequestPlaneStats>,
    answer_budget: AnswerBudget,
}

/// Lock a std mutex whose data stays consistent even if a holder panicked (every critical
/// section here is a single map or counter update).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn bump(counter: &mut u64) {
    *counter = counter.saturating_add(1);
}

impl Shared {
    fn count(&self, update: impl FnOnce(&mut RequestPlaneStats)) {
        update(&mut lock(&self.stats));
    }

    /// The slot of `address`, created if needed; evicts idle slots at the bound.
    fn worker_slot(&self, address: &str) -> Result<WorkerSlot, RecoveryError> {
        let mut workers = lock(&self.workers);
        if let Some(slot) = workers.get(address) {
            return Ok(Arc::clone(slot));
        }
        if workers.len() >= self.config.worker_connections_max {
            // A slot referenced only by the map has no query in flight: closing it is safe.
            workers.retain(|_, slot| Arc::strong_count(slot) > 1);
        }
        if workers.len() >= self.config.worker_connections_max {
            return Err(RecoveryError::TooManyWorkers);
        }
        let slot = WorkerSlot::default();
        workers.insert(address.to_owned(), Arc::clone(&slot));
        Ok(slot)
    }

    fn next_ids(&self) -> QueryIds {
        let mut rng = lock(&self.ids);
        QueryIds { request_id: uuid_v4(&mut rng), subject: uuid_v4(&mut rng) }
    }
}

/// UUID version-4 text from the seeded generator.
fn uuid_v4(rng: &mut RelayRng) -> String {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&rng.next_u64().to_be_bytes());
    bytes[8..].copy_from_slice(&rng.next_u64().to_be_bytes());
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("{}-{}-{}-{}-{}", &hex[0..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..32])
}

/// A query's claim on its call-home connection; dropping it withdraws the claim.
struct PendingCall {
    shared: Arc<Shared>,
    subject: String,
    receiver: Option<oneshot::Receiver<TcpStream>>,
}

impl PendingCall {
    fn register(shared: &Arc<Shared>, subject: &str) -> Result<Self, RecoveryError> {
        let (sender, receiver) = oneshot::channel();
        let mut pending = lock(&shared.pending);
        if pending.len() >= shared.config.pending_queries_max {
            return Err(RecoveryError::TooManyPending);
        }
        pending.insert(subject.to_owned(), sender);
        Ok(PendingCall {
            shared: Arc::clone(shared),
            subject: subject.to_owned(),
            receiver: Some(receiver),
        })
    }

    async fn connection(&mut self) -> Result<TcpStream, RecoveryError> {
        let receiver = self.receiver.take().ok_or(RecoveryError::Closed)?;
        receiver.await.map_err(|_| RecoveryError::Closed)
    }
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        lock(&self.shared.pending).remove(&self.subject);
    }
}

/// Sends recovery queries to workers over Dynamo's TCP request plane.
///
/// Invariants: at most one query in flight per worker address; every query bounded by its
/// timeout; every buffer bounded (see the module bounds); the response listener lives exactly as
/// long as the client.
pub struct RecoveryClient {
    shared: Arc<Shared>,
    response_address: SocketAddr,
    _accept_task: DropGuard,
}

impl fmt::Debug for RecoveryClient {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("RecoveryClient")
            .field("response_address", &self.response_address)
            .field("advertised", &self.shared.advertised)
            .finish_non_exhaustive()
    }
}

impl RecoveryClient {
    /// Bind the response listener and start accepting call-home connections. Large answers are
    /// decoded through `executor`.
    pub async fn bind(
        config: RecoveryClientConfig,
        executor: Arc<dyn BlockingExecutor>,
    ) -> Result<Self, RecoveryError> {
        config.validate()?;
        let bind_error = |error: io::Error| RecoveryError::Bind {
            address: config.listen_address.to_string(),
            detail: error.to_string(),
        };
        let listener = TcpListener::bind(config.listen_address).await.map_err(bind_error)?;
        let response_address = listener.local_addr().map_err(bind_error)?;
        let advertised = match config.advertise_address {
            Some(address) => address,
            None if response_address.ip().is_unspecified() => {
                return Err(RecoveryError::InvalidConfig(
                    "a listener on an unspecified address needs an advertise_address",
                ));
            }
            None => response_address,
        };
        let shared = Arc::new(Shared {
            ids: Mutex::new(rng_from_seed(config.id_seed)),
            advertised: advertised.to_string(),
            executor,
            pending: Mutex::new(BTreeMap::new()),
            workers: Mutex::new(BTreeMap::new()),
            stats: Mutex::new(RequestPlaneStats::default()),
            answer_budget: AnswerBudget::new(config.answers_bytes_max, config.response_bytes_max),
            config,
        });
        let stop = CancellationToken::new();
        crate::runtime::spawn(accept_call_homes(listener, Arc::clone(&shared), stop.clone()));
        Ok(RecoveryClient { shared, response_address, _accept_task: stop.drop_guard() })
    }

    /// The bound address of the response listener.
    #[must_use]
    pub fn response_address(&self) -> SocketAddr {
        self.response_address
    }

    /// The address workers are told to call home to.
    #[must_use]
    pub fn advertised_address(&self) -> &str {
        &self.shared.advertised
    }

    /// A copy of the counters.
    #[must_use]
    pub fn stats(&self) -> RequestPlaneStats {
        let mut stats = lock(&self.shared.stats).clone();
        let budget = self.shared.answer_budget.reading();
        stats.answer_bytes_waits = budget.waits;
        stats.answer_bytes_in_use = u64::try_from(budget.in_use).unwrap_or(u64::MAX);
        stats.answer_bytes_peak = u64::try_from(budget.peak).unwrap_or(u64::MAX);
        stats.answer_bytes_max =
            u64::try_from(self.shared.config.answers_bytes_max).unwrap_or(u64::MAX);
        stats
    }

    /// Ask `target` for `request` with the MessagePack body codec (Dynamo 1.6.1's default),
    /// waiting at most `timeout` in total.
    pub async fn query(
        &self,
        target: &RecoveryTarget,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> Result<RecoveryResponse, RecoveryError> {
        self.query_with_codec(target, PayloadCodec::MsgPack, request, timeout).await
    }

    /// Ask `target` for `request` with the body codec the target advertises
    /// ([`PayloadCodec::from_advertised`]), waiting at most `timeout` in total (including the
    /// wait for the worker's previous query).
    pub async fn query_with_codec(
        &self,
        target: &RecoveryTarget,
        codec: PayloadCodec,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> Result<RecoveryResponse, RecoveryError> {
        self.shared.count(|stats| bump(&mut stats.queries));
        let phase = AtomicU8::new(QueryPhase::WaitingForWorker as u8);
        let outcome =
            match tokio::time::timeout(timeout, self.run_query(target, codec, request, &phase))
                .await
            {
                Ok(outcome) => outcome,
                Err(_elapsed) => Err(RecoveryError::Timeout {
                    timeout,
                    phase: QueryPhase::from_u8(phase.load(Ordering::Relaxed)),
                }),
            };
        self.shared.count(|stats| match &outcome {
            Ok(_) => bump(&mut stats.answered),
            Err(error) => {
                bump(&mut stats.failed);
                if matches!(error, RecoveryError::Timeout { .. }) {
                    bump(&mut stats.timeouts);
                }
            }
        });
        if let Err(error) = &outcome {
            debug!(instance_id = target.instance_id, %error, "recovery query failed");
        }
        outcome
    }

    async fn run_query(
        &self,
        target: &RecoveryTarget,
        codec: PayloadCodec,
        request: RecoveryRequest,
        phase: &AtomicU8,
    ) -> Result<RecoveryResponse, RecoveryError> {
        let set_phase = |value: QueryPhase| phase.store(value as u8, Ordering::Relaxed);
        let (address, path) = split_target(target)?;
        let slot = self.shared.worker_slot(address)?;
        let mut slot_guard: OwnedMutexGuard<Option<TcpStream>> = slot.lock_owned().await;
        set_phase(QueryPhase::Connecting);
        // Taken out of the pool: it goes back only once this query's ACK has been read.
        let mut connection = match slot_guard.take() {
            Some(pooled) if pooled_connection_is_usable(&pooled) => {
                self.shared.count(|stats| bump(&mut stats.connections_reused));
                pooled
            }
            _ => {
                let fresh = connect(address, self.shared.config.connect_timeout).await?;
                self.shared.count(|stats| bump(&mut stats.connections_opened));
                fresh
            }
        };
        let ids = self.shared.next_ids();
        let mut pending = PendingCall::register(&self.shared, &ids.subject)?;
        let headers = encode_request_headers(&ids, path);
        let control = encode_control_message(&ids, codec, &self.shared.advertised);
        let body = encode_request_body(codec, &request)?;
        let frame = encode_request_frame(path, &headers, &encode_two_part(&control, &body))?;
        set_phase(QueryPhase::Sending);
        connection.write_all(&frame).await.map_err(io_error("request"))?;
        set_phase(QueryPhase::AwaitingCallHome);
        let (outcome, ack_read) =
            self.exchange(&mut connection, &mut pending, codec, &request, phase).await;
        if ack_read {
            *slot_guard = Some(connection);
        }
        outcome
    }

    /// Wait for the ACK and the answer, in whichever order they come. Returns the outcome and
    /// whether the ACK was read (the connection is then in sync and can be pooled).
    async fn exchange(
        &self,
        connection: &mut TcpStream,
        pending: &mut PendingCall,
        codec: PayloadCodec,
        request: &RecoveryRequest,
        phase: &AtomicU8,
    ) -> (Result<RecoveryResponse, RecoveryError>, bool) {
        let ack = read_ack(connection);
        let answer = async {
            let call_home = pending.connection().await?;
            phase.store(QueryPhase::ReceivingResponse as u8, Ordering::Relaxed);
            self.receive_answer(call_home, codec, request).await
        };
        tokio::pin!(ack);
        tokio::pin!(answer);
        let mut acked = false;
        loop {
            tokio::select! {
                biased;
                read = &mut ack, if !acked => match read {
                    Ok(Ack::Accepted) => acked = true,
                    // A refused request is never called home.
                    Ok(Ack::Rejected(message)) => {
                        return (Err(RecoveryError::Rejected { message }), true);
                    }
                    Err(error) => return (Err(error), false),
                },
                received = &mut answer => {
                    if acked || received.is_err() {
                        return (received, acked);
                    }
                    // The ACK may trail the stream; give it a short grace, then answer anyway.
                    phase.store(QueryPhase::AwaitingAck as u8, Ordering::Relaxed);
                    let late = tokio::time::timeout(ACK_GRACE_AFTER_ANSWER, &mut ack).await;
                    return (received, matches!(late, Ok(Ok(Ack::Accepted))));
                }
            }
        }
    }

    /// Read the response stream of one call-home connection (handshake already consumed), then
    /// close the connection. The frames' bytes are held of the shared answer budget until this
    /// returns.
    async fn receive_answer(
        &self,
        call_home: TcpStream,
        codec: PayloadCodec,
        request: &RecoveryRequest,
    ) -> Result<RecoveryResponse, RecoveryError> {
        let bytes_max = self.shared.config.response_bytes_max;
        let mut budget = bytes_max;
        let mut held = self.shared.answer_budget.open();
        let mut reader = BufReader::with_capacity(64 << 10, call_home);
        let mut stream = ResponseStream::new();
        loop {
            let read =
                read_frame(&mut reader, &mut budget, bytes_max, "call-home", Some(&mut held));
            let Some(frame) = read.await? else {
                // The worker closed the connection: complete only after `complete_final`.
                return stream.finish();
            };
            let decoded = match frame.kind {
                FrameKind::Control => StreamFrame::Control(decode_control_frame(&frame.header)?),
                FrameKind::Item => {
                    StreamFrame::Item(self.decode_item(codec, frame.body, request).await?)
                }
            };
            if stream.handle(decoded)? {
                break;
            }
        }
        // Closing after the sentinel is the caller's part of the protocol; send nothing else.
        drop(reader);
        stream.finish()
    }

    async fn decode_item(
        &self,
        codec: PayloadCodec,
        body: Vec<u8>,
        request: &RecoveryRequest,
    ) -> Result<super::message::ItemFrame, RecoveryError> {
        if body.len() <= INLINE_DECODE_BYTES_MAX {
            return decode_item_frame(codec, &body, request);
        }
        let request = *request;
        run_blocking(self.shared.executor.as_ref(), move || {
            decode_item_frame(codec, &body, &request)
        })
        .await
        .map_err(|_| RecoveryError::DecoderLost)?
    }
}

/// `host:port` and the endpoint path of a TCP recovery target: `transport.tcp` split at its
/// first `/`, the path kept verbatim.
fn split_target(target: &RecoveryTarget) -> Result<(&str, &str), RecoveryError> {
    let RequestPlaneTransport::Tcp(address) = &target.transport else {
        return Err(RecoveryError::UnsupportedTransport("nats_tcp".to_owned()));
    };
    let invalid = |reason| RecoveryError::InvalidTarget { address: address.clone(), reason };
    let (host_port, path) =
        address.split_once('/').ok_or_else(|| invalid("no '/' before the endpoint path"))?;
    if host_port.is_empty() {
        return Err(invalid("empty host:port"));
    }
    if path.is_empty() {
        return Err(invalid("empty endpoint path"));
    }
    Ok((host_port, path))
}

fn io_error(connection: &'static str) -> impl Fn(io::Error) -> RecoveryError {
    move |error| RecoveryError::Io { connection, detail: error.to_string() }
}

async fn connect(address: &str, timeout: Duration) -> Result<TcpStream, RecoveryError> {
    let failed = |detail: String| RecoveryError::Connect { address: address.to_owned(), detail };
    let stream = tokio::time::timeout(timeout, TcpStream::connect(address))
        .await
        .map_err(|_| failed(format!("no connection within {timeout:?}")))?
        .map_err(|error| failed(error.to_string()))?;
    stream.set_nodelay(true).map_err(|error| failed(error.to_string()))?;
    Ok(stream)
}

/// A pooled connection is usable when nothing is waiting to be read on it: end of stream means
/// the worker closed it (e.g. restarted), unexpected bytes mean it is out of sync.
fn pooled_connection_is_usable(connection: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    matches!(connection.try_read(&mut probe), Err(error) if error.kind() == io::ErrorKind::WouldBlock)
}

/// Read one ACK frame from the request connection.
async fn read_ack(connection: &mut TcpStream) -> Result<Ack, RecoveryError> {
    let length = connection.read_u32().await.map_err(io_error("request"))?;
    let length = usize::try_from(length).unwrap_or(usize::MAX);
    if length > ACK_TEXT_BYTES_MAX {
        return Err(RecoveryError::Protocol(format!("ACK of {length} bytes")));
    }
    let mut text = vec![0u8; length];
    connection.read_exact(&mut text).await.map_err(io_error("request"))?;
    Ok(Ack::from_text(&text))
}

/// One two-part message, sized and checked.
struct Frame {
    kind: FrameKind,
    header: Vec<u8>,
    body: Vec<u8>,
}

/// Read the next two-part message: `Ok(None)` at a clean end of stream (before any byte of a
/// frame). Every frame is charged to `budget` before its parts are buffered; control headers are
/// bounded by [`CONTROL_FRAME_BYTES_MAX`]. With `shared`, every allocation of the frame's
/// buffers is first reserved from the answers' shared budget.
async fn read_frame<R: AsyncRead + Unpin>(
    reader: &mut R,
    budget: &mut usize,
    bytes_max: usize,
    connection: &'static str,
    mut shared: Option<&mut AnswerBytes<'_>>,
) -> Result<Option<Frame>, RecoveryError> {
    let mut prefix_bytes = [0u8; TWO_PART_PREFIX_BYTES];
    let mut filled = 0;
    while filled < TWO_PART_PREFIX_BYTES {
        let read = reader.read(&mut prefix_bytes[filled..]).await.map_err(io_error(connection))?;
        if read == 0 {
            if filled == 0 {
                return Ok(None);
            }
            return Err(RecoveryError::StreamEnded { after: "part of a frame prefix" });
        }
        filled += read;
    }
    let prefix = TwoPartPrefix::parse(&prefix_bytes);
    let kind = classify_frame(prefix.header_len, prefix.body_len)?;
    let header_len = usize::try_from(prefix.header_len).unwrap_or(usize::MAX);
    if header_len > CONTROL_FRAME_BYTES_MAX {
        return Err(RecoveryError::Protocol(format!("frame header of {header_len} bytes")));
    }
    let body_len = usize::try_from(prefix.body_len).unwrap_or(usize::MAX);
    let frame_len = TWO_PART_PREFIX_BYTES.saturating_add(header_len).saturating_add(body_len);
    *budget =
        budget.checked_sub(frame_len).ok_or(RecoveryError::ResponseTooLarge { max: bytes_max })?;
    if let Some(held) = shared.as_deref_mut() {
        held.reserve(header_len).await?;
    }
    let mut header = vec![0u8; header_len];
    reader.read_exact(&mut header).await.map_err(ended_or_io(connection))?;
    let body = read_growing(reader, body_len, connection, shared).await?;
    if !prefix.checksum_matches(&header, &body) {
        return Err(RecoveryError::Protocol("two-part checksum mismatch".to_owned()));
    }
    Ok(Some(Frame { kind, header, body }))
}

fn ended_or_io(connection: &'static str) -> impl Fn(io::Error) -> RecoveryError {
    move |error| {
        if error.kind() == io::ErrorKind::UnexpectedEof {
            RecoveryError::StreamEnded { after: "part of a frame" }
        } else {
            RecoveryError::Io { connection, detail: error.to_string() }
        }
    }
}

/// Read exactly `length` bytes into a buffer that grows (doubling from
/// [`ITEM_READ_CHUNK_BYTES`]) only as bytes arrive, so a large declared length costs memory only
/// once its bytes are really sent. The final capacity is at most `length`. With `shared`, each
/// growth is reserved from the answers' shared budget before it is allocated.
async fn read_growing<R: AsyncRead + Unpin>(
    reader: &mut R,
    length: usize,
    connection: &'static str,
    mut shared: Option<&mut AnswerBytes<'_>>,
) -> Result<Vec<u8>, RecoveryError> {
    let first = length.min(ITEM_READ_CHUNK_BYTES);
    if let Some(held) = shared.as_deref_mut() {
        held.reserve(first).await?;
    }
    let mut buffer = Vec::with_capacity(first);
    while buffer.len() < length {
        let remaining = length - buffer.len();
        if buffer.len() == buffer.capacity() {
            let grow = buffer.capacity().max(ITEM_READ_CHUNK_BYTES).min(remaining);
            if let Some(held) = shared.as_deref_mut() {
                held.reserve(grow).await?;
            }
            buffer.reserve_exact(grow);
        }
        let mut limited = (&mut *reader).take(u64::try_from(remaining).unwrap_or(u64::MAX));
        let read = limited.read_buf(&mut buffer).await.map_err(ended_or_io(connection))?;
        if read == 0 {
            return Err(ended_or_io(connection)(io::Error::from(io::ErrorKind::UnexpectedEof)));
        }
    }
    Ok(buffer)
}

/// The call-home handshakes being read, oldest first. Each is cancelled when it finishes (its
/// task holds a drop guard), so the live ones are those not yet cancelled.
#[derive(Default)]
struct HandshakeSlots {
    open: std::collections::VecDeque<CancellationToken>,
}

impl HandshakeSlots {
    /// A slot for a new handshake under `stop`; at the bound the oldest unfinished handshake
    /// is cancelled first, and `true` says one was.
    fn admit(&mut self, stop: &CancellationToken) -> (CancellationToken, bool) {
        self.open.retain(|slot| !slot.is_cancelled());
        let evicted = self.open.len() >= CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX;
        if evicted && let Some(oldest) = self.open.pop_front() {
            oldest.cancel();
        }
        let slot = stop.child_token();
        self.open.push_back(slot.clone());
        debug_assert!(self.open.len() <= CALL_HOME_HANDSHAKES_IN_FLIGHT_MAX);
        (slot, evicted)
    }
}

/// Accept call-home connections until `stop` fires; route each by its handshake.
async fn accept_call_homes(listener: TcpListener, shared: Arc<Shared>, stop: CancellationToken) {
    let mut slots = HandshakeSlots::default();
    let mut backoff = Duration::from_millis(1);
    loop {
        let accepted = tokio::select! {
            biased;
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, _peer)) => {
                backoff = Duration::from_millis(1);
                if lock(&shared.pending).is_empty() {
                    // No query asked for an answer: nothing this connection says can match.
                    shared.count(|stats| bump(&mut stats.call_homes_unmatched));
                    drop(stream);
                    continue;
                }
                let (slot, evicted) = slots.admit(&stop);
                if evicted {
                    shared.count(|stats| bump(&mut stats.call_homes_refused));
                }
                let shared = Arc::clone(&shared);
                crate::runtime::spawn(async move {
                    let _finished = slot.clone().drop_guard();
                    route_call_home(stream, &shared, &slot).await;
                });
            }
            Err(error) => {
                warn!(%error, "response listener accept failed; backing off");
                tokio::select! {
                    biased;
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = backoff.saturating_mul(2).min(ACCEPT_BACKOFF_MAX);
            }
        }
    }
}

/// Read a call-home handshake and hand the connection to the query it names, unless `slot` is
/// cancelled first (shutdown, or a newer connection took the slot).
async fn route_call_home(mut stream: TcpStream, shared: &Shared, slot: &CancellationToken) {
    let read = tokio::select! {
        biased;
        () = slot.cancelled() => return,
        read = tokio::time::timeout(shared.config.handshake_timeout, read_handshake(&mut stream)) => read,
    };
    let subject = match read {
        Ok(Ok(subject)) => subject,
        Ok(Err(error)) => {
            debug!(%error, "unreadable call-home handshake");
            shared.count(|stats| bump(&mut stats.call_homes_malformed));
            return;
        }
        Err(_elapsed) => {
            shared.count(|stats| bump(&mut stats.call_homes_malformed));
            return;
        }
    };
    let waiting = lock(&shared.pending).remove(&subject);
    let delivered = match waiting {
        Some(query) => query.send(stream).is_ok(),
        None => false,
    };
    if !delivered {
        debug!("call-home connection for no pending query; closing it");
        shared.count(|stats| bump(&mut stats.call_homes_unmatched));
    }
}

/// The first frame of a call-home connection: a header-only handshake naming the subject.
async fn read_handshake(stream: &mut TcpStream) -> Result<String, RecoveryError> {
    let mut budget = CONTROL_FRAME_BYTES_MAX;
    let frame = read_frame(stream, &mut budget, CONTROL_FRAME_BYTES_MAX, "call-home", None)
        .await?
        .ok_or(RecoveryError::StreamEnded { after: "connecting, before the handshake" })?;
    if frame.kind != FrameKind::Control {
        return Err(RecoveryError::Protocol("call-home without a handshake".to_owned()));
    }
    decode_handshake(&frame.header)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::model::identity::EndpointPath;

    fn target(transport: RequestPlaneTransport) -> RecoveryTarget {
        RecoveryTarget {
            endpoint: EndpointPath::new("dynamo", "small", "worker_kv_query_source_1bbe13eb67504f")
                .unwrap(),
            instance_id: 15_884_517_127_758_876_217,
            transport,
        }
    }

    #[test]
    fn targets_split_at_the_first_slash_and_keep_the_path_verbatim() {
        let captured = target(RequestPlaneTransport::Tcp(
            "127.0.0.1:39685/dc71242afcad0e39/dynamo/small/worker_kv_query_source_1bbe13eb67504f"
                .into(),
        ));
        assert_eq!(
            split_target(&captured).unwrap(),
            (
                "127.0.0.1:39685",
                "dc71242afcad0e39/dynamo/small/worker_kv_query_source_1bbe13eb67504f"
            )
        );
        for bad in ["127.0.0.1:1", "/path", "127.0.0.1:1/"] {
            let bad_target = target(RequestPlaneTransport::Tcp(bad.into()));
            assert!(matches!(split_target(&bad_target), Err(RecoveryError::InvalidTarget { .. })));
        }
        let nats = target(RequestPlaneTransport::NatsTcp("subject".into()));
        assert!(matches!(split_target(&nats), Err(RecoveryError::UnsupportedTransport(_))));
    }

    #[test]
    fn ids_are_version_4_uuids_and_reproducible_from_the_seed() {
        let mut first = rng_from_seed(7);
        let mut again = rng_from_seed(7);
        let id = uuid_v4(&mut first);
        assert_eq!(id, uuid_v4(&mut again));
        assert_eq!(id.len(), 36);
        let groups: Vec<&str> = id.split('-').collect();
        assert_eq!(groups.iter().map(|group| group.len()).collect::<Vec<_>>(), [8, 4, 4, 4, 12]);
        assert!(groups[2].starts_with('4'));
        assert!(matches!(groups[3].as_bytes()[0], b'8' | b'9' | b'a' | b'b'));
        assert_ne!(id, uuid_v4(&mut first));
    }

    #[test]
    fn configurations_are_validated() {
        let mut config = RecoveryClientConfig::new(1);
        assert!(config.validate().is_ok());
        config.response_bytes_max = 10;
        assert!(config.validate().is_err());
        let mut config = RecoveryClientConfig::new(1);
        config.advertise_address = Some("0.0.0.0:5".parse().unwrap());
        assert!(config.validate().is_err());
        let mut config = RecoveryClientConfig::new(1);
        config.pending_queries_max = 0;
        assert!(config.validate().is_err());
    }

    #[tokio::test]
    async fn frames_are_charged_to_the_budget_before_buffering() {
        let frame = encode_two_part(b"", &[0u8; 100]);
        let mut budget = 110;
        let read = read_frame(&mut frame.as_slice(), &mut budget, 110, "call-home", None).await;
        assert!(matches!(read, Err(RecoveryError::ResponseTooLarge { max: 110 })));

        // A declared length far beyond what is sent fails on the missing bytes, having buffered
        // only what arrived.
        let mut lying = encode_two_part(b"", b"");
        lying[8..16].copy_from_slice(&(50u64 << 20).to_be_bytes());
        lying.extend_from_slice(&[1, 2, 3]);
        let mut budget = usize::MAX;
        let read =
            read_frame(&mut lying.as_slice(), &mut budget, usize::MAX, "call-home", None).await;
        assert!(matches!(read, Err(RecoveryError::StreamEnded { .. })));

        let mut budget = 1000;
        let empty: &[u8] = &[];
        let read = read_frame(&mut &*empty, &mut budget, 1000, "call-home", None).await;
        assert!(read.unwrap().is_none());
        let mut budget = 1000;
        let partial: &[u8] = &[0, 0, 0];
        assert!(matches!(
            read_frame(&mut &*partial, &mut budget, 1000, "call-home", None).await,
            Err(RecoveryError::StreamEnded { .. })
        ));
    }

    #[tokio::test]
    async fn growing_reads_return_exactly_the_declared_bytes() {
        let data: Vec<u8> = (0..=255u8).cycle().take(3 * ITEM_READ_CHUNK_BYTES + 17).collect();
        let mut extra = data.clone();
        extra.extend_from_slice(b"next frame");
        let mut source = extra.as_slice();
        let read = read_growing(&mut source, data.len(), "call-home", None).await.unwrap();
        assert_eq!(read, data);
        assert!(read.capacity() <= data.len());
        assert_eq!(source, b"next frame");
    }
}
