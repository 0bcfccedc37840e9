//! The relay host's side of the planes: one connection to the planes host carrying discovery
//! (list, then watch from the applied revision into the production
//! [`RecordDiffer`]), the event subscription (decoded by the production decoders) and the
//! recovery queries of [`PlanesRecovery`].
//!
//! Liveness: a turmoil partition drops TCP segments without breaking the connection, after
//! which the stream never delivers again; a hold only delays them. The relay cannot tell the
//! two apart from silence, so after [`SILENCE`] without a frame it *probes* with a fresh
//! connection (a `Ping`). If the old connection speaks first, it was only held and the probe is
//! dropped; if the probe answers while the old connection is still silent, the old one is dead
//! and the relay resumes on the probe: it watches from its last applied revision (or relists
//! when the planes host compacted it). A failed probe is retried every [`PROBE_RETRY`].

use kvrelay::node::InputSender;
use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, SinkExt, StreamExt};
use kvrelay::discovery_plane::{DiscoveryOutput, KeyForm, ListingEntry, ListingMode, RecordDiffer};
use kvrelay::node::RecoveryTransport;
use kvrelay::request_plane::PayloadCodec;
use kvrelay::request_plane::answer::read_answer_stream;
use kvrelay_core::discovery::DiscoveryScope;
use kvrelay_core::inputs::RecoveryTarget;
use kvrelay_core::sources::{RecoveryFailure, RecoveryRequest, RecoveryResponse};
use tokio::sync::{mpsc, oneshot};
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};
use turmoil::net::TcpStream;
use turmoil::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

use super::frame::{self, Item, ToPlanes, ToRelay};
use super::{PLANES_HOST, PLANES_PORT, decode_event};

/// Silence on the planes connection after which the relay probes.
pub const SILENCE: Duration = Duration::from_millis(300);
/// How long a connection attempt (or a probe's ping) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(250);
/// Wait between failed probes or connection attempts.
pub const PROBE_RETRY: Duration = Duration::from_millis(200);

type Reader = FramedRead<OwnedReadHalf, LengthDelimitedCodec>;
type Writer = FramedWrite<OwnedWriteHalf, LengthDelimitedCodec>;

/// One recovery query on its way to the planes host.
#[derive(Debug)]
struct Query {
    target: RecoveryTarget,
    request: RecoveryRequest,
    reply: oneshot::Sender<Result<RecoveryResponse, RecoveryFailure>>,
}

/// The relay's recovery transport over the planes connection.
#[derive(Debug, Clone)]
pub struct PlanesRecovery {
    queries: mpsc::UnboundedSender<Query>,
}

impl RecoveryTransport for PlanesRecovery {
    /// The query is sent on the current planes connection; it fails when no answer arrives
    /// within `timeout` (a partition, a hold, a connection replaced meanwhile).
    fn query(
        &self,
        target: RecoveryTarget,
        request: RecoveryRequest,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<RecoveryResponse, RecoveryFailure>> {
        let (reply, answer) = oneshot::channel();
        let sent = self.queries.send(Query { target, request, reply }).is_ok();
        Box::pin(async move {
            if !sent {
                return Err(RecoveryFailure::NotSent("the planes client is gone".to_owned()));
            }
            match tokio::time::timeout(timeout, answer).await {
                Ok(Ok(result)) => result,
                Ok(Err(_)) => Err(RecoveryFailure::Unreachable(
                    "the planes connection dropped the query".to_owned(),
                )),
                Err(_) => Err(RecoveryFailure::TimedOut),
            }
        })
    }
}

/// The relay host's planes client: feeds `inputs`, counts what its decoders refuse.
#[derive(Debug)]
pub struct PlanesClient {
    differ: RecordDiffer,
    applied: Option<u64>,
    decode_errors: Arc<AtomicU64>,
    queries: mpsc::UnboundedReceiver<Query>,
    /// Whether a [`PlanesRecovery`] can still send queries. A node that asks no worker (a
    /// journal replay answers its recovery calls from the journal) drops it at once: the client
    /// then only feeds inputs.
    queries_open: bool,
    /// Queries sent and not answered yet: the request (its answer is decoded for it) and the
    /// caller.
    pending: BTreeMap<
        u64,
        (RecoveryRequest, oneshot::Sender<Result<RecoveryResponse, RecoveryFailure>>),
    >,
    next_query: u64,
}

/// Why a connection ended.
enum Ended {
    /// The node is gone.
    Closed,
    /// The connection broke; connect afresh.
    Broken,
    /// A probe found the connection dead and answered: continue on it.
    Replaced(Box<(Reader, Writer)>),
}

impl PlanesClient {
    /// A client for a relay watching `scope`, and the recovery transport that uses it.
    #[must_use]
    pub fn new(scope: DiscoveryScope, decode_errors: Arc<AtomicU64>) -> (Self, PlanesRecovery) {
        let (queries_tx, queries) = mpsc::unbounded_channel();
        let client = PlanesClient {
            differ: RecordDiffer::new(scope, KeyForm::Logical),
            applied: None,
            decode_errors,
            queries,
            queries_open: true,
            pending: BTreeMap::new(),
            next_query: 0,
        };
        (client, PlanesRecovery { queries: queries_tx })
    }

