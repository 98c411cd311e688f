//! The server side of a PostgreSQL replication connection over any
//! `AsyncRead + AsyncWrite + Unpin` stream (a `TcpStream` in practice).
//!
//! [`ServerConn::handshake`] does the startup phase: SSL/GSS negotiation is refused with `N`,
//! the StartupMessage must ask for a physical replication connection (`replication=true`),
//! authentication is trust or a shared secret sent as a cleartext password, and the
//! ParameterStatus values real PostgreSQL 15 clients require are sent. After that the caller
//! reads [`FrontendMessage`]s and answers with result sets, errors, or CopyBothResponse; for the
//! duplex CopyBoth phase [`ServerConn::split`] gives a reader and a writer that two tasks can
//! drive concurrently.
//!
//! Writes are buffered: `write_*` methods only append to the write buffer, `flush` sends it.
//! Command semantics (what IDENTIFY_SYSTEM answers, which WAL to stream) are left to the handler.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicI32, Ordering};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};

use pg_wal::Lsn;

use crate::PqError;
use crate::backend::{
    Authentication, BackendMessage, CopyResponse, FieldDescription, TransactionStatus,
    put_copy_data,
};
use crate::error::{ErrorFields, ProtocolError, sqlstate};
use crate::framing::DEFAULT_MAX_MESSAGE_SIZE;
use crate::frontend::{
    FrontendMessage, GSSENC_REQUEST_CODE, SSL_REQUEST_CODE, StartupPacket, StartupParams,
    decode_startup,
};
use crate::io::{flush_buf, read_frame, read_frontend, shutdown_after_flush};
use crate::replication::{ReplicationMessage, xlog_data_header};

/// The `server_version` we report when [`ServerConfig::version_for`] gives none. Clients parse
/// it with `%d.%d`: major 15, so PostgreSQL 15's pg_receivewal (which refuses newer servers) and
/// walreceiver accept us.
pub const DEFAULT_SERVER_VERSION: &str = "15.18 (mini-safekeeper)";

/// Chooses the `server_version` reported to one client from its startup parameters.
pub type VersionFor = std::sync::Arc<dyn Fn(&StartupParams) -> Option<String> + Send + Sync>;

/// How a server connection authenticates clients and what it reports. `Debug` hides the secret.
#[derive(Clone)]
pub struct ServerConfig {
    /// `None`: trust. `Some(secret)`: ask for a cleartext password and compare it with the
    /// secret in constant time.
    pub password: Option<Vec<u8>>,
    /// Reported as the `server_version` parameter when `version_for` gives none.
    pub server_version: String,
    /// The `server_version` for a client's startup parameters (a safekeeper reports the version
    /// of the timeline the client's options name, so version-aware clients behave as they do
    /// against that timeline's primary); `None` to report `server_version` to everyone.
    pub version_for: Option<VersionFor>,
    /// Limit on one message body from the client.
    pub max_message_size: usize,
    /// Limit on each message before authentication completes (the startup packet, SSL/GSS
    /// requests, the password): an unauthenticated client can make the server buffer no more.
    pub max_startup_message_size: usize,
}

/// Default [`ServerConfig::max_startup_message_size`]: 8 KiB holds any real startup packet and
/// a JWT, and is below PostgreSQL's own 10,000-byte startup packet limit.
pub const DEFAULT_MAX_STARTUP_MESSAGE_SIZE: usize = 8192;

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("server_version", &self.server_version)
            .field("version_for", &self.version_for.as_ref().map(|_| "<fn>"))
            .field("max_message_size", &self.max_message_size)
            .field("max_startup_message_size", &self.max_startup_message_size)
            .finish()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            password: None,
            server_version: DEFAULT_SERVER_VERSION.to_string(),
            version_for: None,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            max_startup_message_size: DEFAULT_MAX_STARTUP_MESSAGE_SIZE,
        }
    }
}

