//! One hub: the mirror of a producer generation's filter and its subscribers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use super::{FRAME_OVERHEAD_BYTES, HubConfig, PublicationError};
use crate::pool::{PoolHandle, Subscription};
use kvrelay_core::filter::MirrorWords;
use kvrelay_core::filter::cbi1::FrameEncoder;
use kvrelay_core::model::identity::{LaneLease, ProducerIdentity};
use kvrelay_core::pool::Delta;

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// A CBI1 snapshot chunk.
    SnapshotChunk,
    /// A CBI1 delta.
    Delta,
}

/// One encoded frame, shared by every subscriber that receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubFrame {
    /// Chunk or delta.
    pub kind: FrameKind,
    /// Envelope base sequence.
    pub base_sequence: u64,
    /// Envelope sequence.
    pub sequence: u64,
    /// The CBI1 frame.
    pub payload: Bytes,
}

/// The filter at a sequence. Shared copy-on-write between the hub and bootstrapping subscribers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorSnapshot {
    /// The sequence of the last applied delta (or of the snapshot).
    pub sequence: u64,
    /// Every bucket word (sparse while few are non-zero).
    pub words: MirrorWords,
}

/// A subscriber's end of its queue.
#[derive(Debug)]
pub(crate) struct SubscriberQueue {
    pub(crate) frames: mpsc::Receiver<Arc<HubFrame>>,
    pub(crate) queued_bytes: Arc<AtomicUsize>,
    pub(crate) terminal: Arc<OnceLock<PublicationError>>,
}

#[derive(Debug)]
struct SubscriberSink {
    frames: mpsc::Sender<Arc<HubFrame>>,
    queued_bytes: Arc<AtomicUsize>,
    terminal: Arc<OnceLock<PublicationError>>,
}

#[derive(Debug)]
struct HubState {
    mirror: Arc<MirrorSnapshot>,
    subscribers: Vec<SubscriberSink>,
    stopped: Option<PublicationError>,
}

/// Asks the host to fence the hub's generation (idempotent).
struct FenceHook(Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for FenceHook {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("FenceHook")
    }
}

/// A running hub of one producer generation.
///
/// Once stopped it stays stopped. A stop caused by a publication failure ([`Hub::fail`]: an
/// invariant drift, a snapshot that cannot be built or encoded, the pool's delta stream closing)
/// also asks the host to fence the generation, so consumers see it withdrawn and a new
/// producer published instead of retrying a generation that cannot serve them.
#[derive(Debug)]
pub struct Hub {
    identity: ProducerIdentity,
    lease: LaneLease,
    config: HubConfig,
    encoder: FrameEncoder,
    state: Mutex<HubState>,
    stop: CancellationToken,
    fence: FenceHook,
}

impl Hub {
    /// Start a hub from a barrier subscription of `pool` and spawn its delta task. `on_failure`
    /// is called once if the hub fails (the caller fences the generation).
    pub(crate) fn start(
        identity: ProducerIdentity,
        config: HubConfig,
        subscription: Subscription,
        pool: PoolHandle,
        on_failure: Arc<dyn Fn() + Send + Sync>,
    ) -> Result<Arc<Hub>, PublicationError> {
        let lease = identity.publication_lease();
        if subscription.snapshot.lease != lease {
            return Err(PublicationError::InvalidPublication);
        }
        let format = identity.format();
        if subscription.snapshot.words.len() as u64 != format.bucket_count {
            return Err(PublicationError::InvalidPublication);
        }
        let encoder = FrameEncoder::new(format, identity.pool_id().dc_id.0)
            .map_err(|_| PublicationError::InvalidPublication)?;
        let mirror = MirrorSnapshot {
            sequence: subscription.snapshot.sequence,
            words: MirrorWords::from_dense(subscription.snapshot.words),
        };
        let hub = Arc::new(Hub {
            identity,
            lease,
            config,
            encoder,
            state: Mutex::new(HubState {
                mirror: Arc::new(mirror),
                subscribers: Vec::new(),
                stopped: None,
            }),
            stop: CancellationToken::new(),
            fence: FenceHook(on_failure),
        });
        crate::runtime::spawn(run(Arc::clone(&hub), subscription.deltas, pool));
        Ok(hub)
    }

    /// The producer this hub publishes.
    #[must_use]
    pub fn identity(&self) -> &ProducerIdentity {
        &self.identity
    }

    /// The CBI1 encoder of this producer.
    pub(crate) fn encoder(&self) -> &FrameEncoder {
        &self.encoder
    }

