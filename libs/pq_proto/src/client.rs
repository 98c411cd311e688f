//! A minimal async client for PostgreSQL replication connections: startup (trust or cleartext
//! password), simple queries returning text rows, and the CopyBoth phase split into a reader
//! and a writer.
//!
//! Used by our walproposer (to talk to safekeepers), by the relay from a real PostgreSQL primary
//! (IDENTIFY_SYSTEM, START_REPLICATION, `w`/`k` in, `r` out) and by tests. No TLS, no MD5/SCRAM,
//! no extended query protocol. What to stream, and when to send feedback, is the caller's.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

use crate::backend::{Authentication, BackendMessage, FieldDescription, put_copy_data};
use crate::framing::DEFAULT_MAX_MESSAGE_SIZE;
use crate::frontend::{FrontendMessage, StartupPacket, StartupParams};
use crate::io::{flush_buf, read_backend, shutdown_after_flush};
use crate::replication::StandbyMessage;
use crate::{ErrorFields, PqError};

/// Where and how to connect. `Debug` hides the password.
#[derive(Clone)]
pub struct ClientConfig {
    /// Server host name or address.
    pub host: String,
    /// Server port.
    pub port: u16,
    /// The `user` startup parameter.
    pub user: String,
    /// The `application_name` startup parameter, if any.
    pub application_name: Option<String>,
    /// The startup `options` parameter, e.g. `-c tenant_id=X timeline_id=Y`.
    pub options: Option<String>,
    /// Sent as `replication=true` (a physical replication connection) when set; most of our
    /// uses need it.
    pub replication: bool,
    /// The `database` of a plain (not replication) connection; the server's default (the user
    /// name) when `None`. Ignored with `replication`.
    pub database: Option<String>,
    /// Sent in answer to AuthenticationCleartextPassword.
    pub password: Option<String>,
    /// Limit on one message body from the server.
    pub max_message_size: usize,
    /// Limit on TCP connect plus startup.
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("application_name", &self.application_name)
            .field("options", &self.options)
            .field("replication", &self.replication)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("max_message_size", &self.max_message_size)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

impl ClientConfig {
    /// A replication connection as `user` with no password, options or application name.
    pub fn new(host: impl Into<String>, port: u16, user: impl Into<String>) -> Self {
        ClientConfig {
            host: host.into(),
            port,
            user: user.into(),
            application_name: None,
            options: None,
            replication: true,
            database: None,
            password: None,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            connect_timeout: Duration::from_secs(10),
        }
    }

    fn startup_params(&self) -> StartupParams {
        let mut p = vec![("user".to_string(), self.user.clone())];
        if self.replication {
            // As libpq does for replication=true (the database is ignored by the server).
            p.push(("database".to_string(), "replication".to_string()));
            p.push(("replication".to_string(), "true".to_string()));
        } else if let Some(db) = &self.database {
            p.push(("database".to_string(), db.clone()));
        }
        if let Some(a) = &self.application_name {
            p.push(("application_name".to_string(), a.clone()));
        }
        if let Some(o) = &self.options {
            p.push(("options".to_string(), o.clone()));
        }
        StartupParams(p)
    }
}

/// Sends an SSLRequest on a fresh connection and reads the one-byte answer: `true` if the
/// server agreed (`S`: start the TLS handshake now), `false` if it declined (`N`). An
/// ErrorResponse instead (a server that refuses the connection outright) is returned as
/// [`PqError::Server`].
pub async fn request_ssl<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
) -> Result<bool, PqError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = BytesMut::new();
    StartupPacket::SslRequest.encode(&mut buf);
    stream.write_all(&buf).await?;
    stream.flush().await?;
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer).await?;
    match answer[0] {
        b'S' => Ok(true),
        b'N' => Ok(false),
        b'E' => {
            let mut rest = BytesMut::from(&b"E"[..]);
            let msg = read_backend(stream, &mut rest, DEFAULT_MAX_MESSAGE_SIZE).await?;
            match msg {
                BackendMessage::ErrorResponse(e) => Err(PqError::Server(e)),
                other => Err(PqError::Unexpected {
                    expected: "an answer to SSLRequest",
                    got: format!("{other:?}"),
                }),
            }
        }
        other => Err(PqError::Unexpected {
            expected: "an answer to SSLRequest",
            got: format!("byte {other:#04x}"),
        }),
    }
}

