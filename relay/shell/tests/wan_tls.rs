//! TLS and mTLS on the WAN listener over loopback: a simulated DC served through
//! [`tls_incoming`], consumers built from the same [`ClientTlsArgs`] the `watch`, `query` and
//! `kvrelay-compare` flags fill, certificates made in the test by `rcgen`.
//!
//! Shown: a consumer over TLS receives the catalog while a plaintext client gets nothing; with a
//! client CA, a client without a certificate is refused and one with a certificate is served;
//! after the certificate files are rewritten, new connections are handshaken with the new
//! certificate, and a rewrite that does not parse keeps the previous one.

mod pki;

use std::sync::Arc;
use std::time::Duration;

use kvrelay::config::WanTuning;
use kvrelay::demo::{Demo, DemoOptions};
use kvrelay::runtime::{SystemWallClock, TokioBlockingExecutor};
use kvrelay::wan::{WanTls, WanTlsSettings, serve, tls_incoming};
use kvrelay_consumer::{ClientTlsArgs, ClientTlsError, ConsumerConfig, RelayConsumer};
use kvrelay_core::rng::rng_from_seed;
use kvrelay_proto::CONTRACT_MARKER;
use kvrelay_proto::v1 as proto;
use kvrelay_proto::v1::kv_event_relay_client::KvEventRelayClient;
use pki::{Leaf, TestCa};
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(30);

/// A demo DC served over TLS on 127.0.0.1.
struct TlsRelay {
    address: String,
    tls: WanTls,
    stop: CancellationToken,
    server: tokio::task::JoinHandle<()>,
    demo: Demo,
}

impl TlsRelay {
    async fn start(settings: WanTlsSettings) -> TlsRelay {
        let options = DemoOptions { tick: Duration::from_millis(5), ..DemoOptions::default() };
        let demo = Demo::start(options, Arc::new(TokioBlockingExecutor), Arc::new(SystemWallClock))
            .unwrap();
        let tuning = WanTuning::default();
        let service = demo.node.relay_service(Arc::new(SystemWallClock), tuning);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let tls = WanTls::load(settings).unwrap();
        let stop = CancellationToken::new();
        let incoming = tls_incoming(listener, tls.clone(), stop.clone());
        let shutdown = stop.clone().cancelled_owned();
        let server = kvrelay::runtime::spawn(async move {
            serve(service, incoming, &tuning, shutdown).await.unwrap();
        });
        TlsRelay { address, tls, stop, server, demo }
    }

    async fn stop(self) {
        self.stop.cancel();
        tokio::time::timeout(WAIT, self.server).await.unwrap().unwrap();
        self.demo.stop().await;
    }
}

fn settings(server: &Leaf, client_ca: Option<&TestCa>) -> WanTlsSettings {
    WanTlsSettings {
        cert_path: server.cert_path.clone(),
        key_path: server.key_path.clone(),
        client_ca_path: client_ca.map(|ca| ca.cert_path.clone()),
        reload_interval: Duration::from_millis(100),
    }
}

fn client_args(ca: &TestCa, client: Option<&Leaf>) -> ClientTlsArgs {
    ClientTlsArgs {
        tls_ca: Some(ca.cert_path.clone()),
        tls_cert: client.map(|leaf| leaf.cert_path.clone()),
        tls_key: client.map(|leaf| leaf.key_path.clone()),
        tls_server_name: Some("localhost".to_owned()),
    }
}

/// One catalog request over `channel`; `Ok` once the first update arrives.
async fn first_catalog_update(
    channel: tonic::transport::Channel,
) -> Result<proto::KvPoolCatalogUpdate, tonic::Status> {
    let mut client = KvEventRelayClient::new(channel).max_decoding_message_size(8 << 20);
    let mut stream = client
        .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
            subscriber_id: "tls-test".into(),
            contract_marker: CONTRACT_MARKER,
        })
        .await?
        .into_inner();
    stream.message().await?.ok_or_else(|| tonic::Status::unavailable("stream ended"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_over_tls_receives_the_catalog_and_plaintext_gets_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "wan");
    let server = ca.server(dir.path(), "relay");
    let relay = TlsRelay::start(settings(&server, None)).await;

    let channel = client_args(&ca, None).connect_lazy(&relay.address).unwrap();
    let consumer =
        RelayConsumer::start(channel, ConsumerConfig::default(), &mut rng_from_seed(7)).unwrap();
    let snapshot = tokio::time::timeout(WAIT, consumer.wait_until(|s| s.pools.len() >= 4))
        .await
        .expect("no catalog over TLS")
        .unwrap();
    assert!(snapshot.relay.is_some());
    consumer.shutdown().await;

    // Plaintext HTTP/2 to the TLS port: the handshake fails, no update arrives.
    let plain = ClientTlsArgs::default().endpoint(&relay.address).unwrap().connect_lazy();
    let refused = tokio::time::timeout(WAIT, first_catalog_update(plain)).await.unwrap();
    assert!(refused.is_err(), "a plaintext client was served: {refused:?}");
    // A client that trusts another CA refuses the relay.
    let other = TestCa::new(dir.path(), "other");
    let untrusted = client_args(&other, None).connect_lazy(&relay.address).unwrap();
    assert!(tokio::time::timeout(WAIT, first_catalog_update(untrusted)).await.unwrap().is_err());
    wait_for_handshake_failures(&relay.tls, 2).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mtls_refuses_a_client_without_a_certificate_and_serves_one_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "wan");
    let server = ca.server(dir.path(), "relay");
    let client = ca.client(dir.path(), "consumer");
    let relay = TlsRelay::start(settings(&server, Some(&ca))).await;

    let anonymous = client_args(&ca, None).connect_lazy(&relay.address).unwrap();
    let refused = tokio::time::timeout(WAIT, first_catalog_update(anonymous)).await.unwrap();
    assert!(refused.is_err(), "served without a client certificate: {refused:?}");
    // A certificate from a CA the relay does not trust is refused too.
    let stranger_ca = TestCa::new(dir.path(), "stranger");
    let stranger = stranger_ca.client(dir.path(), "stranger");
    let foreign = client_args(&ca, Some(&stranger)).connect_lazy(&relay.address).unwrap();
    assert!(tokio::time::timeout(WAIT, first_catalog_update(foreign)).await.unwrap().is_err());

    let trusted = client_args(&ca, Some(&client)).connect_lazy(&relay.address).unwrap();
    let update = tokio::time::timeout(WAIT, first_catalog_update(trusted)).await.unwrap();
    assert!(update.is_ok(), "a client with a certificate was refused: {update:?}");
    wait_for_handshake_failures(&relay.tls, 2).await;
    relay.stop().await;
}

