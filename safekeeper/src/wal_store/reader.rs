//! Reading WAL back from the segment files, for walsenders and recovery.
//!
//! Not here: writing ([`super::WalFileStore`]), deciding what a reader may see (callers read
//! only below the flush LSN they serve).

use std::path::PathBuf;

use sk_core::storage::fs::Fs;
use sk_core::storage::{Error, Result};
use sk_core::types::Lsn;

use super::segment::{open_segment_ro, segment_path};

/// Largest single [`WalReader::read`]: a bound on what a caller can make us allocate.
pub const MAX_READ_LEN: u64 = 64 << 20;

/// Reads WAL bytes from the segment files of a timeline; independent of the writer, so a
/// walsender can read while appends go on (callers only read below the writer's flush LSN).
#[derive(Clone, Debug)]
pub struct WalReader {
    fs: Fs,
    dir: PathBuf,
    seg_size: u64,
}

impl WalReader {
    /// A reader of the segments in `dir` on the real file system.
    pub fn new(dir: impl Into<PathBuf>, seg_size: u64) -> WalReader {
        WalReader::on(Fs::real(), dir, seg_size)
    }

    /// A reader of the segments in `dir` on file system `fs`.
    pub fn on(fs: Fs, dir: impl Into<PathBuf>, seg_size: u64) -> WalReader {
        WalReader {
            fs,
            dir: dir.into(),
            seg_size,
        }
    }

    /// Whether segment `segno` exists (`.partial` or plain), on the reader's file system.
    pub fn has_segment(&self, segno: u64) -> bool {
        [true, false].into_iter().any(|partial| {
            self.fs
                .exists(&segment_path(&self.dir, segno, self.seg_size, partial))
        })
    }

    /// Appends the WAL bytes `[from, to)` to `out`, crossing segments as needed (each segment
    /// is read from `.partial` first, then its plain name). A missing segment or a short file is
    /// an error, and so is a range over [`MAX_READ_LEN`] (walsenders read 128 KiB at a time).
    /// Segments are preallocated: bytes past the writer's end read as zeros, so callers read
    /// only below the flush LSN they serve.
    pub fn read(&self, from: Lsn, to: Lsn, out: &mut Vec<u8>) -> Result<()> {
        let len = to
            .checked_sub(from)
            .ok_or_else(|| Error::Rejected(format!("read of [{from}, {to}) is reversed")))?;
        if len > MAX_READ_LEN {
            return Err(Error::Rejected(format!(
                "read of [{from}, {to}) exceeds {MAX_READ_LEN} bytes"
            )));
        }
        let at = out.len();
        sk_core::storage::fs::zero_extend(out, len as usize);
        let res = self.read_into(from, &mut out[at..]);
        if res.is_err() {
            out.truncate(at);
        }
        res
    }

    /// Fills `buf` with the WAL bytes starting at `from`.
    pub fn read_into(&self, from: Lsn, buf: &mut [u8]) -> Result<()> {
        let mut lsn = from;
        let mut done = 0;
        while done < buf.len() {
            let segno = lsn.segment_number(self.seg_size);
            let off = lsn.segment_offset(self.seg_size);
            let n = ((self.seg_size - off) as usize).min(buf.len() - done);
            let (f, path) = open_segment_ro(&self.fs, &self.dir, segno, self.seg_size)?
                .ok_or_else(|| {
                    Error::io(
                        format!(
                            "reading WAL at {lsn}: segment {} is missing",
                            segment_path(&self.dir, segno, self.seg_size, false).display()
                        ),
                        std::io::Error::from(std::io::ErrorKind::NotFound),
                    )
                })?;
            f.read_exact_at(&mut buf[done..done + n], off)
                .map_err(|e| Error::io(format!("reading {} at {lsn}", path.display()), e))?;
            done += n;
            lsn = Lsn(lsn.0 + n as u64);
        }
        Ok(())
    }
}
