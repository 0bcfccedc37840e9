//! The WAN over turmoil's simulated network: the relay's `incoming` stream of connections and the
//! consumer's connector. Both carry `turmoil::net::TcpStream`s, so partitions, latency and host
//! crashes that turmoil scripts reach the real tonic server and client unchanged.

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
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
