//! How the NATS event plane authenticates and encrypts: the `NATS_AUTH_*` and `NATS_TLS_*`
//! environment variables Dynamo's workers read, validated once at start-up.
//!
//! Authentication (at most one method; two is a [`NatsSecurityError::Conflict`]):
//!
//! - `NATS_AUTH_USERNAME` + `NATS_AUTH_PASSWORD` (both or neither);
//! - `NATS_AUTH_TOKEN`;
//! - `NATS_AUTH_NKEY`: a user NKEY seed (`SU...`), which signs the server's nonce;
//! - `NATS_AUTH_CREDENTIALS_FILE`: a `.creds` file holding a user JWT and its NKEY seed.
//!
//! Encryption: a `tls://` server URL, or any of `NATS_TLS_CA_CERT_PATH` (PEM roots that verify
//! the server, in place of the system roots) and `NATS_TLS_CLIENT_CERT_PATH` +
//! `NATS_TLS_CLIENT_KEY_PATH` (a client certificate for mutual TLS, both or neither), makes TLS
//! required: the client never falls back to plaintext. `NATS_TLS_INSECURE` (skipping
//! verification) is refused rather than honoured.
//!
//! Invariants: every file named is read once here, bounded by [`NATS_SECURITY_FILE_BYTES_MAX`]
//! before it is read, and must parse (certificates, key, credentials, seed), so a bad value stops
//! the relay at start-up with an error naming its variable instead of failing on every
//! reconnect. Secrets never reach `Debug` output or error messages.

use std::fmt;
use std::path::{Path, PathBuf};

use async_nats::ConnectOptions;
use thiserror::Error;

use kvrelay_consumer::pem_files::{self, PemFileError};

/// `NATS_AUTH_USERNAME`.
pub const NATS_AUTH_USERNAME: &str = "NATS_AUTH_USERNAME";
/// `NATS_AUTH_PASSWORD`.
pub const NATS_AUTH_PASSWORD: &str = "NATS_AUTH_PASSWORD";
/// `NATS_AUTH_TOKEN`.
pub const NATS_AUTH_TOKEN: &str = "NATS_AUTH_TOKEN";
/// `NATS_AUTH_NKEY`: a user NKEY seed.
pub const NATS_AUTH_NKEY: &str = "NATS_AUTH_NKEY";
/// `NATS_AUTH_CREDENTIALS_FILE`: path of a `.creds` file.
pub const NATS_AUTH_CREDENTIALS_FILE: &str = "NATS_AUTH_CREDENTIALS_FILE";
/// `NATS_TLS_CA_CERT_PATH`: PEM roots that verify the server.
pub const NATS_TLS_CA_CERT_PATH: &str = "NATS_TLS_CA_CERT_PATH";
/// `NATS_TLS_CLIENT_CERT_PATH`: PEM client certificate chain (mutual TLS).
pub const NATS_TLS_CLIENT_CERT_PATH: &str = "NATS_TLS_CLIENT_CERT_PATH";
/// `NATS_TLS_CLIENT_KEY_PATH`: PEM private key of the client certificate.
pub const NATS_TLS_CLIENT_KEY_PATH: &str = "NATS_TLS_CLIENT_KEY_PATH";
/// `NATS_TLS_INSECURE`: refused when truthy.
pub const NATS_TLS_INSECURE: &str = "NATS_TLS_INSECURE";

/// Largest certificate, key or credentials file accepted (1 MiB).
pub const NATS_SECURITY_FILE_BYTES_MAX: u64 = pem_files::PEM_FILE_BYTES_MAX;

/// A secret string whose `Debug` is redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wrap `value`.
    #[must_use]
    pub fn new(value: String) -> Self {
        Secret(value)
    }

    /// The secret itself.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// How the client proves who it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    Anonymous,
    /// `NATS_AUTH_USERNAME` / `NATS_AUTH_PASSWORD`.
    UserPassword {
        /// The user name.
        user: String,
        /// The password.
        password: Secret,
    },
    /// `NATS_AUTH_TOKEN`.
    Token(Secret),
    /// `NATS_AUTH_NKEY`: a validated user seed.
    Nkey(Secret),
    /// `NATS_AUTH_CREDENTIALS_FILE`: the validated file's contents (the path is kept for logs).
    Credentials {
        /// Where the file was read from.
        path: PathBuf,
        /// Its contents (JWT and seed).
        contents: Secret,
    },
}

