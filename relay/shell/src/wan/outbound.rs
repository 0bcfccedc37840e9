//! One subscriber's outbound side: every send under a deadline, and a final status that never
//! waits for queue space.
//!
//! A stream task holds a [`Subscriber`] (the sending end and the stream's admission permit);
//! tonic reads the [`Outbound`] stream. Invariants:
//!
//! - a send that the client does not take within its deadline ends the stream as a slow
//!   consumer: the admission permit is released at that moment, the final status is put
//!   ahead of the queued frames (the client gets it as soon as it reads again), and if it has
//!   not been taken [`SLOW_CONSUMER_GRACE`] later the stream's connection is closed, so a
//!   client that never reads holds nothing past `deadline + grace`;
//! - a final status ([`Subscriber::finish`]) is queued behind the frames when there is room and
//!   put ahead of them otherwise; it never blocks.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tonic::Status;

use super::counters::{StreamType, WanCounters};
use super::listener::ConnectionCloser;

/// How long a slow consumer's final status waits to be read before its connection is closed.
pub const SLOW_CONSUMER_GRACE: Duration = Duration::from_secs(1);

/// Frames buffered between a stream task and tonic.
const STREAM_BUFFER: usize = 2;

#[derive(Debug, Default)]
struct FinalStatus {
    status: Mutex<Option<Status>>,
    /// The final status was read, or the stream was dropped: nothing is pending.
    settled: AtomicBool,
}

impl FinalStatus {
    fn put(&self, status: Status) {
        if let Ok(mut slot) = self.status.lock() {
            *slot = Some(status);
        }
    }

    fn take(&self) -> Option<Status> {
        self.status.lock().ok().and_then(|mut slot| slot.take())
    }
}

/// The stream tonic sends to the client.
#[derive(Debug)]
pub(crate) struct Outbound<T> {
    receiver: mpsc::Receiver<Result<T, Status>>,
    end: Arc<FinalStatus>,
    done: bool,
}

impl<T> Stream for Outbound<T> {
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        if let Some(status) = this.end.take() {
            this.done = true;
            this.end.settled.store(true, Ordering::Release);
            return Poll::Ready(Some(Err(status)));
        }
        let next = this.receiver.poll_recv(cx);
        if let Poll::Ready(None) = next {
            this.done = true;
        }
        next
    }
}

impl<T> Drop for Outbound<T> {
    fn drop(&mut self) {
        self.end.settled.store(true, Ordering::Release);
    }
}

/// How a send ended the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SendFailed {
    /// The client went away.
    Gone,
    /// The client did not take the frame within the deadline.
    Slow,
}

/// The stream task's end.
#[derive(Debug)]
pub(crate) struct Subscriber<T> {
    sender: mpsc::Sender<Result<T, Status>>,
    end: Arc<FinalStatus>,
    permit: Option<OwnedSemaphorePermit>,
    closer: Option<ConnectionCloser>,
    stream: StreamType,
    counters: Arc<WanCounters>,
}

/// A subscriber of `stream` type holding `permit`, on the connection `closer` closes (none when
/// the service is called without a listener).
pub(crate) fn outbound<T>(
    stream: StreamType,
    permit: OwnedSemaphorePermit,
    closer: Option<ConnectionCloser>,
    counters: Arc<WanCounters>,
) -> (Subscriber<T>, Outbound<T>) {
    let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
    let end = Arc::new(FinalStatus::default());
    let subscriber = Subscriber {
        sender,
        end: Arc::clone(&end),
        permit: Some(permit),
        closer,
        stream,
        counters,
    };
    (subscriber, Outbound { receiver, end, done: false })
}

