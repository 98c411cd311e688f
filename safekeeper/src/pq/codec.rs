//! PostgreSQL wire protocol (v3) framing: message types for both directions, bounded decoders
//! and encoders.
//!
//! Pure code: no I/O, no clock. Decoders take a [`BytesMut`] that holds whatever has arrived so
//! far and return
//! - `Ok(Some(msg))`: one whole message, consumed from the buffer;
//! - `Ok(None)`: the message is not complete yet, read more bytes (the buffer is untouched);
//! - `Err(_)`: the bytes are invalid, close the connection (the buffer state is then unspecified).
//!
//! A length prefix is checked against a limit before anything is allocated for it, and only
//! then is the buffer grown to hold the frame.
//!
//! Server side: [`decode_startup`] + [`decode_frontend`] read what clients send,
//! [`BackendMessage::encode`] writes replies. Client side is the mirror: [`StartupPacket::encode`]
//! + [`FrontendMessage::encode`] and [`decode_backend`].
//!
//! Left to others: socket handling ([`super::server`], [`super::client`]), the replication
//! sub-protocol inside CopyData ([`super::replication`]), and command parsing
//! ([`super::command`]).

use bytes::{Buf, BufMut, Bytes, BytesMut};

/// Default limit on one message's body (the bytes after the 5-byte tag+length header): 1 MiB
/// plus room for message headers. An AppendRequest carries at most 128 KiB of WAL.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = (1 << 20) + 1024;

/// Limit on a startup packet, the same as PostgreSQL's `MAX_STARTUP_PACKET_LENGTH`.
pub const MAX_STARTUP_PACKET_LENGTH: usize = 10_000;

/// StartupMessage protocol version 3.0.
pub const PROTOCOL_VERSION_3_0: u32 = 196_608;
/// Magic "protocol version" of an SSLRequest.
pub const SSL_REQUEST_CODE: u32 = 80_877_103;
/// Magic "protocol version" of a GSSENCRequest.
pub const GSSENC_REQUEST_CODE: u32 = 80_877_104;
/// Magic "protocol version" of a CancelRequest.
pub const CANCEL_REQUEST_CODE: u32 = 80_877_102;

/// Type OIDs used in RowDescription.
pub mod oid {
    pub const BOOL: u32 = 16;
    pub const INT8: u32 = 20;
    pub const INT4: u32 = 23;
    pub const TEXT: u32 = 25;
}

/// SQLSTATE codes we send.
pub mod sqlstate {
    pub const SUCCESSFUL_COMPLETION: &str = "00000";
    pub const PROTOCOL_VIOLATION: &str = "08P01";
    pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
    pub const INVALID_PARAMETER_VALUE: &str = "22023";
    pub const INVALID_AUTHORIZATION_SPECIFICATION: &str = "28000";
    pub const INVALID_PASSWORD: &str = "28P01";
    pub const SYNTAX_ERROR: &str = "42601";
    pub const UNDEFINED_OBJECT: &str = "42704";
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    pub const QUERY_CANCELED: &str = "57014";
    pub const ADMIN_SHUTDOWN: &str = "57P01";
    pub const INTERNAL_ERROR: &str = "XX000";
}

/// Why bytes could not be decoded. Every variant means "close the connection".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    #[error("message length {len} exceeds the limit of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("invalid message length {0}")]
    BadLength(i64),
    #[error("unsupported frontend protocol {major}.{minor}: server supports 3.0")]
    UnsupportedProtocolVersion { major: u16, minor: u16 },
    #[error("unsupported {name} message ('{}'): only the simple query protocol is supported", char::from(*tag))]
    UnsupportedMessage { tag: u8, name: &'static str },
    #[error("unknown message type {tag:#04x}")]
    UnknownTag { tag: u8 },
    #[error("malformed {message} message: {reason}")]
    Malformed {
        message: &'static str,
        reason: &'static str,
    },
}

impl ProtocolError {
    /// The FATAL error to send before closing the connection over this error.
    pub fn to_error_fields(&self) -> ErrorFields {
        let code = match self {
            ProtocolError::UnsupportedProtocolVersion { .. }
            | ProtocolError::UnsupportedMessage { .. } => sqlstate::FEATURE_NOT_SUPPORTED,
            _ => sqlstate::PROTOCOL_VIOLATION,
        };
        ErrorFields::fatal(code, self.to_string())
    }
}

fn malformed(message: &'static str, reason: &'static str) -> ProtocolError {
    ProtocolError::Malformed { message, reason }
}

// ------------------------------------------------------------------------------------------------
// Frontend (client → server)

/// Parameters of a StartupMessage, in the order the client sent them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartupParams(pub Vec<(String, String)>);

impl StartupParams {
    /// The value of the first parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn user(&self) -> Option<&str> {
        self.get("user")
    }

    pub fn application_name(&self) -> Option<&str> {
        self.get("application_name")
    }

    /// The raw `options` parameter (see [`super::command::parse_options`]).
    pub fn options(&self) -> Option<&str> {
        self.get("options")
    }
}

/// The untyped packets a client may send first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    SslRequest,
    GssEncRequest,
    CancelRequest {
        process_id: i32,
        secret_key: i32,
    },
    /// A StartupMessage. `minor_version` is the requested 3.x minor version.
    Startup {
        minor_version: u16,
        params: StartupParams,
    },
}

/// Typed messages a client sends after startup (the simple query and COPY subset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontendMessage {
    /// 'Q': one or more SQL/replication commands.
    Query(String),
    /// 'd'
    CopyData(Bytes),
    /// 'c'
    CopyDone,
    /// 'f': the client aborts a COPY, with a reason.
    CopyFail(String),
    /// 'X'
    Terminate,
    /// 'p': a password (or, for other auth methods, a response); the trailing NUL is removed.
    Password(Bytes),
}

