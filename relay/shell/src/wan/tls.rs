//! TLS and mutual TLS on the WAN listener, beside the contract's plaintext default
//! (`--tls-cert`/`--tls-key`, `--tls-client-ca`; README "TLS on the WAN listener").
//!
//! [`WanTls`] holds the current rustls `ServerConfig` behind a lock and [`tls_incoming`] turns
//! a TCP listener into a stream of finished TLS connections for [`serve`](super::serve): each
//! connection is handshaken with the configuration current when it was accepted.
//! [`WanTls::run_reloader`] re-reads the certificate, key and client CA files every
//! `reload_interval` and swaps the configuration when their contents changed and still parse;
//! a change that does not parse keeps the previous configuration (logged and counted).
//!
//! Bounds: at most [`TLS_HANDSHAKES_MAX`] handshakes run at once (further connections wait in
//! the listener's backlog); a handshake that takes longer than [`TLS_HANDSHAKE_TIMEOUT`] is
//! dropped; every file is bounded by [`PEM_FILE_BYTES_MAX`](kvrelay_consumer::pem_files::PEM_FILE_BYTES_MAX)
//! before it is read. A failed handshake is counted and never stops the listener. The
//! negotiated protocol is HTTP/2 (ALPN `h2`), as gRPC needs.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::Stream;
use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use kvrelay_consumer::pem_files::{self, PemFileError};

/// Handshakes in progress at once.
pub const TLS_HANDSHAKES_MAX: usize = 64;
/// Longest handshake.
pub const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default period of the certificate file check.
pub const TLS_RELOAD_INTERVAL_DEFAULT: Duration = Duration::from_secs(5);

/// Where the WAN listener's certificate comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WanTlsSettings {
    /// PEM certificate chain (`--tls-cert` / `DYN_RELAY_TLS_CERT`).
    pub cert_path: PathBuf,
    /// PEM private key (`--tls-key` / `DYN_RELAY_TLS_KEY`).
    pub key_path: PathBuf,
    /// PEM roots a client certificate must chain to (`--tls-client-ca` /
    /// `DYN_RELAY_TLS_CLIENT_CA`); `Some` makes client certificates mandatory (mTLS).
    pub client_ca_path: Option<PathBuf>,
    /// How often the files are checked for a change (`DYN_RELAY_TLS_RELOAD_INTERVAL_MS`).
    pub reload_interval: Duration,
}

/// A TLS configuration that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum WanTlsError {
    /// A file is missing, too large or does not parse.
    #[error("{setting}: {error}")]
    File {
        /// The flag the file was given with.
        setting: &'static str,
        /// What is wrong with it.
        error: PemFileError,
    },
    /// rustls refused the material (a key that does not match the certificate, a CA that is
    /// not a CA).
    #[error("{setting}: {reason}")]
    Rejected {
        /// The flag concerned.
        setting: &'static str,
        /// rustls' reason.
        reason: String,
    },
}

/// The bytes of the three files, compared to detect a change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Material {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Material {
    fn read(settings: &WanTlsSettings) -> Result<Material, WanTlsError> {
        let read = |setting, path: &Path| {
            pem_files::read_bounded(path).map_err(|error| WanTlsError::File { setting, error })
        };
        Ok(Material {
            cert: read("--tls-cert", &settings.cert_path)?,
            key: read("--tls-key", &settings.key_path)?,
            client_ca: settings
                .client_ca_path
                .as_deref()
                .map(|path| read("--tls-client-ca", path))
                .transpose()?,
        })
    }

    fn server_config(
        &self,
        settings: &WanTlsSettings,
    ) -> Result<rustls::ServerConfig, WanTlsError> {
        let file = |setting, error| WanTlsError::File { setting, error };
        let chain = pem_files::certificates(&settings.cert_path, &self.cert)
            .map_err(|error| file("--tls-cert", error))?;
        let key = pem_files::private_key(&settings.key_path, &self.key)
            .map_err(|error| file("--tls-key", error))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|error| WanTlsError::Rejected {
                setting: "--tls-cert",
                reason: error.to_string(),
            })?;
        let builder = match (&self.client_ca, &settings.client_ca_path) {
            (Some(pem), Some(path)) => {
                let mut roots = RootCertStore::empty();
                for certificate in pem_files::certificates(path, pem)
                    .map_err(|error| file("--tls-client-ca", error))?
                {
                    roots.add(certificate).map_err(|error| WanTlsError::Rejected {
                        setting: "--tls-client-ca",
                        reason: error.to_string(),
                    })?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|error| WanTlsError::Rejected {
                            setting: "--tls-client-ca",
                            reason: error.to_string(),
                        })?;
                builder.with_client_cert_verifier(verifier)
            }
            _ => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).map_err(|error| {
            WanTlsError::Rejected { setting: "--tls-key", reason: error.to_string() }
        })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(config)
    }
}

