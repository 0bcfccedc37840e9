//! Certificates made in the test with `rcgen`: one CA, and server and client certificates it
//! signs, written as PEM files into a temporary directory.
#![allow(dead_code, reason = "each test binary that includes this module uses a part of it")]

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A certificate authority whose key signs the leaves.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate's PEM file.
    pub cert_path: PathBuf,
}

/// A leaf certificate and its key, as PEM files.
#[derive(Debug, Clone)]
pub struct Leaf {
    /// The certificate chain (the leaf alone).
    pub cert_path: PathBuf,
    /// Its private key.
    pub key_path: PathBuf,
    /// The certificate's PEM text.
    pub cert_pem: String,
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir/{name}-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> TestCa {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let cert_path = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&cert_path, issuer.pem()).unwrap();
        TestCa { issuer, cert_path }
    }

    /// A server certificate for `127.0.0.1` and `localhost` written as `dir/{name}.pem` and
    /// `dir/{name}-key.pem`.
    pub fn server(&self, dir: &Path, name: &str) -> Leaf {
        self.leaf(dir, name, ExtendedKeyUsagePurpose::ServerAuth)
    }

    /// A client certificate (common name `name`).
    pub fn client(&self, dir: &Path, name: &str) -> Leaf {
        self.leaf(dir, name, ExtendedKeyUsagePurpose::ClientAuth)
    }

    fn leaf(&self, dir: &Path, name: &str, usage: ExtendedKeyUsagePurpose) -> Leaf {
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![usage];
        params.key_usages =
            vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        let leaf = Leaf {
            cert_path: dir.join(format!("{name}.pem")),
            key_path: dir.join(format!("{name}-key.pem")),
            cert_pem: cert.pem(),
        };
        std::fs::write(&leaf.cert_path, &leaf.cert_pem).unwrap();
        std::fs::write(&leaf.key_path, key.serialize_pem()).unwrap();
        leaf
    }
}

/// `path` as a `&str` for environment maps and server configs.
pub fn text(path: &Path) -> &str {
    path.to_str().expect("temporary paths are UTF-8")
}
