//! TLS with rustls (the `ring` provider; no OpenSSL): the certificate and key of `--tls-cert`
//! and `--tls-key`, reloaded without a restart (SIGHUP).
//!
//! Not here: where TLS is negotiated (the PostgreSQL port's SSLRequest in
//! [`crate::wal_service`], HTTPS in [`crate::http::serve`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::Context as _;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;

use crate::secrets::read_secret_file;

/// The server's TLS configuration, reloadable: each connection takes the current one.
pub struct TlsConfig {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<TlsAcceptor>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("cert_path", &self.cert_path)
            .field("key_path", &self.key_path)
            .finish()
    }
}

impl TlsConfig {
    /// Loads the certificate chain and the private key (PEM). An unreadable or empty file, or
    /// one without a certificate / key, is an error naming it.
    pub fn load(cert_path: &Path, key_path: &Path) -> anyhow::Result<TlsConfig> {
        Ok(TlsConfig {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            current: RwLock::new(acceptor(cert_path, key_path)?),
        })
    }

    /// Loads the files again (SIGHUP): new connections use the new certificate; on error the
    /// old one stays in force.
    pub fn reload(&self) -> anyhow::Result<()> {
        let a = acceptor(&self.cert_path, &self.key_path)?;
        *self.current.write().expect("TLS lock poisoned") = a;
        Ok(())
    }

    /// The acceptor for a new connection.
    pub fn acceptor(&self) -> TlsAcceptor {
        self.current.read().expect("TLS lock poisoned").clone()
    }

    /// The certificate file.
    pub fn cert_path(&self) -> &Path {
        &self.cert_path
    }
}

/// The crypto provider of the daemon's TLS, server and peer client alike: rustls over *ring*
/// (as jsonwebtoken uses; no C build of aws-lc). rustls 0.23.48 deprecates it because *ring*
/// has no post-quantum key exchange, so connections agree on X25519 or a NIST curve (README,
/// Security).
#[expect(
    deprecated,
    reason = "ring has no post-quantum key exchange; kept (README)"
)]
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn acceptor(cert_path: &Path, key_path: &Path) -> anyhow::Result<TlsAcceptor> {
    let pem = read_secret_file("--tls-cert", cert_path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--tls-cert {}: invalid PEM", cert_path.display()))?;
    if certs.is_empty() {
        anyhow::bail!(
            "--tls-cert {}: no certificate in the file",
            cert_path.display()
        );
    }
    let pem = read_secret_file("--tls-key", key_path)?;
    let key = PrivateKeyDer::from_pem_slice(&pem).with_context(|| {
        format!(
            "--tls-key {}: no private key in the file",
            key_path.display()
        )
    })?;
    let config = rustls::ServerConfig::builder_with_provider(crypto_provider())
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .with_context(|| {
            format!(
                "--tls-cert {} and --tls-key {} do not make a usable certificate",
                cert_path.display(),
                key_path.display()
            )
        })?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}
