//! The node's input queue: DC inputs wait here between the planes that decode them and the node
//! task that hands them to the control plane. It is bounded twice, in items and in bytes.
//!
//! Invariants:
//!
//! - an input is weighed ([`DcInput::weight_bytes`]) and its bytes are reserved **before** it is
//!   queued, and released only when the node has finished the step it feeds (the
//!   [`QueuedInput`] is dropped): the bytes held by queued and in-step inputs never exceed the
//!   budget;
//! - at the bound a sender waits (backpressure, as at the item bound); nothing is dropped. An
//!   input heavier than the whole budget is charged the whole budget, so it waits for an empty
//!   queue and then passes alone: no input is refused for its size here (the decoders' limits
//!   bound one input);
//! - one sender's inputs arrive in the order it sent them;
//! - when the receiver is dropped the byte budget closes, so no sender waits forever.
//!
//! The fast path takes the bytes with `try_acquire`, which neither yields nor spends the task's
//! cooperative budget: while the queue is under its budget, tasks are scheduled exactly as with
//! an item-bounded channel alone (the simulator's digests depend on that).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};

use kvrelay_core::inputs::DcInput;

/// Default byte budget of the node's input queue (256 MiB: about sixteen maximal event
/// messages of a million blocks, or hundreds of thousands of ordinary ones).
pub const INPUT_QUEUE_BYTES_MAX_DEFAULT: usize = 256 << 20;

/// Largest byte budget: one reservation is a `u32` of bytes, and the semaphore holds at most
/// [`Semaphore::MAX_PERMITS`].
pub const INPUT_QUEUE_BYTES_MAX_LIMIT: usize = if Semaphore::MAX_PERMITS < u32::MAX as usize {
    Semaphore::MAX_PERMITS
} else {
    u32::MAX as usize
};

/// The queue was closed: the node has stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the node's input queue is closed")]
pub struct InputQueueClosed;

/// Counters of the queue, shared by its ends.
#[derive(Debug, Default)]
struct Counters {
    /// Sends that found the byte budget spent and waited.
    byte_waits: AtomicU64,
    /// Inputs charged the whole budget because they weigh more.
    oversized: AtomicU64,
}

/// A reading of the queue's state, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct InputQueueStats {
    /// The byte budget.
    pub bytes_max: u64,
    /// Bytes reserved by queued inputs and the one in its step.
    pub bytes_queued: u64,
    /// Sends that waited for bytes.
    pub byte_waits: u64,
    /// Inputs heavier than the whole budget (each passed alone).
    pub oversized: u64,
}

/// The sending end; cheap to clone, one per plane.
#[derive(Debug, Clone)]
pub struct InputSender {
    items: mpsc::Sender<QueuedInput>,
    bytes: Arc<Semaphore>,
    budget: u32,
    counters: Arc<Counters>,
}

/// The receiving end, held by the node task.
#[derive(Debug)]
pub struct InputReceiver {
    items: mpsc::Receiver<QueuedInput>,
    bytes: Arc<Semaphore>,
}

/// An input taken from the queue, holding its bytes until dropped.
#[derive(Debug)]
pub struct QueuedInput {
    /// The input.
    pub input: DcInput,
    /// Its reservation.
    charge: OwnedSemaphorePermit,
}

impl QueuedInput {
    /// Take the input out; the returned guard holds its bytes until it is dropped.
    #[must_use]
    pub fn into_parts(self) -> (DcInput, InputCharge) {
        (self.input, InputCharge { _permit: self.charge })
    }
}

/// Room reserved in the queue for one input ([`InputSender::reserve`]); dropping it unused
/// gives the room back.
#[derive(Debug)]
pub struct InputPermit<'a> {
    slot: mpsc::Permit<'a, QueuedInput>,
    bytes: OwnedSemaphorePermit,
}

