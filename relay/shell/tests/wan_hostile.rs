//! Hostile clients against the WAN listener over real loopback TCP, and a slowloris against the
//! operations listener of the built binary. Each test asserts the refusal the contract (or
//! HTTP/2) names, that a well-behaved consumer is served meanwhile, and a bound on resident
//! memory where a flood could grow it.
//!
//! Low-level misbehaviour is written as raw HTTP/2 frames (or with the `h2` client where it
//! can express it: a zero flow-control window, a socket that is never read). Every test is
//! bounded in client count and time.

mod relay_process;
mod support;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use kvrelay::config::{ListenerLimits, WanTuning};
use kvrelay::wan::StreamType;
use kvrelay_core::wire::RelayErrorReason;
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use prost::Message;
use relay_process::{RelayProcess, rss_kib_of};
use support::{ENDPOINT, LoopbackRelay, pool_request, producer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::net::tcp::OwnedReadHalf;
use tokio::time::Instant;
use tonic::Code;

/// Every test ends within this.
const TEST_BOUND: Duration = Duration::from_secs(60);
/// Resident memory of the test process (relay included) after a flood: well above a normal
/// run (about 12 MiB), far below what an unbounded flood would take.
const RSS_BOUND_KIB: u64 = 128 * 1024;

async fn bounded<F: std::future::Future>(test: F) -> F::Output {
    tokio::time::timeout(TEST_BOUND, test).await.expect("test exceeded its time bound")
}

fn path(method: &str) -> String {
    format!("/{}/{method}", kvrelay_proto::SERVICE_NAME)
}

fn catalog_request(subscriber: &str) -> proto::WatchKvPoolCatalogRequest {
    proto::WatchKvPoolCatalogRequest {
        subscriber_id: subscriber.into(),
        contract_marker: CONTRACT_MARKER,
    }
}

fn reason(status: &tonic::Status) -> Option<RelayErrorReason> {
    kvrelay_consumer::policy::reason_from_status(status)
}

/// Wait (at most 10 s) until `condition` holds.
async fn eventually(what: &str, condition: impl Fn() -> bool) {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A well-behaved consumer on its own connection gets relay info and a catalog update.
async fn assert_served(address: SocketAddr) {
    let mut client =
        proto::kv_event_relay_client::KvEventRelayClient::connect(format!("http://{address}"))
            .await
            .expect("a well-behaved consumer connects");
    client
        .get_relay_info(proto::RelayInfoRequest { contract_marker: CONTRACT_MARKER })
        .await
        .expect("relay info is served");
    let mut catalog = client.watch_kv_pool_catalog(catalog_request("good")).await.unwrap();
    assert!(catalog.get_mut().message().await.unwrap().is_some(), "a catalog update is served");
}

fn assert_rss_bounded() {
    let rss = rss_kib_of("/proc/self/status");
    eprintln!("test process VmRSS {rss} KiB");
    assert!(rss < RSS_BOUND_KIB, "resident memory {rss} KiB over the {RSS_BOUND_KIB} KiB bound");
}

// ---------------------------------------------------------------------------------------------
// gRPC framing through the `h2` client.

fn grpc_frame(message: &[u8]) -> Bytes {
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(message.len() as u32).to_be_bytes());
    frame.extend_from_slice(message);
    frame.into()
}

fn grpc_request(method: &str) -> http::Request<()> {
    http::Request::builder()
        .method("POST")
        .uri(format!("http://relay{}", path(method)))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap()
}

/// A transport whose reads can be stopped: once paused the client never reads the socket.
struct PausableIo {
    inner: TcpStream,
    paused: Arc<AtomicBool>,
}

impl AsyncRead for PausableIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.paused.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for PausableIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

type H2Connection = tokio::task::JoinHandle<Result<(), h2::Error>>;

/// An `h2` client granting `window` bytes per stream; `paused` stops its socket reads.
async fn h2_client(
    address: SocketAddr,
    window: u32,
    paused: Arc<AtomicBool>,
) -> (h2::client::SendRequest<Bytes>, H2Connection) {
    let inner = TcpStream::connect(address).await.unwrap();
    let (send, connection) = h2::client::Builder::new()
        .initial_window_size(window)
        .handshake(PausableIo { inner, paused })
        .await
        .unwrap();
    (send, kvrelay::runtime::spawn(connection))
}

/// Open a `method` stream with one request message and return the response head.
async fn open_stream(
    send: &mut h2::client::SendRequest<Bytes>,
    method: &str,
    message: &[u8],
) -> http::Response<h2::RecvStream> {
    let (response, mut body) = send.send_request(grpc_request(method), false).unwrap();
    body.send_data(grpc_frame(message), true).unwrap();
    response.await.unwrap()
}

/// The `grpc-status` of a response: from its headers (trailers-only) or its trailers.
async fn grpc_status(response: http::Response<h2::RecvStream>) -> Option<i32> {
    let (parts, mut body) = response.into_parts();
    let from = |headers: &http::HeaderMap| {
        headers.get("grpc-status").and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
    };
    if let Some(code) = from(&parts.headers) {
        return Some(code);
    }
    while let Some(data) = body.data().await {
        if data.is_err() {
            return None;
        }
    }
    body.trailers().await.ok().flatten().as_ref().and_then(from)
}

// ---------------------------------------------------------------------------------------------
// Raw HTTP/2 frames.

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const REFUSED_STREAM: u32 = 0x7;
const CANCEL: u32 = 0x8;
const SETTINGS_MAX_CONCURRENT_STREAMS: u16 = 0x3;

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let length = payload.len() as u32;
    let mut bytes = length.to_be_bytes()[1..].to_vec();
    bytes.extend_from_slice(&[kind, flags]);
    bytes.extend_from_slice(&(stream & 0x7FFF_FFFF).to_be_bytes());
    bytes.extend_from_slice(payload);
    bytes
}

