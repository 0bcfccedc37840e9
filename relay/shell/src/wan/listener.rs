//! The connection layer under the WAN listener: a cap on open connections, back-off after
//! accept errors, a handshake deadline, and a way to close one connection (a slow consumer) or
//! all of them (the shutdown drain deadline) from above.
//!
//! - A connection past [`ListenerLimits::max_connections`] is accepted and dropped at once
//!   (the peer sees the socket close), counted; the permit of an admitted connection is
//!   released when hyper drops its transport.
//! - A failed accept is counted, logged and followed by [`ListenerLimits::accept_error_backoff`]
//!   before the next accept, so a descriptor exhaustion cannot spin the listener.
//! - A connection that has not sent the 24-byte HTTP/2 client preface within
//!   [`ListenerLimits::handshake_timeout`] is closed.
//! - Once its [`ConnectionCloser`] fires, every read and write of the transport fails, so hyper
//!   tears the connection down (with all its streams) even when no stream can make progress.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tonic::transport::server::Connected;
use tracing::warn;

use super::counters::{WanCounters, bump_counter, drop_gauge};
use crate::config::ListenerLimits;

/// Length of the HTTP/2 client connection preface.
const PREFACE_BYTES: usize = 24;

/// Closes one connection: every later read or write of its transport fails. Cheap to clone;
/// the connect info of every WAN request, so a stream task can end its own connection.
#[derive(Debug, Clone)]
pub struct ConnectionCloser {
    token: CancellationToken,
}

impl ConnectionCloser {
    /// A closer firing `token` (for tests of the layers above).
    #[cfg(test)]
    pub(crate) fn from_token(token: CancellationToken) -> Self {
        ConnectionCloser { token }
    }

    /// Close the connection now.
    pub fn close(&self) {
        self.token.cancel();
    }

    /// Whether the connection was closed by the relay.
    #[must_use]
    pub fn is_closed(&self) -> bool {
        self.token.is_cancelled()
    }
}

/// A transport admitted under the connection limit.
pub struct LimitedIo<IO> {
    inner: IO,
    token: CancellationToken,
    closed: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Preface bytes still expected and their deadline, until the preface is in.
    preface: Option<(usize, Pin<Box<Sleep>>)>,
    counters: Arc<WanCounters>,
    _permit: OwnedSemaphorePermit,
}

impl<IO> std::fmt::Debug for LimitedIo<IO> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("LimitedIo")
            .field("closed", &self.token.is_cancelled())
            .finish_non_exhaustive()
    }
}

impl<IO> Drop for LimitedIo<IO> {
    fn drop(&mut self) {
        drop_gauge(&self.counters.listener.connections_open);
    }
}

fn aborted() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionAborted, "connection closed by the relay")
}