impl InputPermit<'_> {
    /// Queue `input`, which weighs what was reserved, without waiting.
    pub fn send(self, input: DcInput) {
        self.slot.send(QueuedInput { input, charge: self.bytes });
    }
}

/// The bytes of an input whose step is under way; released when dropped.
#[derive(Debug)]
pub struct InputCharge {
    _permit: OwnedSemaphorePermit,
}

/// A queue of at most `items_max` inputs (at least 1) and `bytes_max` bytes (1 to
/// [`INPUT_QUEUE_BYTES_MAX_LIMIT`], clamped into that range).
#[must_use]
pub fn input_queue(items_max: usize, bytes_max: usize) -> (InputSender, InputReceiver) {
    let budget = u32::try_from(bytes_max.clamp(1, INPUT_QUEUE_BYTES_MAX_LIMIT)).unwrap_or(u32::MAX);
    let (items_tx, items_rx) = mpsc::channel(items_max.max(1));
    let bytes = Arc::new(Semaphore::new(budget as usize));
    let sender = InputSender {
        items: items_tx,
        bytes: Arc::clone(&bytes),
        budget,
        counters: Arc::default(),
    };
    (sender, InputReceiver { items: items_rx, bytes })
}

impl InputSender {
    /// Queue `input`, waiting while the queue is full in items or in bytes.
    ///
    /// Cancelling the returned future drops the input, as with a channel's `send`.
    pub async fn send(&self, input: DcInput) -> Result<(), InputQueueClosed> {
        self.reserve(input.weight_bytes()).await?.send(input);
        Ok(())
    }

    /// Room for one input weighing `weight` bytes ([`DcInput::weight_bytes`]), waiting while
    /// the queue is full in items or in bytes; [`InputPermit::send`] then queues the input at
    /// once. Cancel-safe: a reservation dropped before it completes holds nothing, so a plane
    /// can wait for room in a `select!` and keep its input.
    pub async fn reserve(&self, weight: usize) -> Result<InputPermit<'_>, InputQueueClosed> {
        let (charge, oversized) = self.charge(weight);
        if oversized {
            self.counters.oversized.fetch_add(1, Ordering::Relaxed);
        }
        let bytes = match Arc::clone(&self.bytes).try_acquire_many_owned(charge) {
            Ok(permit) => permit,
            Err(TryAcquireError::Closed) => return Err(InputQueueClosed),
            Err(TryAcquireError::NoPermits) => {
                self.counters.byte_waits.fetch_add(1, Ordering::Relaxed);
                Arc::clone(&self.bytes)
                    .acquire_many_owned(charge)
                    .await
                    .map_err(|_| InputQueueClosed)?
            }
        };
        let slot = self.items.reserve().await.map_err(|_| InputQueueClosed)?;
        Ok(InputPermit { slot, bytes })
    }

    /// Room for one input weighing `weight` bytes if the queue has it now (`None` if not:
    /// nothing is held, and nothing counted).
    pub fn try_reserve(&self, weight: usize) -> Result<Option<InputPermit<'_>>, InputQueueClosed> {
        let (charge, oversized) = self.charge(weight);
        let bytes = match Arc::clone(&self.bytes).try_acquire_many_owned(charge) {
            Ok(permit) => permit,
            Err(TryAcquireError::Closed) => return Err(InputQueueClosed),
            Err(TryAcquireError::NoPermits) => return Ok(None),
        };
        match self.items.try_reserve() {
            Ok(slot) => {
                if oversized {
                    self.counters.oversized.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Some(InputPermit { slot, bytes }))
            }
            Err(mpsc::error::TrySendError::Full(())) => Ok(None),
            Err(mpsc::error::TrySendError::Closed(())) => Err(InputQueueClosed),
        }
    }

    /// The bytes an input of `weight` is charged, and whether it is heavier than the whole
    /// budget (then it is charged the budget, so that it can still pass alone).
    fn charge(&self, weight: usize) -> (u32, bool) {
        match u32::try_from(weight) {
            Ok(weight) if weight <= self.budget => (weight, false),
            _ => (self.budget, true),
        }
    }

    /// Completes when the node has stopped taking inputs.
    pub async fn closed(&self) {
        self.items.closed().await;
    }

    /// Whether the node has stopped taking inputs.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.items.is_closed()
    }

    /// The queue's counters now.
    #[must_use]
    pub fn stats(&self) -> InputQueueStats {
        let available = self.bytes.available_permits().min(self.budget as usize);
        InputQueueStats {
            bytes_max: u64::from(self.budget),
            bytes_queued: (self.budget as usize - available) as u64,
            byte_waits: self.counters.byte_waits.load(Ordering::Relaxed),
            oversized: self.counters.oversized.load(Ordering::Relaxed),
        }
    }
}