/// Check that `settings` build a configuration (at start-up, before anything listens).
pub fn validate_wan_tls(settings: &WanTlsSettings) -> Result<(), WanTlsError> {
    Material::read(settings)?.server_config(settings).map(drop)
}

/// What the TLS listener did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WanTlsStats {
    /// Configurations swapped in after a file change.
    pub reloads: u64,
    /// File changes that did not build a configuration (the previous one was kept).
    pub reload_failures: u64,
    /// Handshakes that failed or timed out.
    pub handshake_failures: u64,
}

#[derive(Debug, Default)]
struct Counters {
    reloads: AtomicU64,
    reload_failures: AtomicU64,
    handshake_failures: AtomicU64,
}

/// The WAN listener's live TLS configuration. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub struct WanTls {
    settings: Arc<WanTlsSettings>,
    current: Arc<RwLock<(Material, Arc<rustls::ServerConfig>)>>,
    counters: Arc<Counters>,
}

impl WanTls {
    /// Read and build the configuration now.
    pub fn load(settings: WanTlsSettings) -> Result<WanTls, WanTlsError> {
        let material = Material::read(&settings)?;
        let config = Arc::new(material.server_config(&settings)?);
        Ok(WanTls {
            settings: Arc::new(settings),
            current: Arc::new(RwLock::new((material, config))),
            counters: Arc::default(),
        })
    }

    /// The counters so far.
    #[must_use]
    pub fn stats(&self) -> WanTlsStats {
        WanTlsStats {
            reloads: self.counters.reloads.load(Ordering::Relaxed),
            reload_failures: self.counters.reload_failures.load(Ordering::Relaxed),
            handshake_failures: self.counters.handshake_failures.load(Ordering::Relaxed),
        }
    }

    fn acceptor(&self) -> TlsAcceptor {
        let current = self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        TlsAcceptor::from(Arc::clone(&current.1))
    }

    /// Re-read the files; swap the configuration if they changed and build. Returns whether a
    /// new configuration is in place.
    pub fn reload_if_changed(&self) -> bool {
        let material = match Material::read(&self.settings) {
            Ok(material) => material,
            Err(error) => {
                self.reload_failed(&error);
                return false;
            }
        };
        {
            let current = self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            if current.0 == material {
                return false;
            }
        }
        match material.server_config(&self.settings) {
            Ok(config) => {
                let mut current =
                    self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner);
                *current = (material, Arc::new(config));
                self.counters.reloads.fetch_add(1, Ordering::Relaxed);
                info!(cert = %self.settings.cert_path.display(), "WAN TLS certificate reloaded");
                true
            }
            Err(error) => {
                self.reload_failed(&error);
                false
            }
        }
    }

    fn reload_failed(&self, error: &WanTlsError) {
        // Files are often rewritten one at a time: a half-written pair fails once, then builds.
        self.counters.reload_failures.fetch_add(1, Ordering::Relaxed);
        warn!(%error, "WAN TLS files changed but do not build; keeping the previous certificate");
    }

    /// Check the files every `reload_interval` until `cancel` fires.
    pub async fn run_reloader(self, cancel: CancellationToken) {
        let mut ticks = tokio::time::interval(self.settings.reload_interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks.tick().await;
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                _ = ticks.tick() => {
                    self.reload_if_changed();
                }
            }
        }
    }
}

/// Accept TCP connections on `listener` and yield them once their TLS handshake (with the
/// configuration current at accept time) succeeded, until `cancel` fires or the stream is
/// dropped. The certificate reloader runs for as long.
pub fn tls_incoming(
    listener: TcpListener,
    tls: WanTls,
    cancel: CancellationToken,
) -> impl Stream<Item = Result<TlsStream<TcpStream>, std::io::Error>> {
    let (ready_tx, ready) = mpsc::channel(TLS_HANDSHAKES_MAX);
    crate::runtime::spawn(tls.clone().run_reloader(cancel.clone()));
    crate::runtime::spawn(async move {
        let permits = Arc::new(Semaphore::new(TLS_HANDSHAKES_MAX));
        loop {
            let permit = tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                () = ready_tx.closed() => return,
                permit = Arc::clone(&permits).acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            let accepted = tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                () = ready_tx.closed() => return,
                accepted = listener.accept() => accepted,
            };
            let (tcp, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of descriptors and the like: pause instead of spinning.
                    warn!(%error, "WAN accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = tls.acceptor();
            let ready_tx = ready_tx.clone();
            let counters = Arc::clone(&tls.counters);
            crate::runtime::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = ready_tx.send(Ok(stream)).await;
                    }
                    Ok(Err(error)) => {
                        counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
                        debug!(%peer, %error, "WAN TLS handshake failed");
                    }
                    Err(_) => {
                        counters.handshake_failures.fetch_add(1, Ordering::Relaxed);
                        debug!(%peer, "WAN TLS handshake timed out");
                    }
                }
            });
        }
    });
    ReceiverStream::new(ready)
}