/// The full answer to a simple query (the last result set if there were several statements).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueryResult {
    /// The result set's columns.
    pub columns: Vec<FieldDescription>,
    /// Text values; `None` = SQL NULL.
    pub rows: Vec<Vec<Option<String>>>,
    /// The CommandComplete tag, if any.
    pub tag: Option<String>,
}

/// What the server said about the session at startup.
#[derive(Debug, Default)]
struct Session {
    /// ParameterStatus values, in order.
    parameters: Vec<(String, String)>,
    /// BackendKeyData (process id, secret key).
    backend_key: Option<(i32, i32)>,
}

/// A connected client in query mode.
pub struct ClientConn<S> {
    stream: S,
    read_buf: BytesMut,
    write_buf: BytesMut,
    max_message_size: usize,
    session: Session,
}

impl ClientConn<TcpStream> {
    /// Connects over TCP (with `TCP_NODELAY`) and runs the startup phase, all within
    /// `config.connect_timeout`. Not cancellation-safe (dropping it drops the connection).
    pub async fn connect(config: &ClientConfig) -> Result<Self, PqError> {
        let fut = async {
            let stream = TcpStream::connect((config.host.as_str(), config.port)).await?;
            stream.set_nodelay(true)?;
            Self::connect_stream(stream, config).await
        };
        tokio::time::timeout(config.connect_timeout, fut)
            .await
            .map_err(|_| {
                PqError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connecting to {}:{} timed out", config.host, config.port),
                ))
            })?
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> ClientConn<S> {
    /// Runs the startup phase over an already connected stream. Not cancellation-safe.
    pub async fn connect_stream(stream: S, config: &ClientConfig) -> Result<Self, PqError> {
        let mut c = ClientConn {
            stream,
            read_buf: BytesMut::with_capacity(8192),
            write_buf: BytesMut::with_capacity(1024),
            max_message_size: config.max_message_size,
            session: Session::default(),
        };
        StartupPacket::Startup {
            minor_version: 0,
            params: config.startup_params(),
        }
        .encode(&mut c.write_buf);
        c.flush().await?;
        loop {
            match c.read_message().await? {
                BackendMessage::Authentication(Authentication::Ok) => {}
                BackendMessage::Authentication(Authentication::CleartextPassword) => {
                    let Some(pw) = &config.password else {
                        return Err(PqError::UnsupportedAuth(
                            "server asks for a password and none is configured".into(),
                        ));
                    };
                    FrontendMessage::Password(Bytes::copy_from_slice(pw.as_bytes()))
                        .encode(&mut c.write_buf);
                    c.flush().await?;
                }
                BackendMessage::Authentication(a) => {
                    return Err(PqError::UnsupportedAuth(format!("{a:?}")));
                }
                BackendMessage::ParameterStatus { name, value } => {
                    c.session.parameters.push((name, value))
                }
                BackendMessage::BackendKeyData {
                    process_id,
                    secret_key,
                } => c.session.backend_key = Some((process_id, secret_key)),
                BackendMessage::NegotiateProtocolVersion { .. }
                | BackendMessage::NoticeResponse(_) => {}
                BackendMessage::ErrorResponse(e) => return Err(PqError::Server(e)),
                BackendMessage::ReadyForQuery(_) => return Ok(c),
                other => {
                    return Err(PqError::Unexpected {
                        expected: "startup response",
                        got: format!("{other:?}"),
                    });
                }
            }
        }
    }

    /// A ParameterStatus value the server sent (e.g. `server_version`).
    pub fn parameter(&self, name: &str) -> Option<&str> {
        self.session
            .parameters
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The server's BackendKeyData (process id, secret key), if it sent one.
    pub fn backend_key(&self) -> Option<(i32, i32)> {
        self.session.backend_key
    }

    /// Reads the next message; EOF is an error here. Cancellation-safe.
    async fn read_message(&mut self) -> Result<BackendMessage, PqError> {
        read_backend(&mut self.stream, &mut self.read_buf, self.max_message_size).await
    }

    async fn flush(&mut self) -> Result<(), PqError> {
        flush_buf(&mut self.stream, &mut self.write_buf).await
    }

    /// Runs a simple query and returns its rows as text (`None` = NULL). A server error is
    /// [`PqError::Server`] with its SQLSTATE and message; the connection stays usable.
    /// Not cancellation-safe (a cancelled query leaves its answer unread).
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>, PqError> {
        Ok(self.simple_query_full(sql).await?.rows)
    }

    /// Like [`Self::simple_query`], with column descriptions and the command tag.
    pub async fn simple_query_full(&mut self, sql: &str) -> Result<QueryResult, PqError> {
        FrontendMessage::Query(sql.to_string()).encode(&mut self.write_buf);
        self.flush().await?;
        let mut result = QueryResult::default();
        let mut error: Option<ErrorFields> = None;
        loop {
            match self.read_message().await? {
                BackendMessage::RowDescription(cols) => {
                    result.columns = cols;
                    result.rows.clear();
                }
                BackendMessage::DataRow(values) => {
                    let row = values
                        .into_iter()
                        .map(|v| v.map(|b| String::from_utf8_lossy(&b).into_owned()))
                        .collect();
                    result.rows.push(row);
                }
                BackendMessage::CommandComplete(tag) => result.tag = Some(tag),
                BackendMessage::EmptyQueryResponse
                | BackendMessage::NoticeResponse(_)
                | BackendMessage::ParameterStatus { .. } => {}
                BackendMessage::ErrorResponse(e) => error = Some(e),
                BackendMessage::ReadyForQuery(_) => {
                    return match error {
                        Some(e) => Err(PqError::Server(e)),
                        None => Ok(result),
                    };
                }
                other => {
                    return Err(PqError::Unexpected {
                        expected: "query response",
                        got: format!("{other:?}"),
                    });
                }
            }
        }
    }

    /// Sends `query` (START_REPLICATION, START_WAL_PUSH...) and, once the server answers
    /// CopyBothResponse, splits the connection for the duplex phase. A server error (e.g. "ahead
    /// of the WAL flush position") is [`PqError::Server`], either from here (our server refuses
    /// before CopyBothResponse) or from the first [`CopyBothReader::read`]: a real PostgreSQL 15
    /// walsender sends CopyBothResponse first and then the ErrorResponse.
    pub async fn start_copy_both(
        mut self,
        query: &str,
    ) -> Result<(CopyBothReader<ReadHalf<S>>, CopyBothWriter<WriteHalf<S>>), PqError> {
        FrontendMessage::Query(query.to_string()).encode(&mut self.write_buf);
        self.flush().await?;
        loop {
            match self.read_message().await? {
                BackendMessage::CopyBothResponse(_) => break,
                BackendMessage::NoticeResponse(_) | BackendMessage::ParameterStatus { .. } => {}
                BackendMessage::ErrorResponse(e) => {
                    // The server follows an ERROR with ReadyForQuery; a FATAL with EOF.
                    return Err(PqError::Server(e));
                }
                other => {
                    return Err(PqError::Unexpected {
                        expected: "CopyBothResponse",
                        got: format!("{other:?}"),
                    });
                }
            }
        }
        let (r, w) = tokio::io::split(self.stream);
        Ok((
            CopyBothReader {
                stream: r,
                read_buf: self.read_buf,
                max_message_size: self.max_message_size,
                done: false,
                session: self.session,
            },
            CopyBothWriter {
                stream: w,
                write_buf: self.write_buf,
            },
        ))
    }

    /// Sends Terminate and closes the write side. Best effort.
    pub async fn close(mut self) -> Result<(), PqError> {
        FrontendMessage::Terminate.encode(&mut self.write_buf);
        shutdown_after_flush(&mut self.stream, &mut self.write_buf).await
    }
}

/// What the server sent during CopyBoth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyEvent {
    /// A CopyData payload (`w`/`k` from a walsender, or a neon acceptor message).
    Data(Bytes),
    /// The server ended its side of the copy (CopyDone). Messages after it (CommandComplete,
    /// a next-timeline result set, ReadyForQuery) are reported by
    /// [`CopyBothReader::read_message`].
    Done,
}

