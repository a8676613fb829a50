//! HTTPS: rustls (with the `ring` provider) over the same router.
//!
//! [`acceptor`] loads a PEM certificate chain and private key. Each
//! connection's handshake runs in that connection's own task (a slow or
//! silent client never holds up the others), bounded by the header timeout,
//! and counts against the connection cap like a plain TCP connection (see
//! `conn.rs`). See `docs/decisions/0009-auth-and-tls-crates.md`.

use std::path::Path;
use std::sync::Arc;

use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub use tokio_rustls::TlsAcceptor;

/// Why the certificate or key could not be used.
#[derive(Debug)]
pub struct TlsError(pub String);

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TlsError {}

/// A TLS acceptor for the PEM certificate chain in `cert` and the PEM
/// private key (PKCS#8, PKCS#1 or SEC1) in `key`. TLS 1.2 and 1.3, no
/// client certificates, ALPN `http/1.1`.
pub fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| {
            TlsError(format!(
                "cannot read certificate file {}: {e}",
                cert.display()
            ))
        })?
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError(format!("certificate file {}: {e}", cert.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!(
            "certificate file {} holds no PEM certificate",
            cert.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| TlsError(format!("private key file {}: {e}", key.display())))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError(format!("TLS setup: {e}")))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            TlsError(format!(
                "certificate and key do not make a TLS identity: {e}"
            ))
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}
