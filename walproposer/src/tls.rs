//! TLS to the safekeepers with rustls (the `ring` provider; no OpenSSL), configured like
//! libpq's `sslmode`: `disable`, `require` (encrypted, the certificate is not checked) or
//! `verify-full` (the chain must lead to `--sslrootcert` and the certificate must name the host).
//!
//! Not here: the SSLRequest exchange and the handshake on a connection ([`crate::conn`]).

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use tokio_rustls::TlsConnector;

/// How the walproposer encrypts its connections to safekeepers (libpq's `sslmode` names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SslMode {
    /// Plain TCP.
    Disable,
    /// TLS required; the server's certificate is not verified.
    Require,
    /// TLS required; the certificate must chain to `--sslrootcert` and name the host.
    VerifyFull,
}

/// A TLS client configuration, shared by every connection.
#[derive(Clone)]
pub struct ClientTls {
    /// The mode it was built for (never `Disable`).
    pub mode: SslMode,
    connector: TlsConnector,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls")
            .field("mode", &self.mode)
            .finish()
    }
}

impl ClientTls {
    /// The configuration of `mode`: `None` for `disable`; `verify-full` needs `root_cert` (PEM,
    /// one or more CA certificates), and an unreadable or empty file is an error naming it.
    pub fn new(mode: SslMode, root_cert: Option<&Path>) -> anyhow::Result<Option<ClientTls>> {
        // rustls 0.23.48 deprecates *ring*'s provider (no post-quantum key exchange); kept, as
        // the daemon keeps it (no C build of aws-lc; README, Security).
        #[expect(
            deprecated,
            reason = "ring has no post-quantum key exchange; kept (README)"
        )]
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?;
        let config = match mode {
            SslMode::Disable => return Ok(None),
            SslMode::Require => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
                .with_no_client_auth(),
            SslMode::VerifyFull => {
                let path = root_cert.context("--sslmode verify-full needs --sslrootcert")?;
                let pem = std::fs::read(path).with_context(|| {
                    format!("--sslrootcert {}: cannot read the file", path.display())
                })?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(&pem) {
                    let cert = cert.with_context(|| {
                        format!("--sslrootcert {}: invalid PEM", path.display())
                    })?;
                    roots.add(cert).with_context(|| {
                        format!(
                            "--sslrootcert {}: not a usable CA certificate",
                            path.display()
                        )
                    })?;
                }
                if roots.is_empty() {
                    anyhow::bail!(
                        "--sslrootcert {}: no certificate in the file",
                        path.display()
                    );
                }
                builder.with_root_certificates(roots).with_no_client_auth()
            }
        };
        Ok(Some(ClientTls {
            mode,
            connector: TlsConnector::from(Arc::new(config)),
        }))
    }

    /// The connector for a new connection.
    pub fn connector(&self) -> &TlsConnector {
        &self.connector
    }

    /// The name the certificate must carry: `host` as a DNS name or an IP address.
    pub fn server_name(host: &str) -> Result<ServerName<'static>, String> {
        ServerName::try_from(host.to_string())
            .map_err(|e| format!("{host:?} is not a valid TLS server name: {e}"))
    }
}

/// `sslmode=require`: encryption without checking who is at the other end (libpq's meaning).
/// Handshake signatures are still checked, so the session key is the server's.
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
