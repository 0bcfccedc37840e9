//! A minimal read-only Kubernetes API client: `GET` over HTTP/1.1 (plaintext or TLS) with a
//! bearer token, bounded JSON bodies, and watch streams read as bounded lines.
//!
//! It is built on `hyper`'s HTTP/1 connection API instead of the `kube` crate: `hyper`,
//! `hyper-util`, `http-body-util`, `rustls` and `tokio-rustls` were already compiled for tonic,
//! axum and the TLS planes, so this client adds no crate to the build (`cargo tree` before and
//! after: the same packages). `kube`'s cost on the two-core build machines was not measured; it
//! would bring `kube-client`, `kube-core`, `k8s-openapi` (a generated type for every API group)
//! and their own HTTP stack for what is four read-only `GET` paths here: no writes, no
//! kubeconfig, no auth plugins.
//!
//! Invariants:
//!
//! - one TCP (and TLS) connection per request; a watch owns its connection until it is dropped,
//!   and the task driving the connection is aborted with it;
//! - the token file is read for every request (projected service-account tokens rotate), at
//!   most [`TOKEN_FILE_BYTES_MAX`] bytes, and is never logged or put in an error;
//! - a response body is bounded before it is buffered: a `GET` fails with
//!   [`KubeError::TooLarge`] past its limit (checked per received frame, before the frame is
//!   appended); a watch line longer than its limit is skipped and reported as
//!   [`WatchLine::Oversized`], and at most the limit plus one received frame of it is ever held;
//! - `410 Gone` (an expired `resourceVersion` or `continue` token) is its own error,
//!   [`KubeError::Gone`], so callers can relist.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::task::AbortHandle;
use tokio_rustls::TlsConnector;

use kvrelay_consumer::pem_files;

/// The in-cluster service-account directory Kubernetes mounts into every pod.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Longest token file accepted.
pub const TOKEN_FILE_BYTES_MAX: u64 = 64 * 1024;
/// Most bytes of an error response kept for its message.
const ERROR_BODY_BYTES_MAX: usize = 4096;

/// How to reach the API server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeApiConfig {
    /// `https://host:port` or `http://host:port` (no path).
    pub api_url: String,
    /// The bearer token file (`None`: no `Authorization` header).
    pub token_file: Option<PathBuf>,
    /// PEM file of the CA that signs the API server's certificate (required for `https`).
    pub ca_file: Option<PathBuf>,
    /// Limit on TCP connect plus TLS handshake.
    pub connect_timeout: Duration,
    /// Limit on a whole `GET` (connect, headers and body); watches have none.
    pub request_timeout: Duration,
}

impl KubeApiConfig {
    /// Defaults (5 s connect, 30 s request) for `api_url`, without token or CA.
    #[must_use]
    pub fn new(api_url: impl Into<String>) -> Self {
        KubeApiConfig {
            api_url: api_url.into(),
            token_file: None,
            ca_file: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
        }
    }
}

/// Why a request failed.
#[derive(Debug, Error)]
pub enum KubeError {
    /// The API URL is not usable.
    #[error("invalid Kubernetes API URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as configured.
        url: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The token or CA file could not be read or used.
    #[error("{what} {path}: {reason}")]
    File {
        /// Which file.
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// Why it failed.
        reason: String,
    },
    /// TCP connect failed.
    #[error("connect to {authority}: {source}")]
    Connect {
        /// `host:port`.
        authority: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The TLS handshake failed.
    #[error("TLS with {authority}: {source}")]
    Tls {
        /// `host:port`.
        authority: String,
        /// The I/O error carrying the TLS alert.
        source: std::io::Error,
    },
    /// A step took longer than its limit.
    #[error("{what} timed out")]
    Timeout {
        /// The step.
        what: &'static str,
    },
    /// HTTP framing or connection error.
    #[error("HTTP: {0}")]
    Http(String),
    /// `410 Gone`: the `resourceVersion` or `continue` token is too old; relist.
    #[error("410 Gone: {message}")]
    Gone {
        /// The server's message.
        message: String,
    },
    /// Any other non-2xx status.
    #[error("the API server answered {status}: {message}")]
    Status {
        /// The status code.
        status: u16,
        /// The server's message (at most 4 KiB of body, its `message` field if JSON).
        message: String,
    },
    /// The response body is larger than the caller's limit.
    #[error("response body larger than {max} bytes")]
    TooLarge {
        /// The limit.
        max: usize,
    },
}

/// A stream the HTTP connection runs over.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// A client for one API server. Cheap to clone.
#[derive(Clone)]
pub struct KubeClient {
    config: KubeApiConfig,
    authority: String,
    host: String,
    tls: Option<TlsConnector>,
}

impl std::fmt::Debug for KubeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeClient")
            .field("authority", &self.authority)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

/// `(https, host, port)` of an API URL.
fn parse_api_url(url: &str) -> Result<(bool, String, u16), KubeError> {
    let invalid = |reason| KubeError::InvalidUrl { url: url.to_owned(), reason };
    let (https, rest) = if let Some(rest) = url.strip_prefix("https://") {
        (true, rest)
    } else if let Some(rest) = url.strip_prefix("http://") {
        (false, rest)
    } else {
        return Err(invalid("must start with http:// or https://"));
    };
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@']) || authority.contains(' ') {
        return Err(invalid("must be scheme://host[:port] without path or user info"));
    }
    let default_port = if https { 443 } else { 80 };
    let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or_else(|| invalid("unclosed '['"))?;
        match after.strip_prefix(':') {
            Some(port) => (host, port.parse().map_err(|_| invalid("bad port"))?),
            None if after.is_empty() => (host, default_port),
            None => return Err(invalid("bad port")),
        }
    } else {
        match authority.rsplit_once(':') {
            Some((host, port)) => (host, port.parse().map_err(|_| invalid("bad port"))?),
            None => (authority, default_port),
        }
    };
    if host.is_empty() || port == 0 {
        return Err(invalid("empty host or zero port"));
    }
    Ok((https, host.to_owned(), port))
}