/// A server connection before the CopyBoth phase. Socket options (`TCP_NODELAY`, keepalive)
/// and read timeouts are the caller's: set them on the stream, wrap calls in timeouts.
pub struct ServerConn<S> {
    stream: S,
    read_buf: BytesMut,
    write_buf: BytesMut,
    config: ServerConfig,
}

/// Compares two byte strings in time that depends only on their lengths.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i % b.len().max(1)).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

/// A BackendKeyData for a new connection: a process-local counter and a random secret. We do
/// not implement query cancellation; the key only has to look plausible.
fn new_backend_key() -> (i32, i32) {
    static NEXT: AtomicI32 = AtomicI32::new(1);
    let pid = NEXT.fetch_add(1, Ordering::Relaxed) & i32::MAX;
    let secret = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish() as i32;
    (pid, secret)
}

fn is_true(v: &str) -> bool {
    matches!(v.to_ascii_lowercase().as_str(), "true" | "on" | "yes" | "1")
}

fn is_false(v: &str) -> bool {
    matches!(
        v.to_ascii_lowercase().as_str(),
        "false" | "off" | "no" | "0"
    )
}

impl<S: AsyncRead + AsyncWrite + Unpin> ServerConn<S> {
    /// A connection over `stream`, before its startup handshake.
    pub fn new(stream: S, config: ServerConfig) -> Self {
        ServerConn {
            stream,
            read_buf: BytesMut::with_capacity(8192),
            write_buf: BytesMut::with_capacity(8192),
            config,
        }
    }

    /// On a server that offers TLS, before [`Self::handshake`]: reads the client's first packet.
    /// An SSLRequest is answered `S` and `true` is returned: the caller runs the TLS handshake
    /// over [`Self::into_inner`] and starts a new connection over the TLS stream. A
    /// GSSENCRequest is answered `N` and the next packet read. Anything else (a startup packet)
    /// stays buffered for [`Self::handshake`], and `false` is returned. Bytes sent after an
    /// SSLRequest before our answer are refused (they would bypass the encryption).
    ///
    /// Not cancellation-safe; run it under the handshake's timeout.
    pub async fn accept_ssl_request(&mut self) -> Result<bool, PqError> {
        use tokio::io::AsyncReadExt;
        for _ in 0..3 {
            while self.read_buf.len() < 8 {
                if self.stream.read_buf(&mut self.read_buf).await? == 0 {
                    return Err(PqError::ConnectionClosed);
                }
            }
            let len = u32::from_be_bytes([
                self.read_buf[0],
                self.read_buf[1],
                self.read_buf[2],
                self.read_buf[3],
            ]);
            let code = u32::from_be_bytes([
                self.read_buf[4],
                self.read_buf[5],
                self.read_buf[6],
                self.read_buf[7],
            ]);
            if len != 8 || (code != SSL_REQUEST_CODE && code != GSSENC_REQUEST_CODE) {
                return Ok(false);
            }
            let _ = self.read_buf.split_to(8);
            if !self.read_buf.is_empty() {
                return Err(self
                    .reject(ErrorFields::fatal(
                        sqlstate::PROTOCOL_VIOLATION,
                        "received unencrypted data after an encryption request",
                    ))
                    .await);
            }
            if code == SSL_REQUEST_CODE {
                self.write_buf.extend_from_slice(b"S");
                flush_buf(&mut self.stream, &mut self.write_buf).await?;
                return Ok(true);
            }
            self.write_buf.extend_from_slice(b"N");
            flush_buf(&mut self.stream, &mut self.write_buf).await?;
        }
        Err(self
            .reject(ErrorFields::fatal(
                sqlstate::PROTOCOL_VIOLATION,
                "too many encryption negotiation requests",
            ))
            .await)
    }

