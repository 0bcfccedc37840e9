//! The Kubernetes API client of the discovery backend: the `kube` crate's client (its HTTP
//! stack, rustls with the configured CA on the `ring` provider, connection pool and connect
//! timeout) sending requests built with `kube`'s request builders, with every response body
//! read here under a byte bound.
//!
//! The bodies are read here rather than through `kube`'s `request` / `request_events`, which
//! buffer a whole list body, and every watch line, without a limit: a relay that reads the
//! API server's answers must not let one oversized object take its memory.
//!
//! Invariants:
//!
//! - only `GET`s are sent; a watch owns its connection until it is dropped (a body dropped
//!   unread closes its connection rather than returning it to the pool);
//! - the token file is read for every request (projected service-account tokens rotate), at
//!   most [`TOKEN_FILE_BYTES_MAX`] bytes, and is never logged or put in an error;
//! - a response body is bounded before it is buffered: a `GET` fails with
//!   [`KubeError::TooLarge`] past its limit (checked per received frame, before the frame is
//!   appended); a watch line longer than its limit is skipped and reported as
//!   [`WatchLine::Oversized`], and at most the limit plus one received frame of it is ever held;
//! - `410 Gone` (an expired `resourceVersion` or `continue` token) is its own error,
//!   [`KubeError::Gone`], so callers can relist.