/// The reading half of a client in the CopyBoth phase.
pub struct CopyBothReader<R> {
    stream: R,
    read_buf: BytesMut,
    max_message_size: usize,
    done: bool,
    /// Kept for [`CopyBothReader::unsplit`].
    session: Session,
}

impl<R: AsyncRead + Unpin> CopyBothReader<R> {
    /// The next CopyData payload or the server's CopyDone. An ErrorResponse is
    /// [`PqError::Server`] (neon ends streams with an "error" of SQLSTATE 00000); EOF is
    /// [`PqError::ConnectionClosed`].
    ///
    /// Cancellation-safe: bytes read so far stay in the reader's buffer.
    pub async fn read(&mut self) -> Result<CopyEvent, PqError> {
        loop {
            match self.read_message().await? {
                BackendMessage::CopyData(d) => return Ok(CopyEvent::Data(d)),
                BackendMessage::CopyDone => {
                    self.done = true;
                    return Ok(CopyEvent::Done);
                }
                BackendMessage::NoticeResponse(_) | BackendMessage::ParameterStatus { .. } => {}
                BackendMessage::ErrorResponse(e) => return Err(PqError::Server(e)),
                other => {
                    return Err(PqError::Unexpected {
                        expected: "CopyData or CopyDone",
                        got: format!("{other:?}"),
                    });
                }
            }
        }
    }