/// Reads a frame header (tag + length) from the start of `buf`. Returns the body length if the
/// whole frame (tag, length, body) is in `buf`; `Ok(None)` otherwise, after reserving room for it.
fn typed_frame_len(buf: &mut BytesMut, max: usize) -> Result<Option<usize>, ProtocolError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    if len < 4 {
        return Err(ProtocolError::BadLength(len.into()));
    }
    let body = (len - 4) as usize;
    if body > max {
        return Err(ProtocolError::TooLarge { len: body, max });
    }
    let total = 5 + body;
    if buf.len() < total {
        // The length is bounded by `max` above, so this reservation is bounded too.
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    Ok(Some(body))
}

/// Decodes one untyped startup-phase packet (SSLRequest, GSSENCRequest, CancelRequest,
/// StartupMessage). Packets are limited to [`MAX_STARTUP_PACKET_LENGTH`].
pub fn decode_startup(buf: &mut BytesMut) -> Result<Option<StartupPacket>, ProtocolError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = i32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if len < 8 {
        return Err(ProtocolError::BadLength(len.into()));
    }
    let len = len as usize;
    if len > MAX_STARTUP_PACKET_LENGTH {
        return Err(ProtocolError::TooLarge {
            len,
            max: MAX_STARTUP_PACKET_LENGTH,
        });
    }
    if buf.len() < len {
        buf.reserve(len - buf.len());
        return Ok(None);
    }
    let mut pkt = buf.split_to(len).freeze();
    pkt.advance(4);
    let code = pkt.get_u32();
    match code {
        SSL_REQUEST_CODE | GSSENC_REQUEST_CODE => {
            if pkt.has_remaining() {
                return Err(malformed("SSLRequest", "trailing bytes"));
            }
            Ok(Some(if code == SSL_REQUEST_CODE {
                StartupPacket::SslRequest
            } else {
                StartupPacket::GssEncRequest
            }))
        }
        CANCEL_REQUEST_CODE => {
            if pkt.remaining() != 8 {
                return Err(malformed("CancelRequest", "length must be 16"));
            }
            Ok(Some(StartupPacket::CancelRequest {
                process_id: pkt.get_i32(),
                secret_key: pkt.get_i32(),
            }))
        }
        _ => {
            let major = (code >> 16) as u16;
            let minor = (code & 0xffff) as u16;
            if major != 3 {
                return Err(ProtocolError::UnsupportedProtocolVersion { major, minor });
            }
            let mut params = Vec::new();
            loop {
                let key = get_cstr(&mut pkt, "StartupMessage")?;
                if key.is_empty() {
                    break;
                }
                let value = get_cstr(&mut pkt, "StartupMessage")?;
                params.push((key, value));
            }
            if pkt.has_remaining() {
                return Err(malformed("StartupMessage", "bytes after the terminator"));
            }
            Ok(Some(StartupPacket::Startup {
                minor_version: minor,
                params: StartupParams(params),
            }))
        }
    }
}

/// Decodes one typed frontend message whose body is at most `max` bytes.
pub fn decode_frontend(
    buf: &mut BytesMut,
    max: usize,
) -> Result<Option<FrontendMessage>, ProtocolError> {
    let Some(body_len) = typed_frame_len(buf, max)? else {
        return Ok(None);
    };
    let tag = buf[0];
    let unsupported = |name| Err(ProtocolError::UnsupportedMessage { tag, name });
    // Refuse unknown tags before copying anything out.
    match tag {
        b'Q' | b'd' | b'c' | b'f' | b'X' | b'p' => {}
        b'S' => return unsupported("Sync"),
        b'H' => return unsupported("Flush"),
        b'P' => return unsupported("Parse"),
        b'B' => return unsupported("Bind"),
        b'E' => return unsupported("Execute"),
        b'D' => return unsupported("Describe"),
        b'C' => return unsupported("Close"),
        b'F' => return unsupported("FunctionCall"),
        _ => return Err(ProtocolError::UnknownTag { tag }),
    }
    buf.advance(5);
    let mut body = buf.split_to(body_len).freeze();
    let msg = match tag {
        b'Q' => {
            let q = get_cstr(&mut body, "Query")?;
            expect_end(&body, "Query")?;
            FrontendMessage::Query(q)
        }
        b'd' => FrontendMessage::CopyData(body),
        b'c' => {
            expect_end(&body, "CopyDone")?;
            FrontendMessage::CopyDone
        }
        b'f' => {
            let reason = get_cstr(&mut body, "CopyFail")?;
            expect_end(&body, "CopyFail")?;
            FrontendMessage::CopyFail(reason)
        }
        b'X' => {
            expect_end(&body, "Terminate")?;
            FrontendMessage::Terminate
        }
        b'p' => {
            // A cleartext password is a C string; tolerate a missing terminator.
            if body.last() == Some(&0) {
                body.truncate(body.len() - 1);
            }
            FrontendMessage::Password(body)
        }
        _ => unreachable!("tag filtered above"),
    };
    Ok(Some(msg))
}

impl StartupPacket {
    /// Appends the packet's wire form to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        let start = buf.len();
        buf.put_i32(0); // length, patched below
        match self {
            StartupPacket::SslRequest => buf.put_u32(SSL_REQUEST_CODE),
            StartupPacket::GssEncRequest => buf.put_u32(GSSENC_REQUEST_CODE),
            StartupPacket::CancelRequest {
                process_id,
                secret_key,
            } => {
                buf.put_u32(CANCEL_REQUEST_CODE);
                buf.put_i32(*process_id);
                buf.put_i32(*secret_key);
            }
            StartupPacket::Startup {
                minor_version,
                params,
            } => {
                buf.put_u32(PROTOCOL_VERSION_3_0 | u32::from(*minor_version));
                for (k, v) in &params.0 {
                    put_cstr(buf, k);
                    put_cstr(buf, v);
                }
                buf.put_u8(0);
            }
        }
        patch_len(buf, start, start);
    }
}

