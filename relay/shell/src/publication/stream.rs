//! One subscriber's stream: the hub's mirror as snapshot chunks, then contiguous deltas.
//!
//! A bootstrap task encodes one chunk at a time into a channel of one frame; if the subscriber
//! does not take a chunk within the progress timeout, the bootstrap gives up and the stream ends
//! with [`PublicationError::SnapshotProgressTimeout`], releasing its share of the mirror. Each
//! chunk is encoded under one permit of the relay-wide encoder semaphore
//! ([`super::HubConfig::encoding_concurrency`] permits), held only while that chunk is encoded;
//! a bootstrap waiting for a permit stops waiting when its subscriber goes away. After
//! the last chunk the stream reads the subscriber's delta queue, returning each frame's bytes to
//! the queue budget as it goes.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use tokio::sync::{Semaphore, mpsc};

use super::hub::{FrameKind, Hub, HubFrame, MirrorSnapshot, SubscriberQueue};
use super::{FRAME_OVERHEAD_BYTES, PublicationError};
use crate::runtime::{BlockingExecutor, run_blocking};
use kvrelay_core::filter::cbi1::{EncodeError, FrameEncoder, snapshot_chunk_count};

/// What a pool stream yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    /// A snapshot chunk or delta to send.
    Frame(Arc<HubFrame>),
}

/// Encode chunk `index` of the snapshot of `mirror`. A dense mirror is borrowed as it is; a
/// sparse one is laid out densely for this encode alone, so at most one laid-out copy exists
/// per encoder permit.
fn encode_chunk(
    encoder: FrameEncoder,
    mirror: &MirrorSnapshot,
    index: u32,
) -> Result<Vec<u8>, EncodeError> {
    let laid_out;
    let words = match mirror.words.as_dense() {
        Some(words) => words,
        None => {
            laid_out = mirror.words.to_dense();
            &laid_out
        }
    };
    encoder.snapshot(mirror.sequence, words)?.encode_chunk(index)
}

/// A subscriber's ordered frames.
#[derive(Debug)]
pub struct PoolStream {
    hub: Arc<Hub>,
    bootstrap: Option<mpsc::Receiver<Arc<HubFrame>>>,
    bootstrap_failure: Arc<OnceLock<PublicationError>>,
    chunk_count: u32,
    chunks_received: u32,
    queue: SubscriberQueue,
    sequence: u64,
}

impl PoolStream {
    /// Subscribe to `hub`.
    pub(crate) fn open(
        hub: Arc<Hub>,
        executor: Arc<dyn BlockingExecutor>,
        encoders: Arc<Semaphore>,
    ) -> Result<PoolStream, PublicationError> {
        let (mirror, queue) = hub.add_subscriber()?;
        let sequence = mirror.sequence;
        let encoder = *hub.encoder();
        if mirror.words.bucket_count() as u64 != encoder.format().bucket_count {
            hub.fail(PublicationError::InvalidPublication);
            return Err(PublicationError::InvalidPublication);
        }
        let chunk_count = snapshot_chunk_count(encoder.format().bucket_count);
        let (chunks, bootstrap) = mpsc::channel(1);
        let failure = Arc::new(OnceLock::new());
        let timeout = hub.config().snapshot_progress_timeout;
        let bootstrap_failure = Arc::clone(&failure);
        let failing = Arc::clone(&hub);
        crate::runtime::spawn(async move {
            for index in 0..chunk_count {
                // A free encoder is taken without awaiting, so an uncontended bound (always the
                // case with an inline executor) changes no scheduling.
                let permit = match Arc::clone(&encoders).try_acquire_owned() {
                    Ok(permit) => Ok(permit),
                    Err(_) => tokio::select! {
                        biased;
                        () = chunks.closed() => return,
                        permit = Arc::clone(&encoders).acquire_owned() => permit,
                    },
                };
                let Ok(permit) = permit else {
                    let _ = failure.set(PublicationError::Internal);
                    return;
                };
                let words = Arc::clone(&mirror);
                let encoded =
                    run_blocking(executor.as_ref(), move || encode_chunk(encoder, &words, index))
                        .await;
                drop(permit);
                let payload = match encoded {
                    Ok(Ok(payload)) => payload,
                    Ok(Err(_)) => {
                        let _ = failure.set(PublicationError::InvalidPublication);
                        failing.fail(PublicationError::InvalidPublication);
                        return;
                    }
                    Err(_) => {
                        // The encoder died (it panicked): the mirror cannot be served.
                        let _ = failure.set(PublicationError::Internal);
                        failing.fail(PublicationError::Internal);
                        return;
                    }
                };
                let frame = Arc::new(HubFrame {
                    kind: FrameKind::SnapshotChunk,
                    base_sequence: sequence,
                    sequence,
                    payload: payload.into(),
                });
                match tokio::time::timeout(timeout, chunks.send(frame)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => return,
                    Err(_) => {
                        let _ = failure.set(PublicationError::SnapshotProgressTimeout);
                        return;
                    }
                }
            }
        });
        Ok(PoolStream {
            hub,
            bootstrap: Some(bootstrap),
            bootstrap_failure,
            chunk_count,
            chunks_received: 0,
            queue,
            sequence,
        })
    }

    /// The producer generation's hub.
    #[must_use]
    pub fn hub(&self) -> &Arc<Hub> {
        &self.hub
    }

    /// Whether every snapshot chunk has been yielded.
    #[must_use]
    pub fn snapshot_complete(&self) -> bool {
        self.bootstrap.is_none()
    }

    /// The sequence of the last yielded frame (the snapshot sequence until a delta went out).
    #[must_use]
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The next frame, or the error that ends the stream. Cancel-safe.
    pub async fn next(&mut self) -> Result<StreamItem, PublicationError> {
        if let Some(bootstrap) = &mut self.bootstrap {
            match bootstrap.recv().await {
                Some(frame) => {
                    self.chunks_received += 1;
                    if self.chunks_received == self.chunk_count {
                        self.bootstrap = None;
                    }
                    return Ok(StreamItem::Frame(frame));
                }
                None => {
                    return Err(self
                        .bootstrap_failure
                        .get()
                        .copied()
                        .unwrap_or(PublicationError::Internal));
                }
            }
        }
        match self.queue.frames.recv().await {
            Some(frame) => {
                self.queue
                    .queued_bytes
                    .fetch_sub(frame.payload.len() + FRAME_OVERHEAD_BYTES, Ordering::AcqRel);
                if frame.base_sequence != self.sequence || frame.sequence != self.sequence + 1 {
                    return Err(PublicationError::InvalidPublication);
                }
                self.sequence = frame.sequence;
                Ok(StreamItem::Frame(frame))
            }
            None => {
                Err(self.queue.terminal.get().copied().unwrap_or(PublicationError::Unavailable))
            }
        }
    }
}