    /// The hub's configuration.
    pub(crate) fn config(&self) -> &HubConfig {
        &self.config
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Current number of subscribers.
    #[must_use]
    pub fn subscriber_count(&self) -> usize {
        self.lock().subscribers.len()
    }

    /// Whether the hub can be evicted: running, no subscriber, mirror shared with nobody.
    pub(crate) fn is_idle(&self) -> bool {
        let state = self.lock();
        state.stopped.is_none()
            && state.subscribers.iter().all(|s| s.frames.is_closed())
            && Arc::strong_count(&state.mirror) == 1
    }

    /// Whether the hub has stopped.
    #[must_use]
    pub fn is_stopped(&self) -> bool {
        self.lock().stopped.is_some()
    }

    /// Whether the mirror is kept sparse.
    #[cfg(test)]
    pub(crate) fn mirror_is_sparse(&self) -> bool {
        self.lock().mirror.words.is_sparse()
    }

    /// The mirror's current sequence.
    #[must_use]
    pub fn sequence(&self) -> u64 {
        self.lock().mirror.sequence
    }

    /// Add a subscriber: it gets the current mirror and every later delta.
    pub(crate) fn add_subscriber(
        &self,
    ) -> Result<(Arc<MirrorSnapshot>, SubscriberQueue), PublicationError> {
        let mut state = self.lock();
        if let Some(error) = state.stopped {
            return Err(error);
        }
        state.subscribers.retain(|sink| !sink.frames.is_closed());
        if state.subscribers.len() >= self.config.subscribers_per_pool_max {
            return Err(PublicationError::SubscriberLimit);
        }
        let (frames, receiver) = mpsc::channel(self.config.subscriber_queue_frames.max(1));
        let queued_bytes = Arc::new(AtomicUsize::new(0));
        let terminal = Arc::new(OnceLock::new());
        state.subscribers.push(SubscriberSink {
            frames,
            queued_bytes: Arc::clone(&queued_bytes),
            terminal: Arc::clone(&terminal),
        });
        Ok((
            Arc::clone(&state.mirror),
            SubscriberQueue { frames: receiver, queued_bytes, terminal },
        ))
    }

    /// Stop the hub: every subscriber ends with `error`, the delta task exits and the caller
    /// retires the lease.
    pub(crate) fn stop(&self, error: PublicationError) {
        let mut state = self.lock();
        if state.stopped.is_none() {
            state.stopped = Some(error);
        }
        for sink in state.subscribers.drain(..) {
            let _ = sink.terminal.set(error);
        }
        drop(state);
        self.stop.cancel();
    }

    /// Stop the hub because its publication failed, and ask the host to fence the generation.
    pub(crate) fn fail(&self, error: PublicationError) {
        self.stop(error);
        (self.fence.0)();
    }

    /// Apply one delta to the mirror and fan it out. Errors are invariant failures.
    fn publish(&self, delta: &Delta) -> Result<(), PublicationError> {
        let payload = self
            .encoder
            .encode_delta(delta.base_sequence, delta.sequence, &delta.images)
            .map_err(|_| PublicationError::InvalidPublication)?;
        let frame = Arc::new(HubFrame {
            kind: FrameKind::Delta,
            base_sequence: delta.base_sequence,
            sequence: delta.sequence,
            payload: Bytes::from(payload),
        });
        let reserved = frame.payload.len() + FRAME_OVERHEAD_BYTES;
        let mut state = self.lock();
        let mirror = Arc::make_mut(&mut state.mirror);
        if delta.lease != self.lease
            || delta.base_sequence != mirror.sequence
            || mirror.sequence.checked_add(1) != Some(delta.sequence)
        {
            return Err(PublicationError::InvalidPublication);
        }
        for image in &delta.images {
            if !mirror.words.set(image.bucket as usize, image.word) {
                return Err(PublicationError::InvalidPublication);
            }
        }
        mirror.sequence = delta.sequence;
        let budget = self.config.subscriber_queue_bytes;
        state.subscribers.retain(|sink| {
            if sink.frames.is_closed() {
                return false;
            }
            let queued = sink.queued_bytes.fetch_add(reserved, Ordering::AcqRel) + reserved;
            if queued > budget || sink.frames.try_send(Arc::clone(&frame)).is_err() {
                let _ = sink.terminal.set(PublicationError::SubscriberLagged);
                return false;
            }
            true
        });
        Ok(())
    }

    /// Replace the mirror with a fresh barrier snapshot and end every current subscriber (they
    /// must reopen and get the new snapshot).
    fn reset_mirror(&self, sequence: u64, words: Vec<u64>) {
        let mut state = self.lock();
        state.mirror = Arc::new(MirrorSnapshot { sequence, words: MirrorWords::from_dense(words) });
        for sink in state.subscribers.drain(..) {
            let _ = sink.terminal.set(PublicationError::Unavailable);
        }
    }
}

async fn run(hub: Arc<Hub>, mut deltas: broadcast::Receiver<Arc<Delta>>, pool: PoolHandle) {
    loop {
        let received = tokio::select! {
            biased;
            () = hub.stop.cancelled() => break,
            received = deltas.recv() => received,
        };
        let outcome = match received {
            Ok(delta) if delta.images.len() > hub.config.max_delta_images => {
                resnapshot(&hub, &pool, &mut deltas).await
            }
            Ok(delta) => hub.publish(&delta),
            Err(broadcast::error::RecvError::Lagged(_)) => {
                resnapshot(&hub, &pool, &mut deltas).await
            }
            Err(broadcast::error::RecvError::Closed) => Err(PublicationError::Unavailable),
        };
        if let Err(error) = outcome {
            // Both mean the generation cannot go on: its publication broke or its pool is gone.
            hub.fail(error);
            break;
        }
    }
    let _ = pool.retire_lease(hub.lease).await;
}

/// Take a new barrier snapshot under the same lease and swap it in.
async fn resnapshot(
    hub: &Hub,
    pool: &PoolHandle,
    deltas: &mut broadcast::Receiver<Arc<Delta>>,
) -> Result<(), PublicationError> {
    let subscription =
        pool.subscribe(hub.lease).await.map_err(|_| PublicationError::InvalidPublication)?;
    if subscription.snapshot.lease != hub.lease {
        return Err(PublicationError::InvalidPublication);
    }
    hub.reset_mirror(subscription.snapshot.sequence, subscription.snapshot.words);
    *deltas = subscription.deltas;
    Ok(())
}