impl InputReceiver {
    /// The next input; `None` once every sender is gone. Cancel-safe.
    pub async fn recv(&mut self) -> Option<QueuedInput> {
        self.items.recv().await
    }

    /// The next input if one is queued now.
    pub fn try_recv(&mut self) -> Option<QueuedInput> {
        self.items.try_recv().ok()
    }
}

impl InputReceiver {
    /// The next input with its bytes released at once, for readers that hold no step (tests,
    /// tools). Cancel-safe.
    pub async fn recv_input(&mut self) -> Option<DcInput> {
        self.items.recv().await.map(|queued| queued.input)
    }

    /// An input if one is queued now, its bytes released at once.
    pub fn try_recv_input(&mut self) -> Result<DcInput, mpsc::error::TryRecvError> {
        self.items.try_recv().map(|queued| queued.input)
    }
}

impl Drop for InputReceiver {
    fn drop(&mut self) {
        // Senders waiting for bytes would otherwise wait forever.
        self.bytes.close();
    }
}

/// A KV event batch on `namespace`'s `backend/generate` endpoint: one event (id `sequence`)
/// storing `blocks` blocks.
#[cfg(test)]
pub(crate) fn kv_batch(namespace: &str, sequence: u64, blocks: u64) -> DcInput {
    use kvrelay_core::inputs::KvEventBatch;
    use kvrelay_core::model::kv_events::{
        KvCacheEvent, RouterEvent, StorageTier, stored_from_wire,
    };
    let event = RouterEvent {
        worker_id: 1,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id: sequence,
            dp_rank: 0,
            data: stored_from_wire(None, None, (0..blocks).map(|b| (b, b))).expect("a valid store"),
        },
    };
    DcInput::KvEvents(KvEventBatch {
        endpoint: format!("{namespace}/backend/generate").parse().expect("a valid endpoint"),
        publisher_id: 1,
        sequence,
        published_at_ms: 0,
        events: vec![event],
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kvrelay_core::inputs::EndpointInstances;
    use kvrelay_core::model::identity::EndpointPath;

    use super::*;

    fn endpoint() -> EndpointPath {
        "ns/backend/generate".parse().unwrap()
    }

    fn events(sequence: u64, blocks: u64) -> DcInput {
        kv_batch("ns", sequence, blocks)
    }

    fn sequence(input: &DcInput) -> u64 {
        match input {
            DcInput::KvEvents(batch) => batch.sequence,
            _ => u64::MAX,
        }
    }

    #[tokio::test]
    async fn a_sender_waits_at_the_byte_bound_and_resumes_when_a_step_ends() {
        let heavy = events(0, 4096).weight_bytes();
        // Room for two heavy inputs, never three, whatever the item bound.
        let (sender, mut receiver) = input_queue(1024, heavy * 5 / 2);
        sender.send(events(0, 4096)).await.unwrap();
        sender.send(events(1, 4096)).await.unwrap();
        assert_eq!(sender.stats().bytes_queued, 2 * heavy as u64);
        let third = tokio::time::timeout(Duration::from_millis(50), sender.send(events(2, 4096)));
        assert!(third.await.is_err(), "a third heavy input waits for bytes");
        assert_eq!(sender.stats().byte_waits, 1);

        // Taking an input out does not free its bytes; ending its step does.
        let first = receiver.recv().await.unwrap();
        let waiting = {
            let sender = sender.clone();
            crate::runtime::spawn(async move { sender.send(events(3, 4096)).await })
        };
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "the taken input's step still holds its bytes");
        let (input, charge) = first.into_parts();
        assert_eq!(sequence(&input), 0);
        drop(charge);
        waiting.await.unwrap().unwrap();
        assert!(sender.stats().bytes_queued <= heavy as u64 * 5 / 2, "{:?}", sender.stats());
        let order: Vec<u64> = [receiver.recv().await, receiver.recv().await]
            .into_iter()
            .map(|queued| sequence(&queued.unwrap().input))
            .collect();
        assert_eq!(order, [1, 3], "one sender's inputs keep their order");
    }

    #[tokio::test]
    async fn an_input_heavier_than_the_budget_passes_alone() {
        let light =
            DcInput::Instances(EndpointInstances { endpoint: endpoint(), live_workers: None });
        let budget = events(0, 64).weight_bytes();
        let (sender, mut receiver) = input_queue(16, budget);
        sender.send(light.clone()).await.unwrap();
        let heavy = {
            let sender = sender.clone();
            crate::runtime::spawn(async move { sender.send(events(9, 1 << 16)).await })
        };
        tokio::task::yield_now().await;
        assert!(!heavy.is_finished(), "an oversized input waits for an empty queue");
        drop(receiver.recv().await.unwrap());
        heavy.await.unwrap().unwrap();
        let stats = sender.stats();
        assert_eq!((stats.oversized, stats.bytes_queued), (1, budget as u64));
        let (input, _charge) = receiver.recv().await.unwrap().into_parts();
        assert_eq!(sequence(&input), 9);
    }

    #[tokio::test]
    async fn try_reserve_takes_room_only_if_there_is_some_now() {
        let heavy = events(0, 4096).weight_bytes();
        let (sender, mut receiver) = input_queue(2, heavy * 5 / 2);
        sender.try_reserve(heavy).unwrap().expect("room").send(events(0, 4096));
        sender.try_reserve(heavy).unwrap().expect("room").send(events(1, 4096));
        assert!(sender.try_reserve(heavy).unwrap().is_none(), "no bytes for a third");
        let light = events(2, 1).weight_bytes();
        assert!(sender.try_reserve(light).unwrap().is_none(), "bytes for it, but no item slot");
        assert_eq!((sender.stats().byte_waits, sender.stats().bytes_queued), (0, 2 * heavy as u64));
        drop(receiver.recv().await.unwrap());
        assert!(sender.try_reserve(heavy).unwrap().is_some(), "room once a step ended");
        // An input heavier than the budget is charged the whole budget, counted when it passes.
        assert!(sender.try_reserve(heavy * 3).unwrap().is_none());
        assert_eq!(sender.stats().oversized, 0, "counted only when it passes");
        drop(receiver);
        assert!(sender.try_reserve(light).is_err(), "a stopped node takes nothing");
    }

    #[tokio::test]
    async fn a_stopped_node_releases_every_waiting_sender() {
        let budget = events(0, 64).weight_bytes();
        let (sender, receiver) = input_queue(16, budget);
        sender.send(events(0, 64)).await.unwrap();
        let waiting = {
            let sender = sender.clone();
            crate::runtime::spawn(async move { sender.send(events(1, 64)).await })
        };
        tokio::task::yield_now().await;
        drop(receiver);
        assert_eq!(waiting.await.unwrap(), Err(InputQueueClosed));
        assert!(sender.is_closed());
        assert_eq!(sender.send(events(2, 1)).await, Err(InputQueueClosed));
    }
}