impl FrontendMessage {
    /// Appends the message's wire form to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        match self {
            FrontendMessage::Query(q) => typed(buf, b'Q', |b| put_cstr(b, q)),
            FrontendMessage::CopyData(d) => typed(buf, b'd', |b| b.put_slice(d)),
            FrontendMessage::CopyDone => typed(buf, b'c', |_| {}),
            FrontendMessage::CopyFail(r) => typed(buf, b'f', |b| put_cstr(b, r)),
            FrontendMessage::Terminate => typed(buf, b'X', |_| {}),
            FrontendMessage::Password(p) => typed(buf, b'p', |b| {
                b.put_slice(p);
                b.put_u8(0);
            }),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Backend (server → client)

/// Authentication request ('R') variants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authentication {
    /// code 0
    Ok,
    /// code 3
    CleartextPassword,
    /// code 5, with its 4-byte salt
    Md5Password { salt: [u8; 4] },
    /// code 10, with the offered SASL mechanisms
    Sasl { mechanisms: Vec<String> },
    /// code 11
    SaslContinue(Bytes),
    /// code 12
    SaslFinal(Bytes),
    /// Any other code (Kerberos, GSS, SSPI...), with its body.
    Other { code: i32, body: Bytes },
}

/// Transaction status in ReadyForQuery ('Z').
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransactionStatus {
    /// 'I'
    Idle,
    /// 'T'
    InTransaction,
    /// 'E'
    Failed,
}

impl TransactionStatus {
    fn byte(self) -> u8 {
        match self {
            TransactionStatus::Idle => b'I',
            TransactionStatus::InTransaction => b'T',
            TransactionStatus::Failed => b'E',
        }
    }
}

/// One column of a RowDescription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDescription {
    pub name: String,
    pub table_oid: u32,
    pub column_attr: i16,
    pub type_oid: u32,
    pub type_size: i16,
    pub type_modifier: i32,
    /// 0 = text, 1 = binary.
    pub format: i16,
}

impl FieldDescription {
    /// A text-format column of type `type_oid` whose size is `type_size` (-1 = variable).
    pub fn new(name: &str, type_oid: u32, type_size: i16) -> Self {
        FieldDescription {
            name: name.to_string(),
            table_oid: 0,
            column_attr: 0,
            type_oid,
            type_size,
            type_modifier: -1,
            format: 0,
        }
    }

    pub fn text(name: &str) -> Self {
        Self::new(name, oid::TEXT, -1)
    }

    pub fn int4(name: &str) -> Self {
        Self::new(name, oid::INT4, 4)
    }

    pub fn int8(name: &str) -> Self {
        Self::new(name, oid::INT8, 8)
    }
}

/// The fields of an ErrorResponse or NoticeResponse that we read and write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFields {
    /// `V` (non-localized) severity, also sent as `S`: ERROR, FATAL, WARNING, NOTICE, ...
    pub severity: String,
    /// `C`: the SQLSTATE (see [`sqlstate`]).
    pub code: String,
    /// `M`
    pub message: String,
    /// `D`
    pub detail: Option<String>,
    /// `H`
    pub hint: Option<String>,
}

impl ErrorFields {
    pub fn new(severity: &str, code: &str, message: impl Into<String>) -> Self {
        ErrorFields {
            severity: severity.to_string(),
            code: code.to_string(),
            message: message.into(),
            detail: None,
            hint: None,
        }
    }

    /// An ERROR: the command failed, the connection stays usable.
    pub fn error(code: &str, message: impl Into<String>) -> Self {
        Self::new("ERROR", code, message)
    }

    /// A FATAL: the server closes the connection after sending it.
    pub fn fatal(code: &str, message: impl Into<String>) -> Self {
        Self::new("FATAL", code, message)
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

impl std::fmt::Display for ErrorFields {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {} (SQLSTATE {})",
            self.severity, self.message, self.code
        )?;
        if let Some(d) = &self.detail {
            write!(f, "; DETAIL: {d}")?;
        }
        Ok(())
    }
}

/// The response to a COPY: 'G' CopyIn, 'H' CopyOut or 'W' CopyBoth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyResponse {
    /// 0 = textual, 1 = binary.
    pub format: u8,
    pub column_formats: Vec<i16>,
}

impl CopyResponse {
    /// What a walsender sends: format 0, no columns.
    pub fn replication() -> Self {
        CopyResponse {
            format: 0,
            column_formats: Vec::new(),
        }
    }
}

/// Messages a server sends (encoded by the server, decoded by the client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendMessage {
    /// 'R'
    Authentication(Authentication),
    /// 'S'
    ParameterStatus { name: String, value: String },
    /// 'K'
    BackendKeyData { process_id: i32, secret_key: i32 },
    /// 'v': the newest minor version we support and the `_pq_.` options we did not recognize.
    NegotiateProtocolVersion {
        newest_minor: i32,
        unrecognized: Vec<String>,
    },
    /// 'Z'
    ReadyForQuery(TransactionStatus),
    /// 'T'
    RowDescription(Vec<FieldDescription>),
    /// 'D': one value per column, `None` = SQL NULL.
    DataRow(Vec<Option<Bytes>>),
    /// 'C': the command tag, e.g. `SELECT 1`.
    CommandComplete(String),
    /// 'I'
    EmptyQueryResponse,
    /// 'E'
    ErrorResponse(ErrorFields),
    /// 'N'
    NoticeResponse(ErrorFields),
    /// 'G'
    CopyInResponse(CopyResponse),
    /// 'H'
    CopyOutResponse(CopyResponse),
    /// 'W'
    CopyBothResponse(CopyResponse),
    /// 'd'
    CopyData(Bytes),
    /// 'c'
    CopyDone,
}

