//! Storage seams of the consensus core: the control-state store and the WAL store.
//!
//! The consensus core ([`crate::safekeeper`]) is generic over these two traits. The file
//! implementations live in the `safekeeper` crate (`control_file`, `wal_store`), on the
//! file-system seam [`fs`] with the durability helpers of [`durable`]; in-memory fakes that can
//! lose everything not yet synced ("power loss") live in [`mem`].
//!
//! Durability contract shared by every implementation:
//! - `ControlStore::persist` returns only once the new state is durable; a crash at any point
//!   leaves either the old or the new state, never a mix.
//! - `WalStore::write_wal` hands bytes to the OS (or buffer) without making them durable;
//!   `WalStore::flush_wal` makes everything written so far durable. `flush_lsn()` never reports
//!   more than is durable.

pub mod durable;
pub mod fs;
pub mod mem;

use std::ops::Deref;

use crate::state::TimelinePersistentState;
use crate::types::Lsn;

/// Storage errors a caller can branch on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request contradicts the stored state (a gap, a rewrite, a truncation above the end).
    #[error("rejected: {0}")]
    Rejected(String),
    /// Stored data failed verification.
    #[error("corruption in {file}: {reason}")]
    Corruption {
        /// The file (or directory) that failed.
        file: String,
        /// What was wrong.
        reason: String,
    },
    /// WAL that does not decode at `lsn` although valid WAL follows it (at `valid_at`), with
    /// no never-written (all-zero) sector in between: corruption in the middle of the log, not
    /// a torn tail. Start-up refuses it: taking `lsn` as the end of WAL would silently drop the
    /// acknowledged WAL after it.
    #[error(
        "corruption in {file} at {lsn}: expected {expected}, found {found}; valid WAL follows \
         at {valid_at}, so this is not a torn tail: refusing to start (acknowledged WAL after \
         the damage would be lost)"
    )]
    WalCorruption {
        /// The segment file holding `lsn`.
        file: String,
        /// Where the damaged page or record starts.
        lsn: Lsn,
        /// What a valid WAL has there.
        expected: String,
        /// What was found instead.
        found: String,
        /// Start of the first valid record after the damage.
        valid_at: Lsn,
    },
    /// The disk is full. Nothing was acknowledged; the write may be retried when space returns.
    #[error("no space left on device while {0}")]
    NoSpace(String),
    /// Any other I/O error.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// Wraps an I/O error, mapping ENOSPC to [`Error::NoSpace`].
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Error {
        let context = context.into();
        if source.raw_os_error() == Some(libc::ENOSPC)
            || source.kind() == std::io::ErrorKind::StorageFull
        {
            Error::NoSpace(context)
        } else {
            Error::Io { context, source }
        }
    }
}

/// The result of a storage operation.
pub type Result<T> = std::result::Result<T, Error>;

/// Durable control state of one timeline. Derefs to the last persisted state.
pub trait ControlStore: Deref<Target = TimelinePersistentState> {
    /// Atomically replaces the persisted state; durable when this returns `Ok`.
    fn persist(&mut self, state: &TimelinePersistentState) -> Result<()>;
}

/// WAL of one timeline.
///
/// Invariant: `flush_lsn() <= write_record_lsn() <= write_lsn()`.
pub trait WalStore {
    /// End of the bytes handed to storage (may be in the middle of a record).
    fn write_lsn(&self) -> Lsn;
    /// End of the last complete, valid record written (not necessarily durable).
    fn write_record_lsn(&self) -> Lsn;
    /// End of the last complete record that is durable. This is the `flush_lsn` the safekeeper
    /// reports: a reply never claims more.
    fn flush_lsn(&self) -> Lsn;
    /// Appends `buf` at `start`. Strict continuity: `start` must equal `write_lsn()` (unless the
    /// store is empty). Not durable until [`WalStore::flush_wal`].
    fn write_wal(&mut self, start: Lsn, buf: &[u8]) -> Result<()>;
    /// Drops all WAL at and after `end` durably, and sets every LSN to `end`. Writes are refused
    /// after start-up until the first truncation has succeeded.
    fn truncate_wal(&mut self, end: Lsn) -> Result<()>;
    /// Makes everything written durable (one `fdatasync`).
    fn flush_wal(&mut self) -> Result<()>;
    /// Prepares an empty store to receive WAL starting at `init_lsn` (which may be mid-segment
    /// and mid-page): writes the segment's page headers so the segment decodes.
    fn initialize_first_segment(&mut self, init_lsn: Lsn) -> Result<()>;
}
