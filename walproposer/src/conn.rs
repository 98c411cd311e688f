//! One proposer→safekeeper connection: a PostgreSQL replication connection in which
//! `START_WAL_PUSH (proto_version '3')` opens a duplex stream of protocol-v3 messages.
//!
//! Used by the walproposer, by tests and by benchmarks; it does no consensus of its own.

use bytes::BytesMut;
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;

use pq_proto::PqError;
use pq_proto::client::{
    ClientConfig, ClientConn, CopyBothReader, CopyBothWriter, CopyEvent, request_ssl,
};
use pq_proto::stream::MaybeTls;
use tokio_rustls::client::TlsStream;

use crate::tls::ClientTls;
use sk_core::protocol::{
    AcceptorProposerMessage, DecodeError, EncodeError, ProposerAcceptorMessage,
};
use sk_core::types::TenantTimelineId;

/// Errors of a proposer connection.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The connection failed or the safekeeper sent an error.
    #[error(transparent)]
    Pq(Box<PqError>),
    /// The safekeeper sent a message that does not decode.
    #[error("invalid message from the safekeeper: {0}")]
    Decode(#[from] DecodeError),
    /// We built a message that cannot be encoded (a bug of ours).
    #[error("cannot encode message: {0}")]
    Encode(#[from] EncodeError),
    /// The safekeeper ended the stream.
    #[error("the safekeeper ended the stream")]
    Closed,
    /// A valid reply that makes no sense at this point.
    #[error("unexpected reply: {0}")]
    Unexpected(String),
    /// Fetching WAL from a safekeeper failed.
    #[error("fetching WAL: {0}")]
    Fetch(String),
}

impl From<PqError> for ConnError {
    fn from(e: PqError) -> Self {
        ConnError::Pq(Box::new(e))
    }
}

/// Where and how to connect.
#[derive(Clone, Debug)]
pub struct SafekeeperAddr {
    /// Host name or address.
    pub host: String,
    /// PostgreSQL-protocol port.
    pub port: u16,
    /// The password: a JWT, or the shared secret of `--pg-auth-token-file`, if the
    /// safekeeper requires one.
    pub password: Option<String>,
    /// TLS (`--sslmode require|verify-full`); `None`: plain TCP.
    pub tls: Option<ClientTls>,
}

impl SafekeeperAddr {
    /// Parses `host:port`.
    pub fn parse(s: &str) -> Result<SafekeeperAddr, String> {
        let (host, port) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("invalid safekeeper address {s:?}: expected host:port"))?;
        let port = port
            .parse()
            .map_err(|_| format!("invalid port in safekeeper address {s:?}"))?;
        Ok(SafekeeperAddr {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
            password: None,
            tls: None,
        })
    }
}

impl SafekeeperAddr {
    /// A replication connection to this safekeeper naming timeline `ttid` in its options.
    pub fn client_config(&self, ttid: TenantTimelineId, application_name: &str) -> ClientConfig {
        let mut config = ClientConfig::new(self.host.clone(), self.port, "walproposer");
        config.application_name = Some(application_name.to_string());
        config.options = Some(format!(
            "-c tenant_id={} timeline_id={}",
            ttid.tenant_id, ttid.timeline_id
        ));
        config.password = self.password.clone();
        config
    }
}

/// A connection to a safekeeper: plain TCP or TLS over it.
pub type SkStream = MaybeTls<TcpStream, Box<TlsStream<TcpStream>>>;

impl SafekeeperAddr {
    /// Connects (TCP, then TLS if configured: SSLRequest, handshake) and runs the startup
    /// phase as `client_config(ttid, application_name)`, all within its connect timeout.
    pub async fn connect(
        &self,
        ttid: TenantTimelineId,
        application_name: &str,
    ) -> Result<ClientConn<SkStream>, PqError> {
        let config = self.client_config(ttid, application_name);
        let fut = async {
            let mut tcp = TcpStream::connect((self.host.as_str(), self.port)).await?;
            tcp.set_nodelay(true)?;
            let stream = match &self.tls {
                None => MaybeTls::Plain(tcp),
                Some(tls) => {
                    if !request_ssl(&mut tcp).await? {
                        return Err(PqError::Io(std::io::Error::other(format!(
                            "{self} does not accept TLS (--sslmode {:?})",
                            tls.mode
                        ))));
                    }
                    let name = ClientTls::server_name(&self.host)
                        .map_err(|e| PqError::Io(std::io::Error::other(e)))?;
                    MaybeTls::Tls(Box::new(tls.connector().connect(name, tcp).await?))
                }
            };
            ClientConn::connect_stream(stream, &config).await
        };
        tokio::time::timeout(config.connect_timeout, fut)
            .await
            .map_err(|_| {
                PqError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connecting to {self} timed out"),
                ))
            })?
    }
}

impl std::fmt::Display for SafekeeperAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// The sending half of a WAL push stream.
pub struct PushWriter {
    inner: CopyBothWriter<WriteHalf<SkStream>>,
    buf: BytesMut,
}

/// The receiving half of a WAL push stream.
pub struct PushReader {
    inner: CopyBothReader<ReadHalf<SkStream>>,
}

/// Connects and opens `START_WAL_PUSH` for `ttid`.
pub async fn connect_push(
    addr: &SafekeeperAddr,
    ttid: TenantTimelineId,
    allow_timeline_creation: bool,
    application_name: &str,
) -> Result<(PushReader, PushWriter), ConnError> {
    let conn = addr.connect(ttid, application_name).await?;
    let (r, w) = conn
        .start_copy_both(&format!(
            "START_WAL_PUSH (proto_version '3', allow_timeline_creation '{allow_timeline_creation}')"
        ))
        .await?;
    Ok((
        PushReader { inner: r },
        PushWriter {
            inner: w,
            buf: BytesMut::with_capacity(64 * 1024),
        },
    ))
}

impl PushWriter {
    /// Queues a message (call [`PushWriter::flush`] to send what is queued).
    pub fn queue(&mut self, msg: &ProposerAcceptorMessage) -> Result<(), ConnError> {
        self.buf.clear();
        msg.encode(&mut self.buf)?;
        self.inner.write_copy_data(&self.buf);
        Ok(())
    }

    /// Bytes queued and not yet sent.
    pub fn buffered(&self) -> usize {
        self.inner.buffered()
    }

    /// Sends what is queued. Cancellation-safe (a later call continues where this one stopped).
    pub async fn flush(&mut self) -> Result<(), ConnError> {
        Ok(self.inner.flush().await?)
    }

    /// Queues and sends one message.
    pub async fn send(&mut self, msg: &ProposerAcceptorMessage) -> Result<(), ConnError> {
        self.queue(msg)?;
        self.flush().await
    }

    /// Ends the stream cleanly (CopyDone).
    pub async fn finish(&mut self) -> Result<(), ConnError> {
        Ok(self.inner.send_copy_done().await?)
    }
}

impl PushReader {
    /// The next reply. Cancellation-safe.
    pub async fn recv(&mut self) -> Result<AcceptorProposerMessage, ConnError> {
        match self.inner.read().await? {
            CopyEvent::Data(frame) => Ok(AcceptorProposerMessage::decode(&frame)?),
            CopyEvent::Done => Err(ConnError::Closed),
        }
    }
}