impl BackendMessage {
    /// A DataRow from text values.
    pub fn data_row<S: AsRef<str>>(values: &[Option<S>]) -> Self {
        BackendMessage::DataRow(
            values
                .iter()
                .map(|v| {
                    v.as_ref()
                        .map(|s| Bytes::copy_from_slice(s.as_ref().as_bytes()))
                })
                .collect(),
        )
    }

    /// Appends the message's wire form to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        match self {
            BackendMessage::Authentication(a) => typed(buf, b'R', |b| match a {
                Authentication::Ok => b.put_i32(0),
                Authentication::CleartextPassword => b.put_i32(3),
                Authentication::Md5Password { salt } => {
                    b.put_i32(5);
                    b.put_slice(salt);
                }
                Authentication::Sasl { mechanisms } => {
                    b.put_i32(10);
                    for m in mechanisms {
                        put_cstr(b, m);
                    }
                    b.put_u8(0);
                }
                Authentication::SaslContinue(d) => {
                    b.put_i32(11);
                    b.put_slice(d);
                }
                Authentication::SaslFinal(d) => {
                    b.put_i32(12);
                    b.put_slice(d);
                }
                Authentication::Other { code, body } => {
                    b.put_i32(*code);
                    b.put_slice(body);
                }
            }),
            BackendMessage::ParameterStatus { name, value } => typed(buf, b'S', |b| {
                put_cstr(b, name);
                put_cstr(b, value);
            }),
            BackendMessage::BackendKeyData {
                process_id,
                secret_key,
            } => typed(buf, b'K', |b| {
                b.put_i32(*process_id);
                b.put_i32(*secret_key);
            }),
            BackendMessage::NegotiateProtocolVersion {
                newest_minor,
                unrecognized,
            } => typed(buf, b'v', |b| {
                b.put_i32(*newest_minor);
                b.put_i32(unrecognized.len() as i32);
                for o in unrecognized {
                    put_cstr(b, o);
                }
            }),
            BackendMessage::ReadyForQuery(s) => typed(buf, b'Z', |b| b.put_u8(s.byte())),
            BackendMessage::RowDescription(fields) => typed(buf, b'T', |b| {
                b.put_i16(fields.len() as i16);
                for f in fields {
                    put_cstr(b, &f.name);
                    b.put_u32(f.table_oid);
                    b.put_i16(f.column_attr);
                    b.put_u32(f.type_oid);
                    b.put_i16(f.type_size);
                    b.put_i32(f.type_modifier);
                    b.put_i16(f.format);
                }
            }),
            BackendMessage::DataRow(values) => typed(buf, b'D', |b| {
                b.put_i16(values.len() as i16);
                for v in values {
                    match v {
                        None => b.put_i32(-1),
                        Some(v) => {
                            b.put_i32(v.len() as i32);
                            b.put_slice(v);
                        }
                    }
                }
            }),
            BackendMessage::CommandComplete(tag) => typed(buf, b'C', |b| put_cstr(b, tag)),
            BackendMessage::EmptyQueryResponse => typed(buf, b'I', |_| {}),
            BackendMessage::ErrorResponse(e) => typed(buf, b'E', |b| put_error_fields(b, e)),
            BackendMessage::NoticeResponse(e) => typed(buf, b'N', |b| put_error_fields(b, e)),
            BackendMessage::CopyInResponse(c) => typed(buf, b'G', |b| put_copy_response(b, c)),
            BackendMessage::CopyOutResponse(c) => typed(buf, b'H', |b| put_copy_response(b, c)),
            BackendMessage::CopyBothResponse(c) => typed(buf, b'W', |b| put_copy_response(b, c)),
            BackendMessage::CopyData(d) => put_copy_data(buf, &[d]),
            BackendMessage::CopyDone => typed(buf, b'c', |_| {}),
        }
    }
}

/// Appends one CopyData message whose payload is the concatenation of `parts` (so a header and
/// a WAL slice need not be copied together first).
pub fn put_copy_data(buf: &mut BytesMut, parts: &[&[u8]]) {
    typed(buf, b'd', |b| {
        for p in parts {
            b.put_slice(p);
        }
    })
}

