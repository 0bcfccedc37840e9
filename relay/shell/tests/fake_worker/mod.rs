//! A fake Dynamo 1.6.1 worker's request plane, written from `reference/dynamo-planes-wire.md`
//! §A: a TCP server that reads request frames on a persistent connection, ACKs them, and calls
//! home to the `connection_info` address with the handshake and the frames its [`Script`]
//! chooses. Shared by the recovery-client tests and the `serve` setup's recovering workers.
#![allow(dead_code, reason = "each test binary that includes this module uses a part of it")]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Mutex, mpsc, watch};

pub fn two_part(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(header.len() as u64).to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(&0u64.to_be_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(body);
    out
}

pub fn prologue() -> Vec<u8> {
    two_part(br#"{"error":null}"#, b"")
}

pub fn sentinel() -> Vec<u8> {
    two_part(br#""sentinel""#, b"")
}

/// One request frame as the fake worker read it.
#[derive(Debug, Clone)]
pub struct ReceivedRequest {
    pub raw: Vec<u8>,
    pub path: String,
    pub headers: serde_json::Value,
    pub control_bytes: Vec<u8>,
    pub control: serde_json::Value,
    pub checksum: u64,
    pub body: Vec<u8>,
    /// The parsed `connection_info.info` text.
    pub info: serde_json::Value,
}

impl ReceivedRequest {
    pub fn info_text(&self, key: &str) -> String {
        self.info[key].as_str().unwrap_or_default().to_owned()
    }
}

/// What the fake worker does with one request.
#[derive(Debug, Clone, Default)]
pub struct Reply {
    /// ACK text (`Some(empty)` accepts); `None` sends no ACK.
    pub ack: Option<Vec<u8>>,
    /// Send the ACK only after the whole response stream.
    pub ack_after_stream: bool,
    /// Frames to send after the handshake; `None` never calls home.
    pub call_home: Option<Vec<Vec<u8>>>,
    /// What the worker does with the call-home connection after its frames.
    pub end: CallHomeEnd,
    /// How long the worker waits after the request before it calls home.
    pub call_home_delay: Duration,
    /// Send only the first bytes of the frames, the rest once released.
    pub pause: Option<CallHomePause>,
}

/// Where a call-home stream stops until the test releases it.
#[derive(Debug, Clone)]
pub struct CallHomePause {
    /// Bytes of the frames (after the handshake) sent before the pause.
    pub after_bytes: usize,
    /// The rest is sent once this reads `true`.
    pub resume: watch::Receiver<bool>,
}

/// How a fake worker ends a call-home connection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CallHomeEnd {
    /// Wait (up to 5 s) for the relay to close it, and report whether it did (Dynamo's worker).
    #[default]
    AwaitRelayClose,
    /// Close it at once.
    Close,
    /// Keep it open and send nothing more (a stalled worker).
    Stall,
}

pub type Script = Arc<dyn Fn(&ReceivedRequest) -> Reply + Send + Sync>;

pub struct FakeWorker {
    pub address: SocketAddr,
    pub requests: mpsc::UnboundedReceiver<ReceivedRequest>,
    /// Request connections accepted.
    pub accepts: Arc<AtomicUsize>,
    /// Call-home connections the relay closed after the frames were sent.
    pub closed_by_relay: mpsc::UnboundedReceiver<bool>,
}

impl FakeWorker {
    pub async fn start(script: Script) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (requests_tx, requests) = mpsc::unbounded_channel();
        let (closed_tx, closed_by_relay) = mpsc::unbounded_channel();
        let accepts = Arc::new(AtomicUsize::new(0));
        let accepted = Arc::clone(&accepts);
        let stalled: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        kvrelay::runtime::spawn(async move {
            while let Ok((connection, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                kvrelay::runtime::spawn(serve_connection(
                    connection,
                    Arc::clone(&script),
                    requests_tx.clone(),
                    closed_tx.clone(),
                    Arc::clone(&stalled),
                ));
            }
        });
        FakeWorker { address, requests, accepts, closed_by_relay }
    }
}

pub async fn serve_connection(
    mut connection: TcpStream,
    script: Script,
    requests: mpsc::UnboundedSender<ReceivedRequest>,
    closed_by_relay: mpsc::UnboundedSender<bool>,
    stalled: Arc<Mutex<Vec<TcpStream>>>,
) {
    while let Some(request) = read_request(&mut connection).await {
        let reply = script(&request);
        let _ = requests.send(request.clone());
        let ack = reply.ack.as_ref().map(|text| {
            let mut frame = (text.len() as u32).to_be_bytes().to_vec();
            frame.extend_from_slice(text);
            frame
        });
        if !reply.ack_after_stream
            && let Some(ack) = &ack
        {
            let _ = connection.write_all(ack).await;
        }
        if let Some(frames) = reply.call_home {
            let address = request.info_text("address");
            let subject = request.info_text("subject");
            tokio::time::sleep(reply.call_home_delay).await;
            if let Ok(mut home) = TcpStream::connect(address).await {
                let handshake = format!(r#"{{"subject":"{subject}","stream_type":"response"}}"#);
                let mut bytes = two_part(handshake.as_bytes(), b"");
                let frames = frames.concat();
                let paused_at =
                    reply.pause.as_ref().map_or(frames.len(), |pause| pause.after_bytes);
                let (before, after) = frames.split_at(paused_at.min(frames.len()));
                bytes.extend_from_slice(before);
                let _ = home.write_all(&bytes).await;
                if let Some(pause) = &reply.pause {
                    let mut resume = pause.resume.clone();
                    let _ = resume.wait_for(|released| *released).await;
                    let _ = home.write_all(after).await;
                }
                match reply.end {
                    CallHomeEnd::Stall => stalled.lock().await.push(home),
                    CallHomeEnd::Close => drop(home),
                    CallHomeEnd::AwaitRelayClose => {
                        let mut probe = [0u8; 64];
                        let wait = Duration::from_secs(5);
                        let closed = matches!(
                            tokio::time::timeout(wait, home.read(&mut probe)).await,
                            Ok(Ok(0))
                        );
                        let _ = closed_by_relay.send(closed);
                    }
                }
            }
        }
        if reply.ack_after_stream
            && let Some(ack) = &ack
        {
            let _ = connection.write_all(ack).await;
        }
    }
}

/// Read one request frame (§A.3); `None` when the relay closed the connection.
pub async fn read_request(connection: &mut TcpStream) -> Option<ReceivedRequest> {
    let path_len = connection.read_u16().await.ok()?;
    let mut path = vec![0u8; usize::from(path_len)];
    connection.read_exact(&mut path).await.ok()?;
    let headers_len = connection.read_u16().await.ok()?;
    let mut headers = vec![0u8; usize::from(headers_len)];
    connection.read_exact(&mut headers).await.ok()?;
    let payload_len = connection.read_u32().await.ok()?;
    let mut payload = vec![0u8; payload_len as usize];
    connection.read_exact(&mut payload).await.ok()?;
    let mut raw = Vec::new();
    raw.extend_from_slice(&path_len.to_be_bytes());
    raw.extend_from_slice(&path);
    raw.extend_from_slice(&headers_len.to_be_bytes());
    raw.extend_from_slice(&headers);
    raw.extend_from_slice(&payload_len.to_be_bytes());
    raw.extend_from_slice(&payload);

    let field = |at: usize| u64::from_be_bytes(payload[at..at + 8].try_into().unwrap());
    let (header_len, body_len, checksum) = (field(0) as usize, field(8) as usize, field(16));
    assert_eq!(payload.len(), 24 + header_len + body_len, "two-part lengths add up");
    let control_bytes = payload[24..24 + header_len].to_vec();
    let body = payload[24 + header_len..].to_vec();
    let control: serde_json::Value = serde_json::from_slice(&control_bytes).unwrap();
    let info_text = control["connection_info"]["info"].as_str().unwrap().to_owned();
    Some(ReceivedRequest {
        raw,
        path: String::from_utf8(path).unwrap(),
        headers: serde_json::from_slice(&headers).unwrap(),
        control_bytes,
        control,
        checksum,
        body,
        info: serde_json::from_str(&info_text).unwrap(),
    })
}
