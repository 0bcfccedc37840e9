//! How the etcd client authenticates and encrypts: the `ETCD_AUTH_*` variables Dynamo's
//! workers read, validated once at start-up.
//!
//! - `ETCD_AUTH_USERNAME` + `ETCD_AUTH_PASSWORD` (both or neither): the client trades them for a
//!   token (etcd's `Auth/Authenticate`) on every connection and sends it on every call;
//! - `ETCD_AUTH_CA`: the PEM roots that verify etcd's certificate. It turns TLS on: endpoints
//!   must then be `https://` (a bare `host:port` becomes `https://host:port`), and an `https://`
//!   endpoint without it is refused, since the client carries no system roots;
//! - `ETCD_AUTH_CLIENT_CERT` + `ETCD_AUTH_CLIENT_KEY` (both or neither, and only with the CA):
//!   a client certificate for etcd's `--client-cert-auth`.
//!
//! Each certificate variable holds a path, or the PEM text itself (a value that starts with
//! `-----BEGIN`). Invariants: files are bounded by [`PEM_FILE_BYTES_MAX`] before they are read
//! and must parse; their contents are kept, so a reconnect never depends on the file again; the
//! password and the key never reach `Debug` output or errors. Username/password and client
//! certificates may be combined.

use std::fmt;
use std::path::Path;

use thiserror::Error;
use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::event_plane::Secret;
use kvrelay_consumer::pem_files::{self, PEM_FILE_BYTES_MAX, PemFileError};

/// `ETCD_AUTH_USERNAME`.
pub const ETCD_AUTH_USERNAME: &str = "ETCD_AUTH_USERNAME";
/// `ETCD_AUTH_PASSWORD`.
pub const ETCD_AUTH_PASSWORD: &str = "ETCD_AUTH_PASSWORD";
/// `ETCD_AUTH_CA`: PEM roots that verify etcd (a path or the PEM text).
pub const ETCD_AUTH_CA: &str = "ETCD_AUTH_CA";
/// `ETCD_AUTH_CLIENT_CERT`: the client certificate chain (a path or the PEM text).
pub const ETCD_AUTH_CLIENT_CERT: &str = "ETCD_AUTH_CLIENT_CERT";
/// `ETCD_AUTH_CLIENT_KEY`: its private key (a path or the PEM text).
pub const ETCD_AUTH_CLIENT_KEY: &str = "ETCD_AUTH_CLIENT_KEY";

/// A user name and password for etcd's authentication.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdCredentials {
    /// The user.
    pub user: String,
    /// The password.
    pub password: Secret,
}

/// Validated PEM material for TLS to etcd.
#[derive(Clone, PartialEq, Eq)]
pub struct EtcdTls {
    /// The roots that verify etcd's certificate.
    pub ca_pem: Vec<u8>,
    /// The client certificate chain and key, for `--client-cert-auth`.
    pub identity: Option<(Vec<u8>, Secret)>,
}

impl fmt::Debug for EtcdTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EtcdTls")
            .field("ca_pem_bytes", &self.ca_pem.len())
            .field("client_certificate", &self.identity.is_some())
            .finish()
    }
}

impl EtcdTls {
    /// The channel's TLS configuration (the server name is the endpoint's host).
    #[must_use]
    pub fn client_config(&self) -> ClientTlsConfig {
        let config = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca_pem));
        match &self.identity {
            Some((cert, key)) => config.identity(Identity::from_pem(cert, key.expose())),
            None => config,
        }
    }
}

/// Everything the etcd client needs beyond the endpoints. The default is anonymous plaintext.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdSecurity {
    /// `ETCD_AUTH_USERNAME` / `ETCD_AUTH_PASSWORD`.
    pub credentials: Option<EtcdCredentials>,
    /// `ETCD_AUTH_CA` and the client certificate.
    pub tls: Option<EtcdTls>,
}

/// An etcd security setting the relay cannot start with.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{variable}: {reason}")]
pub struct EtcdSecurityError {
    /// The variable it is about.
    pub variable: &'static str,
    /// Why it is refused (never the secret itself).
    pub reason: String,
}

fn refuse(variable: &'static str, reason: impl Into<String>) -> EtcdSecurityError {
    EtcdSecurityError { variable, reason: reason.into() }
}

impl EtcdSecurity {
    /// Read and validate the variables through `lookup` (blank values count as unset).
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<EtcdSecurity, EtcdSecurityError> {
        let get = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        let credentials = match (get(ETCD_AUTH_USERNAME), get(ETCD_AUTH_PASSWORD)) {
            (Some(user), Some(password)) => Some(EtcdCredentials {
                user: user.trim().to_owned(),
                password: Secret::new(password),
            }),
            (Some(_), None) => return Err(refuse(ETCD_AUTH_USERNAME, "needs ETCD_AUTH_PASSWORD")),
            (None, Some(_)) => return Err(refuse(ETCD_AUTH_PASSWORD, "needs ETCD_AUTH_USERNAME")),
            (None, None) => None,
        };
        let ca = get(ETCD_AUTH_CA).map(|value| pem_value(ETCD_AUTH_CA, &value)).transpose()?;
        let cert = get(ETCD_AUTH_CLIENT_CERT);
        let key = get(ETCD_AUTH_CLIENT_KEY);
        let identity = match (cert, key) {
            (Some(cert), Some(key)) => {
                let cert_pem = pem_value(ETCD_AUTH_CLIENT_CERT, &cert)?;
                let key_pem = pem_value(ETCD_AUTH_CLIENT_KEY, &key)?;
                let origin = |value: &str| Path::new(value.trim()).to_owned();
                pem_files::certificates(&origin(&cert), &cert_pem)
                    .map_err(|error| file_error(ETCD_AUTH_CLIENT_CERT, &error))?;
                pem_files::private_key(&origin(&key), &key_pem)
                    .map_err(|error| file_error(ETCD_AUTH_CLIENT_KEY, &error))?;
                let key_text = String::from_utf8(key_pem)
                    .map_err(|_| refuse(ETCD_AUTH_CLIENT_KEY, "not UTF-8 PEM text"))?;
                Some((cert_pem, Secret::new(key_text)))
            }
            (Some(_), None) => {
                return Err(refuse(ETCD_AUTH_CLIENT_CERT, "needs ETCD_AUTH_CLIENT_KEY"));
            }
            (None, Some(_)) => {
                return Err(refuse(ETCD_AUTH_CLIENT_KEY, "needs ETCD_AUTH_CLIENT_CERT"));
            }
            (None, None) => None,
        };
        let tls = match ca {
            Some(ca_pem) => {
                pem_files::certificates(Path::new(ETCD_AUTH_CA), &ca_pem)
                    .map_err(|error| refuse(ETCD_AUTH_CA, error.reason))?;
                Some(EtcdTls { ca_pem, identity })
            }
            None if identity.is_some() => {
                return Err(refuse(
                    ETCD_AUTH_CA,
                    "a client certificate needs ETCD_AUTH_CA (the roots that verify etcd)",
                ));
            }
            None => None,
        };
        Ok(EtcdSecurity { credentials, tls })
    }
}

