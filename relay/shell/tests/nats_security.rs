//! The NATS event plane against a real `nats-server` configured per case with a generated
//! config file: user/password, token, NKEY, a credentials file (user JWT and seed) against a
//! server in operator mode, and TLS with a client certificate (certificates made by `rcgen`,
//! NKEY pairs by `nkeys`, the operator, account and user JWTs by the small builder in
//! [`jwt`]). Each case shows a published `kv-events` envelope arriving through the relay's plane
//! with the right credentials, and the plane ending with [`EventPlaneError::NatsRefused`] with
//! wrong ones (a failed TLS handshake is retried like a server that is down: the plane never
//! connects nor delivers).
//!
//! The relay's settings are read with [`NatsSecurity::from_lookup`] from the same variable names
//! the relay reads from its environment.

mod pki;
mod servers;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Child;
use std::time::Duration;

use kvrelay::event_plane::{
    EventPlaneCounters, EventPlaneError, NatsEventPlaneConfig, NatsNamespaces, NatsSecurity,
    run_nats_event_plane,
};
use kvrelay_core::inputs::{
    DcInput, EventEnvelope, KV_EVENTS_TOPIC, encode_event_envelope, encode_kv_events_payload,
};
use kvrelay_core::model::hashing::{ExternalBlockHash, LocalBlockHash};
use kvrelay_core::model::identity::EndpointPath;
use kvrelay_core::model::kv_events::{
    KvCacheEvent, KvCacheEventData, RouterEvent, StorageTier, StoreData, StoredBlock,
};
use pki::{TestCa, text};
use servers::free_port;
use tokio_util::sync::CancellationToken;

const TEST_TIMEOUT: Duration = Duration::from_secs(60);
const SUBJECT: &str = "namespace.dynamo.component.backend.endpoint.generate.kv-events";
const WORKER: u64 = 77;

/// A `nats-server` started with a generated config file; killed by PID when dropped.
struct ConfiguredNats {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl ConfiguredNats {
    /// Start with `body` (the config text after the `listen` line).
    async fn start(body: &str) -> ConfiguredNats {
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let config = dir.path().join("nats.conf");
        std::fs::write(&config, format!("listen: 127.0.0.1:{port}\n{body}\n")).unwrap();
        let config = config.to_str().unwrap();
        let child = servers::spawn_nats(port, &["-c", config]).await;
        ConfiguredNats { child, port, _dir: dir }
    }

    fn url(&self, scheme: &str) -> String {
        format!("{scheme}://127.0.0.1:{}", self.port)
    }
}

impl Drop for ConfiguredNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn security(pairs: &[(&str, &str)]) -> NatsSecurity {
    let map: BTreeMap<String, String> =
        pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    NatsSecurity::from_lookup(|name| map.get(name).cloned()).expect("valid NATS settings")
}

/// A one-block `kv-events` envelope of publisher 1, message `sequence`.
fn envelope(sequence: u64) -> Vec<u8> {
    let events = vec![RouterEvent {
        worker_id: WORKER,
        storage_tier: StorageTier::Device,
        residency_domain: None,
        event: KvCacheEvent {
            event_id: sequence,
            dp_rank: 0,
            data: KvCacheEventData::Stored(StoreData {
                parent_hash: None,
                start_position: None,
                blocks: vec![StoredBlock {
                    block_hash: ExternalBlockHash(0xabcd),
                    tokens_hash: LocalBlockHash(0x1234),
                }],
            }),
        },
    }];
    let payload = encode_kv_events_payload(&events).unwrap();
    encode_event_envelope(&EventEnvelope {
        publisher_id: 1,
        sequence,
        published_at_ms: 1_796_040_159_861,
        topic: KV_EVENTS_TOPIC,
        payload: &payload,
    })
    .unwrap()
}

/// The relay's plane with `security`, feeding a channel.
struct Plane {
    inputs: kvrelay::node::InputReceiver,
    counters: EventPlaneCounters,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), EventPlaneError>>,
}