    /// Follow the planes host, feeding `inputs`, until the node stops taking them.
    pub async fn run(mut self, inputs: InputSender) {
        let mut next: Option<(Reader, Writer)> = None;
        loop {
            let (reader, writer) = match next.take() {
                Some(pair) => pair,
                None => match connect().await {
                    Ok(pair) => pair,
                    Err(_) => {
                        tokio::time::sleep(PROBE_RETRY).await;
                        continue;
                    }
                },
            };
            let ended = self.follow(reader, writer, &inputs).await;
            // Answers to queries sent on the old connection can only come back on it.
            self.fail_pending();
            match ended {
                Ended::Closed => return,
                Ended::Broken => tokio::time::sleep(PROBE_RETRY).await,
                Ended::Replaced(pair) => next = Some(*pair),
            }
        }
    }

    /// Fail every query waiting on the connection that just ended, as a real transport does
    /// when its connection resets, so the relay retries after its backoff instead of waiting
    /// out the call's deadline.
    fn fail_pending(&mut self) {
        for (_, (_, reply)) in std::mem::take(&mut self.pending) {
            let failure = RecoveryFailure::Unreachable("the planes connection ended".to_owned());
            let _ = reply.send(Err(failure));
        }
    }

    async fn follow(
        &mut self,
        mut reader: Reader,
        mut writer: Writer,
        inputs: &InputSender,
    ) -> Ended {
        if send(&mut writer, &ToPlanes::Subscribe { after: self.applied }).await.is_err() {
            return Ended::Broken;
        }
        let mut heard = tokio::time::Instant::now();
        let mut probe: Option<BoxFuture<'static, io::Result<(Reader, Writer)>>> = None;
        let mut probe_at = heard + SILENCE;
        loop {
            let idle = probe.is_none();
            let probing = async {
                match probe.as_mut() {
                    Some(probe) => probe.await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                incoming = reader.next() => {
                    let Some(Ok(body)) = incoming else { return Ended::Broken };
                    let Ok(frame) = frame::decode::<ToRelay>(&body) else {
                        self.decode_errors.fetch_add(1, Ordering::Relaxed);
                        return Ended::Broken;
                    };
                    heard = tokio::time::Instant::now();
                    probe = None;
                    probe_at = heard + SILENCE;
                    if !self.handle(frame, inputs).await {
                        return Ended::Closed;
                    }
                }
                query = self.queries.recv(), if self.queries_open => {
                    let Some(query) = query else {
                        self.queries_open = false;
                        continue;
                    };
                    self.next_query += 1;
                    let id = self.next_query;
                    self.pending.retain(|_, (_, reply)| !reply.is_closed());
                    self.pending.insert(id, (query.request, query.reply));
                    let request =
                        ToPlanes::Query { id, target: query.target, request: query.request };
                    if send(&mut writer, &request).await.is_err() {
                        return Ended::Broken;
                    }
                }
                probed = probing => {
                    probe = None;
                    match probed {
                        Ok(pair) => return Ended::Replaced(Box::new(pair)),
                        Err(_) => probe_at = tokio::time::Instant::now() + PROBE_RETRY,
                    }
                }
                () = tokio::time::sleep_until(probe_at), if idle => {
                    probe = Some(probe_connection().boxed());
                }
            }
        }
    }

    /// Apply one frame; `false` when the node no longer takes inputs.
    async fn handle(&mut self, frame: ToRelay, inputs: &InputSender) -> bool {
        let outputs = match frame {
            ToRelay::Listing { revision, entries } => {
                let entries = entries
                    .into_iter()
                    .map(|(key, value)| ListingEntry::bytes(key, value.into_vec()))
                    .collect();
                self.applied = Some(revision);
                self.differ.apply_listing(entries, ListingMode::Relist)
            }
            ToRelay::Batch(items) => {
                let mut outputs = Vec::new();
                for item in items {
                    match item {
                        Item::Change(change) => {
                            if self.applied.is_some_and(|applied| change.revision <= applied) {
                                continue;
                            }
                            self.applied = Some(change.revision);
                            outputs.extend(match change.value {
                                Some(value) => self.differ.apply_put(&change.key, value),
                                None => self.differ.apply_delete(&change.key),
                            });
                        }
                        Item::Event(message) => match decode_event(&message) {
                            Ok(fact) => outputs.push(DiscoveryOutput::Fact(fact)),
                            Err(_) => {
                                self.decode_errors.fetch_add(1, Ordering::Relaxed);
                            }
                        },
                    }
                }
                outputs
            }
            ToRelay::Answer { id, result } => {
                if let Some((request, reply)) = self.pending.remove(&id) {
                    // The worker's call-home stream, read by the relay's own decoders.
                    let result = result.map_err(RecoveryFailure::Refused).and_then(|stream| {
                        let parts = stream.iter().map(|(h, b)| (h.as_slice(), b.as_slice()));
                        Ok(read_answer_stream(PayloadCodec::MsgPack, parts, &request)?)
                    });
                    let _ = reply.send(result);
                }
                Vec::new()
            }
            ToRelay::Pong | ToRelay::Heartbeat => Vec::new(),
        };
        for output in outputs {
            if let DiscoveryOutput::Fact(fact) = output
                && inputs.send(fact).await.is_err()
            {
                return false;
            }
        }
        true
    }
}

/// Write one frame. turmoil's TCP grants a window of segments that only the reader's progress
/// replenishes, so a write to a dead connection can wait forever: it fails after
/// [`CONNECT_TIMEOUT`] instead (the connection is then treated as broken).
async fn send(writer: &mut Writer, frame: &ToPlanes) -> io::Result<()> {
    let body = frame::encode(frame).map_err(io::Error::other)?;
    tokio::time::timeout(CONNECT_TIMEOUT, writer.send(body))
        .await
        .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))?
}

async fn connect() -> io::Result<(Reader, Writer)> {
    let stream =
        tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((PLANES_HOST, PLANES_PORT)))
            .await
            .map_err(|_| io::Error::from(io::ErrorKind::TimedOut))??;
    let (read, write) = stream.into_split();
    Ok((FramedRead::new(read, frame::codec()), FramedWrite::new(write, frame::codec())))
}

/// A fresh connection that answered a ping.
async fn probe_connection() -> io::Result<(Reader, Writer)> {
    let (mut reader, mut writer) = connect().await?;
    send(&mut writer, &ToPlanes::Ping).await?;
    match tokio::time::timeout(CONNECT_TIMEOUT, reader.next()).await {
        Ok(Some(Ok(body))) if matches!(frame::decode::<ToRelay>(&body), Ok(ToRelay::Pong)) => {
            Ok((reader, writer))
        }
        _ => Err(io::Error::from(io::ErrorKind::TimedOut)),
    }
}