impl<T> Subscriber<T> {
    /// Send `item`, waiting at most `deadline` for the client to make room.
    pub(crate) async fn send(&self, item: T, deadline: Duration) -> Result<(), SendFailed> {
        match tokio::time::timeout(deadline, self.sender.send(Ok(item))).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(SendFailed::Gone),
            Err(_) => Err(SendFailed::Slow),
        }
    }

    /// Resolves when the client went away.
    pub(crate) async fn closed(&self) {
        self.sender.closed().await;
    }

    /// End the stream with `status` without waiting.
    pub(crate) fn finish(self, status: Status) {
        match self.sender.try_send(Err(status)) {
            Ok(()) | Err(mpsc::error::TrySendError::Closed(_)) => {}
            Err(mpsc::error::TrySendError::Full(item)) => {
                if let Err(status) = item {
                    self.end.put(status);
                }
            }
        }
    }

    /// End a slow consumer with `status`: release the admission slot now, and close the
    /// connection if the status is still unread after [`SLOW_CONSUMER_GRACE`].
    pub(crate) async fn end_slow(mut self, status: Status) {
        self.counters.slow_consumer(self.stream);
        drop(self.permit.take());
        self.end.put(status);
        let Subscriber { sender, end, closer, counters, .. } = self;
        // Dropping the sender wakes a reader waiting on an empty queue.
        drop(sender);
        tokio::time::sleep(SLOW_CONSUMER_GRACE).await;
        if !end.settled.load(Ordering::Acquire)
            && let Some(closer) = closer
        {
            counters.slow_consumer_connection_closed();
            closer.close();
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;
    use tokio::sync::Semaphore;
    use tokio_util::sync::CancellationToken;

    use super::*;

    fn subscriber(
        closer: Option<ConnectionCloser>,
    ) -> (Subscriber<u32>, Outbound<u32>, Arc<Semaphore>, Arc<WanCounters>) {
        let slots = Arc::new(Semaphore::new(1));
        let permit = Arc::clone(&slots).try_acquire_owned().unwrap();
        let counters = Arc::new(WanCounters::default());
        let (subscriber, outbound) =
            outbound(StreamType::Catalog, permit, closer, Arc::clone(&counters));
        (subscriber, outbound, slots, counters)
    }

    #[tokio::test(start_paused = true)]
    async fn a_send_past_its_deadline_is_slow_and_a_final_status_never_waits() {
        let (subscriber, mut outbound, _slots, _) = subscriber(None);
        let deadline = Duration::from_millis(100);
        subscriber.send(1, deadline).await.unwrap();
        subscriber.send(2, deadline).await.unwrap();
        // The buffer is full and nobody reads: the third send is slow.
        assert_eq!(subscriber.send(3, deadline).await, Err(SendFailed::Slow));
        // A final status on a full queue goes ahead of the queued frames.
        subscriber.finish(Status::unavailable("bye"));
        let first = outbound.next().await.unwrap().unwrap_err();
        assert_eq!(first.code(), tonic::Code::Unavailable);
        assert!(outbound.next().await.is_none());
        // With room, it queues behind the frames.
        let (subscriber, mut outbound, _slots, _) = self::subscriber(None);
        subscriber.send(7, deadline).await.unwrap();
        subscriber.finish(Status::unavailable("bye"));
        assert_eq!(outbound.next().await.unwrap().unwrap(), 7);
        assert!(outbound.next().await.unwrap().is_err());
        assert!(outbound.next().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_consumer_releases_its_slot_at_once_and_loses_its_connection_if_unread() {
        let token = CancellationToken::new();
        let closer = ConnectionCloser::from_token(token.clone());
        let (subscriber, outbound, slots, counters) = subscriber(Some(closer));
        let ending = crate::runtime::spawn(subscriber.end_slow(Status::resource_exhausted("slow")));
        tokio::task::yield_now().await;
        assert_eq!(slots.available_permits(), 1, "the admission slot is free at once");
        assert!(!token.is_cancelled());
        ending.await.unwrap();
        assert!(token.is_cancelled(), "unread after the grace: the connection is closed");
        assert_eq!(counters.snapshot().slow_consumer_ended[StreamType::Catalog as usize], 1);
        assert_eq!(counters.snapshot().slow_consumer_connections_closed, 1);
        drop(outbound);
        // A client that reads the status in time keeps its connection.
        let token = CancellationToken::new();
        let closer = ConnectionCloser::from_token(token.clone());
        let (subscriber, mut outbound, _slots, _) = self::subscriber(Some(closer));
        let ending = crate::runtime::spawn(subscriber.end_slow(Status::resource_exhausted("slow")));
        let status = outbound.next().await.unwrap().unwrap_err();
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        ending.await.unwrap();
        assert!(!token.is_cancelled());
    }
}