impl<IO> LimitedIo<IO> {
    /// Whether the relay closed this connection (polling registers the waker).
    fn poll_closed(&mut self, cx: &mut Context<'_>) -> bool {
        self.token.is_cancelled() || self.closed.as_mut().poll(cx).is_ready()
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for LimitedIo<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.poll_closed(cx) {
            return Poll::Ready(Err(aborted()));
        }
        if let Some((_, deadline)) = &mut this.preface
            && deadline.as_mut().poll(cx).is_ready()
        {
            bump_counter(&this.counters.listener.handshake_timeouts);
            this.token.cancel();
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no HTTP/2 preface within the handshake timeout",
            )));
        }
        let before = buf.filled().len();
        let result = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let (Poll::Ready(Ok(())), Some((remaining, _))) = (&result, &mut this.preface) {
            *remaining = remaining.saturating_sub(buf.filled().len() - before);
            if *remaining == 0 {
                this.preface = None;
            }
        }
        result
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for LimitedIo<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.poll_closed(cx) {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut this.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.poll_closed(cx) {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.poll_closed(cx) {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut this.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<IO> Connected for LimitedIo<IO> {
    type ConnectInfo = ConnectionCloser;

    fn connect_info(&self) -> ConnectionCloser {
        ConnectionCloser { token: self.token.clone() }
    }
}

struct Accepting<I> {
    incoming: Pin<Box<I>>,
    slots: Arc<Semaphore>,
    limits: ListenerLimits,
    counters: Arc<WanCounters>,
    all: CancellationToken,
}

/// `incoming` under `limits`: only admitted connections come out (accept errors are counted and
/// waited out, never passed on). Cancelling `all` closes every connection it yielded.
pub(crate) fn limited_incoming<I, IO, IE>(
    incoming: I,
    limits: ListenerLimits,
    counters: Arc<WanCounters>,
    all: CancellationToken,
) -> impl Stream<Item = Result<LimitedIo<IO>, IE>>
where
    I: Stream<Item = Result<IO, IE>>,
    IE: std::fmt::Display,
{
    let state = Accepting {
        incoming: Box::pin(incoming),
        slots: Arc::new(Semaphore::new(limits.max_connections)),
        limits,
        counters,
        all,
    };
    futures::stream::unfold(state, |mut state| async move {
        loop {
            let io = match state.incoming.next().await? {
                Ok(io) => io,
                Err(error) => {
                    bump_counter(&state.counters.listener.accept_errors);
                    warn!(%error, backoff = ?state.limits.accept_error_backoff, "WAN accept failed");
                    tokio::time::sleep(state.limits.accept_error_backoff).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&state.slots).try_acquire_owned() else {
                bump_counter(&state.counters.listener.connections_refused);
                drop(io);
                continue;
            };
            state.counters.listener.connections_open.fetch_add(1, Ordering::Relaxed);
            let token = state.all.child_token();
            let deadline = Box::pin(tokio::time::sleep(state.limits.handshake_timeout));
            let limited = LimitedIo {
                inner: io,
                closed: Box::pin(token.clone().cancelled_owned()),
                token,
                preface: Some((PREFACE_BYTES, deadline)),
                counters: Arc::clone(&state.counters),
                _permit: permit,
            };
            return Some((Ok(limited), state));
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::StreamExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream, duplex};

    use super::*;

    fn limits() -> ListenerLimits {
        ListenerLimits {
            max_connections: 1,
            accept_error_backoff: Duration::from_millis(100),
            handshake_timeout: Duration::from_secs(1),
            ..ListenerLimits::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn accept_errors_are_counted_and_backed_off_and_the_cap_closes_extra_connections() {
        let counters = Arc::new(WanCounters::default());
        let (first, _first_peer) = duplex(64);
        let (second, mut second_peer) = duplex(64);
        let items: Vec<Result<DuplexStream, std::io::Error>> = vec![
            Err(std::io::Error::other("EMFILE")),
            Err(std::io::Error::other("EMFILE")),
            Ok(first),
            Ok(second),
        ];
        let all = CancellationToken::new();
        let incoming =
            limited_incoming(futures::stream::iter(items), limits(), Arc::clone(&counters), all);
        let mut incoming = Box::pin(incoming);
        let started = tokio::time::Instant::now();
        let admitted = incoming.next().await.unwrap().unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200), "two back-offs");
        assert_eq!(counters.listener.accept_errors.load(Ordering::Relaxed), 2);
        // The second connection finds the one slot taken: dropped, counted, stream ends.
        assert!(incoming.next().await.is_none());
        assert_eq!(counters.listener.connections_refused.load(Ordering::Relaxed), 1);
        let mut byte = [0u8; 1];
        assert_eq!(second_peer.read(&mut byte).await.unwrap(), 0, "closed at once");
        assert_eq!(counters.listener.connections_open.load(Ordering::Relaxed), 1);
        drop(admitted);
        assert_eq!(counters.listener.connections_open.load(Ordering::Relaxed), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_closed_or_silent_connection_fails_its_reads_and_writes() {
        let counters = Arc::new(WanCounters::default());
        let (a, mut a_peer) = duplex(64);
        let (b, _b_peer) = duplex(64);
        let all = CancellationToken::new();
        let items: Vec<Result<DuplexStream, std::io::Error>> = vec![Ok(a), Ok(b)];
        let generous = ListenerLimits { max_connections: 2, ..limits() };
        let mut incoming = Box::pin(limited_incoming(
            futures::stream::iter(items),
            generous,
            Arc::clone(&counters),
            all.clone(),
        ));
        let mut a = incoming.next().await.unwrap().unwrap();
        let mut b = incoming.next().await.unwrap().unwrap();
        // `a` sends its preface and keeps working past the handshake deadline.
        a_peer.write_all(&[0u8; PREFACE_BYTES]).await.unwrap();
        let mut buffer = [0u8; PREFACE_BYTES];
        a.read_exact(&mut buffer).await.unwrap();
        // `b` is silent: its read fails at the deadline.
        let error = b.read(&mut buffer).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(counters.listener.handshake_timeouts.load(Ordering::Relaxed), 1);
        a.write_all(b"x").await.unwrap();
        // Closing one connection (a slow consumer) fails its pending read at once.
        let closer = a.connect_info();
        let pending = crate::runtime::spawn(async move {
            let mut byte = [0u8; 1];
            a.read(&mut byte).await
        });
        tokio::task::yield_now().await;
        closer.close();
        let error = pending.await.unwrap().unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionAborted);
        assert!(closer.is_closed());
        // Cancelling the listener-wide token closes the rest.
        all.cancel();
        assert_eq!(b.write(b"x").await.unwrap_err().kind(), io::ErrorKind::ConnectionAborted);
    }
}
