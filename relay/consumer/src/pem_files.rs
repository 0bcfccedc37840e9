//! Reading the PEM files that secure the relay's connections (NATS and etcd client
//! certificates, the WAN listener's certificate): bounded in size before they are read, parsed
//! before they are used, and refused with the path and a reason. Callers add the setting's name.

use std::path::{Path, PathBuf};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use thiserror::Error;

/// Largest certificate, key or credentials file accepted (1 MiB).
pub const PEM_FILE_BYTES_MAX: u64 = 1 << 20;

/// A file that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{path:?}: {reason}")]
pub struct PemFileError {
    /// The path given.
    pub path: PathBuf,
    /// Why it is refused.
    pub reason: String,
}

/// The contents of `path`, refused past [`PEM_FILE_BYTES_MAX`] before reading.
pub fn read_bounded(path: &Path) -> Result<Vec<u8>, PemFileError> {
    let refuse = |reason: String| PemFileError { path: path.to_owned(), reason };
    let metadata = std::fs::metadata(path).map_err(|error| refuse(error.to_string()))?;
    if !metadata.is_file() {
        return Err(refuse("not a regular file".to_owned()));
    }
    if metadata.len() > PEM_FILE_BYTES_MAX {
        return Err(refuse(format!(
            "{} bytes, more than the {PEM_FILE_BYTES_MAX} accepted",
            metadata.len()
        )));
    }
    std::fs::read(path).map_err(|error| refuse(error.to_string()))
}

/// The PEM certificates in `pem` (read from `path`); none is an error.
pub fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PemFileError> {
    let refuse = |reason: String| PemFileError { path: path.to_owned(), reason };
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| refuse(format!("not PEM certificates: {error}")))?;
    if certificates.is_empty() {
        return Err(refuse("holds no PEM certificate".to_owned()));
    }
    Ok(certificates)
}

/// The first PEM private key in `pem` (read from `path`).
pub fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, PemFileError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|error| PemFileError {
        path: path.to_owned(),
        reason: format!("holds no PEM private key: {error}"),
    })
}

/// Read and parse the certificates at `path`.
pub fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, PemFileError> {
    certificates(path, &read_bounded(path)?)
}

/// Read and parse the private key at `path`.
pub fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, PemFileError> {
    private_key(path, &read_bounded(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_oversized_and_non_pem_files_are_refused_with_their_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        assert_eq!(read_bounded(&missing).unwrap_err().path, missing);
        let huge = dir.path().join("huge.pem");
        std::fs::File::create(&huge).unwrap().set_len(PEM_FILE_BYTES_MAX + 1).unwrap();
        assert!(read_bounded(&huge).unwrap_err().reason.contains("more than"));
        assert!(read_bounded(dir.path()).unwrap_err().reason.contains("not a regular file"));
        let text = dir.path().join("text.pem");
        std::fs::write(&text, "no pem here").unwrap();
        assert!(read_certificates(&text).unwrap_err().reason.contains("no PEM certificate"));
        assert!(read_private_key(&text).unwrap_err().reason.contains("no PEM private key"));
    }
}
