//! PostgreSQL WAL as bytes, for each supported major version 14 to 18 ([`PgMajor`]): [`Lsn`] positions, page and record layouts with CRC-32C and the
//! first-segment image a new timeline starts from ([`format`](mod@format)), a streaming decoder
//! that finds record boundaries and the end of valid WAL ([`decoder`]), and a generator of valid
//! logical-message WAL for tests and benches ([`generator`]).
//!
//! The bottom layer of the workspace: pure code, no I/O, no tokio, no clock; it depends on no
//! other crate of ours.
//!
//! Not here: segment files on disk (the safekeeper's WAL store), the wire protocols
//! (`pq_proto`, `sk_core::protocol`).

pub mod decoder;
pub mod format;
pub mod generator;
pub mod lsn;
pub mod version;

pub use decoder::{DecodeError, DecodeErrorKind, WalStreamDecoder, find_end_of_wal_in};
pub use format::{WalStartError, first_segment_image};
pub use generator::{RecordPos, WalGenerator};
pub use lsn::{Lsn, LsnParseError, XLOG_BLCKSZ};
pub use version::{PgMajor, UnsupportedVersion};