impl NatsAuth {
    /// The method's name for logs (never the secret).
    #[must_use]
    pub fn method(&self) -> &'static str {
        match self {
            NatsAuth::Anonymous => "none",
            NatsAuth::UserPassword { .. } => "user/password",
            NatsAuth::Token(_) => "token",
            NatsAuth::Nkey(_) => "nkey",
            NatsAuth::Credentials { .. } => "credentials file",
        }
    }
}

/// TLS settings beyond what the URL says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// `NATS_TLS_CA_CERT_PATH`: roots replacing the system's.
    pub ca_path: Option<PathBuf>,
    /// `NATS_TLS_CLIENT_CERT_PATH` and `NATS_TLS_CLIENT_KEY_PATH`.
    pub client_identity: Option<(PathBuf, PathBuf)>,
}

/// Everything the NATS client needs beyond the server URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsSecurity {
    /// The authentication method.
    pub auth: NatsAuth,
    /// TLS settings; `Some` makes TLS required even for a `nats://` URL.
    pub tls: Option<NatsTls>,
}

/// A NATS security setting the relay cannot start with. Each names its variable.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NatsSecurityError {
    /// A variable needs its partner (user without password, certificate without key).
    #[error("{variable} needs {partner}")]
    MissingPartner {
        /// The variable that is set.
        variable: &'static str,
        /// The variable that must be set with it.
        partner: &'static str,
    },
    /// Two authentication methods are configured.
    #[error("{first} conflicts with {second}: configure one NATS authentication method")]
    Conflict {
        /// One method's variable.
        first: &'static str,
        /// The other's.
        second: &'static str,
    },
    /// A named file cannot be read or is too large.
    #[error("{variable}={path:?}: {reason}")]
    File {
        /// The variable.
        variable: &'static str,
        /// The path given.
        path: PathBuf,
        /// Why it is refused.
        reason: String,
    },
    /// A value does not parse (the value itself is not repeated: it may be secret).
    #[error("{variable}: {reason}")]
    Invalid {
        /// The variable.
        variable: &'static str,
        /// Why it is refused.
        reason: String,
    },
}

impl NatsSecurityError {
    /// The variable the error is about.
    #[must_use]
    pub fn variable(&self) -> &'static str {
        match self {
            NatsSecurityError::MissingPartner { variable, .. }
            | NatsSecurityError::File { variable, .. }
            | NatsSecurityError::Invalid { variable, .. } => variable,
            NatsSecurityError::Conflict { second, .. } => second,
        }
    }
}