    /// The next backend message of any kind; EOF is [`PqError::ConnectionClosed`].
    /// Cancellation-safe.
    pub async fn read_message(&mut self) -> Result<BackendMessage, PqError> {
        read_backend(&mut self.stream, &mut self.read_buf, self.max_message_size).await
    }

    /// Whether the server has sent CopyDone.
    pub fn server_done(&self) -> bool {
        self.done
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> CopyBothReader<ReadHalf<S>> {
    /// Joins the halves again, in query mode; call it once both sides have sent CopyDone and
    /// the server's ReadyForQuery has been read with [`Self::read_message`].
    ///
    /// Panics if `writer` is not this reader's other half.
    pub fn unsplit(self, writer: CopyBothWriter<WriteHalf<S>>) -> ClientConn<S> {
        ClientConn {
            stream: self.stream.unsplit(writer.stream),
            read_buf: self.read_buf,
            write_buf: writer.write_buf,
            max_message_size: self.max_message_size,
            session: self.session,
        }
    }
}

/// The writing half of a client in the CopyBoth phase.
pub struct CopyBothWriter<W> {
    stream: W,
    write_buf: BytesMut,
}

impl<W: AsyncWrite + Unpin> CopyBothWriter<W> {
    /// Buffers a CopyData with `payload`.
    pub fn write_copy_data(&mut self, payload: &[u8]) {
        put_copy_data(&mut self.write_buf, &[payload]);
    }

    /// Buffers a CopyData carrying a standby message (`r` status update, `h` feedback).
    pub fn write_standby_message(&mut self, msg: &StandbyMessage) {
        let mut b = BytesMut::with_capacity(40);
        msg.encode(&mut b);
        self.write_copy_data(&b);
    }

    /// Buffers and sends a CopyData. If cancelled, the message stays buffered and goes out with
    /// the next flush.
    pub async fn send_copy_data(&mut self, payload: &[u8]) -> Result<(), PqError> {
        self.write_copy_data(payload);
        self.flush().await
    }

    /// Sends CopyDone: our side of the copy is finished.
    pub async fn send_copy_done(&mut self) -> Result<(), PqError> {
        FrontendMessage::CopyDone.encode(&mut self.write_buf);
        self.flush().await
    }

    /// Sends Terminate and shuts the write side down.
    pub async fn terminate(&mut self) -> Result<(), PqError> {
        FrontendMessage::Terminate.encode(&mut self.write_buf);
        shutdown_after_flush(&mut self.stream, &mut self.write_buf).await
    }

    /// Bytes buffered and not yet sent.
    pub fn buffered(&self) -> usize {
        self.write_buf.len()
    }

    /// Sends everything buffered. Cancellation-safe: unsent bytes stay buffered.
    pub async fn flush(&mut self) -> Result<(), PqError> {
        flush_buf(&mut self.stream, &mut self.write_buf).await
    }
}
