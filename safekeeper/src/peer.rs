//! How this safekeeper talks to its peers: the HTTP(S) requests of a pull and of peer
//! recovery's status polls, and the PostgreSQL connections of recovery's WAL stream.
//!
//! A peer address is `host:port` (plain HTTP) or `https://host:port`; the PostgreSQL port of a
//! peer reached over HTTPS is reached over TLS too (a safekeeper with `--tls-cert` serves both
//! ports encrypted). Certificates are checked against `--peer-ca` (and must name the host). With
//! `--peer-auth-token-path`, every request carries the token (`Authorization: Bearer`, and as the
//! PostgreSQL password): a JWT of scope `safekeeperdata` for peers with
//! `--auth-public-key-path`.
//!
//! Not here: what is asked ([`crate::pull`], [`crate::recovery`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use pq_proto::PqError;
use pq_proto::client::{ClientConfig, ClientConn, request_ssl};
use pq_proto::stream::MaybeTls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use sk_core::types::TenantTimelineId;

use crate::secrets::read_secret_file;

/// How long a peer may stay silent.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connecting to a peer may take (a peer that is down must not hold a recovery check
/// for the system's connect timeout, minutes).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// A PostgreSQL connection to a peer: plain TCP or TLS over it.
pub type PeerStream =
    MaybeTls<tokio::net::TcpStream, Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>;

/// The credentials and trust anchors of requests to peers (`--peer-auth-token-path`,
/// `--peer-ca`). `Debug` hides the token.
#[derive(Clone, Default)]
pub struct PeerClient {
    token: Option<String>,
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for PeerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClient")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

/// A peer address split into its parts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerAddr {
    /// Host name or address (what a certificate must name).
    pub host: String,
    /// The `host:port` to connect to.
    pub authority: String,
    /// Whether the peer is reached over TLS.
    pub tls: bool,
}

impl PeerAddr {
    /// Parses `host:port`, `http://host:port` or `https://host:port`.
    pub fn parse(addr: &str) -> Result<PeerAddr, String> {
        let (tls, rest) = if let Some(r) = addr.strip_prefix("https://") {
            (true, r)
        } else {
            (false, addr.strip_prefix("http://").unwrap_or(addr))
        };
        let authority = rest.trim_end_matches('/').to_string();
        let host = match authority.rsplit_once(':') {
            Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok() => {
                h.trim_start_matches('[').trim_end_matches(']').to_string()
            }
            _ => return Err(format!("invalid peer address {addr:?}: expected host:port")),
        };
        Ok(PeerAddr {
            host,
            authority,
            tls,
        })
    }
}

impl PeerClient {
    /// The client of `--peer-auth-token-path` and `--peer-ca`; an unreadable or empty file is an
    /// error naming the flag.
    pub fn from_files(
        peer_auth_token_path: Option<&Path>,
        peer_ca: Option<&Path>,
    ) -> anyhow::Result<PeerClient> {
        let token = match peer_auth_token_path {
            Some(p) => {
                let t = read_secret_file("--peer-auth-token-path", p)?;
                Some(
                    String::from_utf8(t)
                        .context("--peer-auth-token-path: the token is not UTF-8")?
                        .trim()
                        .to_string(),
                )
            }
            None => None,
        };
        let tls = match peer_ca {
            Some(p) => Some(Arc::new(client_tls(p)?)),
            None => None,
        };
        Ok(PeerClient { token, tls })
    }

    fn tls_for(&self, addr: &PeerAddr) -> Result<Option<&Arc<rustls::ClientConfig>>, String> {
        if !addr.tls {
            return Ok(None);
        }
        self.tls.as_ref().map(Some).ok_or_else(|| {
            format!(
                "{}: an https peer needs --peer-ca (the CA its certificate is checked against)",
                addr.authority
            )
        })
    }

