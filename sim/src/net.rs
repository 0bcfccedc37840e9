//! The WAN over turmoil's simulated network: the relay's `incoming` stream of connections and the
//! consumer's connector. Both carry `turmoil::net::TcpStream`s, so partitions, latency and host
//! crashes that turmoil scripts reach the real tonic server and client unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::Stream;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::Uri;
use tonic::transport::server::Connected;
use turmoil::net::{TcpListener, TcpStream};

/// One accepted simulated connection, as tonic's server wants it.
#[derive(Debug)]
pub struct SimConnection(pub TcpStream);

impl Connected for SimConnection {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for SimConnection {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for SimConnection {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// Every connection `listener` accepts, forever (accept errors are passed on for tonic to log).
pub fn incoming(listener: TcpListener) -> impl Stream<Item = io::Result<SimConnection>> + Send {
    futures::stream::unfold(listener, |listener| async move {
        let accepted = listener.accept().await.map(|(stream, _peer)| SimConnection(stream));
        Some((accepted, listener))
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