/// An HPACK integer with an `prefix`-bit prefix under `flags`.
fn hpack_integer(flags: u8, prefix: u32, value: usize, out: &mut Vec<u8>) {
    let max = (1usize << prefix) - 1;
    if value < max {
        out.push(flags | value as u8);
        return;
    }
    out.push(flags | max as u8);
    let mut rest = value - max;
    while rest >= 128 {
        out.push((rest % 128) as u8 | 0x80);
        rest /= 128;
    }
    out.push(rest as u8);
}

/// A literal header field without indexing, with a literal name (no Huffman coding).
fn literal(name: &str, value: &str, out: &mut Vec<u8>) {
    out.push(0x00);
    hpack_integer(0, 7, name.len(), out);
    out.extend_from_slice(name.as_bytes());
    hpack_integer(0, 7, value.len(), out);
    out.extend_from_slice(value.as_bytes());
}

/// The header block of a gRPC request for `method`, plus `extra` headers.
fn header_block(method: &str, extra: &[(&str, &str)]) -> Vec<u8> {
    // Static table: 3 = `:method POST`, 6 = `:scheme http`.
    let mut block = vec![0x83, 0x86];
    literal(":path", &path(method), &mut block);
    literal(":authority", "relay", &mut block);
    literal("content-type", "application/grpc", &mut block);
    literal("te", "trailers", &mut block);
    for (name, value) in extra {
        literal(name, value, &mut block);
    }
    block
}

/// A raw connection: the preface and an empty SETTINGS sent, the read half returned.
async fn raw_connection(address: SocketAddr) -> (OwnedReadHalf, tokio::net::tcp::OwnedWriteHalf) {
    let stream = TcpStream::connect(address).await.unwrap();
    let (read, mut write) = stream.into_split();
    write.write_all(PREFACE).await.unwrap();
    write.write_all(&frame(SETTINGS, 0, 0, &[])).await.unwrap();
    (read, write)
}

/// What the server sent on a raw connection.
#[derive(Debug, Default)]
struct Seen {
    max_concurrent_streams: Option<u32>,
    resets: usize,
    refused: usize,
    goaway: Option<u32>,
    /// Header blocks of responses (the first fragment of each).
    responses: Vec<Vec<u8>>,
    closed: bool,
}

