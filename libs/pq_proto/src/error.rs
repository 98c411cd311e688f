//! Errors on the wire: [`ProtocolError`] (bytes that are not valid protocol, so the connection
//! closes), [`ErrorFields`] (the body of an ErrorResponse or NoticeResponse, both directions)
//! and the [`sqlstate`] codes we send.
//!
//! Not here: connection-level errors ([`crate::PqError`]) and the encoding of an
//! ErrorResponse frame ([`crate::backend`]).

use crate::reader::ReadError;

/// SQLSTATE codes we send (PostgreSQL's `errcodes.txt` names).
pub mod sqlstate {
    /// `successful_completion`.
    pub const SUCCESSFUL_COMPLETION: &str = "00000";
    /// `protocol_violation`: bytes that are not valid protocol.
    pub const PROTOCOL_VIOLATION: &str = "08P01";
    /// `feature_not_supported`: valid protocol we do not implement.
    pub const FEATURE_NOT_SUPPORTED: &str = "0A000";
    /// `invalid_parameter_value`.
    pub const INVALID_PARAMETER_VALUE: &str = "22023";
    /// `invalid_authorization_specification`: not a replication connection, or no user.
    pub const INVALID_AUTHORIZATION_SPECIFICATION: &str = "28000";
    /// `invalid_password`.
    pub const INVALID_PASSWORD: &str = "28P01";
    /// `syntax_error`: a command we cannot parse.
    pub const SYNTAX_ERROR: &str = "42601";
    /// `undefined_object`: e.g. an unknown timeline.
    pub const UNDEFINED_OBJECT: &str = "42704";
    /// `too_many_connections`: the server's connection limit is reached.
    pub const TOO_MANY_CONNECTIONS: &str = "53300";
    /// `insufficient_privilege`: authenticated, but not allowed to do this.
    pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
    /// `object_not_in_prerequisite_state`: e.g. WAL that is not available (any more).
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    /// `query_canceled`.
    pub const QUERY_CANCELED: &str = "57014";
    /// `admin_shutdown`: the server is shutting down.
    pub const ADMIN_SHUTDOWN: &str = "57P01";
    /// `internal_error`: our fault, details in the server log.
    pub const INTERNAL_ERROR: &str = "XX000";
}

/// Why bytes could not be decoded. Every variant means "close the connection".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A length prefix above the limit (checked before anything is buffered for it).
    #[error("message length {len} exceeds the limit of {max} bytes")]
    TooLarge {
        /// The announced length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A length prefix smaller than the length field itself (or negative).
    #[error("invalid message length {0}")]
    BadLength(i64),
    /// A StartupMessage for a protocol other than 3.x.
    #[error("unsupported frontend protocol {major}.{minor}: server supports 3.0")]
    UnsupportedProtocolVersion {
        /// Requested major version.
        major: u16,
        /// Requested minor version.
        minor: u16,
    },
    /// A valid frontend message of the extended query protocol, which we do not implement.
    #[error("unsupported {name} message ('{}'): only the simple query protocol is supported", char::from(*tag))]
    UnsupportedMessage {
        /// The message type byte.
        tag: u8,
        /// The message's name in PostgreSQL's documentation.
        name: &'static str,
    },
    /// A message type byte that no message has.
    #[error("unknown message type {tag:#04x}")]
    UnknownTag {
        /// The message type byte.
        tag: u8,
    },
    /// A known message whose body does not parse.
    #[error("malformed {message} message: {reason}")]
    Malformed {
        /// The message's name.
        message: &'static str,
        /// What is wrong with it.
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

    /// A [`ProtocolError::Malformed`] of `message`.
    pub(crate) fn malformed(message: &'static str, reason: &'static str) -> ProtocolError {
        ProtocolError::Malformed { message, reason }
    }

    /// A failed read of message `message`'s body as a [`ProtocolError::Malformed`]. A string
    /// that runs to the end of the body lacks its terminator.
    pub(crate) fn from_read(message: &'static str, e: ReadError) -> ProtocolError {
        let reason = match e {
            ReadError::Truncated { .. } => "truncated",
            ReadError::UnterminatedString { .. } => "missing string terminator",
            ReadError::InvalidUtf8 { .. } => "string is not UTF-8",
            ReadError::TrailingBytes(_) => "trailing bytes",
            ReadError::TooMany { .. } => "count exceeds message",
        };
        ProtocolError::malformed(message, reason)
    }
}

/// The fields of an ErrorResponse or NoticeResponse that we read and write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFields {
    /// `V` (non-localized) severity, also sent as `S`: ERROR, FATAL, WARNING, NOTICE, ...
    pub severity: String,
    /// `C`: the SQLSTATE (see [`sqlstate`]).
    pub code: String,
    /// `M`: the primary message.
    pub message: String,
    /// `D`: an optional detail.
    pub detail: Option<String>,
    /// `H`: an optional hint.
    pub hint: Option<String>,
}

impl ErrorFields {
    /// An error or notice of `severity` with SQLSTATE `code`.
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

    /// Adds a `D` detail.
    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    /// Adds an `H` hint.
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