/// Read a small file whole, refusing it past `max` bytes before buffering it.
fn read_small_file(what: &'static str, path: &Path, max: u64) -> Result<Vec<u8>, KubeError> {
    let error = |reason: String| KubeError::File { what, path: path.to_owned(), reason };
    let file = std::fs::File::open(path).map_err(|e| error(e.to_string()))?;
    let length = file.metadata().map_err(|e| error(e.to_string()))?.len();
    if length > max {
        return Err(error(format!("larger than {max} bytes")));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(length).unwrap_or(0));
    std::io::Read::read_to_end(&mut std::io::Read::take(file, max + 1), &mut bytes)
        .map_err(|e| error(e.to_string()))?;
    if bytes.len() as u64 > max {
        return Err(error(format!("larger than {max} bytes")));
    }
    Ok(bytes)
}

impl KubeClient {
    /// A client for `config`; reads and checks the CA file now (the token is read per request).
    pub fn new(config: KubeApiConfig) -> Result<Self, KubeError> {
        let (https, host, port) = parse_api_url(&config.api_url)?;
        let authority =
            if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
        let tls = match (https, &config.ca_file) {
            (false, _) => None,
            (true, None) => {
                return Err(KubeError::InvalidUrl {
                    url: config.api_url.clone(),
                    reason: "https needs a CA file",
                });
            }
            (true, Some(ca)) => {
                let file_error = |reason: String| KubeError::File {
                    what: "Kubernetes CA file",
                    path: ca.clone(),
                    reason,
                };
                let certificates =
                    pem_files::read_certificates(ca).map_err(|e| file_error(e.to_string()))?;
                let mut roots = rustls::RootCertStore::empty();
                for certificate in certificates {
                    roots.add(certificate).map_err(|e| file_error(e.to_string()))?;
                }
                let provider = Arc::new(rustls::crypto::ring::default_provider());
                let tls_config = rustls::ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()
                    .map_err(|e| file_error(e.to_string()))?
                    .with_root_certificates(roots)
                    .with_no_client_auth();
                Some(TlsConnector::from(Arc::new(tls_config)))
            }
        };
        Ok(KubeClient { config, authority, host, tls })
    }

    /// The bearer token, trimmed; `None` without a token file.
    fn token(&self) -> Result<Option<String>, KubeError> {
        let Some(path) = &self.config.token_file else { return Ok(None) };
        let bytes = read_small_file("Kubernetes token file", path, TOKEN_FILE_BYTES_MAX)?;
        let text = String::from_utf8(bytes).map_err(|_| KubeError::File {
            what: "Kubernetes token file",
            path: path.clone(),
            reason: "not UTF-8".to_owned(),
        })?;
        Ok(Some(text.trim().to_owned()))
    }

