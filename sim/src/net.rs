//! The WAN over turmoil's simulated network: the relay's `incoming` stream of connections and the
//! consumer's connector. Both carry `turmoil::net::TcpStream`s, so partitions, latency and host
//! crashes that turmoil scripts reach the real tonic server and client unchanged.
//!
//! turmoil has no bandwidth setting; a consumer behind a slow link connects through
//! [`limited_connector`], whose [`Throttled`] stream paces reads and writes to a [`Bandwidth`]
//! the fault script sets (unlimited until then: it passes through).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};

use futures::Stream;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::Uri;
use tonic::transport::server::Connected;
use turmoil::net::{TcpListener, TcpStream};

/// One accepted simulated connection, as tonic's server wants it.
///
/// A bounce drops the host's runtime tasks (tonic's connection tasks among them) in an order
/// that depends on process-wide tokio task ids, and each dropped stream sends a segment that
/// draws a latency from turmoil's generator: a run's outcome would depend on what else the
/// process ran before. So the stream lives in a slot shared with the accept loop: closed
/// normally, the connection drops it at once; while its host is [`Crashing`], it leaves it to
/// the accept loop, which drops every stream it still holds in accept order when the bounce
/// drops the host's own future (after every runtime task).
#[derive(Debug)]
pub struct SimConnection {
    stream: Arc<Mutex<Option<TcpStream>>>,
    crashing: Crashing,
}

/// A scripted restart of the relay host: requested by the fault script, carried out by the
/// loop that steps the simulation, which marks the host [`Crashing`] first.
#[derive(Debug, Clone, Default)]
pub struct Bounce {
    requested: Arc<AtomicBool>,
    crashing: Crashing,
}

impl Bounce {
    /// Ask for a bounce at the next step.
    pub fn request(&self) {
        self.requested.store(true, Ordering::Relaxed);
    }

    /// Whether a bounce was asked for since the last call; if so the host is now crashing.
    pub fn take(&self) -> bool {
        let requested = self.requested.swap(false, Ordering::Relaxed);
        if requested {
            self.crashing.set();
        }
        requested
    }

    /// The host's crash flag.
    #[must_use]
    pub fn crashing(&self) -> Crashing {
        self.crashing.clone()
    }
}

/// Set on a host just before it is bounced (see [`SimConnection`]).
#[derive(Debug, Clone, Default)]
pub struct Crashing(Arc<AtomicBool>);