use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::{Request, Response, StatusCode};
use kube::client::Body;
use thiserror::Error;

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
    /// Limit on a whole `GET` (connect, headers and body), and on opening a watch; the
    /// stream of a watch has none (the server ends it after its `timeoutSeconds`).
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

    /// The `kube` client configuration: the URL checked, the CA read and parsed. No client is
    /// built, so this runs outside an async runtime (`kube`'s client needs one).
    pub fn kube_config(&self) -> Result<kube::Config, KubeError> {
        let invalid = |reason| KubeError::InvalidUrl { url: self.api_url.clone(), reason };
        let (https, host, port) = parse_api_url(&self.api_url)?;
        let authority =
            if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") };
        let scheme = if https { "https" } else { "http" };
        let uri: http::Uri =
            format!("{scheme}://{authority}").parse().map_err(|_| invalid("not a valid URI"))?;
        let mut config = kube::Config::new(uri);
        config.connect_timeout = Some(self.connect_timeout);
        // Watches are quiet between events; `get` bounds itself with `request_timeout`.
        config.read_timeout = None;
        // The watcher has its own backoff, and a 429 / 503 must reach its counters and logs
        // rather than be retried here for up to the request timeout.
        config.default_retry = false;
        config.write_timeout = Some(self.request_timeout);
        if https {
            let Some(ca) = &self.ca_file else {
                return Err(invalid("https needs a CA file"));
            };
            let file_error = |reason: String| KubeError::File {
                what: "Kubernetes CA file",
                path: ca.clone(),
                reason,
            };
            let certificates =
                pem_files::read_certificates(ca).map_err(|e| file_error(e.to_string()))?;
            let roots = certificates.iter().map(|der| der.as_ref().to_vec()).collect();
            config.root_cert = Some(roots);
            if host.parse::<std::net::IpAddr>().is_err()
                && rustls::pki_types::ServerName::try_from(host.as_str()).is_err()
            {
                return Err(invalid("host is not a valid TLS server name"));
            }
        }
        Ok(config)
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
    /// The `kube` client could not be built or could not send (connect, HTTP); the text is
    /// the whole cause chain.
    #[error("Kubernetes API client: {0}")]
    Client(String),
    /// The TLS handshake with the API server failed (an untrusted certificate, a bad name).
    #[error("TLS with the Kubernetes API: {0}")]
    Tls(String),
    /// A step took longer than its limit.
    #[error("{what} timed out")]
    Timeout {
        /// The step.
        what: &'static str,
    },
    /// HTTP framing or connection error, or a request that could not be built.
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

/// A client for one API server. Cheap to clone.
#[derive(Clone)]
pub struct KubeClient {
    client: kube::Client,
    token_file: Option<PathBuf>,
    request_timeout: Duration,
}

impl std::fmt::Debug for KubeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeClient")
            .field("token_file", &self.token_file)
            .field("request_timeout", &self.request_timeout)
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

/// A request built by `kube`'s builders (`kube::core::Request`), not yet sent.
pub type ApiRequest = Request<Vec<u8>>;

impl KubeClient {
    /// A client for `config`. Reads and checks the CA file now (the token is read per request).
    /// Must be called inside a Tokio runtime: `kube`'s client starts its dispatch task here.
    pub fn new(config: KubeApiConfig) -> Result<Self, KubeError> {
        let kube_config = config.kube_config()?;
        let client = kube::Client::try_from(kube_config).map_err(|e| client_error(&e))?;
        Ok(KubeClient {
            client,
            token_file: config.token_file,
            request_timeout: config.request_timeout,
        })
    }

    /// The bearer token, trimmed; `None` without a token file.
    fn token(&self) -> Result<Option<String>, KubeError> {
        read_token(self.token_file.as_deref())
    }

    /// Send `request` (a `GET`) with the bearer token and JSON accepted.
    async fn send(&self, request: ApiRequest) -> Result<Response<Body>, KubeError> {
        let token = self.token()?;
        let (mut parts, body) = request.into_parts();
        let headers = &mut parts.headers;
        headers.insert(hyper::header::ACCEPT, http::HeaderValue::from_static("application/json"));
        headers.insert(
            hyper::header::USER_AGENT,
            http::HeaderValue::from_static(concat!("kvrelay/", env!("CARGO_PKG_VERSION"))),
        );
        if let Some(token) = token {
            let mut value = http::HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| KubeError::Http("the token is not a valid header value".into()))?;
            value.set_sensitive(true);
            headers.insert(hyper::header::AUTHORIZATION, value);
        }
        self.client
            .send(Request::from_parts(parts, Body::from(body)))
            .await
            .map_err(|e| client_error(&e))
    }

    /// `GET` a JSON document of at most `max_bytes`; non-2xx statuses are errors.
    pub async fn get(&self, request: ApiRequest, max_bytes: usize) -> Result<Vec<u8>, KubeError> {
        let request = async {
            let response = self.send(request).await?;
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
        tokio::time::timeout(self.request_timeout, request)
            .await
            .map_err(|_| KubeError::Timeout { what: "a Kubernetes API request" })?
    }

    /// Open a watch (a `watch=true` request) whose lines are at most `line_max` bytes.
    /// Connecting and the response headers are bounded by the request timeout; the stream
    /// itself is not.
    pub async fn watch(
        &self,
        request: ApiRequest,
        line_max: usize,
    ) -> Result<WatchLines, KubeError> {
        // The headers, and the body of a refusal, within the request timeout; the stream of
        // an accepted watch has none.
        let opened = async {
            let response = self.send(request).await?;
            let status = response.status();
            if !status.is_success() {
                return Err(status_error(status, response.into_body()).await);
            }
            Ok(response)
        };
        let response = tokio::time::timeout(self.request_timeout, opened)
            .await
            .map_err(|_| KubeError::Timeout { what: "opening a Kubernetes watch" })??;
        Ok(WatchLines {
            body: response.into_body(),
            buffer: Vec::new(),
            line_max,
            skipping: None,
            ended: false,
        })
    }
}

/// `error` with its whole cause chain (`kube`'s own text names only the outermost layer), as
/// [`KubeError::Tls`] when a TLS error is among the causes.
fn client_error(error: &kube::Error) -> KubeError {
    let mut text = error.to_string();
    let mut tls = false;
    let mut cause = std::error::Error::source(error);
    while let Some(current) = cause {
        tls |= is_tls_error(current);
        let layer = current.to_string();
        if !text.contains(&layer) {
            text.push_str(": ");
            text.push_str(&layer);
        }
        cause = current.source();
    }
    if tls { KubeError::Tls(text) } else { KubeError::Client(text) }
}

/// Whether `error` is a TLS error, or an I/O error wrapping one (at any depth: an I/O error's
/// `source` skips the error it wraps, so the wrapped ones are read here).
fn is_tls_error(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = error;
    for _ in 0..8 {
        if current.is::<rustls::Error>() {
            return true;
        }
        match current.downcast_ref::<std::io::Error>().and_then(std::io::Error::get_ref) {
            Some(inner) => current = inner,
            None => return false,
        }
    }
    false
}

/// The bearer token in `path`, trimmed; `None` without a token file.
fn read_token(path: Option<&Path>) -> Result<Option<String>, KubeError> {
    let Some(path) = path else { return Ok(None) };
    let bytes = read_small_file("Kubernetes token file", path, TOKEN_FILE_BYTES_MAX)?;
    let text = String::from_utf8(bytes).map_err(|_| KubeError::File {
        what: "Kubernetes token file",
        path: path.to_owned(),
        reason: "not UTF-8".to_owned(),
    })?;
    Ok(Some(text.trim().to_owned()))
}

fn content_length(response: &Response<Body>) -> Option<u64> {
    response.headers().get(hyper::header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The body, or `None` if it exceeds `max` bytes (reading stops at the first frame past it).
async fn read_bounded(mut body: Body, max: usize) -> Result<Option<Vec<u8>>, KubeError> {
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
async fn status_error(status: StatusCode, body: Body) -> KubeError {
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
    body: Body,
    buffer: Vec<u8>,
    line_max: usize,
    /// Bytes of the oversized line being skipped, if one is.
    skipping: Option<usize>,
    ended: bool,
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
            KubeApiConfig::new("https://127.0.0.1:6443").kube_config(),
            Err(KubeError::InvalidUrl { reason: "https needs a CA file", .. })
        ));
        let config = KubeApiConfig {
            ca_file: Some("/nonexistent/ca.crt".into()),
            ..KubeApiConfig::new("https://127.0.0.1:6443")
        };
        assert!(matches!(config.kube_config(), Err(KubeError::File { .. })));

        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.crt");
        std::fs::write(&empty, "").unwrap();
        let config =
            KubeApiConfig { ca_file: Some(empty), ..KubeApiConfig::new("https://127.0.0.1:6443") };
        let error = config.kube_config().unwrap_err();
        assert!(matches!(error, KubeError::File { .. }), "{error}");
        assert!(error.to_string().contains("no PEM certificate"), "{error}");

        let big = dir.path().join("token");
        std::fs::write(&big, vec![b'a'; usize::try_from(TOKEN_FILE_BYTES_MAX).unwrap() + 1])
            .unwrap();
        let error = read_token(Some(&big)).unwrap_err();
        assert!(error.to_string().contains("larger than"), "{error}");
        let small = dir.path().join("small");
        std::fs::write(&small, " t0k3n\n").unwrap();
        assert_eq!(read_token(Some(&small)).unwrap().as_deref(), Some("t0k3n"));
        assert_eq!(read_token(None).unwrap(), None);
    }

    #[test]
    fn tls_errors_are_found_inside_wrapping_io_errors() {
        use std::io::{Error, ErrorKind};
        let alert = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let wrapped = Error::other(Error::new(ErrorKind::InvalidData, alert.clone()));
        assert!(is_tls_error(&wrapped));
        assert!(is_tls_error(&alert));
        assert!(!is_tls_error(&Error::new(ErrorKind::ConnectionRefused, "refused")));
        assert!(!is_tls_error(&Error::other(Error::other("plain"))));
    }

    #[test]
    fn the_kube_configuration_carries_the_url_ca_and_timeouts() {
        let config = KubeApiConfig::new("http://[::1]:8080/").kube_config().unwrap();
        assert_eq!(config.cluster_url.to_string(), "http://[::1]:8080/");
        assert_eq!(config.connect_timeout, Some(Duration::from_secs(5)));
        assert_eq!(config.read_timeout, None, "a quiet watch is not a dead one");
        assert!(!config.default_retry, "failures reach the watcher's own backoff");
        assert!(config.root_cert.is_none());
    }

    #[test]
    fn status_messages_come_from_status_documents_and_are_bounded() {
        let status = br#"{"kind":"Status","status":"Failure","message":"too old resource version: 5 (9)","code":410}"#;
        assert_eq!(status_message(status), "too old resource version: 5 (9)");
        assert_eq!(status_message(b"plain"), "plain");
        assert_eq!(status_message(&[b'x'; 1000]).len(), 256);
    }
}