fn start_plane(url: String, security: NatsSecurity) -> Plane {
    let (sink, inputs) =
        kvrelay::node::input_queue(64, kvrelay::node::INPUT_QUEUE_BYTES_MAX_DEFAULT);
    let counters = EventPlaneCounters::new();
    let cancel = CancellationToken::new();
    let config = NatsEventPlaneConfig {
        security,
        connection_timeout: Duration::from_secs(2),
        ..NatsEventPlaneConfig::new(url, NatsNamespaces::Only(["dynamo".to_owned()].into()))
    };
    let task = kvrelay::runtime::spawn(run_nats_event_plane(
        config,
        sink,
        counters.clone(),
        cancel.clone(),
    ));
    Plane { inputs, counters, cancel, task }
}

/// Publish envelopes with `publisher` until the plane delivers one, and check it.
async fn assert_delivered(plane: &mut Plane, publisher: &async_nats::Client) {
    let delivered = tokio::time::timeout(TEST_TIMEOUT, async {
        for sequence in 0.. {
            publisher.publish(SUBJECT, envelope(sequence).into()).await.unwrap();
            publisher.flush().await.unwrap();
            if let Ok(Some(input)) =
                tokio::time::timeout(Duration::from_millis(200), plane.inputs.recv_input()).await
            {
                return input;
            }
        }
        unreachable!()
    })
    .await
    .expect("no envelope arrived through the relay's NATS plane");
    let DcInput::KvEvents(batch) = delivered else { panic!("not kv-events: {delivered:?}") };
    assert_eq!(batch.endpoint, EndpointPath::new("dynamo", "backend", "generate").unwrap());
    assert_eq!(batch.publisher_id, 1);
    assert_eq!(batch.events[0].worker_id, WORKER);
    // The client reports the connection through its event callback, possibly after delivery.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while plane.counters.snapshot().connects == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the connection was never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The plane ends with a refusal whose text names `expected`.
async fn assert_refused(plane: Plane, expected: &str) {
    let result = tokio::time::timeout(TEST_TIMEOUT, plane.task)
        .await
        .expect("a refused plane must end, not retry forever")
        .unwrap();
    match result {
        Err(EventPlaneError::NatsRefused { reason, .. }) => {
            assert!(reason.contains(expected), "reason {reason:?} lacks {expected:?}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

async fn stop(plane: Plane) {
    plane.cancel.cancel();
    assert!(matches!(plane.task.await.unwrap(), Ok(())));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_and_password_deliver_and_a_wrong_password_is_refused() {
    let server = ConfiguredNats::start(
        r#"authorization { users: [ { user: "relay", password: "right-pw" } ] }"#,
    )
    .await;
    let good = security(&[("NATS_AUTH_USERNAME", "relay"), ("NATS_AUTH_PASSWORD", "right-pw")]);
    let publisher = good.apply(async_nats::ConnectOptions::new()).unwrap();
    let publisher = publisher.connect(server.url("nats")).await.unwrap();
    let mut plane = start_plane(server.url("nats"), good);
    assert_delivered(&mut plane, &publisher).await;
    stop(plane).await;
    let wrong = security(&[("NATS_AUTH_USERNAME", "relay"), ("NATS_AUTH_PASSWORD", "wrong")]);
    assert_refused(start_plane(server.url("nats"), wrong), "authorization violation").await;
    // No credentials at all is refused the same way.
    assert_refused(start_plane(server.url("nats"), security(&[])), "authorization violation").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_delivers_and_a_wrong_token_is_refused() {
    let server = ConfiguredNats::start(r#"authorization { token: "s3cret-token" }"#).await;
    let good = security(&[("NATS_AUTH_TOKEN", "s3cret-token")]);
    let publisher =
        good.apply(async_nats::ConnectOptions::new()).unwrap().connect(server.url("nats"));
    let publisher = publisher.await.unwrap();
    let mut plane = start_plane(server.url("nats"), good);
    assert_delivered(&mut plane, &publisher).await;
    stop(plane).await;
    let wrong = security(&[("NATS_AUTH_TOKEN", "not-the-token")]);
    assert_refused(start_plane(server.url("nats"), wrong), "authorization violation").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_nkey_seed_delivers_and_an_unknown_key_is_refused() {
    let user = nkeys::KeyPair::new_user();
    let server = ConfiguredNats::start(&format!(
        r#"authorization {{ users: [ {{ nkey: "{}" }} ] }}"#,
        user.public_key()
    ))
    .await;
    let seed = user.seed().unwrap();
    let good = security(&[("NATS_AUTH_NKEY", &seed)]);
    let publisher =
        good.apply(async_nats::ConnectOptions::new()).unwrap().connect(server.url("nats"));
    let publisher = publisher.await.unwrap();
    let mut plane = start_plane(server.url("nats"), good);
    assert_delivered(&mut plane, &publisher).await;
    stop(plane).await;
    let stranger = nkeys::KeyPair::new_user().seed().unwrap();
    let wrong = security(&[("NATS_AUTH_NKEY", &stranger)]);
    assert_refused(start_plane(server.url("nats"), wrong), "authorization violation").await;
}

/// NATS 2 decentralized-auth JWTs, just enough for a server in operator mode: an operator
/// (self-signed), an account (signed by the operator) and users (signed by the account). A
/// JWT is `header.claims.signature`, each part base64url without padding; the signature is the
/// issuer's ed25519 NKEY signature over `header.claims`.
mod jwt {
    use nkeys::KeyPair;
    use serde_json::{Value, json};

    const HEADER: &str = r#"{"typ":"JWT","alg":"ed25519-nkey"}"#;
    /// A fixed past issue time (2023-11-14): the server checks only `exp` and `nbf`, which
    /// these JWTs leave out, and the tests read no wall clock.
    const ISSUED_AT_S: u64 = 1_700_000_000;
    /// `-1`: no limit, in every NATS limit field.
    const NO_LIMIT: i64 = -1;

    /// RFC 4648 §5 (URL-safe alphabet), no padding.
    pub fn base64url(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut encoded = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let group = chunk
                .iter()
                .enumerate()
                .fold(0_u32, |group, (index, byte)| group | u32::from(*byte) << (16 - 8 * index));
            // n input bytes carry n + 1 sextets.
            for sextet in 0..=chunk.len() {
                encoded.push(char::from(ALPHABET[(group >> (18 - 6 * sextet)) as usize & 63]));
            }
        }
        encoded
    }

    /// A signed JWT: standard claims around the NATS-specific `nats` object.
    fn signed(issuer: &KeyPair, subject: &str, name: &str, nats: Value) -> String {
        let claims = json!({
            // Any unique id will do: the server does not recompute it.
            "jti": format!("{name}-{subject}"),
            "iat": ISSUED_AT_S,
            "iss": issuer.public_key(),
            "sub": subject,
            "name": name,
            "nats": nats,
        });
        let signed = format!(
            "{}.{}",
            base64url(HEADER.as_bytes()),
            base64url(&claims.to_string().into_bytes())
        );
        let signature = issuer.sign(signed.as_bytes()).unwrap();
        format!("{signed}.{}", base64url(&signature))
    }

    pub fn operator(operator: &KeyPair) -> String {
        let nats = json!({ "type": "operator", "version": 2 });
        signed(operator, &operator.public_key(), "test-operator", nats)
    }

    /// An account with the limits `nsc` writes by default: none (`-1`; a field left out would
    /// decode as 0).
    pub fn account(operator: &KeyPair, account: &KeyPair) -> String {
        let nats = json!({
            "limits": {
                "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
                "imports": NO_LIMIT, "exports": NO_LIMIT, "wildcards": true,
                "conn": NO_LIMIT, "leaf": NO_LIMIT,
            },
            "default_permissions": { "pub": {}, "sub": {} },
            "type": "account",
            "version": 2,
        });
        signed(operator, &account.public_key(), "test-account", nats)
    }

    /// A user of `account`, allowed to publish and subscribe anywhere.
    pub fn user(account: &KeyPair, user: &KeyPair, name: &str) -> String {
        let nats = json!({
            "pub": {}, "sub": {},
            "subs": NO_LIMIT, "data": NO_LIMIT, "payload": NO_LIMIT,
            "type": "user",
            "version": 2,
        });
        signed(account, &user.public_key(), name, nats)
    }

    /// A `.creds` file as `nsc` writes it: the decorated user JWT, then the decorated seed.
    pub fn creds_file(user_jwt: &str, seed: &str) -> String {
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             ************************* IMPORTANT *************************\n\
             NKEY Seed printed below can be used to sign and prove identity.\n\
             NKEYs are sensitive and should be treated as secrets.\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n\n\
             *************************************************************\n"
        )
    }
}

/// A server in operator mode trusting `operator`, with `account`'s JWT preloaded in its
/// memory resolver (no account server: an account it was not given does not exist).
async fn operator_mode_nats(operator: &nkeys::KeyPair, account: &nkeys::KeyPair) -> ConfiguredNats {
    ConfiguredNats::start(&format!(
        "operator: \"{}\"\nresolver: MEMORY\nresolver_preload: {{\n  {}: \"{}\"\n}}",
        jwt::operator(operator),
        account.public_key(),
        jwt::account(operator, account),
    ))
    .await
}

#[test]
fn the_jwt_encoder_is_unpadded_url_safe_base64() {
    // RFC 4648 §10 vectors, without padding, and the two URL-safe characters.
    for (plain, encoded) in [
        ("", ""),
        ("f", "Zg"),
        ("fo", "Zm8"),
        ("foo", "Zm9v"),
        ("foob", "Zm9vYg"),
        ("fooba", "Zm9vYmE"),
    ] {
        assert_eq!(jwt::base64url(plain.as_bytes()), encoded);
    }
    assert_eq!(jwt::base64url(&[0xfb, 0xff]), "-_8");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_credentials_file_delivers_in_operator_mode_and_unknown_accounts_or_seeds_are_refused() {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let server = operator_mode_nats(&operator, &account).await;
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, contents: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, contents).unwrap();
        path
    };
    let creds_security = |path: &Path| security(&[("NATS_AUTH_CREDENTIALS_FILE", text(path))]);

    // The worker publishing the events is another user of the same account, connecting with
    // the client's own credentials support (not through the relay's settings).
    let worker = nkeys::KeyPair::new_user();
    let worker_creds =
        jwt::creds_file(&jwt::user(&account, &worker, "worker"), &worker.seed().unwrap());
    let publisher = async_nats::ConnectOptions::with_credentials(&worker_creds)
        .unwrap()
        .connect(server.url("nats"))
        .await
        .expect("the worker's credentials are accepted");

    let relay = nkeys::KeyPair::new_user();
    let relay_jwt = jwt::user(&account, &relay, "kvrelay");
    let good = write("relay.creds", &jwt::creds_file(&relay_jwt, &relay.seed().unwrap()));
    let mut plane = start_plane(server.url("nats"), creds_security(&good));
    assert_delivered(&mut plane, &publisher).await;
    stop(plane).await;

    // A user JWT signed by an account the server was never given.
    let stranger_account = nkeys::KeyPair::new_account();
    let unknown = write(
        "unknown-account.creds",
        &jwt::creds_file(&jwt::user(&stranger_account, &relay, "kvrelay"), &relay.seed().unwrap()),
    );
    assert_refused(
        start_plane(server.url("nats"), creds_security(&unknown)),
        "authorization violation",
    )
    .await;
    // The relay's JWT with a seed that is not its subject's: the nonce signature does not verify.
    let other_seed = nkeys::KeyPair::new_user().seed().unwrap();
    let mismatched = write("mismatched.creds", &jwt::creds_file(&relay_jwt, &other_seed));
    assert_refused(
        start_plane(server.url("nats"), creds_security(&mismatched)),
        "authorization violation",
    )
    .await;
    // The same valid file ending right after its seed's closing line, with no final newline
    // (as a Kubernetes Secret written with `stringData: |-` or `--from-literal` holds it), still
    // delivers: the NATS tools accept it.
    let full = jwt::creds_file(&relay_jwt, &relay.seed().unwrap());
    const SEED_END: &str = "------END USER NKEY SEED------";
    let unterminated = &full[..full.find(SEED_END).unwrap() + SEED_END.len()];
    let unterminated = write("no-final-newline.creds", unterminated);
    let mut plane = start_plane(server.url("nats"), creds_security(&unterminated));
    assert_delivered(&mut plane, &publisher).await;
    stop(plane).await;
}

fn tls_block(ca: &TestCa, server: &pki::Leaf, verify: bool) -> String {
    format!(
        "tls {{\n  cert_file: \"{}\"\n  key_file: \"{}\"\n  ca_file: \"{}\"\n  verify: {verify}\n  timeout: 2\n}}",
        text(&server.cert_path),
        text(&server.key_path),
        text(&ca.cert_path),
    )
}

fn client_tls<'a>(ca: &'a Path, client: Option<&'a pki::Leaf>) -> Vec<(&'static str, &'a str)> {
    let mut pairs = vec![("NATS_TLS_CA_CERT_PATH", text(ca))];
    if let Some(client) = client {
        pairs.push(("NATS_TLS_CLIENT_CERT_PATH", text(&client.cert_path)));
        pairs.push(("NATS_TLS_CLIENT_KEY_PATH", text(&client.key_path)));
    }
    pairs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_client_certificate_delivers_and_untrusted_or_missing_certificates_fail() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "nats");
    let server_leaf = ca.server(dir.path(), "nats-server");
    let client = ca.client(dir.path(), "relay-client");
    let server = ConfiguredNats::start(&tls_block(&ca, &server_leaf, true)).await;
    let good = security(&client_tls(&ca.cert_path, Some(&client)));
    let publisher =
        good.apply(async_nats::ConnectOptions::new()).unwrap().connect(server.url("tls"));
    let publisher = publisher.await.unwrap();
    let mut plane = start_plane(server.url("tls"), good.clone());
    assert_delivered(&mut plane, &publisher).await;
    stop(plane).await;
    // A nats:// URL with the TLS variables set still upgrades (TLS is required, not optional).
    let mut plane = start_plane(server.url("nats"), good);
    assert_delivered(&mut plane, &publisher).await;
    stop(plane).await;

    // A CA that did not sign the server's certificate: the client refuses the server. The
    // client reports a failed handshake as an I/O error, like a server that is down, so the
    // plane keeps retrying; it never connects nor delivers.
    let other_ca = TestCa::new(dir.path(), "other");
    let untrusted = security(&client_tls(&other_ca.cert_path, Some(&client)));
    assert_never_connects(start_plane(server.url("tls"), untrusted), &publisher).await;
    // No client certificate against `verify: true`: the server drops the connection.
    let anonymous = security(&client_tls(&ca.cert_path, None));
    assert_never_connects(start_plane(server.url("tls"), anonymous), &publisher).await;
}

/// While `publisher` publishes for 2 s, `plane` neither connects nor delivers, and counts
/// failed attempts.
async fn assert_never_connects(mut plane: Plane, publisher: &async_nats::Client) {
    for sequence in 0..10 {
        publisher.publish(SUBJECT, envelope(sequence).into()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(plane.inputs.try_recv_input().is_err(), "delivered over a TLS setup the peer refuses");
    assert_eq!(plane.counters.snapshot().connects, 0);
    assert!(plane.counters.snapshot().connect_failures >= 1);
    assert!(!plane.task.is_finished(), "the plane retries a failed handshake");
    stop(plane).await;
}