/// Decodes one backend message whose body is at most `max` bytes.
pub fn decode_backend(
    buf: &mut BytesMut,
    max: usize,
) -> Result<Option<BackendMessage>, ProtocolError> {
    let Some(body_len) = typed_frame_len(buf, max)? else {
        return Ok(None);
    };
    let tag = buf[0];
    if !matches!(
        tag,
        b'R' | b'S'
            | b'K'
            | b'v'
            | b'Z'
            | b'T'
            | b'D'
            | b'C'
            | b'I'
            | b'E'
            | b'N'
            | b'G'
            | b'H'
            | b'W'
            | b'd'
            | b'c'
    ) {
        return Err(ProtocolError::UnknownTag { tag });
    }
    buf.advance(5);
    let mut b = buf.split_to(body_len).freeze();
    let msg = match tag {
        b'R' => {
            let code = get_i32(&mut b, "Authentication")?;
            let a = match code {
                0 => Authentication::Ok,
                3 => Authentication::CleartextPassword,
                5 => {
                    if b.remaining() != 4 {
                        return Err(malformed(
                            "AuthenticationMD5Password",
                            "salt must be 4 bytes",
                        ));
                    }
                    let mut salt = [0u8; 4];
                    b.copy_to_slice(&mut salt);
                    Authentication::Md5Password { salt }
                }
                10 => {
                    let mut mechanisms = Vec::new();
                    loop {
                        let m = get_cstr(&mut b, "AuthenticationSASL")?;
                        if m.is_empty() {
                            break;
                        }
                        mechanisms.push(m);
                    }
                    Authentication::Sasl { mechanisms }
                }
                11 => Authentication::SaslContinue(b.split_off(0)),
                12 => Authentication::SaslFinal(b.split_off(0)),
                code => Authentication::Other {
                    code,
                    body: b.split_off(0),
                },
            };
            BackendMessage::Authentication(a)
        }
        b'S' => BackendMessage::ParameterStatus {
            name: get_cstr(&mut b, "ParameterStatus")?,
            value: get_cstr(&mut b, "ParameterStatus")?,
        },
        b'K' => BackendMessage::BackendKeyData {
            process_id: get_i32(&mut b, "BackendKeyData")?,
            secret_key: get_i32(&mut b, "BackendKeyData")?,
        },
        b'v' => {
            let newest_minor = get_i32(&mut b, "NegotiateProtocolVersion")?;
            let n = get_i32(&mut b, "NegotiateProtocolVersion")?;
            if n < 0 {
                return Err(malformed("NegotiateProtocolVersion", "negative count"));
            }
            let mut unrecognized = Vec::new();
            for _ in 0..n {
                unrecognized.push(get_cstr(&mut b, "NegotiateProtocolVersion")?);
            }
            BackendMessage::NegotiateProtocolVersion {
                newest_minor,
                unrecognized,
            }
        }
        b'Z' => {
            let s = match get_u8(&mut b, "ReadyForQuery")? {
                b'I' => TransactionStatus::Idle,
                b'T' => TransactionStatus::InTransaction,
                b'E' => TransactionStatus::Failed,
                _ => return Err(malformed("ReadyForQuery", "unknown transaction status")),
            };
            BackendMessage::ReadyForQuery(s)
        }
        b'T' => {
            let n = get_i16(&mut b, "RowDescription")?;
            if n < 0 {
                return Err(malformed("RowDescription", "negative field count"));
            }
            // Each field takes at least 19 bytes: bound the count by the body before allocating.
            if n as usize * 19 > b.remaining() {
                return Err(malformed("RowDescription", "field count exceeds message"));
            }
            let mut fields = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let m = "RowDescription";
                fields.push(FieldDescription {
                    name: get_cstr(&mut b, m)?,
                    table_oid: get_i32(&mut b, m)? as u32,
                    column_attr: get_i16(&mut b, m)?,
                    type_oid: get_i32(&mut b, m)? as u32,
                    type_size: get_i16(&mut b, m)?,
                    type_modifier: get_i32(&mut b, m)?,
                    format: get_i16(&mut b, m)?,
                });
            }
            BackendMessage::RowDescription(fields)
        }
        b'D' => {
            let n = get_i16(&mut b, "DataRow")?;
            if n < 0 {
                return Err(malformed("DataRow", "negative column count"));
            }
            // Each value takes at least its 4-byte length.
            if n as usize * 4 > b.remaining() {
                return Err(malformed("DataRow", "column count exceeds message"));
            }
            let mut values = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let len = get_i32(&mut b, "DataRow")?;
                if len == -1 {
                    values.push(None);
                } else if len < 0 || len as usize > b.remaining() {
                    return Err(malformed("DataRow", "value length out of range"));
                } else {
                    values.push(Some(b.split_to(len as usize)));
                }
            }
            BackendMessage::DataRow(values)
        }
        b'C' => BackendMessage::CommandComplete(get_cstr(&mut b, "CommandComplete")?),
        b'I' => BackendMessage::EmptyQueryResponse,
        b'E' => BackendMessage::ErrorResponse(get_error_fields(&mut b, "ErrorResponse")?),
        b'N' => BackendMessage::NoticeResponse(get_error_fields(&mut b, "NoticeResponse")?),
        b'G' => BackendMessage::CopyInResponse(get_copy_response(&mut b)?),
        b'H' => BackendMessage::CopyOutResponse(get_copy_response(&mut b)?),
        b'W' => BackendMessage::CopyBothResponse(get_copy_response(&mut b)?),
        b'd' => BackendMessage::CopyData(b.split_off(0)),
        b'c' => BackendMessage::CopyDone,
        _ => unreachable!("tag filtered above"),
    };
    Ok(Some(msg))
}

// ------------------------------------------------------------------------------------------------
// helpers

/// Writes a typed message: tag, length placeholder, body, then patches the length.
fn typed(buf: &mut BytesMut, tag: u8, body: impl FnOnce(&mut BytesMut)) {
    buf.put_u8(tag);
    let len_at = buf.len();
    buf.put_i32(0);
    body(buf);
    patch_len(buf, len_at, len_at);
}