impl NatsSecurity {
    /// Read and validate the variables through `lookup` (blank values count as unset).
    pub fn from_lookup(
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<NatsSecurity, NatsSecurityError> {
        let get = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        let mut methods: Vec<(&'static str, NatsAuth)> = Vec::new();
        match (get(NATS_AUTH_USERNAME), get(NATS_AUTH_PASSWORD)) {
            (Some(user), Some(password)) => methods.push((
                NATS_AUTH_USERNAME,
                NatsAuth::UserPassword { user, password: Secret(password) },
            )),
            (Some(_), None) => {
                return Err(NatsSecurityError::MissingPartner {
                    variable: NATS_AUTH_USERNAME,
                    partner: NATS_AUTH_PASSWORD,
                });
            }
            (None, Some(_)) => {
                return Err(NatsSecurityError::MissingPartner {
                    variable: NATS_AUTH_PASSWORD,
                    partner: NATS_AUTH_USERNAME,
                });
            }
            (None, None) => {}
        }
        if let Some(token) = get(NATS_AUTH_TOKEN) {
            methods.push((NATS_AUTH_TOKEN, NatsAuth::Token(Secret(token))));
        }
        if let Some(seed) = get(NATS_AUTH_NKEY) {
            let seed = seed.trim().to_owned();
            nkeys::KeyPair::from_seed(&seed).map_err(|error| NatsSecurityError::Invalid {
                variable: NATS_AUTH_NKEY,
                reason: format!("not an NKEY seed: {error}"),
            })?;
            methods.push((NATS_AUTH_NKEY, NatsAuth::Nkey(Secret(seed))));
        }
        if let Some(path) = get(NATS_AUTH_CREDENTIALS_FILE) {
            let path = PathBuf::from(path.trim());
            let bytes = read_bounded(NATS_AUTH_CREDENTIALS_FILE, &path)?;
            let mut contents = String::from_utf8(bytes).map_err(|_| NatsSecurityError::File {
                variable: NATS_AUTH_CREDENTIALS_FILE,
                path: path.clone(),
                reason: "not UTF-8 text".to_owned(),
            })?;
            // The client's parser wants a line break after the seed's closing line, which a
            // file ending right there lacks (a Kubernetes Secret written with `|-` or
            // `--from-literal`); the NATS tools accept such a file, so the relay does too.
            if !contents.ends_with('\n') {
                contents.push('\n');
            }
            ConnectOptions::new().credentials(&contents).map_err(|error| {
                NatsSecurityError::File {
                    variable: NATS_AUTH_CREDENTIALS_FILE,
                    path: path.clone(),
                    reason: format!("not a NATS credentials file: {error}"),
                }
            })?;
            methods.push((
                NATS_AUTH_CREDENTIALS_FILE,
                NatsAuth::Credentials { path, contents: Secret(contents) },
            ));
        }
        if methods.len() > 1 {
            return Err(NatsSecurityError::Conflict { first: methods[0].0, second: methods[1].0 });
        }
        let auth = methods.pop().map_or(NatsAuth::Anonymous, |(_, auth)| auth);
        let tls = tls_from_lookup(&get)?;
        Ok(NatsSecurity { auth, tls })
    }

    /// Apply these settings to `options`.
    pub fn apply(&self, mut options: ConnectOptions) -> Result<ConnectOptions, NatsSecurityError> {
        options = match &self.auth {
            NatsAuth::Anonymous => options,
            NatsAuth::UserPassword { user, password } => {
                options.user_and_password(user.clone(), password.expose().to_owned())
            }
            NatsAuth::Token(token) => options.token(token.expose().to_owned()),
            NatsAuth::Nkey(seed) => options.nkey(seed.expose().to_owned()),
            NatsAuth::Credentials { contents, .. } => options
                .credentials(contents.expose())
                .map_err(|error| NatsSecurityError::Invalid {
                    variable: NATS_AUTH_CREDENTIALS_FILE,
                    reason: error.to_string(),
                })?,
        };
        if let Some(tls) = &self.tls {
            options = options.require_tls(true);
            if let Some(ca) = &tls.ca_path {
                options = options.add_root_certificates(ca.clone());
            }
            if let Some((cert, key)) = &tls.client_identity {
                options = options.add_client_certificate(cert.clone(), key.clone());
            }
        }
        Ok(options)
    }
}

fn tls_from_lookup(
    get: &impl Fn(&str) -> Option<String>,
) -> Result<Option<NatsTls>, NatsSecurityError> {
    if let Some(value) = get(NATS_TLS_INSECURE) {
        let truthy =
            matches!(value.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on");
        if truthy {
            return Err(NatsSecurityError::Invalid {
                variable: NATS_TLS_INSECURE,
                reason: "skipping certificate verification is not supported; give the server's \
                         CA in NATS_TLS_CA_CERT_PATH"
                    .to_owned(),
            });
        }
    }
    let ca_path = get(NATS_TLS_CA_CERT_PATH).map(|path| PathBuf::from(path.trim()));
    if let Some(path) = &ca_path {
        let pem = read_bounded(NATS_TLS_CA_CERT_PATH, path)?;
        certificates(NATS_TLS_CA_CERT_PATH, path, &pem)?;
    }
    let client_identity = match (get(NATS_TLS_CLIENT_CERT_PATH), get(NATS_TLS_CLIENT_KEY_PATH)) {
        (Some(cert), Some(key)) => {
            let (cert, key) = (PathBuf::from(cert.trim()), PathBuf::from(key.trim()));
            certificates(
                NATS_TLS_CLIENT_CERT_PATH,
                &cert,
                &read_bounded(NATS_TLS_CLIENT_CERT_PATH, &cert)?,
            )?;
            private_key(
                NATS_TLS_CLIENT_KEY_PATH,
                &key,
                &read_bounded(NATS_TLS_CLIENT_KEY_PATH, &key)?,
            )?;
            Some((cert, key))
        }
        (Some(_), None) => {
            return Err(NatsSecurityError::MissingPartner {
                variable: NATS_TLS_CLIENT_CERT_PATH,
                partner: NATS_TLS_CLIENT_KEY_PATH,
            });
        }
        (None, Some(_)) => {
            return Err(NatsSecurityError::MissingPartner {
                variable: NATS_TLS_CLIENT_KEY_PATH,
                partner: NATS_TLS_CLIENT_CERT_PATH,
            });
        }
        (None, None) => None,
    };
    if ca_path.is_none() && client_identity.is_none() {
        return Ok(None);
    }
    Ok(Some(NatsTls { ca_path, client_identity }))
}

/// `pem_files::read_bounded` with the variable named.
fn read_bounded(variable: &'static str, path: &Path) -> Result<Vec<u8>, NatsSecurityError> {
    pem_files::read_bounded(path).map_err(|error| file_error(variable, error))
}

fn certificates(variable: &'static str, path: &Path, pem: &[u8]) -> Result<(), NatsSecurityError> {
    pem_files::certificates(path, pem).map(drop).map_err(|error| file_error(variable, error))
}

fn private_key(variable: &'static str, path: &Path, pem: &[u8]) -> Result<(), NatsSecurityError> {
    pem_files::private_key(path, pem).map(drop).map_err(|error| file_error(variable, error))
}

fn file_error(variable: &'static str, error: PemFileError) -> NatsSecurityError {
    NatsSecurityError::File { variable, path: error.path, reason: error.reason }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn security(pairs: &[(&str, &str)]) -> Result<NatsSecurity, NatsSecurityError> {
        let map: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        NatsSecurity::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn nothing_set_is_anonymous_plaintext() {
        assert_eq!(security(&[]).unwrap(), NatsSecurity::default());
        assert_eq!(security(&[(NATS_AUTH_TOKEN, "  ")]).unwrap(), NatsSecurity::default());
    }

    #[test]
    fn each_method_is_read_and_secrets_stay_out_of_debug() {
        let user =
            security(&[(NATS_AUTH_USERNAME, "relay"), (NATS_AUTH_PASSWORD, "hunter2")]).unwrap();
        assert_eq!(user.auth.method(), "user/password");
        assert!(!format!("{user:?}").contains("hunter2"));
        let token = security(&[(NATS_AUTH_TOKEN, "s3cret")]).unwrap();
        assert_eq!(token.auth, NatsAuth::Token(Secret("s3cret".to_owned())));
        assert!(!format!("{token:?}").contains("s3cret"));
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        let nkey = security(&[(NATS_AUTH_NKEY, &seed)]).unwrap();
        assert_eq!(nkey.auth.method(), "nkey");
        assert!(!format!("{nkey:?}").contains(&seed));
    }

    #[test]
    fn partners_and_conflicts_are_refused_naming_the_variable() {
        let error = security(&[(NATS_AUTH_USERNAME, "relay")]).unwrap_err();
        assert_eq!(
            error,
            NatsSecurityError::MissingPartner {
                variable: NATS_AUTH_USERNAME,
                partner: NATS_AUTH_PASSWORD
            }
        );
        assert_eq!(
            security(&[(NATS_AUTH_PASSWORD, "p")]).unwrap_err().variable(),
            NATS_AUTH_PASSWORD
        );
        let both = security(&[
            (NATS_AUTH_USERNAME, "relay"),
            (NATS_AUTH_PASSWORD, "p"),
            (NATS_AUTH_TOKEN, "t"),
        ])
        .unwrap_err();
        assert_eq!(
            both,
            NatsSecurityError::Conflict { first: NATS_AUTH_USERNAME, second: NATS_AUTH_TOKEN }
        );
        let error = security(&[(NATS_TLS_CLIENT_KEY_PATH, "/k.pem")]).unwrap_err();
        assert_eq!(error.variable(), NATS_TLS_CLIENT_KEY_PATH);
        let insecure = security(&[(NATS_TLS_INSECURE, "yes")]).unwrap_err();
        assert_eq!(insecure.variable(), NATS_TLS_INSECURE);
        assert!(security(&[(NATS_TLS_INSECURE, "false")]).is_ok());
    }

    #[test]
    fn bad_seeds_and_files_are_refused_without_echoing_secrets() {
        let error = security(&[(NATS_AUTH_NKEY, "SUNOTASEED")]).unwrap_err();
        assert_eq!(error.variable(), NATS_AUTH_NKEY);
        assert!(!error.to_string().contains("SUNOTASEED"));
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.creds");
        let error =
            security(&[(NATS_AUTH_CREDENTIALS_FILE, missing.to_str().unwrap())]).unwrap_err();
        assert!(matches!(
            error,
            NatsSecurityError::File { variable: NATS_AUTH_CREDENTIALS_FILE, .. }
        ));
        let garbage = dir.path().join("garbage.creds");
        std::fs::write(&garbage, "not a creds file").unwrap();
        let error =
            security(&[(NATS_AUTH_CREDENTIALS_FILE, garbage.to_str().unwrap())]).unwrap_err();
        assert_eq!(error.variable(), NATS_AUTH_CREDENTIALS_FILE);
        let not_pem = dir.path().join("ca.pem");
        std::fs::write(&not_pem, "no certificate here").unwrap();
        let error = security(&[(NATS_TLS_CA_CERT_PATH, not_pem.to_str().unwrap())]).unwrap_err();
        assert_eq!(error.variable(), NATS_TLS_CA_CERT_PATH);
        let huge = dir.path().join("huge.pem");
        std::fs::File::create(&huge).unwrap().set_len(NATS_SECURITY_FILE_BYTES_MAX + 1).unwrap();
        let error = security(&[(NATS_TLS_CA_CERT_PATH, huge.to_str().unwrap())]).unwrap_err();
        assert!(error.to_string().contains("more than"), "{error}");
        let error = security(&[(NATS_TLS_CA_CERT_PATH, dir.path().to_str().unwrap())]).unwrap_err();
        assert!(error.to_string().contains("not a regular file"), "{error}");
    }

    #[test]
    fn a_credentials_file_with_a_jwt_and_a_seed_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        let path = dir.path().join("relay.creds");
        std::fs::write(
            &path,
            format!(
                "-----BEGIN NATS USER JWT-----\neyJhbGciOiJlZDI1NTE5In0.e30.c2ln\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
            ),
        )
        .unwrap();
        let parsed = security(&[(NATS_AUTH_CREDENTIALS_FILE, path.to_str().unwrap())]).unwrap();
        assert!(matches!(&parsed.auth, NatsAuth::Credentials { path: read, .. } if *read == path));
        assert!(!format!("{parsed:?}").contains(&seed));
    }

    #[test]
    fn a_credentials_file_ending_without_a_newline_is_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        let path = dir.path().join("relay.creds");
        std::fs::write(
            &path,
            format!(
                "-----BEGIN NATS USER JWT-----\neyJhbGciOiJlZDI1NTE5In0.e30.c2ln\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------"
            ),
        )
        .unwrap();
        let parsed = security(&[(NATS_AUTH_CREDENTIALS_FILE, path.to_str().unwrap())]).unwrap();
        assert_eq!(parsed.auth.method(), "credentials file");
        // What is kept is what the client is given on every connection: it must parse too.
        assert!(parsed.apply(ConnectOptions::new()).is_ok());
    }

    #[test]
    fn tls_files_are_parsed_and_make_tls_required() {
        let dir = tempfile::tempdir().unwrap();
        let (cert_path, key_path) = crate::test_pki::write_self_signed(dir.path());
        let tls = security(&[
            (NATS_TLS_CA_CERT_PATH, cert_path.to_str().unwrap()),
            (NATS_TLS_CLIENT_CERT_PATH, cert_path.to_str().unwrap()),
            (NATS_TLS_CLIENT_KEY_PATH, key_path.to_str().unwrap()),
        ])
        .unwrap()
        .tls
        .unwrap();
        assert_eq!(tls.ca_path.as_deref(), Some(cert_path.as_path()));
        assert_eq!(tls.client_identity, Some((cert_path.clone(), key_path.clone())));
        // A certificate given as the key is refused.
        let error = security(&[
            (NATS_TLS_CLIENT_CERT_PATH, cert_path.to_str().unwrap()),
            (NATS_TLS_CLIENT_KEY_PATH, cert_path.to_str().unwrap()),
        ])
        .unwrap_err();
        assert_eq!(error.variable(), NATS_TLS_CLIENT_KEY_PATH);
    }
}