/// The PEM bytes a certificate variable names: its text when it starts with `-----BEGIN`, else
/// the file at that path.
fn pem_value(variable: &'static str, value: &str) -> Result<Vec<u8>, EtcdSecurityError> {
    let value = value.trim();
    if value.starts_with("-----BEGIN") {
        if value.len() as u64 > PEM_FILE_BYTES_MAX {
            return Err(refuse(variable, "inline PEM text larger than 1 MiB"));
        }
        return Ok(value.as_bytes().to_vec());
    }
    pem_files::read_bounded(Path::new(value)).map_err(|error| file_error(variable, &error))
}

fn file_error(variable: &'static str, error: &PemFileError) -> EtcdSecurityError {
    refuse(variable, error.to_string())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn security(pairs: &[(&str, &str)]) -> Result<EtcdSecurity, EtcdSecurityError> {
        let map: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        EtcdSecurity::from_lookup(|name| map.get(name).cloned())
    }

    fn self_signed() -> (String, String) {
        crate::test_pki::self_signed_pem("127.0.0.1")
    }

    #[test]
    fn credentials_need_both_halves_and_stay_out_of_debug() {
        assert_eq!(security(&[]).unwrap(), EtcdSecurity::default());
        let both = security(&[(ETCD_AUTH_USERNAME, "root"), (ETCD_AUTH_PASSWORD, "pw-1")]).unwrap();
        assert_eq!(both.credentials.as_ref().unwrap().user, "root");
        assert!(!format!("{both:?}").contains("pw-1"));
        assert_eq!(
            security(&[(ETCD_AUTH_USERNAME, "root")]).unwrap_err().variable,
            ETCD_AUTH_USERNAME
        );
        assert_eq!(
            security(&[(ETCD_AUTH_PASSWORD, "p")]).unwrap_err().variable,
            ETCD_AUTH_PASSWORD
        );
    }

    #[test]
    fn certificates_come_from_paths_or_inline_pem_and_bad_ones_name_the_variable() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed();
        let (cert_path, key_path) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&cert_path, &cert).unwrap();
        std::fs::write(&key_path, &key).unwrap();
        let from_files = security(&[
            (ETCD_AUTH_CA, cert_path.to_str().unwrap()),
            (ETCD_AUTH_CLIENT_CERT, cert_path.to_str().unwrap()),
            (ETCD_AUTH_CLIENT_KEY, key_path.to_str().unwrap()),
        ])
        .unwrap();
        let inline = security(&[
            (ETCD_AUTH_CA, &cert),
            (ETCD_AUTH_CLIENT_CERT, &cert),
            (ETCD_AUTH_CLIENT_KEY, &key),
        ])
        .unwrap();
        assert_eq!(from_files.tls.as_ref().unwrap().ca_pem, cert.as_bytes());
        assert_eq!(inline.tls.as_ref().unwrap().ca_pem, cert.trim().as_bytes());
        assert!(!format!("{inline:?}").contains("PRIVATE KEY"));
        let missing = security(&[(ETCD_AUTH_CA, "/nonexistent/ca.pem")]).unwrap_err();
        assert_eq!(missing.variable, ETCD_AUTH_CA);
        assert!(missing.reason.contains("/nonexistent/ca.pem"), "{missing}");
        let key_as_cert = security(&[
            (ETCD_AUTH_CA, &cert),
            (ETCD_AUTH_CLIENT_CERT, &key),
            (ETCD_AUTH_CLIENT_KEY, &key),
        ])
        .unwrap_err();
        assert_eq!(key_as_cert.variable, ETCD_AUTH_CLIENT_CERT);
        let no_ca = security(&[(ETCD_AUTH_CLIENT_CERT, &cert), (ETCD_AUTH_CLIENT_KEY, &key)]);
        assert_eq!(no_ca.unwrap_err().variable, ETCD_AUTH_CA);
        let half = security(&[(ETCD_AUTH_CA, &cert), (ETCD_AUTH_CLIENT_KEY, &key)]);
        assert_eq!(half.unwrap_err().variable, ETCD_AUTH_CLIENT_KEY);
        let not_a_ca = security(&[(ETCD_AUTH_CA, "-----BEGIN garbage")]).unwrap_err();
        assert_eq!(not_a_ca.variable, ETCD_AUTH_CA);
    }
}