/// Wait until the listener counted `count` failed handshakes (the server side counts after the
/// client already saw its error).
async fn wait_for_handshake_failures(tls: &WanTls, count: u64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while tls.stats().handshake_failures < count {
        assert!(tokio::time::Instant::now() < deadline, "{:?}", tls.stats());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The leaf certificate a fresh TLS handshake with `address` presents.
async fn served_certificate(address: &str, ca: &TestCa) -> CertificateDer<'static> {
    let mut roots = rustls::RootCertStore::empty();
    for certificate in kvrelay_consumer::pem_files::read_certificates(&ca.cert_path).unwrap() {
        roots.add(certificate).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(address).await.unwrap();
    let stream = connector.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
    stream.get_ref().1.peer_certificates().unwrap()[0].clone().into_owned()
}

fn der(leaf: &Leaf) -> CertificateDer<'static> {
    kvrelay_consumer::pem_files::certificates(&leaf.cert_path, leaf.cert_pem.as_bytes()).unwrap()[0]
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rewritten_certificate_files_are_served_to_new_connections() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "wan");
    let first = ca.server(dir.path(), "relay");
    let relay = TlsRelay::start(settings(&first, None)).await;
    assert_eq!(served_certificate(&relay.address, &ca).await, der(&first));

    // A rewrite that does not parse is refused; the first certificate is still served.
    std::fs::write(&first.cert_path, "not a certificate").unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while relay.tls.stats().reload_failures == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the broken rewrite was not noticed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(served_certificate(&relay.address, &ca).await, der(&first));
    assert_eq!(relay.tls.stats().reloads, 0);

    // Rewrite both files with a new certificate: new handshakes present it.
    let second = ca.server(dir.path(), "relay-next");
    std::fs::copy(&second.key_path, &first.key_path).unwrap();
    std::fs::copy(&second.cert_path, &first.cert_path).unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if served_certificate(&relay.address, &ca).await == der(&second) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the new certificate was never served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(relay.tls.stats().reloads >= 1);
    // A consumer still gets the catalog through the reloaded listener.
    let channel = client_args(&ca, None).connect_lazy(&relay.address).unwrap();
    assert!(tokio::time::timeout(WAIT, first_catalog_update(channel)).await.unwrap().is_ok());
    relay.stop().await;
}

#[test]
fn client_tls_flags_need_a_ca_and_readable_files() {
    let needs_ca = ClientTlsArgs { tls_cert: Some("c.pem".into()), ..ClientTlsArgs::default() };
    assert!(matches!(needs_ca.config(), Err(ClientTlsError::NeedsCa { flag: "--tls-cert" })));
    let https = ClientTlsArgs::default().endpoint("https://127.0.0.1:5561");
    assert!(matches!(https, Err(ClientTlsError::NeedsCa { .. })));
    let missing =
        ClientTlsArgs { tls_ca: Some("/nonexistent/ca.pem".into()), ..ClientTlsArgs::default() };
    assert!(matches!(missing.config(), Err(ClientTlsError::File { flag: "--tls-ca", .. })));
    // An explicit http:// address stays plaintext even with a CA given.
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new(dir.path(), "wan");
    let plain = client_args(&ca, None).endpoint("http://127.0.0.1:5561").unwrap();
    assert_eq!(plain.uri().scheme_str(), Some("http"));
    let tls = client_args(&ca, None).endpoint("127.0.0.1:5561").unwrap();
    assert_eq!(tls.uri().scheme_str(), Some("https"));
}
