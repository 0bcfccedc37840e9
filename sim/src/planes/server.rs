//! The planes host's side of the protocol: accept relay connections, answer subscriptions,
//! forward each tick's items in one frame, answer recovery queries and pings, and send a
//! heartbeat when a subscribed connection has been idle for [`HEARTBEAT`].
//!
//! A connection's writes wait for turmoil's TCP window (backpressure, as over a stalled link);
//! items published meanwhile collect in the subscriber's outbox, which goes away when the relay
//! subscribes on another connection or this one ends.

use std::io;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::BytesMut;
use futures::{SinkExt, StreamExt};
use kvrelay::node::RecoveryTransport;
use kvrelay::request_plane::PayloadCodec;
use kvrelay::request_plane::answer::answer_stream;
use serde_bytes::ByteBuf;
use tokio::sync::{Notify, mpsc};
use tokio_util::codec::{FramedRead, FramedWrite};
use turmoil::net::{TcpListener, TcpStream};

use super::frame::{self, ToPlanes, ToRelay};
use super::{PLANES_PORT, Planes};

/// Bound a simulated worker is given to answer a recovery query.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

/// Idle time after which a subscribed connection gets a heartbeat.
pub const HEARTBEAT: Duration = Duration::from_millis(100);

fn lock(planes: &Mutex<Planes>) -> std::sync::MutexGuard<'_, Planes> {
    planes.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Serve every relay connection, forever; `workers` answer the recovery queries.
///
/// # Errors
/// When the listener cannot be bound.
pub async fn serve(
    planes: Arc<Mutex<Planes>>,
    workers: Arc<dyn RecoveryTransport>,
) -> io::Result<()> {
    let listener = TcpListener::bind(("0.0.0.0", PLANES_PORT)).await?;
    loop {
        let (stream, _) = listener.accept().await?;
        let connection = lock(&planes).connection_id();
        kvrelay::runtime::spawn(connection_task(
            stream,
            connection,
            Arc::clone(&planes),
            Arc::clone(&workers),
        ));
    }
}

async fn connection_task(
    stream: TcpStream,
    connection: u64,
    planes: Arc<Mutex<Planes>>,
    workers: Arc<dyn RecoveryTransport>,
) {
    let (read, write) = stream.into_split();
    let mut frames = FramedRead::new(read, frame::codec());
    let mut sink = FramedWrite::new(write, frame::codec());
    let (answers, mut answered) = mpsc::unbounded_channel::<ToRelay>();
    let mut notify: Option<Arc<Notify>> = None;
    let mut heartbeat = tokio::time::interval(HEARTBEAT);
    let mut wrote = false;
    let mut buffer = BytesMut::new();
    let epoch = lock(&planes).epoch();
    // Set once the peer spoke as a relay: a server restart closes relay connections only.
    let mut relay_side = false;
    loop {
        if relay_side && lock(&planes).epoch() != epoch {
            break;
        }
        let ready = async {
            match &notify {
                Some(notify) => notify.notified().await,
                None => std::future::pending().await,
            }
        };
        let out = tokio::select! {
            biased;
            incoming = frames.next() => {
                let Some(Ok(body)) = incoming else { break };
                let Ok(request) = frame::decode::<ToPlanes>(&body) else { break };
                relay_side |= !matches!(request, ToPlanes::Publish(_));
                match request {
                    ToPlanes::Subscribe { after } => {
                        let (first, wake) = lock(&planes).subscribe(connection, after);
                        notify = Some(wake);
                        Some(first)
                    }
                    ToPlanes::Query { id, target, request } => {
                        let query = workers.query(target, request, ANSWER_TIMEOUT);
                        let answers = answers.clone();
                        kvrelay::runtime::spawn(async move {
                            // On the wire, as from a worker: its own words on refusal.
                            let result = query.await.map_err(worker_text).and_then(|response| {
                                answer_stream(PayloadCodec::MsgPack, &response)
                                    .map(|stream| {
                                        stream
                                            .into_iter()
                                            .map(|m| (ByteBuf::from(m.header), ByteBuf::from(m.body)))
                                            .collect()
                                    })
                                    .map_err(|error| error.to_string())
                            });
                            let _ = answers.send(ToRelay::Answer { id, result });
                        });
                        None
                    }
                    ToPlanes::Ping => Some(ToRelay::Pong),
                    ToPlanes::Publish(publications) => {
                        lock(&planes).apply(publications, crate::sim_ms());
                        None
                    }
                }
            }
            Some(answer) = answered.recv() => Some(answer),
            () = ready => {
                match lock(&planes).take_outbox(connection) {
                    Some(items) if !items.is_empty() => Some(ToRelay::Batch(items)),
                    Some(_) => None,
                    None => {
                        notify = None;
                        None
                    }
                }
            }
            _ = heartbeat.tick() => {
                let idle = notify.is_some() && !std::mem::take(&mut wrote);
                idle.then_some(ToRelay::Heartbeat)
            }
        };
        if let Some(out) = out {
            let Ok(body) = frame::encode_with(&out, &mut buffer) else { break };
            if sink.send(body).await.is_err() {
                break;
            }
            wrote = true;
        }
    }
    lock(&planes).detach(connection);
}

/// The text a worker would answer with for `failure`.
fn worker_text(failure: kvrelay_core::sources::RecoveryFailure) -> String {
    match failure {
        kvrelay_core::sources::RecoveryFailure::Refused(text) => text,
        other => other.to_string(),
    }
}