/// The TLS values given on `kvrelay serve`'s command line (`None` = not given).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WanTlsValues {
    /// `--tls-cert`.
    pub cert: Option<PathBuf>,
    /// `--tls-key`.
    pub key: Option<PathBuf>,
    /// `--tls-client-ca`.
    pub client_ca: Option<PathBuf>,
}

/// `DYN_RELAY_TLS_CERT`.
pub const TLS_CERT_ENV: &str = "DYN_RELAY_TLS_CERT";
/// `DYN_RELAY_TLS_KEY`.
pub const TLS_KEY_ENV: &str = "DYN_RELAY_TLS_KEY";
/// `DYN_RELAY_TLS_CLIENT_CA`.
pub const TLS_CLIENT_CA_ENV: &str = "DYN_RELAY_TLS_CLIENT_CA";
/// `DYN_RELAY_TLS_RELOAD_INTERVAL_MS`.
pub const TLS_RELOAD_INTERVAL_ENV: &str = "DYN_RELAY_TLS_RELOAD_INTERVAL_MS";

/// Resolve the WAN TLS settings: each flag over its variable; certificate and key together; a
/// client CA only with them; any of them only with a listener (`listening`). The files are
/// read and must build a configuration, so a bad one stops the relay at start-up.
pub fn resolve_wan_tls(
    cli: &WanTlsValues,
    environment: &std::collections::BTreeMap<String, String>,
    listening: bool,
) -> Result<Option<WanTlsSettings>, crate::config::ConfigError> {
    use crate::config::ConfigError;
    let env = |name: &str| {
        environment.get(name).map(|value| value.trim()).filter(|value| !value.is_empty())
    };
    let pick =
        |flag: &Option<PathBuf>, name: &str| flag.clone().or_else(|| env(name).map(PathBuf::from));
    let cert = pick(&cli.cert, TLS_CERT_ENV);
    let key = pick(&cli.key, TLS_KEY_ENV);
    let client_ca = pick(&cli.client_ca, TLS_CLIENT_CA_ENV);
    let reload_ms = env(TLS_RELOAD_INTERVAL_ENV);
    let (cert_path, key_path) = match (cert, key) {
        (None, None) => {
            if client_ca.is_some() {
                return Err(ConfigError::Missing { setting: "--tls-cert" });
            }
            if reload_ms.is_some() {
                return Err(ConfigError::Missing { setting: "--tls-cert" });
            }
            return Ok(None);
        }
        (Some(_), None) => return Err(ConfigError::Missing { setting: "--tls-key" }),
        (None, Some(_)) => return Err(ConfigError::Missing { setting: "--tls-cert" }),
        (Some(cert), Some(key)) => (cert, key),
    };
    if !listening {
        return Err(ConfigError::Conflict { first: "--tls-cert", second: "no --bind" });
    }
    let reload_interval = match reload_ms {
        None => TLS_RELOAD_INTERVAL_DEFAULT,
        Some(text) => match text.parse::<u64>() {
            Ok(ms) if (100..=86_400_000).contains(&ms) => Duration::from_millis(ms),
            _ => {
                return Err(ConfigError::Invalid {
                    setting: TLS_RELOAD_INTERVAL_ENV,
                    value: text.to_owned(),
                    reason: "milliseconds from 100 to 86400000".to_owned(),
                });
            }
        },
    };
    let settings =
        WanTlsSettings { cert_path, key_path, client_ca_path: client_ca, reload_interval };
    validate_wan_tls(&settings).map_err(|error| {
        let (setting, value) = match &error {
            WanTlsError::File { setting, error } => (*setting, error.path.display().to_string()),
            WanTlsError::Rejected { setting, .. } => (*setting, String::new()),
        };
        ConfigError::Invalid { setting, value, reason: error.to_string() }
    })?;
    Ok(Some(settings))
}