    /// The same connection over another stream type (e.g. wrapped in an enum), keeping what is
    /// buffered.
    pub fn map_stream<T>(self, f: impl FnOnce(S) -> T) -> ServerConn<T> {
        ServerConn {
            stream: f(self.stream),
            read_buf: self.read_buf,
            write_buf: self.write_buf,
            config: self.config,
        }
    }

    /// Runs the startup phase and returns the client's startup parameters (`user`,
    /// `application_name`, `options`, ...). On refusal a FATAL ErrorResponse has been sent and
    /// [`PqError::Rejected`] is returned; on a CancelRequest, [`PqError::CancelRequest`]. In every
    /// error case the caller closes the connection.
    ///
    /// Not cancellation-safe (a half-done handshake cannot be resumed); wrap it in a timeout
    /// and drop the connection if it fires.
    pub async fn handshake(&mut self) -> Result<StartupParams, PqError> {
        self.handshake_then(|| Ok(())).await.map(|(p, ())| p)
    }

    /// [`Self::handshake`] with an admission step between authentication and
    /// AuthenticationOk: `admit` runs once the client authenticated, and its `Err(fields)` is
    /// sent as a FATAL ErrorResponse in place of AuthenticationOk (as PostgreSQL refuses a
    /// client over `max_connections`), failing with [`PqError::Rejected`]. Its `Ok(a)` (a
    /// connection slot, say) is returned with the parameters.
    pub async fn handshake_then<A>(
        &mut self,
        admit: impl FnOnce() -> Result<A, ErrorFields>,
    ) -> Result<(StartupParams, A), PqError> {
        let (params, user) = self.startup().await?;
        if let Some(secret) = self.config.password.clone() {
            let p = self.read_password().await?;
            if !constant_time_eq(&p, &secret) {
                return Err(self
                    .reject(ErrorFields::fatal(
                        sqlstate::INVALID_PASSWORD,
                        format!("password authentication failed for user \"{user}\""),
                    ))
                    .await);
            }
        }
        let admitted = match admit() {
            Ok(a) => a,
            Err(e) => return Err(self.reject(e).await),
        };
        self.finish_startup(&params).await?;
        Ok((params, admitted))
    }

    /// Like [`Self::handshake`], but always asks for a cleartext password and lets `check`
    /// decide (a JWT, say): `Ok(t)` authenticates the connection and `t` (what the password
    /// proved, e.g. its claims) is returned with the parameters; `Err(fields)` is sent as a
    /// FATAL ErrorResponse and the handshake fails with [`PqError::Rejected`].
    /// `config.password` is not used. Not cancellation-safe, as [`Self::handshake`].
    pub async fn handshake_with_password<T>(
        &mut self,
        check: impl FnOnce(&StartupParams, &[u8]) -> Result<T, ErrorFields>,
    ) -> Result<(StartupParams, T), PqError> {
        self.handshake_with_password_then(check, || Ok(()))
            .await
            .map(|(p, t, ())| (p, t))
    }

    /// [`Self::handshake_with_password`] with the admission step of [`Self::handshake_then`]
    /// after the password was checked.
    pub async fn handshake_with_password_then<T, A>(
        &mut self,
        check: impl FnOnce(&StartupParams, &[u8]) -> Result<T, ErrorFields>,
        admit: impl FnOnce() -> Result<A, ErrorFields>,
    ) -> Result<(StartupParams, T, A), PqError> {
        let (params, _user) = self.startup().await?;
        let password = self.read_password().await?;
        let proved = match check(&params, &password) {
            Ok(t) => t,
            Err(e) => return Err(self.reject(e).await),
        };
        let admitted = match admit() {
            Ok(a) => a,
            Err(e) => return Err(self.reject(e).await),
        };
        self.finish_startup(&params).await?;
        Ok((params, proved, admitted))
    }