    /// `GET path` on peer `addr` (HTTP/1.0: the body ends with the connection). Blocking.
    /// Returns the body reader after a 200, the status and body otherwise.
    pub fn get(&self, addr: &str, path: &str) -> Result<Box<dyn Read + Send>, String> {
        let a = PeerAddr::parse(addr)?;
        let host = &a.authority;
        let tcp = connect(host).map_err(|e| format!("{host}: {e}"))?;
        tcp.set_read_timeout(Some(PEER_TIMEOUT))
            .and_then(|()| tcp.set_write_timeout(Some(PEER_TIMEOUT)))
            .map_err(|e| format!("{host}: {e}"))?;
        let mut stream: Box<dyn ReadWrite> = match self.tls_for(&a)? {
            None => Box::new(tcp),
            Some(cfg) => {
                let name = server_name(&a.host)?;
                let conn = rustls::ClientConnection::new(cfg.clone(), name)
                    .map_err(|e| format!("{host}: TLS: {e}"))?;
                Box::new(rustls::StreamOwned::new(conn, tcp))
            }
        };
        let auth = match &self.token {
            Some(t) => format!("Authorization: Bearer {t}\r\n"),
            None => String::new(),
        };
        write!(stream, "GET {path} HTTP/1.0\r\nHost: {host}\r\n{auth}\r\n")
            .and_then(|()| stream.flush())
            .map_err(|e| format!("{host}: {e}"))?;
        let mut r = BufReader::with_capacity(1 << 20, EofTolerant(stream));
        let code = read_head(&mut r).map_err(|e| format!("{host}: GET {path}: {e}"))?;
        if code != "200" {
            let mut body = String::new();
            let _ = r.take(4096).read_to_string(&mut body);
            return Err(format!("{host}: GET {path}: HTTP {code}: {}", body.trim()));
        }
        Ok(Box::new(r))
    }

    /// A replication connection to the PostgreSQL port `host:port` of a peer (TLS if `tls`),
    /// naming timeline `ttid`, with the peer token as the password. Within the connect timeout.
    pub async fn connect_pg(
        &self,
        host: &str,
        port: u16,
        tls: bool,
        ttid: TenantTimelineId,
        application_name: &str,
    ) -> Result<ClientConn<PeerStream>, PqError> {
        let mut config = ClientConfig::new(host, port, "safekeeper");
        config.application_name = Some(application_name.to_string());
        config.options = Some(format!(
            "-c tenant_id={} timeline_id={}",
            ttid.tenant_id, ttid.timeline_id
        ));
        config.password = self.token.clone();
        let other = |m: String| PqError::Io(std::io::Error::other(m));
        let addr = PeerAddr {
            host: host.to_string(),
            authority: format!("{host}:{port}"),
            tls,
        };
        let tls = self.tls_for(&addr).map_err(other)?.cloned();
        let fut = async {
            let mut tcp = tokio::net::TcpStream::connect((host, port)).await?;
            tcp.set_nodelay(true)?;
            let stream = match tls {
                None => MaybeTls::Plain(tcp),
                Some(cfg) => {
                    if !request_ssl(&mut tcp).await? {
                        return Err(other(format!("{host}:{port} does not accept TLS")));
                    }
                    let name = server_name(host).map_err(other)?;
                    let connector = tokio_rustls::TlsConnector::from(cfg);
                    MaybeTls::Tls(Box::new(connector.connect(name, tcp).await?))
                }
            };
            ClientConn::connect_stream(stream, &config).await
        };
        tokio::time::timeout(config.connect_timeout, fut)
            .await
            .map_err(|_| other(format!("connecting to {host}:{port} timed out")))?
    }
}

/// Connects to `host:port` (each address it resolves to, in turn) within [`CONNECT_TIMEOUT`].
fn connect(authority: &str) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = None;
    for addr in authority.to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other("the name resolves to no address")))
}

