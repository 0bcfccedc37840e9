//! Self-signed certificates for the shell's unit tests (the integration tests have a CA in
//! `tests/pki`).

use std::path::{Path, PathBuf};

/// A self-signed certificate for `host` and its key, as PEM text.
pub(crate) fn self_signed_pem(host: &str) -> (String, String) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec![host.to_owned()]).unwrap().self_signed(&key).unwrap();
    (cert.pem(), key.serialize_pem())
}

/// [`self_signed_pem`] for `localhost` written into `dir`: the certificate's and the key's paths.
pub(crate) fn write_self_signed(dir: &Path) -> (PathBuf, PathBuf) {
    let (cert, key) = self_signed_pem("localhost");
    let (cert_path, key_path) = (dir.join("c.pem"), dir.join("k.pem"));
    std::fs::write(&cert_path, cert).unwrap();
    std::fs::write(&key_path, key).unwrap();
    (cert_path, key_path)
}