    /// The startup phase up to authentication: encryption requests, the StartupMessage and its
    /// checks. Returns the parameters and the user name.
    async fn startup(&mut self) -> Result<(StartupParams, String), PqError> {
        let mut negotiations = 0;
        let limit = self.config.max_startup_message_size;
        let (minor_version, params) = loop {
            let pkt = match read_frame(&mut self.stream, &mut self.read_buf, 0, |b, _| {
                // The length word is checked against our pre-authentication limit before
                // anything more is buffered.
                if let Some(len) = b.get(..4) {
                    let len = i32::from_be_bytes([len[0], len[1], len[2], len[3]]);
                    if let Ok(len) = usize::try_from(len)
                        && len > limit
                    {
                        return Err(ProtocolError::TooLarge { len, max: limit });
                    }
                }
                decode_startup(b)
            })
            .await
            {
                Ok(Some(p)) => p,
                Ok(None) => return Err(PqError::ConnectionClosed),
                Err(PqError::Protocol(e)) => return Err(self.reject(e.to_error_fields()).await),
                Err(e) => return Err(e),
            };
            match pkt {
                StartupPacket::SslRequest | StartupPacket::GssEncRequest => {
                    negotiations += 1;
                    if negotiations > 2 {
                        return Err(self
                            .reject(ErrorFields::fatal(
                                sqlstate::PROTOCOL_VIOLATION,
                                "too many encryption negotiation requests",
                            ))
                            .await);
                    }
                    // No TLS, no GSS: a single 'N' byte, no length word.
                    self.write_buf.extend_from_slice(b"N");
                    flush_buf(&mut self.stream, &mut self.write_buf).await?;
                }
                StartupPacket::CancelRequest {
                    process_id,
                    secret_key,
                } => {
                    return Err(PqError::CancelRequest {
                        process_id,
                        secret_key,
                    });
                }
                StartupPacket::Startup {
                    minor_version,
                    params,
                } => break (minor_version, params),
            }
        };

        // Protocol options (`_pq_.*`) and minor versions above 3.0 are declined, as PostgreSQL
        // 15 does, with NegotiateProtocolVersion.
        let (pq_opts, params): (Vec<_>, Vec<_>) = params
            .0
            .into_iter()
            .partition(|(k, _)| k.starts_with("_pq_."));
        let params = StartupParams(params);
        if minor_version > 0 || !pq_opts.is_empty() {
            self.write_message(&BackendMessage::NegotiateProtocolVersion {
                newest_minor: 0,
                unrecognized: pq_opts.into_iter().map(|(k, _)| k).collect(),
            });
        }

        let Some(user) = params.user().map(str::to_string) else {
            return Err(self
                .reject(ErrorFields::fatal(
                    sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                    "no PostgreSQL user name specified in startup packet",
                ))
                .await);
        };
        match params.get("replication") {
            Some(v) if is_true(v) => {}
            Some(v) if v.eq_ignore_ascii_case("database") => {
                return Err(self
                    .reject(
                        ErrorFields::fatal(
                            sqlstate::FEATURE_NOT_SUPPORTED,
                            "logical replication connections (replication=database) are not supported",
                        )
                        .with_hint("connect with replication=true for physical replication"),
                    )
                    .await);
            }
            Some(v) if !is_false(v) => {
                return Err(self
                    .reject(ErrorFields::fatal(
                        sqlstate::PROTOCOL_VIOLATION,
                        format!("invalid value for parameter \"replication\": \"{v}\""),
                    ))
                    .await);
            }
            _ => {
                return Err(self
                    .reject(
                        ErrorFields::fatal(
                            sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
                            "this server accepts only physical replication connections",
                        )
                        .with_hint("connect with replication=true"),
                    )
                    .await);
            }
        }

        Ok((params, user))
    }