/// A TLS client configuration trusting the CA certificates in `path` (PEM).
fn client_tls(path: &Path) -> anyhow::Result<rustls::ClientConfig> {
    let pem = read_secret_file("--peer-ca", path)?;
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.with_context(|| format!("--peer-ca {}: invalid PEM", path.display()))?;
        roots.add(cert).with_context(|| {
            format!("--peer-ca {}: not a usable CA certificate", path.display())
        })?;
    }
    if roots.is_empty() {
        anyhow::bail!("--peer-ca {}: no certificate in the file", path.display());
    }
    Ok(
        rustls::ClientConfig::builder_with_provider(crate::tls::crypto_provider())
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

fn server_name(host: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} is not a valid TLS server name: {e}"))
}

trait ReadWrite: Read + Write + Send {}
impl<T: Read + Write + Send> ReadWrite for T {}

/// The most bytes of a peer's HTTP response head (status line and headers) read.
pub const MAX_HTTP_HEAD: u64 = 64 << 10;

/// Reads an HTTP response's status line and headers, at most [`MAX_HTTP_HEAD`] bytes in all;
/// returns the status code (empty if the response had none).
fn read_head(r: &mut impl BufRead) -> Result<String, String> {
    let mut left = MAX_HTTP_HEAD;
    let mut code = None;
    loop {
        let mut line = String::new();
        let n = r
            .by_ref()
            .take(left)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        left -= n as u64;
        if left == 0 && !line.ends_with('\n') {
            return Err(format!(
                "the response's status line and headers exceed {MAX_HTTP_HEAD} bytes"
            ));
        }
        if code.is_none() {
            code = Some(line.split(' ').nth(1).unwrap_or("").to_string());
            if n == 0 {
                break;
            }
            continue;
        }
        if n == 0 || line == "\r\n" || line == "\n" {
            break;
        }
    }
    Ok(code.unwrap_or_default())
}

/// A peer that closes its TLS connection without `close_notify` ends the body like a plain
/// connection's close: what a truncation would cut is caught by the callers (JSON that does not
/// parse, a snapshot without its END frame).
struct EofTolerant(Box<dyn ReadWrite>);

impl Read for EofTolerant {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.0.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(0),
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_head_is_read_up_to_its_cap() {
        let mut r = std::io::Cursor::new(b"HTTP/1.0 200 OK\r\nA: b\r\n\r\nbody".to_vec());
        assert_eq!(read_head(&mut r).as_deref(), Ok("200"));
        let mut body = String::new();
        r.read_to_string(&mut body).unwrap();
        assert_eq!(body, "body");
        // Endless headers, or one endless line: refused at the cap, not read into memory.
        let mut many = b"HTTP/1.0 200 OK\r\n".to_vec();
        while many.len() < 2 * MAX_HTTP_HEAD as usize {
            many.extend_from_slice(b"X-Pad: 0123456789\r\n");
        }
        let err = read_head(&mut std::io::Cursor::new(many)).unwrap_err();
        assert!(err.contains("exceed"), "{err}");
        let long = vec![b'a'; 2 * MAX_HTTP_HEAD as usize];
        assert!(read_head(&mut std::io::Cursor::new(long)).is_err());
        // A response cut short ends the head.
        let mut r = std::io::Cursor::new(b"HTTP/1.0 404 Not Found\r\nA: b".to_vec());
        assert_eq!(read_head(&mut r).as_deref(), Ok("404"));
    }

    #[test]
    fn peer_addresses_parse_with_and_without_a_scheme() {
        let a = PeerAddr::parse("127.0.0.1:7676").unwrap();
        assert_eq!((a.host.as_str(), a.tls), ("127.0.0.1", false));
        let a = PeerAddr::parse("http://sk1:7676/").unwrap();
        assert_eq!((a.authority.as_str(), a.tls), ("sk1:7676", false));
        let a = PeerAddr::parse("https://localhost:7676").unwrap();
        assert_eq!((a.host.as_str(), a.tls), ("localhost", true));
        let a = PeerAddr::parse("https://[::1]:7676").unwrap();
        assert_eq!(a.host, "::1");
        for bad in ["localhost", ":7676", "https://x:port", ""] {
            assert!(PeerAddr::parse(bad).is_err(), "{bad}");
        }
    }
}
