//! TLS options of the relay's clients (`kvrelay watch`, `kvrelay query`, `kvrelay-compare`):
//! `--tls-ca` (the roots that verify the relay; required for TLS, since the clients carry no
//! system roots), `--tls-cert` + `--tls-key` (a client certificate for a relay that requires
//! mTLS) and `--tls-server-name` (the name checked in the relay's certificate when it differs
//! from the address's host).
//!
//! Which connections use TLS: an `https://` address always, an `http://` address never, and a
//! bare `host:port` when `--tls-ca` is given. Files are bounded and parsed before use.

use std::path::PathBuf;

use thiserror::Error;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use super::client::endpoint;
use crate::pem_files::{self, PemFileError};

/// The TLS flags of a relay client.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ClientTlsArgs {
    /// PEM roots that verify the relay's certificate; turns TLS on for `host:port` addresses.
    #[arg(long, value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate chain, for a relay that requires client certificates.
    #[arg(long, value_name = "PEM", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "PEM", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Name to verify in the relay's certificate (default: the address's host).
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
}

/// Client TLS options that cannot be used.
#[derive(Debug, Error)]
pub enum ClientTlsError {
    /// A file is missing, too large or does not parse.
    #[error("{flag}: {error}")]
    File {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        error: PemFileError,
    },
    /// A flag needs another one.
    #[error("{flag} needs --tls-ca (the roots that verify the relay)")]
    NeedsCa {
        /// The flag given without `--tls-ca`.
        flag: &'static str,
    },
    /// The address is not a URI.
    #[error(transparent)]
    Address(Box<super::ConsumerError>),
    /// The TLS setup was refused by the transport.
    #[error("relay address {address}: {source}")]
    Transport {
        /// The address.
        address: String,
        /// The transport's error.
        #[source]
        source: tonic::transport::Error,
    },
}

impl ClientTlsArgs {
    /// The TLS configuration, or `None` without `--tls-ca`.
    pub fn config(&self) -> Result<Option<ClientTlsConfig>, ClientTlsError> {
        let Some(ca) = &self.tls_ca else {
            if self.tls_cert.is_some() {
                return Err(ClientTlsError::NeedsCa { flag: "--tls-cert" });
            }
            if self.tls_server_name.is_some() {
                return Err(ClientTlsError::NeedsCa { flag: "--tls-server-name" });
            }
            return Ok(None);
        };
        let read = |flag, path: &PathBuf| {
            pem_files::read_bounded(path).map_err(|error| ClientTlsError::File { flag, error })
        };
        let ca_pem = read("--tls-ca", ca)?;
        pem_files::certificates(ca, &ca_pem)
            .map_err(|error| ClientTlsError::File { flag: "--tls-ca", error })?;
        let mut config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            let cert_pem = read("--tls-cert", cert)?;
            pem_files::certificates(cert, &cert_pem)
                .map_err(|error| ClientTlsError::File { flag: "--tls-cert", error })?;
            let key_pem = read("--tls-key", key)?;
            pem_files::private_key(key, &key_pem)
                .map_err(|error| ClientTlsError::File { flag: "--tls-key", error })?;
            config = config.identity(Identity::from_pem(cert_pem, key_pem));
        }
        if let Some(name) = &self.tls_server_name {
            config = config.domain_name(name.clone());
        }
        Ok(Some(config))
    }

    /// The endpoint for `address` with these options (see the module doc for which addresses
    /// use TLS).
    pub fn endpoint(&self, address: &str) -> Result<Endpoint, ClientTlsError> {
        let transport = |source| ClientTlsError::Transport { address: address.to_owned(), source };
        let config = self.config()?;
        let tls = address.starts_with("https://") || (config.is_some() && !address.contains("://"));
        if !tls {
            return endpoint(address).map_err(|error| ClientTlsError::Address(Box::new(error)));
        }
        let Some(config) = config else {
            return Err(ClientTlsError::NeedsCa { flag: "an https:// address" });
        };
        let uri =
            if address.contains("://") { address.to_owned() } else { format!("https://{address}") };
        let plain = endpoint(&uri).map_err(|error| ClientTlsError::Address(Box::new(error)))?;
        plain.tls_config(config).map_err(transport)
    }

    /// A channel to `address` that connects on first use.
    pub fn connect_lazy(&self, address: &str) -> Result<Channel, ClientTlsError> {
        Ok(self.endpoint(address)?.connect_lazy())
    }
}