    /// Asks for a cleartext password and reads it, held to the pre-authentication size limit.
    async fn read_password(&mut self) -> Result<Bytes, PqError> {
        self.write_message(&BackendMessage::Authentication(
            Authentication::CleartextPassword,
        ));
        self.flush().await?;
        let limit = self.config.max_startup_message_size;
        let password = match read_frontend(&mut self.stream, &mut self.read_buf, limit).await {
            Err(PqError::Protocol(e)) => return Err(self.reject(e.to_error_fields()).await),
            other => other?,
        };
        match password {
            Some(FrontendMessage::Password(p)) => Ok(p),
            // libpq closes and reconnects once it has asked the user for a password.
            None => Err(PqError::ConnectionClosed),
            Some(other) => Err(self
                .reject(ErrorFields::fatal(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("expected password response, got {}", msg_name(&other)),
                ))
                .await),
        }
    }

    /// AuthenticationOk, the ParameterStatus values clients need, BackendKeyData and
    /// ReadyForQuery.
    async fn finish_startup(&mut self, params: &StartupParams) -> Result<(), PqError> {
        self.write_message(&BackendMessage::Authentication(Authentication::Ok));
        let version = self
            .config
            .version_for
            .as_ref()
            .and_then(|f| f(params))
            .unwrap_or_else(|| self.config.server_version.clone());
        for (name, value) in [
            ("server_version", version.as_str()),
            ("server_encoding", "UTF8"),
            ("client_encoding", "UTF8"),
            ("DateStyle", "ISO, MDY"),
            ("integer_datetimes", "on"),
            ("standard_conforming_strings", "on"),
            ("application_name", params.application_name().unwrap_or("")),
        ] {
            self.write_message(&BackendMessage::ParameterStatus {
                name: name.to_string(),
                value: value.to_string(),
            });
        }
        let (process_id, secret_key) = new_backend_key();
        self.write_message(&BackendMessage::BackendKeyData {
            process_id,
            secret_key,
        });
        self.write_message(&BackendMessage::ReadyForQuery(TransactionStatus::Idle));
        self.flush().await?;
        Ok(())
    }

    /// Sends a FATAL error (best effort: the client may be gone) and returns the error to give
    /// the caller.
    async fn reject(&mut self, e: ErrorFields) -> PqError {
        self.write_message(&BackendMessage::ErrorResponse(e.clone()));
        let _ = self.flush().await;
        PqError::Rejected(e)
    }

    /// Reads the next message. `Ok(None)`: the client closed the connection between messages.
    ///
    /// Cancellation-safe: bytes read so far stay in the connection's buffer.
    pub async fn read_message(&mut self) -> Result<Option<FrontendMessage>, PqError> {
        let max = self.config.max_message_size;
        read_frontend(&mut self.stream, &mut self.read_buf, max).await
    }

    /// Appends a message to the write buffer (nothing is sent until [`Self::flush`]).
    pub fn write_message(&mut self, msg: &BackendMessage) {
        msg.encode(&mut self.write_buf);
    }

    /// Sends everything buffered. Cancellation-safe: unsent bytes stay buffered.
    pub async fn flush(&mut self) -> Result<(), PqError> {
        flush_buf(&mut self.stream, &mut self.write_buf).await
    }

    /// Buffers a result set: RowDescription, one DataRow per row (text values, `None` = NULL),
    /// CommandComplete `tag` (e.g. `IDENTIFY_SYSTEM`, `SHOW`, `SELECT 1`). No ReadyForQuery.
    pub fn write_result_set<V: AsRef<str>>(
        &mut self,
        fields: &[FieldDescription],
        rows: &[Vec<Option<V>>],
        tag: &str,
    ) {
        self.write_message(&BackendMessage::RowDescription(fields.to_vec()));
        for row in rows {
            self.write_message(&BackendMessage::data_row(row));
        }
        self.write_message(&BackendMessage::CommandComplete(tag.to_string()));
    }