fn be32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Read frames for at most `bound` or until the server closes the connection.
async fn read_frames(mut read: OwnedReadHalf, bound: Duration) -> Seen {
    let deadline = Instant::now() + bound;
    let mut seen = Seen::default();
    loop {
        let mut header = [0u8; 9];
        match tokio::time::timeout_at(deadline, read.read_exact(&mut header)).await {
            Err(_) => return seen,
            Ok(Err(_)) => {
                seen.closed = true;
                return seen;
            }
            Ok(Ok(_)) => {}
        }
        let length = be32(&[0, header[0], header[1], header[2]]) as usize;
        let mut payload = vec![0u8; length];
        match tokio::time::timeout_at(deadline, read.read_exact(&mut payload)).await {
            Err(_) => return seen,
            Ok(Err(_)) => {
                seen.closed = true;
                return seen;
            }
            Ok(Ok(_)) => {}
        }
        match header[3] {
            RST_STREAM if payload.len() >= 4 => {
                seen.resets += 1;
                if be32(&payload) == REFUSED_STREAM {
                    seen.refused += 1;
                }
            }
            GOAWAY if payload.len() >= 8 => seen.goaway = Some(be32(&payload[4..])),
            SETTINGS if header[4] & 0x1 == 0 => {
                for entry in payload.chunks_exact(6) {
                    if u16::from_be_bytes([entry[0], entry[1]]) == SETTINGS_MAX_CONCURRENT_STREAMS {
                        seen.max_concurrent_streams = Some(be32(&entry[2..]));
                    }
                }
            }
            HEADERS => seen.responses.push(payload),
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Connections.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_and_silent_ones_end_at_the_handshake_deadline() {
    bounded(async {
        let limits = ListenerLimits {
            max_connections: 3,
            handshake_timeout: Duration::from_millis(500),
            ..ListenerLimits::default()
        };
        let server = LoopbackRelay::start(WanTuning { limits, ..WanTuning::default() }).await;
        server.publish_catalog(1, Vec::new());
        let mut good = server.client().await;
        good.get_relay_info(proto::RelayInfoRequest { contract_marker: CONTRACT_MARKER })
            .await
            .unwrap();
        // Two silent connections fill the cap; three more are closed at once.
        let mut silent = Vec::new();
        for _ in 0..2 {
            silent.push(TcpStream::connect(server.address).await.unwrap());
        }
        eventually("the silent connections admitted", || {
            server.service.stats().listener.connections_open == 3
        })
        .await;
        for _ in 0..3 {
            let mut extra = TcpStream::connect(server.address).await.unwrap();
            let mut byte = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_secs(2), extra.read(&mut byte))
                .await
                .expect("a connection past the cap is closed at once");
            assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        }
        assert_eq!(server.service.stats().listener.connections_refused, 3);
        // The admitted consumer is unaffected.
        good.get_relay_info(proto::RelayInfoRequest { contract_marker: CONTRACT_MARKER })
            .await
            .unwrap();
        // The silent ones never sent the preface: closed at the handshake deadline.
        // (The server's own SETTINGS arrive first; the connection then ends.)
        for mut connection in silent {
            let mut received = Vec::new();
            let read =
                tokio::time::timeout(Duration::from_secs(3), connection.read_to_end(&mut received))
                    .await
                    .expect("a silent connection is closed at the handshake deadline");
            assert!(received.len() < 1024, "{read:?}: {} bytes", received.len());
        }
        let stats = server.service.stats().listener;
        assert_eq!(stats.handshake_timeouts, 2);
        eventually("the slots released", || server.service.stats().listener.connections_open == 1)
            .await;
        assert_served(server.address).await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Slow consumers.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_sends_window_update_is_ended_lagged_and_releases_its_slot() {
    bounded(async {
        let tuning = WanTuning {
            catalog_heartbeat_interval: Duration::from_millis(50),
            max_catalog_subscribers: 1,
            limits: ListenerLimits {
                subscriber_send_timeout: Duration::from_millis(300),
                ..ListenerLimits::default()
            },
            ..WanTuning::default()
        };
        let server = LoopbackRelay::start(tuning).await;
        server.publish_catalog(1, Vec::new());
        // A zero window: the relay can send headers but never a byte of data.
        let (mut send, connection) =
            h2_client(server.address, 0, Arc::new(AtomicBool::new(false))).await;
        let stalled = open_stream(
            &mut send,
            "WatchKvPoolCatalog",
            &catalog_request("stalled").encode_to_vec(),
        )
        .await;
        assert_eq!(stalled.status(), 200);
        let started = Instant::now();
        let catalog = StreamType::Catalog as usize;
        eventually("the stalled stream ended as slow", || {
            server.service.stats().slow_consumer_ended[catalog] == 1
        })
        .await;
        // Bound: the send deadline after the buffered frames (two) fill, plus slack.
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
        let stats = server.service.stats();
        assert_eq!(stats.subscriber_lagged[catalog], 1, "ended as SUBSCRIBER_LAGGED");
        // Its admission slot is free again: the one catalog slot goes to a good consumer.
        let mut good = server.client().await;
        let mut stream = good
            .watch_kv_pool_catalog(catalog_request("good"))
            .await
            .expect("the slot was released")
            .into_inner();
        assert!(stream.message().await.unwrap().is_some());
        // The final status cannot reach a client that grants no window: its connection is
        // closed after the grace.
        let ended = tokio::time::timeout(Duration::from_secs(5), connection)
            .await
            .expect("the stalled connection is closed by the relay");
        assert!(ended.is_ok());
        assert_eq!(server.service.stats().slow_consumer_connections_closed, 1);
        for _ in 0..3 {
            assert!(stream.message().await.unwrap().is_some(), "the good stream keeps flowing");
        }
        // A second catalog stream is still refused with the contract's admission answer.
        let refused = good.watch_kv_pool_catalog(catalog_request("second")).await.unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert_eq!(reason(&refused), Some(RelayErrorReason::ResourceLimit));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_subscriber_that_stops_reading_its_socket_is_ended_and_its_slot_released() {
    bounded(async {
        let tuning = WanTuning {
            pool_heartbeat_interval: Duration::from_millis(50),
            max_pool_streams_total: 1,
            limits: ListenerLimits {
                subscriber_send_timeout: Duration::from_millis(300),
                ..ListenerLimits::default()
            },
            ..WanTuning::default()
        };
        let server = LoopbackRelay::start(tuning).await;
        // 65,536 buckets: a 512 KiB snapshot, far more than one flow-control window.
        let identity = producer(ENDPOINT, 1, 65_536);
        let _actor = server.activate(identity, 3);
        server.publish_catalog(1, vec![support::base_descriptor(identity, ENDPOINT)]);
        let paused = Arc::new(AtomicBool::new(false));
        let (mut send, _connection) = h2_client(server.address, 65_535, Arc::clone(&paused)).await;
        let response = open_stream(
            &mut send,
            "SubscribeKvPool",
            &pool_request(&identity, "never-reads").encode_to_vec(),
        )
        .await;
        assert_eq!(response.status(), 200);
        paused.store(true, Ordering::SeqCst);
        let pool = StreamType::Pool as usize;
        eventually("the unread pool stream ended as slow", || {
            server.service.stats().slow_consumer_ended[pool] == 1
        })
        .await;
        assert_eq!(server.service.stats().subscriber_lagged[pool], 1);
        assert_eq!(server.service.open_streams().pool, 0, "the admission slot is released");
        let mut good = server.client().await;
        let mut stream =
            good.subscribe_kv_pool(pool_request(&identity, "good")).await.unwrap().into_inner();
        let first = stream.message().await.unwrap().unwrap();
        assert_eq!(first.kind, proto::FilterUpdateKind::SnapshotChunk as i32);
        eventually("the unread connection closed", || {
            server.service.stats().slow_consumer_connections_closed == 1
        })
        .await;
        assert_rss_bounded();
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Stream and reset floods.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_streams_on_one_connection_are_refused_past_the_stream_limit() {
    bounded(async {
        let limits = ListenerLimits { max_streams_per_connection: 8, ..ListenerLimits::default() };
        let server = LoopbackRelay::start(WanTuning { limits, ..WanTuning::default() }).await;
        server.publish_catalog(1, Vec::new());
        let (read, mut write) = raw_connection(server.address).await;
        let reader = kvrelay::runtime::spawn(read_frames(read, Duration::from_secs(5)));
        // 2,000 catalog streams whose request never arrives: each stays open.
        let block = header_block("WatchKvPoolCatalog", &[]);
        let mut flood = Vec::new();
        for index in 0..2_000u32 {
            flood.extend(frame(HEADERS, END_HEADERS, 2 * index + 1, &block));
        }
        let _ = write.write_all(&flood).await;
        assert_served(server.address).await;
        let seen = reader.await.unwrap();
        eprintln!(
            "stream flood: {} refused, GOAWAY {:?}, {} responses",
            seen.refused,
            seen.goaway,
            seen.responses.len()
        );
        assert_eq!(seen.max_concurrent_streams, Some(8), "the limit is advertised");
        // h2 refuses streams past the limit (REFUSED_STREAM), and past 256 such resets ends
        // the connection with ENHANCE_YOUR_CALM.
        assert!(seen.refused >= 1, "no refusal of the excess streams: {seen:?}");
        assert!(seen.refused <= kvrelay::wan::LOCAL_ERROR_RESETS_MAX, "{seen:?}");
        assert_eq!(seen.goaway, Some(0xb), "{seen:?}");
        assert!(seen.responses.len() <= 8, "at most the limit was served: {seen:?}");
        assert_served(server.address).await;
        assert_rss_bounded();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_flood_ends_the_connection_and_nothing_else() {
    bounded(async {
        let server = LoopbackRelay::start(WanTuning::default()).await;
        server.publish_catalog(1, Vec::new());
        let (read, mut write) = raw_connection(server.address).await;
        let reader = kvrelay::runtime::spawn(read_frames(read, Duration::from_secs(5)));
        let block = header_block("WatchKvPoolCatalog", &[]);
        let mut flood = Vec::new();
        for index in 0..10_000u32 {
            let stream = 2 * index + 1;
            flood.extend(frame(HEADERS, END_HEADERS, stream, &block));
            flood.extend(frame(RST_STREAM, 0, stream, &CANCEL.to_be_bytes()));
        }
        let _ = write.write_all(&flood).await;
        let seen = reader.await.unwrap();
        eprintln!("reset flood: GOAWAY {:?}, {} resets", seen.goaway, seen.resets);
        // ENHANCE_YOUR_CALM (0xb): the pending-reset bound tripped.
        assert_eq!(seen.goaway, Some(0xb), "{seen:?}");
        assert!(seen.closed, "the connection is closed after GOAWAY: {seen:?}");
        assert_served(server.address).await;
        assert_rss_bounded();
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Oversized and malformed requests.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_and_malformed_requests_are_refused_before_allocation() {
    bounded(async {
        let limits = ListenerLimits { max_header_list_bytes: 2048, ..ListenerLimits::default() };
        let server = LoopbackRelay::start(WanTuning { limits, ..WanTuning::default() }).await;
        server.publish_catalog(1, Vec::new());
        let (mut send, _connection) =
            h2_client(server.address, 65_535, Arc::new(AtomicBool::new(false))).await;
        // A message declaring 2 GiB: refused by its declared length (OUT_OF_RANGE), not read.
        let (response, mut body) = send.send_request(grpc_request("GetRelayInfo"), false).unwrap();
        body.send_data(Bytes::from_static(&[0, 0x7F, 0xFF, 0xFF, 0xFF, 1, 2, 3]), true).unwrap();
        assert_eq!(grpc_status(response.await.unwrap()).await, Some(Code::OutOfRange as i32));
        // A request over the 64 KiB request limit (responses keep the 8 MiB limit).
        let big = proto::WatchKvPoolCatalogRequest {
            subscriber_id: "x".repeat(100 * 1024),
            contract_marker: CONTRACT_MARKER,
        };
        let response = open_stream(&mut send, "WatchKvPoolCatalog", &big.encode_to_vec()).await;
        assert_eq!(grpc_status(response).await, Some(Code::OutOfRange as i32));
        // Bytes that are no protobuf message.
        let response = open_stream(&mut send, "GetRelayInfo", &[0xFF, 0xFF, 0xFF, 0xFF]).await;
        assert_eq!(grpc_status(response).await, Some(Code::Internal as i32));
        // A request the contract refuses: the wrong contract marker.
        let marker = proto::RelayInfoRequest { contract_marker: 7 };
        let response = open_stream(&mut send, "GetRelayInfo", &marker.encode_to_vec()).await;
        assert_eq!(grpc_status(response).await, Some(Code::FailedPrecondition as i32));
        // A header list over the limit: refused by h2 before any handler runs.
        let (read, mut write) = raw_connection(server.address).await;
        let padding = "p".repeat(4096);
        let block = header_block("GetRelayInfo", &[("x-padding", &padding)]);
        write.write_all(&frame(HEADERS, END_HEADERS | END_STREAM, 1, &block)).await.unwrap();
        let seen = read_frames(read, Duration::from_secs(2)).await;
        eprintln!(
            "oversized header list: {} resets, {} responses",
            seen.resets,
            seen.responses.len()
        );
        let answered_ok = seen.responses.iter().any(|block| block.first() == Some(&0x88));
        assert!(!answered_ok, "an oversized header list was served: {seen:?}");
        assert!(
            seen.resets >= 1 || !seen.responses.is_empty() || seen.goaway.is_some(),
            "an oversized header list got no refusal: {seen:?}"
        );
        assert_served(server.address).await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Health Watch and reflection admission.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_watch_and_reflection_streams_are_admitted_under_their_limits() {
    bounded(async {
        use tonic_health::pb::HealthCheckRequest;
        use tonic_health::pb::health_client::HealthClient;
        let limits = ListenerLimits {
            max_health_watch_streams: 2,
            max_reflection_streams: 1,
            ..ListenerLimits::default()
        };
        let server = LoopbackRelay::start(WanTuning { limits, ..WanTuning::default() }).await;
        server.publish_catalog(1, Vec::new());
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.address))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut health = HealthClient::new(channel);
        let request = || HealthCheckRequest { service: String::new() };
        let mut first = health.watch(request()).await.unwrap().into_inner();
        let _second = health.watch(request()).await.unwrap().into_inner();
        assert!(first.message().await.unwrap().is_some());
        let refused = health.watch(request()).await.unwrap_err();
        assert_eq!(refused.code(), Code::ResourceExhausted);
        assert_eq!(reason(&refused), Some(RelayErrorReason::ResourceLimit));
        let stats = server.service.stats().listener;
        assert_eq!((stats.health_watch_open, stats.health_watch_rejected), (2, 1));
        // Check is never limited.
        health.check(request()).await.unwrap();
        drop(first);
        eventually("the watch slot released", || {
            server.service.stats().listener.health_watch_open == 1
        })
        .await;
        let _third = health.watch(request()).await.expect("admitted after a watch ended");
        // Reflection: one open stream, the next refused.
        let (mut send, _connection) =
            h2_client(server.address, 65_535, Arc::new(AtomicBool::new(false))).await;
        let reflection = |send: &mut h2::client::SendRequest<Bytes>| {
            let request = http::Request::builder()
                .method("POST")
                .uri(format!("http://relay{}", kvrelay::wan::REFLECTION_PATHS[0]))
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(())
                .unwrap();
            send.send_request(request, false).unwrap()
        };
        let (open, _open_body) = reflection(&mut send);
        let open = open.await.unwrap();
        assert_eq!(open.status(), 200);
        assert!(open.headers().get("grpc-status").is_none(), "the first stream is open");
        let (refused, _refused_body) = reflection(&mut send);
        assert_eq!(grpc_status(refused.await.unwrap()).await, Some(Code::ResourceExhausted as i32));
        let stats = server.service.stats().listener;
        assert_eq!((stats.reflection_open, stats.reflection_rejected), (1, 1));
        assert_served(server.address).await;
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Slowloris on the operations listener of the built binary.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_on_the_ops_listener_is_cut_off_while_the_wan_serves() {
    bounded(async {
        let discovery = tempfile::tempdir().unwrap();
        let mut relay = RelayProcess::spawn(discovery.path(), &[]);
        relay.wait_listening().await;
        // 40 clients dripping a request line one byte every 200 ms: the listener serves 32
        // connections, so at least 8 are closed at once; the rest at the 5 s header deadline.
        let started = Instant::now();
        let mut drippers = Vec::new();
        for _ in 0..40 {
            let ops = relay.ops;
            drippers.push(kvrelay::runtime::spawn(async move {
                let mut stream = TcpStream::connect(ops).await.unwrap();
                for byte in b"GET /metrics HTTP/1.1\r\nHost: relay\r\nX-Slow: ".iter().cycle() {
                    if stream.write_all(&[*byte]).await.is_err() {
                        break;
                    }
                    let mut buf = [0u8; 64];
                    let read =
                        tokio::time::timeout(Duration::from_millis(200), stream.read(&mut buf));
                    if let Ok(Ok(0) | Err(_)) = read.await {
                        break;
                    }
                }
                Instant::now()
            }));
        }
        assert_served(relay.wan).await;
        let mut cut = Vec::new();
        for dripper in drippers {
            cut.push(dripper.await.unwrap().duration_since(started));
        }
        cut.sort();
        assert!(cut[7] < Duration::from_secs(2), "past the cap closed at once: {cut:?}");
        assert!(cut[39] < Duration::from_secs(9), "all cut by the header deadline: {cut:?}");
        let mut page = TcpStream::connect(relay.ops).await.unwrap();
        page.write_all(b"GET /live HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        page.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let rss = relay.rss_kib();
        eprintln!("slowloris: cut at {:?} .. {:?}; relay VmRSS {rss} KiB", cut[0], cut[39]);
        assert!(rss > 0 && rss < 128 * 1024, "relay RSS {rss} KiB over the 128 MiB bound");
        relay.terminate();
        let (exit, _) = relay.wait_exit(Duration::from_secs(15)).await.expect("exit after SIGTERM");
        assert_eq!(exit.code(), Some(0));
    })
    .await;
}
