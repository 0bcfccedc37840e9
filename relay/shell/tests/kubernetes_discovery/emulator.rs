//! A local emulator of the parts of the Kubernetes API server the relay's discovery uses:
//! namespaced collections served on 127.0.0.1 (plaintext or TLS) with
//!
//! - `list` with `limit`/`continue` pagination and a collection `resourceVersion`;
//! - `watch` from a `resourceVersion` (history replayed, then live events), `ADDED`, `MODIFIED`,
//!   `DELETED`, `BOOKMARK` and `ERROR` (`410`) events as JSON lines, and `timeoutSeconds` ends
//!   honoured as an explicit [`Emulator::close_watches`];
//! - `labelSelector` (`k=v,...`) filtering;
//! - a required bearer token (`401` otherwise), every request recorded.
//!
//! Resource versions are one global counter, as in the real server. [`Emulator::expire`] moves the
//! compaction point to "now": watches and `continue` tokens from before it get `410 Gone`.
//! It is a test double, not a conformance-tested API server.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

type Body = BoxBody<Bytes, Infallible>;

/// One recorded event of a collection.
#[derive(Debug, Clone)]
struct Event {
    version: u64,
    collection: String,
    line: Bytes,
}

#[derive(Default)]
struct State {
    version: u64,
    /// Watches and continue tokens from below this version are expired.
    compacted: u64,
    /// collection path -> name -> object.
    objects: BTreeMap<String, BTreeMap<String, Value>>,
    history: Vec<Event>,
    /// Live watches: collection, label selector, sender of lines.
    watches: Vec<(String, String, mpsc::UnboundedSender<Bytes>)>,
    /// Every request: path and query, and the Authorization header.
    requests: Vec<(String, Option<String>)>,
    uids: u64,
}

/// The emulator; stops serving when dropped.
pub struct Emulator {
    state: Arc<Mutex<State>>,
    address: SocketAddr,
    https: bool,
    stop: CancellationToken,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn labels_match(object: &Value, selector: &str) -> bool {
    selector.split(',').filter(|term| !term.is_empty()).all(|term| {
        let Some((key, value)) = term.split_once('=') else { return false };
        object
            .pointer("/metadata/labels")
            .and_then(|labels| labels.get(key))
            .and_then(Value::as_str)
            == Some(value)
    })
}

fn query_value(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (key, value) = pair.split_once('=')?;
        (key == name).then(|| percent_decode(value))
    })
}

fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let escaped = (bytes[index] == b'%' && index + 2 < bytes.len())
            .then(|| std::str::from_utf8(&bytes[index + 1..index + 3]).ok())
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        if let Some(byte) = escaped {
            out.push(byte);
            index += 3;
            continue;
        }
        out.push(bytes[index]);
        index += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn full(status: StatusCode, body: Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())).boxed())
        .unwrap()
}

fn status(code: StatusCode, message: &str) -> Response<Body> {
    full(
        code,
        json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "code": code.as_u16()}),
    )
}