    /// Sends a whole query answer: [`Self::write_result_set`], ReadyForQuery, flush.
    ///
    /// The `send_*` methods buffer, then flush; if cancelled, the rest stays buffered and goes
    /// out with the next flush (cancellation-safe in that sense).
    pub async fn send_result_set<V: AsRef<str>>(
        &mut self,
        fields: &[FieldDescription],
        rows: &[Vec<Option<V>>],
        tag: &str,
    ) -> Result<(), PqError> {
        self.write_result_set(fields, rows, tag);
        self.send_ready_for_query().await
    }

    /// Sends CommandComplete `tag`, ReadyForQuery, and flushes.
    pub async fn send_command_complete(&mut self, tag: &str) -> Result<(), PqError> {
        self.write_message(&BackendMessage::CommandComplete(tag.to_string()));
        self.send_ready_for_query().await
    }

    /// Sends EmptyQueryResponse, ReadyForQuery, and flushes (the answer to an empty query).
    pub async fn send_empty_query_response(&mut self) -> Result<(), PqError> {
        self.write_message(&BackendMessage::EmptyQueryResponse);
        self.send_ready_for_query().await
    }

    /// Sends an ErrorResponse, then ReadyForQuery, and flushes: the command failed, the
    /// connection stays usable.
    pub async fn send_error(&mut self, e: ErrorFields) -> Result<(), PqError> {
        self.write_message(&BackendMessage::ErrorResponse(e));
        self.send_ready_for_query().await
    }

    /// Sends a FATAL ErrorResponse (no ReadyForQuery) and flushes; the caller then closes.
    pub async fn send_fatal(&mut self, e: ErrorFields) -> Result<(), PqError> {
        self.write_message(&BackendMessage::ErrorResponse(e));
        self.flush().await
    }

    async fn send_ready_for_query(&mut self) -> Result<(), PqError> {
        self.write_message(&BackendMessage::ReadyForQuery(TransactionStatus::Idle));
        self.flush().await
    }

    /// Sends CopyBothResponse (format 0, no columns) and flushes: the CopyBoth phase begins.
    /// Usually followed by [`Self::split`].
    pub async fn send_copy_both_response(&mut self) -> Result<(), PqError> {
        self.write_message(&BackendMessage::CopyBothResponse(
            CopyResponse::replication(),
        ));
        self.flush().await
    }

    /// Splits into halves that two tasks drive concurrently. Buffered bytes move with them:
    /// unread input to the reader, unsent output to the writer.
    pub fn split(self) -> (ServerReader<ReadHalf<S>>, ServerWriter<WriteHalf<S>>) {
        let (r, w) = tokio::io::split(self.stream);
        (
            ServerReader {
                stream: r,
                read_buf: self.read_buf,
                config: self.config,
            },
            ServerWriter {
                stream: w,
                write_buf: self.write_buf,
            },
        )
    }

    /// The underlying stream, to adjust it in place (buffered bytes stay).
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.stream
    }

    /// Appends a CopyData whose payload is the concatenation of `parts` (sent by
    /// [`Self::flush`]).
    pub fn write_copy_data(&mut self, parts: &[&[u8]]) {
        put_copy_data(&mut self.write_buf, parts);
    }

    /// Flushes, then shuts down the write direction (the client sees EOF).
    pub async fn shutdown(&mut self) -> Result<(), PqError> {
        shutdown_after_flush(&mut self.stream, &mut self.write_buf).await
    }

    /// The underlying stream (buffered bytes are dropped).
    pub fn into_inner(self) -> S {
        self.stream
    }
}

fn msg_name(m: &FrontendMessage) -> &'static str {
    match m {
        FrontendMessage::Query(_) => "Query",
        FrontendMessage::CopyData(_) => "CopyData",
        FrontendMessage::CopyDone => "CopyDone",
        FrontendMessage::CopyFail(_) => "CopyFail",
        FrontendMessage::Terminate => "Terminate",
        FrontendMessage::Password(_) => "PasswordMessage",
    }
}

/// The reading half of a split server connection.
pub struct ServerReader<R> {
    stream: R,
    read_buf: BytesMut,
    config: ServerConfig,
}