/// Writes `buf.len() - from` as a BE i32 at `at`.
fn patch_len(buf: &mut BytesMut, at: usize, from: usize) {
    let len = i32::try_from(buf.len() - from).expect("encoded messages are far below 2 GiB");
    buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

fn put_cstr(buf: &mut BytesMut, s: &str) {
    buf.put_slice(s.as_bytes());
    buf.put_u8(0);
}

fn put_error_fields(b: &mut BytesMut, e: &ErrorFields) {
    for (t, v) in [
        (b'S', Some(&e.severity)),
        (b'V', Some(&e.severity)),
        (b'C', Some(&e.code)),
        (b'M', Some(&e.message)),
        (b'D', e.detail.as_ref()),
        (b'H', e.hint.as_ref()),
    ] {
        if let Some(v) = v {
            b.put_u8(t);
            put_cstr(b, v);
        }
    }
    b.put_u8(0);
}

fn put_copy_response(b: &mut BytesMut, c: &CopyResponse) {
    b.put_u8(c.format);
    b.put_i16(c.column_formats.len() as i16);
    for f in &c.column_formats {
        b.put_i16(*f);
    }
}

fn get_copy_response(b: &mut Bytes) -> Result<CopyResponse, ProtocolError> {
    let m = "CopyResponse";
    let format = get_u8(b, m)?;
    let n = get_i16(b, m)?;
    if n < 0 || n as usize * 2 != b.remaining() {
        return Err(malformed(m, "column count does not match length"));
    }
    let mut column_formats = Vec::with_capacity(n as usize);
    for _ in 0..n {
        column_formats.push(get_i16(b, m)?);
    }
    Ok(CopyResponse {
        format,
        column_formats,
    })
}

fn get_error_fields(b: &mut Bytes, m: &'static str) -> Result<ErrorFields, ProtocolError> {
    let mut e = ErrorFields::new("", "", "");
    let mut s = None;
    let mut v = None;
    loop {
        let t = get_u8(b, m)?;
        if t == 0 {
            break;
        }
        let val = get_cstr(b, m)?;
        match t {
            b'S' => s = Some(val),
            b'V' => v = Some(val),
            b'C' => e.code = val,
            b'M' => e.message = val,
            b'D' => e.detail = Some(val),
            b'H' => e.hint = Some(val),
            _ => {}
        }
    }
    // V is never localized; prefer it.
    e.severity = v.or(s).unwrap_or_default();
    Ok(e)
}

fn get_u8(b: &mut Bytes, m: &'static str) -> Result<u8, ProtocolError> {
    b.try_get_u8().map_err(|_| malformed(m, "truncated"))
}

fn get_i16(b: &mut Bytes, m: &'static str) -> Result<i16, ProtocolError> {
    b.try_get_i16().map_err(|_| malformed(m, "truncated"))
}

fn get_i32(b: &mut Bytes, m: &'static str) -> Result<i32, ProtocolError> {
    b.try_get_i32().map_err(|_| malformed(m, "truncated"))
}

/// Reads a NUL-terminated UTF-8 string.
fn get_cstr(b: &mut Bytes, m: &'static str) -> Result<String, ProtocolError> {
    let end = b
        .iter()
        .position(|&c| c == 0)
        .ok_or(malformed(m, "missing string terminator"))?;
    let s = b.split_to(end);
    b.advance(1);
    String::from_utf8(s.to_vec()).map_err(|_| malformed(m, "string is not UTF-8"))
}

fn expect_end(b: &Bytes, m: &'static str) -> Result<(), ProtocolError> {
    if b.has_remaining() {
        Err(malformed(m, "trailing bytes"))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn enc_b(m: &BackendMessage) -> Vec<u8> {
        let mut b = BytesMut::new();
        m.encode(&mut b);
        b.to_vec()
    }

    fn enc_f(m: &FrontendMessage) -> Vec<u8> {
        let mut b = BytesMut::new();
        m.encode(&mut b);
        b.to_vec()
    }

    /// Checks `bytes` encodes `m`, decodes back to `m`, and that every strict prefix is "need more".
    fn backend_fixture(m: BackendMessage, bytes: &[u8]) {
        assert_eq!(enc_b(&m), bytes, "encoding of {m:?}");
        for cut in 0..bytes.len() {
            let mut buf = BytesMut::from(&bytes[..cut]);
            assert_eq!(
                decode_backend(&mut buf, 1000),
                Ok(None),
                "prefix {cut} of {m:?}"
            );
            assert_eq!(buf.len(), cut, "a partial frame is not consumed");
        }
        let mut buf = BytesMut::from(bytes);
        buf.extend_from_slice(b"Z\0\0\0\x05I");
        assert_eq!(decode_backend(&mut buf, 1000), Ok(Some(m)));
        assert_eq!(&buf[..], b"Z\0\0\0\x05I", "exactly one frame consumed");
    }

    fn frontend_fixture(m: FrontendMessage, bytes: &[u8]) {
        assert_eq!(enc_f(&m), bytes, "encoding of {m:?}");
        for cut in 0..bytes.len() {
            let mut buf = BytesMut::from(&bytes[..cut]);
            assert_eq!(decode_frontend(&mut buf, 1000), Ok(None));
        }
        let mut buf = BytesMut::from(bytes);
        assert_eq!(decode_frontend(&mut buf, 1000), Ok(Some(m)));
        assert!(buf.is_empty());
    }

    #[test]
    fn ssl_gss_and_cancel_requests_fixture() {
        let ssl = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        let gss = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30];
        let cancel = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 7, 0, 0, 0, 9];
        for (pkt, bytes) in [
            (StartupPacket::SslRequest, &ssl[..]),
            (StartupPacket::GssEncRequest, &gss[..]),
            (
                StartupPacket::CancelRequest {
                    process_id: 7,
                    secret_key: 9,
                },
                &cancel[..],
            ),
        ] {
            let mut b = BytesMut::new();
            pkt.encode(&mut b);
            assert_eq!(&b[..], bytes);
            for cut in 0..bytes.len() {
                assert_eq!(decode_startup(&mut BytesMut::from(&bytes[..cut])), Ok(None));
            }
            assert_eq!(decode_startup(&mut b), Ok(Some(pkt)));
        }
    }

    #[test]
    fn startup_message_fixture() {
        let mut bytes = vec![0, 0, 0, 0, 0, 3, 0, 0];
        bytes.extend_from_slice(b"user\0postgres\0replication\0true\0\0");
        let n = bytes.len() as u8;
        bytes[3] = n;
        let pkt = StartupPacket::Startup {
            minor_version: 0,
            params: StartupParams(vec![
                ("user".into(), "postgres".into()),
                ("replication".into(), "true".into()),
            ]),
        };
        let mut b = BytesMut::new();
        pkt.encode(&mut b);
        assert_eq!(&b[..], &bytes[..]);
        let got = decode_startup(&mut b).unwrap().unwrap();
        assert_eq!(got, pkt);
        let StartupPacket::Startup { params, .. } = got else {
            unreachable!()
        };
        assert_eq!(params.user(), Some("postgres"));
        assert_eq!(params.get("replication"), Some("true"));
        assert_eq!(params.options(), None);
    }

    #[test]
    fn startup_rejects_protocol_2_bad_and_huge_lengths() {
        let v2 = [0, 0, 0, 9, 0, 2, 0, 0, 0];
        assert_eq!(
            decode_startup(&mut BytesMut::from(&v2[..])),
            Err(ProtocolError::UnsupportedProtocolVersion { major: 2, minor: 0 })
        );
        assert_eq!(
            decode_startup(&mut BytesMut::from(&[0, 0, 0, 3][..])),
            Err(ProtocolError::BadLength(3))
        );
        assert!(matches!(
            decode_startup(&mut BytesMut::from(&[0x7f, 0xff, 0xff, 0xff][..])),
            Err(ProtocolError::TooLarge { .. })
        ));
        // Missing the final terminator.
        let mut bad = vec![0, 0, 0, 0, 0, 3, 0, 0];
        bad.extend_from_slice(b"user\0x\0");
        bad[3] = bad.len() as u8;
        assert!(matches!(
            decode_startup(&mut BytesMut::from(&bad[..])),
            Err(ProtocolError::Malformed { .. })
        ));
    }

    #[test]
    fn frontend_message_fixtures() {
        frontend_fixture(
            FrontendMessage::Query("IDENTIFY_SYSTEM".into()),
            b"Q\0\0\0\x14IDENTIFY_SYSTEM\0",
        );
        frontend_fixture(
            FrontendMessage::CopyData(Bytes::from_static(b"abc")),
            b"d\0\0\0\x07abc",
        );
        frontend_fixture(FrontendMessage::CopyDone, b"c\0\0\0\x04");
        frontend_fixture(FrontendMessage::CopyFail("no".into()), b"f\0\0\0\x07no\0");
        frontend_fixture(FrontendMessage::Terminate, b"X\0\0\0\x04");
        frontend_fixture(
            FrontendMessage::Password(Bytes::from_static(b"secret")),
            b"p\0\0\0\x0bsecret\0",
        );
    }

    #[test]
    fn extended_protocol_messages_are_unsupported() {
        for (tag, name) in [
            (b'S', "Sync"),
            (b'H', "Flush"),
            (b'P', "Parse"),
            (b'B', "Bind"),
        ] {
            let mut b = BytesMut::from(&[tag, 0, 0, 0, 4][..]);
            assert_eq!(
                decode_frontend(&mut b, 100),
                Err(ProtocolError::UnsupportedMessage { tag, name })
            );
        }
        let e = ProtocolError::UnsupportedMessage {
            tag: b'P',
            name: "Parse",
        };
        assert!(e.to_string().contains("Parse"));
        assert_eq!(
            decode_frontend(&mut BytesMut::from(&b"?\0\0\0\x04"[..]), 100),
            Err(ProtocolError::UnknownTag { tag: b'?' })
        );
    }

    #[test]
    fn oversized_and_negative_lengths_are_rejected_before_buffering() {
        let mut b = BytesMut::from(&b"d\x00\x10\x00\x05"[..]);
        let cap = b.capacity();
        assert_eq!(
            decode_frontend(&mut b, 1 << 20),
            Err(ProtocolError::TooLarge {
                len: (1 << 20) + 1,
                max: 1 << 20
            })
        );
        assert_eq!(b.capacity(), cap, "nothing reserved for a rejected frame");
        assert_eq!(
            decode_backend(&mut BytesMut::from(&b"d\xff\xff\xff\xff"[..]), 100),
            Err(ProtocolError::BadLength(-1))
        );
        assert_eq!(
            decode_backend(&mut BytesMut::from(&b"d\0\0\0\x03"[..]), 100),
            Err(ProtocolError::BadLength(3))
        );
        // Exactly at the limit is fine.
        let mut b = BytesMut::from(&b"d\0\0\0\x0e"[..]);
        b.extend_from_slice(&[1; 10]);
        assert!(matches!(decode_frontend(&mut b, 10), Ok(Some(_))));
    }

    #[test]
    fn authentication_fixtures() {
        backend_fixture(
            BackendMessage::Authentication(Authentication::Ok),
            b"R\0\0\0\x08\0\0\0\0",
        );
        backend_fixture(
            BackendMessage::Authentication(Authentication::CleartextPassword),
            b"R\0\0\0\x08\0\0\0\x03",
        );
        backend_fixture(
            BackendMessage::Authentication(Authentication::Md5Password { salt: *b"abcd" }),
            b"R\0\0\0\x0c\0\0\0\x05abcd",
        );
        backend_fixture(
            BackendMessage::Authentication(Authentication::Sasl {
                mechanisms: vec!["SCRAM-SHA-256".into()],
            }),
            b"R\0\0\0\x17\0\0\0\x0aSCRAM-SHA-256\0\0",
        );
    }

    #[test]
    fn startup_reply_fixtures() {
        backend_fixture(
            BackendMessage::ParameterStatus {
                name: "integer_datetimes".into(),
                value: "on".into(),
            },
            b"S\0\0\0\x19integer_datetimes\0on\0",
        );
        backend_fixture(
            BackendMessage::BackendKeyData {
                process_id: 0x0102_0304,
                secret_key: -2,
            },
            b"K\0\0\0\x0c\x01\x02\x03\x04\xff\xff\xff\xfe",
        );
        backend_fixture(
            BackendMessage::ReadyForQuery(TransactionStatus::Idle),
            b"Z\0\0\0\x05I",
        );
        backend_fixture(
            BackendMessage::NegotiateProtocolVersion {
                newest_minor: 0,
                unrecognized: vec!["_pq_.x".into()],
            },
            b"v\0\0\0\x13\0\0\0\0\0\0\0\x01_pq_.x\0",
        );
    }

    #[test]
    fn result_set_fixtures() {
        // RowDescription: 2 fields; "a" text, "tli" int4.
        let mut t = b"T\0\0\0\x30\0\x02".to_vec();
        t.extend_from_slice(b"a\0\0\0\0\0\0\0\0\0\0\x19\xff\xff\xff\xff\xff\xff\0\0");
        t.extend_from_slice(b"tli\0\0\0\0\0\0\0\0\0\0\x17\0\x04\xff\xff\xff\xff\0\0");
        backend_fixture(
            BackendMessage::RowDescription(vec![
                FieldDescription::text("a"),
                FieldDescription::int4("tli"),
            ]),
            &t,
        );
        // DataRow: "0/0", NULL.
        backend_fixture(
            BackendMessage::data_row(&[Some("0/0"), None]),
            b"D\0\0\0\x11\0\x02\0\0\0\x030/0\xff\xff\xff\xff",
        );
        backend_fixture(
            BackendMessage::CommandComplete("SELECT 1".into()),
            b"C\0\0\0\x0dSELECT 1\0",
        );
        backend_fixture(BackendMessage::EmptyQueryResponse, b"I\0\0\0\x04");
    }

    #[test]
    fn error_and_notice_fixtures() {
        let e = ErrorFields::error("42601", "bad");
        backend_fixture(
            BackendMessage::ErrorResponse(e.clone()),
            b"E\0\0\0\x1fSERROR\0VERROR\0C42601\0Mbad\0\0",
        );
        backend_fixture(
            BackendMessage::NoticeResponse(e.with_detail("d").with_hint("h")),
            b"N\0\0\0\x25SERROR\0VERROR\0C42601\0Mbad\0Dd\0Hh\0\0",
        );
        // A localized S without V, and unknown fields, still decode.
        let mut b = BytesMut::from(&b"E\0\0\0\x1cSFEHLER\0C28000\0Mx\0Fa.c\0\0"[..]);
        let Ok(Some(BackendMessage::ErrorResponse(e))) = decode_backend(&mut b, 100) else {
            panic!("error response must decode");
        };
        assert_eq!(
            (e.severity.as_str(), e.code.as_str(), e.message.as_str()),
            ("FEHLER", "28000", "x")
        );
    }

    #[test]
    fn copy_fixtures() {
        backend_fixture(
            BackendMessage::CopyBothResponse(CopyResponse::replication()),
            b"W\0\0\0\x07\0\0\0",
        );
        backend_fixture(
            BackendMessage::CopyOutResponse(CopyResponse {
                format: 0,
                column_formats: vec![0, 1],
            }),
            b"H\0\0\0\x0b\0\0\x02\0\0\0\x01",
        );
        backend_fixture(
            BackendMessage::CopyInResponse(CopyResponse::replication()),
            b"G\0\0\0\x07\0\0\0",
        );
        backend_fixture(
            BackendMessage::CopyData(Bytes::from_static(b"wx")),
            b"d\0\0\0\x06wx",
        );
        backend_fixture(BackendMessage::CopyDone, b"c\0\0\0\x04");
        let mut b = BytesMut::new();
        put_copy_data(&mut b, &[b"ab", b"", b"c"]);
        assert_eq!(&b[..], b"d\0\0\0\x07abc");
    }

    #[test]
    fn backend_decoders_reject_lying_counts() {
        // DataRow claiming 1000 columns in a 2-byte body.
        assert!(matches!(
            decode_backend(&mut BytesMut::from(&b"D\0\0\0\x06\x03\xe8"[..]), 100),
            Err(ProtocolError::Malformed { .. })
        ));
        // DataRow value longer than the message.
        assert!(matches!(
            decode_backend(
                &mut BytesMut::from(&b"D\0\0\0\x0a\0\x01\0\0\0\x09"[..]),
                100
            ),
            Err(ProtocolError::Malformed { .. })
        ));
        // RowDescription claiming many fields.
        assert!(matches!(
            decode_backend(&mut BytesMut::from(&b"T\0\0\0\x06\x7f\xff"[..]), 100),
            Err(ProtocolError::Malformed { .. })
        ));
        assert!(matches!(
            decode_backend(&mut BytesMut::from(&b"Z\0\0\0\x05Q"[..]), 100),
            Err(ProtocolError::Malformed { .. })
        ));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic_decoders(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut b = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = decode_startup(&mut b) {}
            let mut b = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = decode_frontend(&mut b, 256) {}
            let mut b = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = decode_backend(&mut b, 256) {}
        }

        #[test]
        fn random_bodies_with_valid_tags_never_panic(
            tag in proptest::sample::select(b"RSKvZTDCIENGHWdcQfXp".to_vec()),
            body in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            let mut b = BytesMut::new();
            b.put_u8(tag);
            b.put_i32(body.len() as i32 + 4);
            b.put_slice(&body);
            let _ = decode_backend(&mut b.clone(), 256);
            let _ = decode_frontend(&mut b, 256);
        }

        #[test]
        fn oversized_length_prefix_is_rejected_without_allocating(
            tag in any::<u8>(),
            len in (1_000_005i64..=i32::MAX as i64),
        ) {
            let mut b = BytesMut::with_capacity(8);
            b.put_u8(tag);
            b.put_i32(len as i32);
            let cap = b.capacity();
            let r = decode_frontend(&mut b, 1_000_000);
            prop_assert!(r.is_err());
            prop_assert_eq!(b.capacity(), cap);
            let r = decode_backend(&mut b, 1_000_000);
            prop_assert!(r.is_err());
            prop_assert_eq!(b.capacity(), cap);
            let mut s = BytesMut::with_capacity(8);
            s.put_i32(len as i32);
            let cap = s.capacity();
            prop_assert!(decode_startup(&mut s).is_err());
            prop_assert_eq!(s.capacity(), cap);
        }

        #[test]
        fn query_round_trips(q in "[^\u{0}]{0,64}") {
            let m = FrontendMessage::Query(q);
            let mut b = BytesMut::new();
            m.encode(&mut b);
            prop_assert_eq!(decode_frontend(&mut b, 1024), Ok(Some(m)));
        }
    }
}