fn line(event_type: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": event_type, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

impl State {
    fn record(&mut self, collection: &str, event_type: &str, object: &Value) {
        let line = line(event_type, object);
        self.history.push(Event {
            version: self.version,
            collection: collection.to_owned(),
            line: line.clone(),
        });
        self.watches.retain(|(watched, selector, sender)| {
            if watched != collection || !labels_match(object, selector) {
                return !sender.is_closed();
            }
            sender.send(line.clone()).is_ok()
        });
    }

    fn list(&self, collection: &str, query: &str) -> Response<Body> {
        let selector = query_value(query, "labelSelector").unwrap_or_default();
        let limit: usize = query_value(query, "limit").and_then(|l| l.parse().ok()).unwrap_or(0);
        let (at, offset) = match query_value(query, "continue") {
            None => (self.version, 0),
            Some(token) => {
                let Some((at, offset)) = token.split_once(':') else {
                    return status(StatusCode::BAD_REQUEST, "bad continue token");
                };
                let (at, offset): (u64, usize) = (at.parse().unwrap(), offset.parse().unwrap());
                if at < self.compacted {
                    return status(
                        StatusCode::GONE,
                        "The provided continue parameter is too old to display a consistent list result.",
                    );
                }
                (at, offset)
            }
        };
        let matching: Vec<&Value> = self
            .objects
            .get(collection)
            .into_iter()
            .flat_map(BTreeMap::values)
            .filter(|object| labels_match(object, &selector))
            .collect();
        let end = if limit == 0 { matching.len() } else { (offset + limit).min(matching.len()) };
        let items: Vec<&Value> = matching[offset.min(end)..end].to_vec();
        let mut metadata = json!({"resourceVersion": at.to_string()});
        if end < matching.len() {
            metadata["continue"] = json!(format!("{at}:{end}"));
        }
        full(StatusCode::OK, json!({"kind": "List", "metadata": metadata, "items": items}))
    }

    fn watch(&mut self, collection: &str, query: &str) -> Response<Body> {
        let selector = query_value(query, "labelSelector").unwrap_or_default();
        let from: u64 =
            query_value(query, "resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
        let (sender, receiver) = mpsc::unbounded_channel();
        if from < self.compacted {
            let gone = json!({"kind": "Status", "status": "Failure", "code": 410,
                "message": format!("too old resource version: {from} ({})", self.compacted)});
            let _ = sender.send(line("ERROR", &gone));
            drop(sender);
        } else {
            for event in
                self.history.iter().filter(|e| e.version > from && e.collection == collection)
            {
                let object: Value = serde_json::from_slice(&event.line).unwrap();
                if labels_match(&object["object"], &selector) {
                    let _ = sender.send(event.line.clone());
                }
            }
            self.watches.push((collection.to_owned(), selector, sender));
        }
        let stream = futures::stream::unfold(receiver, |mut receiver| async move {
            let line = receiver.recv().await?;
            Some((Ok::<_, Infallible>(Frame::data(line)), receiver))
        });
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(BodyExt::boxed(StreamBody::new(stream)))
            .unwrap()
    }
}

impl Emulator {
    /// Serve on 127.0.0.1; with `tls` (certificate and key PEM files) over HTTPS. Requests must
    /// carry `Authorization: Bearer {token}`.
    pub async fn start(token: &str, tls: Option<(&Path, &Path)>) -> Emulator {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(State::default()));
        let stop = CancellationToken::new();
        let acceptor = tls.map(|(cert, key)| {
            let certs = kvrelay_consumer::pem_files::read_certificates(cert).unwrap();
            let key = kvrelay_consumer::pem_files::read_private_key(key).unwrap();
            let provider = Arc::new(rustls::crypto::ring::default_provider());
            let config = rustls::ServerConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_no_client_auth()
                .with_single_cert(certs, key)
                .unwrap();
            tokio_rustls::TlsAcceptor::from(Arc::new(config))
        });
        let expected = format!("Bearer {token}");
        let (serving, stopped) = (state.clone(), stop.clone());
        kvrelay::runtime::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    biased;
                    () = stopped.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let Ok((tcp, _)) = accepted else { continue };
                let (state, expected, acceptor, stopped) =
                    (serving.clone(), expected.clone(), acceptor.clone(), stopped.clone());
                kvrelay::runtime::spawn(async move {
                    let service = hyper::service::service_fn(move |request| {
                        let response = handle(&state, &expected, request);
                        async move { Ok::<_, Infallible>(response) }
                    });
                    let builder = hyper::server::conn::http1::Builder::new();
                    let served = async {
                        match acceptor {
                            None => {
                                let _ = builder.serve_connection(TokioIo::new(tcp), service).await;
                            }
                            Some(acceptor) => {
                                if let Ok(stream) = acceptor.accept(tcp).await {
                                    let _ = builder
                                        .serve_connection(TokioIo::new(stream), service)
                                        .await;
                                }
                            }
                        }
                    };
                    tokio::select! {
                        biased;
                        () = stopped.cancelled() => {}
                        () = served => {}
                    }
                });
            }
        });
        Emulator { state, address, https: tls.is_some(), stop }
    }

    /// The API URL.
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.address)
    }

    /// Create or replace the object named by its `metadata.name` in `collection`; it gets a new
    /// resource version, and keeps its `uid` (a new one when created) unless it carries one.
    pub fn put(&self, collection: &str, mut object: Value) {
        let mut state = self.state.lock().unwrap();
        state.version += 1;
        let name = object["metadata"]["name"].as_str().unwrap().to_owned();
        let existing_uid = state
            .objects
            .get(collection)
            .and_then(|objects| objects.get(&name))
            .map(|held| held["metadata"]["uid"].clone());
        let exists = existing_uid.is_some();
        if let Some(uid) = existing_uid.filter(|_| object["metadata"].get("uid").is_none()) {
            object["metadata"]["uid"] = uid;
        } else if object["metadata"].get("uid").is_none() {
            state.uids += 1;
            object["metadata"]["uid"] = json!(format!("uid-{}", state.uids));
        }
        object["metadata"]["resourceVersion"] = json!(state.version.to_string());
        state.objects.entry(collection.to_owned()).or_default().insert(name, object.clone());
        state.record(collection, if exists { "MODIFIED" } else { "ADDED" }, &object);
    }

    /// Delete the object `name` from `collection`.
    pub fn delete(&self, collection: &str, name: &str) {
        let mut state = self.state.lock().unwrap();
        state.version += 1;
        let Some(mut object) = state.objects.get_mut(collection).and_then(|o| o.remove(name))
        else {
            return;
        };
        object["metadata"]["resourceVersion"] = json!(state.version.to_string());
        state.record(collection, "DELETED", &object);
    }

    /// Send `raw` (a line, newline included) to every live watch of `collection` unrecorded.
    pub fn send_raw(&self, collection: &str, raw: &[u8]) {
        let state = self.state.lock().unwrap();
        for (watched, _, sender) in &state.watches {
            if watched == collection {
                let _ = sender.send(Bytes::copy_from_slice(raw));
            }
        }
    }

    /// Send a `BOOKMARK` at the current version to every live watch.
    pub fn bookmark(&self) {
        let state = self.state.lock().unwrap();
        let object = json!({"metadata": {"resourceVersion": state.version.to_string()}});
        for (_, _, sender) in &state.watches {
            let _ = sender.send(line("BOOKMARK", &object));
        }
    }

    /// Expire every version up to now: live watches get `ERROR 410` and end, and watches or
    /// `continue` tokens from before now are refused. `mutate` runs after the expiry and before
    /// anyone can relist, so its changes are seen only through the relist.
    pub fn expire(&self, mutate: impl FnOnce(&Emulator)) {
        {
            let mut state = self.state.lock().unwrap();
            state.compacted = state.version;
            let gone = json!({"kind": "Status", "status": "Failure", "code": 410,
                "message": "too old resource version"});
            for (_, _, sender) in state.watches.drain(..) {
                let _ = sender.send(line("ERROR", &gone));
            }
        }
        mutate(self);
        // The changes made while expired are not replayable from before the compaction.
        let mut state = self.state.lock().unwrap();
        state.compacted = state.version;
    }

    /// End every live watch, as the server does when a watch's `timeoutSeconds` passes.
    pub fn close_watches(&self) {
        self.state.lock().unwrap().watches.clear();
    }

    /// Live watches.
    pub fn watch_count(&self) -> usize {
        let mut state = self.state.lock().unwrap();
        state.watches.retain(|(_, _, sender)| !sender.is_closed());
        state.watches.len()
    }

    /// Every request so far: path with query, and its Authorization header.
    pub fn requests(&self) -> Vec<(String, Option<String>)> {
        self.state.lock().unwrap().requests.clone()
    }
}

fn handle(state: &Mutex<State>, expected: &str, request: Request<Incoming>) -> Response<Body> {
    let authorization =
        request.headers().get("authorization").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let path = request.uri().path().to_owned();
    let query = request.uri().query().unwrap_or("").to_owned();
    let mut state = state.lock().unwrap();
    state.requests.push((format!("{path}?{query}"), authorization.clone()));
    if authorization.as_deref() != Some(expected) {
        return status(StatusCode::UNAUTHORIZED, "Unauthorized");
    }
    if request.method() != hyper::Method::GET {
        return status(StatusCode::METHOD_NOT_ALLOWED, "read-only emulator");
    }
    // As the API server does, `watch=true` and `watch=1` both ask for a watch.
    if matches!(query_value(&query, "watch").as_deref(), Some("true" | "1")) {
        state.watch(&path, &query)
    } else {
        state.list(&path, &query)
    }
}