impl<R: AsyncRead + Unpin> ServerReader<R> {
    /// Reads the next message (`CopyData` with `r`/`h` feedback, `CopyDone`, `Terminate`...).
    /// `Ok(None)`: the client closed the connection between messages.
    ///
    /// Cancellation-safe: bytes read so far stay in the reader's buffer.
    pub async fn read_message(&mut self) -> Result<Option<FrontendMessage>, PqError> {
        let max = self.config.max_message_size;
        read_frontend(&mut self.stream, &mut self.read_buf, max).await
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> ServerReader<ReadHalf<S>> {
    /// Joins the halves again (e.g. to answer more queries after the client's CopyDone).
    ///
    /// Panics if `writer` is not this reader's other half.
    pub fn unsplit(self, writer: ServerWriter<WriteHalf<S>>) -> ServerConn<S> {
        ServerConn {
            stream: self.stream.unsplit(writer.stream),
            read_buf: self.read_buf,
            write_buf: writer.write_buf,
            config: self.config,
        }
    }
}

/// The writing half of a split server connection.
pub struct ServerWriter<W> {
    stream: W,
    write_buf: BytesMut,
}

impl<W: AsyncWrite + Unpin> ServerWriter<W> {
    /// Appends a message to the write buffer.
    pub fn write_message(&mut self, msg: &BackendMessage) {
        msg.encode(&mut self.write_buf);
    }

    /// Appends a CopyData whose payload is the concatenation of `parts`.
    pub fn write_copy_data(&mut self, parts: &[&[u8]]) {
        put_copy_data(&mut self.write_buf, parts);
    }

    /// Appends CopyData(XLogData) carrying `data`, which starts at `wal_start`; `wal_end` is the
    /// end of WAL the server can send. Copies `data` once, into the write buffer.
    pub fn write_xlog_data(&mut self, wal_start: Lsn, wal_end: Lsn, send_time: i64, data: &[u8]) {
        let h = xlog_data_header(wal_start, wal_end, send_time);
        self.write_copy_data(&[&h, data]);
    }

    /// Appends CopyData(keepalive).
    pub fn write_keepalive(&mut self, wal_end: Lsn, send_time: i64, reply_requested: bool) {
        let mut b = BytesMut::with_capacity(18);
        ReplicationMessage::Keepalive {
            wal_end,
            send_time,
            reply_requested,
        }
        .encode(&mut b);
        self.write_copy_data(&[&b]);
    }

    /// Appends CopyData with an arbitrary payload (e.g. a neon AcceptorProposerMessage).
    pub fn write_copy_bytes(&mut self, payload: &Bytes) {
        self.write_copy_data(&[payload]);
    }

    /// Bytes buffered and not yet sent; callers flush before this grows large.
    pub fn buffered(&self) -> usize {
        self.write_buf.len()
    }

    /// Sends everything buffered. Cancellation-safe: unsent bytes stay buffered.
    pub async fn flush(&mut self) -> Result<(), PqError> {
        flush_buf(&mut self.stream, &mut self.write_buf).await
    }

    /// Flushes, then shuts down the write direction (the client sees EOF).
    pub async fn shutdown(&mut self) -> Result<(), PqError> {
        shutdown_after_flush(&mut self.stream, &mut self.write_buf).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares_bytes() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secre"));
        assert!(!constant_time_eq(b"secre", b"secret"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(!constant_time_eq(b"x", b""));
        assert!(constant_time_eq(b"", b""));
    }

    #[test]
    fn debug_output_hides_the_secret() {
        let c = ServerConfig {
            password: Some(b"hunter2".to_vec()),
            ..ServerConfig::default()
        };
        let s = format!("{c:?}");
        assert!(!s.contains("hunter2") && !s.contains("[104,"), "{s}");
        assert!(s.contains("redacted"));
    }
}