impl Crashing {
    /// The host is about to be bounced.
    pub fn set(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// A new boot of the host.
    pub fn clear(&self) {
        self.0.store(false, Ordering::Relaxed);
    }

    fn is_set(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

impl SimConnection {
    fn stream(&self) -> MutexGuard<'_, Option<TcpStream>> {
        self.stream.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn with<T>(
        &self,
        act: impl FnOnce(Pin<&mut TcpStream>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match self.stream().as_mut() {
            Some(stream) => act(Pin::new(stream)),
            None => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }
}

impl Drop for SimConnection {
    fn drop(&mut self) {
        if !self.crashing.is_set() {
            drop(self.stream().take());
        }
    }
}

impl Connected for SimConnection {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for SimConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.with(|stream| stream.poll_read(cx, buf))
    }
}

impl AsyncWrite for SimConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.with(|stream| stream.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|stream| stream.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.with(|stream| stream.poll_shutdown(cx))
    }
}

/// Every connection `listener` accepts, forever (accept errors are passed on for tonic to log).
/// `crashing` is the host's flag; the stream must be polled on the host's own future (not a
/// spawned task) for the bounce order of [`SimConnection`] to hold.
pub fn incoming(
    listener: TcpListener,
    crashing: Crashing,
) -> impl Stream<Item = io::Result<SimConnection>> + Send {
    let accepted: Vec<Arc<Mutex<Option<TcpStream>>>> = Vec::new();
    futures::stream::unfold((listener, accepted), move |(listener, mut accepted)| {
        let crashing = crashing.clone();
        async move {
            let connection = listener.accept().await.map(|(stream, _peer)| {
                accepted.retain(|slot| Arc::strong_count(slot) > 1);
                let stream = Arc::new(Mutex::new(Some(stream)));
                accepted.push(Arc::clone(&stream));
                SimConnection { stream, crashing }
            });
            Some((connection, (listener, accepted)))
        }
    })
}

/// A connector for `Endpoint::connect_with_connector` that dials `host:port` on turmoil's network
/// whatever the URI says.
pub fn connector(
    host: &'static str,
    port: u16,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<TcpStream>,
    Error = io::Error,
    Future = impl Future<Output = io::Result<TokioIo<TcpStream>>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_uri: Uri| async move {
        let stream = TcpStream::connect((host, port)).await?;
        Ok::<_, io::Error>(TokioIo::new(stream))
    })
}

/// A link's bandwidth in bytes per second, each direction (0: unlimited), shared between the
/// fault script that sets it and the connections that obey it.
#[derive(Debug, Clone, Default)]
pub struct Bandwidth(Arc<AtomicU64>);

impl Bandwidth {
    /// Limit the link to `bytes_per_s` (0 lifts the limit).
    pub fn set(&self, bytes_per_s: u64) {
        self.0.store(bytes_per_s, Ordering::Relaxed);
    }

    /// The limit now (0: none).
    #[must_use]
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// The most bytes one direction of a limited link carries in a burst: 100 ms at its rate, at
/// least one 1,500-byte frame.
#[must_use]
pub fn burst_bytes(bytes_per_s: u64) -> u64 {
    (bytes_per_s / 10).max(1500)
}

/// A token bucket on simulated time: `rate` bytes per second, at most [`burst_bytes`] banked.
#[derive(Debug)]
struct Bucket {
    tokens: u64,
    /// Simulated time the tokens were last counted up to.
    at: tokio::time::Instant,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Bucket {
    fn new() -> Self {
        Bucket { tokens: u64::MAX, at: tokio::time::Instant::now(), wait: None }
    }

    /// The bytes that may pass now at `rate` (never 0 when it returns `Ready`); with none
    /// banked, `Pending` until the first byte is due (the sleep wakes the task).
    fn poll_grant(&mut self, cx: &mut Context<'_>, rate: u64) -> Poll<u64> {
        let burst = burst_bytes(rate);
        let now = tokio::time::Instant::now();
        let elapsed_us = u64::try_from(now.duration_since(self.at).as_micros()).unwrap_or(u64::MAX);
        let earned = elapsed_us.saturating_mul(rate) / 1_000_000;
        if earned > 0 || self.tokens > burst {
            // Count time up to the last whole byte earned, so no fraction is lost.
            let spent_us = earned.saturating_mul(1_000_000).div_ceil(rate);
            self.at += std::time::Duration::from_micros(spent_us);
            self.tokens = self.tokens.saturating_add(earned).min(burst);
            if self.tokens == burst {
                self.at = now;
            }
        }
        if self.tokens > 0 {
            self.wait = None;
            return Poll::Ready(self.tokens);
        }
        let due = self.at + std::time::Duration::from_micros(1_000_000_u64.div_ceil(rate));
        let wait = self.wait.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(due)));
        if wait.deadline() != due {
            wait.as_mut().reset(due);
        }
        match wait.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.wait = None;
                self.poll_grant(cx, rate)
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn spend(&mut self, bytes: usize) {
        self.tokens = self.tokens.saturating_sub(bytes as u64);
    }
}

/// A stream whose reads and writes are paced to a [`Bandwidth`], each direction with its own
/// token bucket: bytes the peer sent wait in the simulated socket (and, once its buffer is
/// full, in the sender) until the link has carried them. Without a limit it passes through.
#[derive(Debug)]
pub struct Throttled<S> {
    inner: S,
    bandwidth: Bandwidth,
    read: Bucket,
    write: Bucket,
    scratch: Vec<u8>,
}

impl<S> Throttled<S> {
    /// `inner` paced to `bandwidth`.
    pub fn new(inner: S, bandwidth: Bandwidth) -> Self {
        Throttled {
            inner,
            bandwidth,
            read: Bucket::new(),
            write: Bucket::new(),
            scratch: Vec::new(),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Throttled<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let rate = this.bandwidth.get();
        if rate == 0 {
            this.read = Bucket::new();
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let granted = std::task::ready!(this.read.poll_grant(cx, rate));
        let limit = usize::try_from(granted).unwrap_or(usize::MAX).min(buf.remaining());
        this.scratch.resize(limit, 0);
        let mut limited = ReadBuf::new(&mut this.scratch);
        std::task::ready!(Pin::new(&mut this.inner).poll_read(cx, &mut limited))?;
        let read = limited.filled().len();
        buf.put_slice(&this.scratch[..read]);
        this.read.spend(read);
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Throttled<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let rate = this.bandwidth.get();
        if rate == 0 {
            this.write = Bucket::new();
            return Pin::new(&mut this.inner).poll_write(cx, buf);
        }
        let granted = std::task::ready!(this.write.poll_grant(cx, rate));
        let limit = usize::try_from(granted).unwrap_or(usize::MAX).min(buf.len());
        let written = std::task::ready!(Pin::new(&mut this.inner).poll_write(cx, &buf[..limit]))?;
        this.write.spend(written);
        Poll::Ready(Ok(written))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// [`connector`] for a host behind a link paced to `bandwidth` (see [`Throttled`]).
pub fn limited_connector(
    host: &'static str,
    port: u16,
    bandwidth: Bandwidth,
) -> impl tower::Service<
    Uri,
    Response = TokioIo<Throttled<TcpStream>>,
    Error = io::Error,
    Future = impl Future<Output = io::Result<TokioIo<Throttled<TcpStream>>>> + Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |_uri: Uri| {
        let bandwidth = bandwidth.clone();
        async move {
            let stream = TcpStream::connect((host, port)).await?;
            Ok::<_, io::Error>(TokioIo::new(Throttled::new(stream, bandwidth)))
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Bytes `server` sends one client behind a link paced to `bytes_per_s` (0: unlimited),
    /// and the simulated ms the client took to read them all.
    fn transfer(bytes: usize, bytes_per_s: u64) -> u64 {
        let mut sim = turmoil::Builder::new()
            .tick_duration(Duration::from_millis(5))
            .simulation_duration(Duration::from_secs(120))
            .build();
        sim.host("server", move || async move {
            let listener = TcpListener::bind(("0.0.0.0", 9000)).await?;
            let (mut stream, _) = listener.accept().await?;
            stream.write_all(&vec![7u8; bytes]).await?;
            // Keep the connection until the client is done.
            let mut end = [0u8; 1];
            let _ = stream.read(&mut end).await;
            Ok(())
        });
        let took = Arc::new(AtomicU64::new(0));
        let seen = Arc::clone(&took);
        sim.client("client", async move {
            let bandwidth = Bandwidth::default();
            bandwidth.set(bytes_per_s);
            let start = tokio::time::Instant::now();
            let stream = TcpStream::connect(("server", 9000)).await?;
            let mut stream = Throttled::new(stream, bandwidth);
            let mut received = vec![0u8; bytes];
            stream.read_exact(&mut received).await?;
            assert!(received.iter().all(|byte| *byte == 7));
            let elapsed = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
            seen.store(elapsed, Ordering::Relaxed);
            stream.write_all(&[0]).await?;
            Ok(())
        });
        sim.run().unwrap();
        took.load(Ordering::Relaxed)
    }

    #[test]
    fn a_limited_link_carries_bytes_at_its_rate_after_one_burst() {
        // 20,000 bytes at 1,000 B/s: one 1,500-byte burst, then 18,500 bytes at the rate.
        let limited = transfer(20_000, 1_000);
        assert!((18_400..=19_200).contains(&limited), "{limited} ms");
        // Four times the rate: the same 1,500-byte burst, the rest in a quarter of the time.
        let faster = transfer(20_000, 4_000);
        assert!((4_600..=4_800).contains(&faster), "{faster} ms");
        // Unlimited: a few steps.
        assert!(transfer(20_000, 0) < 200);
    }

    #[test]
    fn the_burst_is_a_tenth_of_a_second_and_at_least_one_frame() {
        assert_eq!(burst_bytes(1_000), 1_500);
        assert_eq!(burst_bytes(1 << 20), (1 << 20) / 10);
    }
}