    async fn connect(&self) -> Result<Box<dyn Io>, KubeError> {
        let tcp = TcpStream::connect(&self.authority)
            .await
            .map_err(|source| KubeError::Connect { authority: self.authority.clone(), source })?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => Ok(Box::new(tcp)),
            Some(connector) => {
                let name =
                    rustls::pki_types::ServerName::try_from(self.host.clone()).map_err(|_| {
                        KubeError::InvalidUrl {
                            url: self.config.api_url.clone(),
                            reason: "host is not a valid TLS server name",
                        }
                    })?;
                let stream = connector.connect(name, tcp).await.map_err(|source| {
                    KubeError::Tls { authority: self.authority.clone(), source }
                })?;
                Ok(Box::new(stream))
            }
        }
    }

    /// Send `GET path_and_query` on a new connection; the returned handle aborts the task that
    /// drives the connection.
    async fn send(
        &self,
        path_and_query: &str,
    ) -> Result<(Response<Incoming>, ConnectionGuard), KubeError> {
        let token = self.token()?;
        let io = tokio::time::timeout(self.config.connect_timeout, self.connect())
            .await
            .map_err(|_| KubeError::Timeout { what: "connecting to the Kubernetes API" })??;
        let (mut sender, connection) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(io))
                .await
                .map_err(|e| KubeError::Http(e.to_string()))?;
        let guard = ConnectionGuard(
            crate::runtime::spawn(async move {
                let _ = connection.await;
            })
            .abort_handle(),
        );
        let mut request = Request::get(path_and_query)
            .header(hyper::header::HOST, &self.authority)
            .header(hyper::header::ACCEPT, "application/json")
            .header(hyper::header::USER_AGENT, concat!("kvrelay/", env!("CARGO_PKG_VERSION")));
        if let Some(token) = token {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let request = request.body(Empty::new()).map_err(|e| KubeError::Http(e.to_string()))?;
        let response =
            sender.send_request(request).await.map_err(|e| KubeError::Http(e.to_string()))?;
        Ok((response, guard))
    }

    /// `GET` a JSON document of at most `max_bytes`; non-2xx statuses are errors.
    pub async fn get(&self, path_and_query: &str, max_bytes: usize) -> Result<Vec<u8>, KubeError> {
        let request = async {
            let (response, _guard) = self.send(path_and_query).await?;
            let status = response.status();
            if !status.is_success() {
                return Err(status_error(status, response.into_body()).await);
            }
            if let Some(length) = content_length(&response)
                && length > max_bytes as u64
            {
                return Err(KubeError::TooLarge { max: max_bytes });
            }
            read_bounded(response.into_body(), max_bytes)
                .await?
                .ok_or(KubeError::TooLarge { max: max_bytes })
        };
        tokio::time::timeout(self.config.request_timeout, request)
            .await
            .map_err(|_| KubeError::Timeout { what: "a Kubernetes API request" })?
    }

    /// Open a watch (`GET` with `watch=1` in `path_and_query`) whose lines are at most
    /// `line_max` bytes. Connecting and the response headers are bounded by the request timeout;
    /// the stream itself is not.
    pub async fn watch(
        &self,
        path_and_query: &str,
        line_max: usize,
    ) -> Result<WatchLines, KubeError> {
        let (response, guard) =
            tokio::time::timeout(self.config.request_timeout, self.send(path_and_query))
                .await
                .map_err(|_| KubeError::Timeout { what: "opening a Kubernetes watch" })??;
        let status = response.status();
        if !status.is_success() {
            return Err(status_error(status, response.into_body()).await);
        }
        Ok(WatchLines {
            body: response.into_body(),
            buffer: Vec::new(),
            line_max,
            skipping: None,
            ended: false,
            _guard: guard,
        })
    }
}

/// Aborts the connection task when dropped.
#[derive(Debug)]
struct ConnectionGuard(AbortHandle);

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn content_length(response: &Response<Incoming>) -> Option<u64> {
    response.headers().get(hyper::header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The body, or `None` if it exceeds `max` bytes (reading stops at the first frame past it).
async fn read_bounded(mut body: Incoming, max: usize) -> Result<Option<Vec<u8>>, KubeError> {
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| KubeError::Http(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            if bytes.len().saturating_add(data.len()) > max {
                return Ok(None);
            }
            bytes.extend_from_slice(&data);
        }
    }
    Ok(Some(bytes))
}

/// The error for a non-2xx response, with the `message` of a Kubernetes `Status` body.
async fn status_error(status: StatusCode, body: Incoming) -> KubeError {
    let message = match read_bounded(body, ERROR_BODY_BYTES_MAX).await {
        Ok(Some(bytes)) => status_message(&bytes),
        _ => String::new(),
    };
    if status == StatusCode::GONE {
        KubeError::Gone { message }
    } else {
        KubeError::Status { status: status.as_u16(), message }
    }
}

/// The `message` field of a `Status` document, else the body as (lossy) text, at most 256 chars.
pub fn status_message(bytes: &[u8]) -> String {
    let parsed: Option<String> = serde_json::from_slice::<serde_json::Value>(bytes)
        .ok()
        .and_then(|value| value.get("message")?.as_str().map(str::to_owned));
    let text = parsed.unwrap_or_else(|| String::from_utf8_lossy(bytes).into_owned());
    text.chars().take(256).collect()
}

/// One line of a watch stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchLine {
    /// A complete line (without its newline), at most the line limit.
    Line(Vec<u8>),
    /// A line longer than the limit was skipped; `bytes` is its length.
    Oversized {
        /// The skipped line's length.
        bytes: usize,
    },
}

