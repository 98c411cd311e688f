//! PostgreSQL 15 WAL format: page and record layouts with CRC-32C ([`format`](mod@format)), a generator of
//! valid logical-message WAL for tests and benches ([`generator`]), and a streaming decoder that
//! finds record boundaries and the end of valid WAL ([`decoder`]).
//!
//! Pure code: no I/O. Segment files are [`crate::storage::wal_file`]'s business.

pub mod decoder;
pub mod format;
pub mod generator;

pub use decoder::{DecodeError, DecodeErrorKind, WalStreamDecoder, find_end_of_wal_in};
pub use generator::{RecordPos, WalGenerator, first_segment_image};
