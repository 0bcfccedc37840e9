//! Response bodies that hold each data frame until the next one is produced, so that a stream's
//! encode buffer never takes back the allocation of a large message.
//!
//! tonic encodes a stream's messages into one `BytesMut` per response and splits each frame off
//! it. If that frame has been written and dropped by the time the next message is encoded, the
//! buffer is the allocation's only owner and `bytes` reclaims the whole allocation for it; the
//! stream then keeps it, touched, for its lifetime. After a 4 MiB snapshot chunk every pool
//! subscriber kept about 4 MiB resident this way (measured: one 8 MiB mapping with 4 MiB
//! resident per subscribed pool). While a frame split from the buffer's allocation is alive, the
//! buffer cannot reclaim it and starts a fresh allocation of its initial size instead; the large
//! one is freed with its last frame, once the connection has written it.
//!
//! Invariant: while the inner body is polled, the last data frame it produced is held, so each
//! encode finds its buffer's allocation shared. The cost is one reference count per frame. This
//! frees a large allocation only if the message filled it: `kvrelay_proto::codec` reserves each
//! message whole, so it does.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use futures::TryFutureExt;
use futures::future::MapOk;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tonic::Status;
use tonic::body::Body;

/// Wraps every response body of a service in [`HoldLatestFrame`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct HoldLatestFrameLayer;

impl<S> tower::Layer<S> for HoldLatestFrameLayer {
    type Service = HoldingFrames<S>;

    fn layer(&self, inner: S) -> HoldingFrames<S> {
        HoldingFrames { inner }
    }
}

/// A service whose response bodies hold their latest frame.
#[derive(Debug, Clone)]
pub(crate) struct HoldingFrames<S> {
    inner: S,
}

impl<S, B> tower::Service<http::Request<B>> for HoldingFrames<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible>,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = MapOk<S::Future, fn(http::Response<Body>) -> http::Response<Body>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        self.inner.call(request).map_ok(hold_frames)
    }
}

fn hold_frames(response: http::Response<Body>) -> http::Response<Body> {
    response.map(|body| Body::new(HoldLatestFrame::new(body)))
}

/// A body that keeps a reference to the last data frame it returned until it is polled again.
#[derive(Debug)]
pub(crate) struct HoldLatestFrame<B> {
    inner: B,
    held: Option<Bytes>,
}

impl<B> HoldLatestFrame<B> {
    pub(crate) fn new(inner: B) -> Self {
        HoldLatestFrame { inner, held: None }
    }
}

impl<B> HttpBody for HoldLatestFrame<B>
where
    B: HttpBody<Data = Bytes, Error = Status> + Unpin,
{
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        let polled = std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx));
        // Only now, after the inner body has encoded its next frame, let the previous one go.
        this.held = match &polled {
            Some(Ok(frame)) => frame.data_ref().cloned(),
            _ => None,
        };
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use http_body_util::BodyExt;
    use kvrelay_proto::v1::FilterUpdate;
    use prost::Message;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};

    /// tonic's response encoding in small: one buffer of tonic's initial capacity, a 5-byte
    /// header before each message, each frame split off the buffer. With `reserve_whole` the
    /// message's length is reserved first, as `kvrelay_proto::codec::ExactEncoder` does.
    /// Records the buffer's capacity after each encode.
    struct EncodeLikeTonic {
        buf: BytesMut,
        messages: VecDeque<FilterUpdate>,
        reserve_whole: bool,
        capacities: Arc<Mutex<Vec<usize>>>,
    }

    impl HttpBody for EncodeLikeTonic {
        type Data = Bytes;
        type Error = Status;

        fn poll_frame(
            self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
            let this = self.get_mut();
            let Some(message) = this.messages.pop_front() else { return Poll::Ready(None) };
            this.buf.reserve(5);
            this.buf.put_slice(&[0; 5]);
            if this.reserve_whole {
                this.buf.reserve(message.encoded_len());
            }
            message.encode(&mut this.buf).unwrap();
            this.capacities.lock().unwrap().push(this.buf.capacity());
            let frame = this.buf.split_to(this.buf.len()).freeze();
            Poll::Ready(Some(Ok(Frame::data(frame))))
        }
    }

    fn update(payload_bytes: usize) -> FilterUpdate {
        FilterUpdate {
            payload: Bytes::from(vec![7u8; payload_bytes]),
            contract_marker: kvrelay_proto::CONTRACT_MARKER,
            ..FilterUpdate::default()
        }
    }

    /// Capacities of the encode buffer while a 4 MiB chunk and then small deltas are sent, the
    /// connection dropping each frame as soon as it has it.
    async fn capacities(hold: bool, reserve_whole: bool) -> Vec<usize> {
        let capacities = Arc::new(Mutex::new(Vec::new()));
        let inner = EncodeLikeTonic {
            buf: BytesMut::with_capacity(8 * 1024),
            messages: VecDeque::from([update(4 << 20), update(100), update(100), update(100)]),
            reserve_whole,
            capacities: Arc::clone(&capacities),
        };
        let mut body =
            if hold { Body::new(HoldLatestFrame::new(Body::new(inner))) } else { Body::new(inner) };
        while let Some(frame) = body.frame().await {
            drop(frame.unwrap());
        }
        capacities.lock().unwrap().clone()
    }

    const SMALL: usize = 64 * 1024;

    #[tokio::test]
    async fn the_encode_buffer_lets_a_large_allocation_go_once_its_frames_are_written() {
        let held = capacities(true, true).await;
        assert_eq!(held.len(), 4);
        assert!(held[0] >= 4 << 20, "the chunk needs a large buffer: {held:?}");
        assert!(held[0] < (4 << 20) + SMALL, "grown once, to the chunk's size: {held:?}");
        assert!(held[1..].iter().all(|capacity| *capacity <= SMALL), "then small: {held:?}");
    }

    #[tokio::test]
    async fn without_holding_the_buffer_takes_the_large_allocation_back() {
        // A control: the assertion above fails without the hold.
        let bare = capacities(false, true).await;
        assert!(bare[1..].iter().all(|capacity| *capacity > 1 << 20), "reclaimed: {bare:?}");
    }

    #[tokio::test]
    async fn without_the_whole_reservation_the_bytes_after_the_payload_double_the_buffer() {
        // A control: the marker after the payload grows the buffer a second time, and the
        // deltas after it go into the unused half of the same allocation.
        let doubled = capacities(true, false).await;
        assert!(doubled[0] >= 8 << 20, "doubled: {doubled:?}");
        assert!(doubled[1..].iter().all(|capacity| *capacity > 1 << 20), "slack: {doubled:?}");
    }

    #[tokio::test]
    async fn trailers_and_the_end_pass_through() {
        let trailers = http::HeaderMap::from_iter([(
            http::HeaderName::from_static("grpc-status"),
            http::HeaderValue::from_static("0"),
        )]);
        let inner = http_body_util::StreamBody::new(futures::stream::iter([
            Ok::<_, Status>(Frame::data(Bytes::from_static(b"abc"))),
            Ok(Frame::trailers(trailers.clone())),
        ]));
        let collected = Body::new(HoldLatestFrame::new(Body::new(inner))).collect().await.unwrap();
        assert_eq!(collected.trailers(), Some(&trailers));
        assert_eq!(collected.to_bytes(), Bytes::from_static(b"abc"));
    }
}