/// The lines of a watch response, read as they arrive.
#[derive(Debug)]
pub struct WatchLines {
    body: Incoming,
    buffer: Vec<u8>,
    line_max: usize,
    /// Bytes of the oversized line being skipped, if one is.
    skipping: Option<usize>,
    ended: bool,
    _guard: ConnectionGuard,
}

impl WatchLines {
    /// The next line; `Ok(None)` when the server ended the stream (a watch timeout).
    ///
    /// Cancel-safe: a line is only taken from the buffer when it is returned.
    pub async fn next_line(&mut self) -> Result<Option<WatchLine>, KubeError> {
        loop {
            if let Some(position) = self.buffer.iter().position(|&byte| byte == b'\n') {
                let skipped = self.skipping.take();
                if skipped.is_some() || position > self.line_max {
                    self.buffer.drain(..=position);
                    let bytes = skipped.unwrap_or(0).saturating_add(position);
                    return Ok(Some(WatchLine::Oversized { bytes }));
                }
                let mut line: Vec<u8> = self.buffer.drain(..=position).collect();
                line.pop();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Ok(Some(WatchLine::Line(line)));
            }
            if self.buffer.len() > self.line_max || self.skipping.is_some() {
                let held = self.buffer.len();
                self.buffer.clear();
                self.skipping = Some(self.skipping.unwrap_or(0).saturating_add(held));
            }
            if self.ended {
                return Ok(None);
            }
            match self.body.frame().await {
                None => self.ended = true,
                Some(Err(error)) => return Err(KubeError::Http(error.to_string())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buffer.extend_from_slice(&data);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_urls_are_parsed_and_bad_ones_refused() {
        assert_eq!(parse_api_url("https://10.96.0.1").unwrap(), (true, "10.96.0.1".into(), 443));
        assert_eq!(
            parse_api_url("http://127.0.0.1:8080/").unwrap(),
            (false, "127.0.0.1".into(), 8080)
        );
        assert_eq!(
            parse_api_url("https://[fd00::1]:6443").unwrap(),
            (true, "fd00::1".into(), 6443)
        );
        for bad in [
            "10.96.0.1:443",
            "ftp://host",
            "https://",
            "https://host/api",
            "https://user@host",
            "https://host:0",
            "https://host:99999",
            "https://[::1",
        ] {
            assert!(parse_api_url(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn https_without_a_ca_and_unreadable_files_are_refused() {
        assert!(matches!(
            KubeClient::new(KubeApiConfig::new("https://127.0.0.1:6443")),
            Err(KubeError::InvalidUrl { reason: "https needs a CA file", .. })
        ));
        let config = KubeApiConfig {
            ca_file: Some("/nonexistent/ca.crt".into()),
            ..KubeApiConfig::new("https://127.0.0.1:6443")
        };
        assert!(matches!(KubeClient::new(config), Err(KubeError::File { .. })));

        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("token");
        std::fs::write(&big, vec![b'a'; usize::try_from(TOKEN_FILE_BYTES_MAX).unwrap() + 1])
            .unwrap();
        let client = KubeClient::new(KubeApiConfig {
            token_file: Some(big),
            ..KubeApiConfig::new("http://127.0.0.1:1")
        })
        .unwrap();
        let error = client.token().unwrap_err();
        assert!(error.to_string().contains("larger than"), "{error}");
    }

    #[test]
    fn status_messages_come_from_status_documents_and_are_bounded() {
        let status = br#"{"kind":"Status","status":"Failure","message":"too old resource version: 5 (9)","code":410}"#;
        assert_eq!(status_message(status), "too old resource version: 5 (9)");
        assert_eq!(status_message(b"plain"), "plain");
        assert_eq!(status_message(&[b'x'; 1000]).len(), 256);
    }
}
