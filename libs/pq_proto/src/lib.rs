//! Our own PostgreSQL wire-protocol layer for physical replication, both sides.
//!
//! Pure (always built):
//! - [`reader`]: the one bounded big-endian reader every decoder of the workspace uses;
//! - [`framing`]: the typed frame header and its bound, shared by both directions;
//! - [`frontend`]: what a client sends (startup packets, simple query, COPY);
//! - [`backend`]: what a server sends (authentication, result sets, errors, COPY);
//! - [`error`]: [`ProtocolError`], [`ErrorFields`] and the SQLSTATE codes;
//! - [`replication`]: XLogData / keepalive / status update / hot-standby feedback.
//!
//! Async, behind the default `tokio` feature (`default-features = false` leaves a pure crate):
//! - [`server`]: a server connection: startup handshake, simple queries, result sets, errors,
//!   and a split into reader and writer halves for the duplex CopyBoth phase;
//! - [`client`]: a minimal replication client (our proposer, our relay from a real primary, our
//!   tests);
//! - [`stream`]: a stream that is plain or TLS (the TLS library is the caller's).
//!
//! Not here: neon's commands (`START_WAL_PUSH`, `START_REPLICATION ... (term)`) and what each
//! command *does* (WalAcceptor, walsender, timeline lookup): the safekeeper's connection
//! handlers.

pub mod backend;
#[cfg(feature = "tokio")]
pub mod client;
pub mod error;
pub mod framing;
pub mod frontend;
#[cfg(feature = "tokio")]
mod io;
pub mod reader;
pub mod replication;
#[cfg(feature = "tokio")]
pub mod server;
#[cfg(feature = "tokio")]
pub mod stream;

use std::time::SystemTime;

pub use backend::BackendMessage;
pub use error::{ErrorFields, ProtocolError, sqlstate};
pub use frontend::FrontendMessage;

/// Errors of a connection (either side).
#[derive(Debug, thiserror::Error)]
pub enum PqError {
    /// The socket failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent bytes that are not valid protocol; the connection must be closed.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// The peer closed the connection where a message was expected (or in the middle of one).
    #[error("connection closed by peer")]
    ConnectionClosed,
    /// The client sent a CancelRequest instead of a startup message; close the connection (and
    /// cancel the running query of that backend, if the caller supports that).
    #[error("cancel request for backend {process_id}")]
    CancelRequest {
        /// The backend whose query is to be cancelled.
        process_id: i32,
        /// Its secret key (from its BackendKeyData).
        secret_key: i32,
    },
    /// Server side: we refused the connection during startup or authentication; an
    /// ErrorResponse with these fields was already sent to the client.
    #[error("connection rejected: {0}")]
    Rejected(ErrorFields),
    /// Client side: the server answered with an ErrorResponse.
    #[error("server error: {0}")]
    Server(ErrorFields),
    /// The peer sent a valid message that makes no sense at this point.
    #[error("unexpected message: expected {expected}, got {got}")]
    Unexpected {
        /// What the state allows.
        expected: &'static str,
        /// What arrived.
        got: String,
    },
    /// Client side: the server asks for an authentication method we do not implement.
    #[error("unsupported authentication method: {0}")]
    UnsupportedAuth(String),
}

impl PqError {
    /// The SQLSTATE of an error reported by the peer or by us, if any.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            PqError::Rejected(e) | PqError::Server(e) => Some(&e.code),
            _ => None,
        }
    }
}

/// Now, as a PostgreSQL timestamp (µs since 2000-01-01 UTC). The network layer's clock read; the
/// pure modules take timestamps as arguments.
pub fn pg_now() -> i64 {
    replication::to_pg_timestamp(SystemTime::now())
}
