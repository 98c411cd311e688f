//! Disk-usage limits (`--max-timeline-disk-usage`, `--max-disk-usage-ratio`): a task
//! ([`crate::lifecycle::run_disk_limits`]) measures
//! each timeline's directory (allocated bytes, so sparse segments count as what they use) and
//! the data directory's file system, and marks the timelines past a limit; their appends are
//! then refused with an error naming the limit (reads, backup and removal go on), until a later
//! measurement finds them back under it (backup and removal freed space): ingestion resumes by
//! itself.
//!
//! Between two measurements the limits still hold to within one append at any ingest rate
//! (issue 26, defect 9: a 32 MiB push once went whole into an 8 MiB limit within the second
//! between samples): each timeline keeps its last measurement as a [`Gauge`], and an append
//! counts every byte appended since then ([`Gauge::refusal`]) — the timeline's own for its
//! directory, the node's ([`APPENDED_BYTES`]) for the file system. The next measurement
//! replaces the estimate (segment preallocation, removal and other writers are what it
//! corrects).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use sk_core::types::Lsn;

/// The limits; zero means no limit.
#[derive(Clone, Debug)]
pub struct DiskLimits {
    /// Most bytes one timeline's directory may use.
    pub max_timeline_bytes: u64,
    /// Most used fraction of the data directory's file system (0 < r < 1).
    pub max_fs_ratio: f64,
    /// The data directory.
    pub datadir: PathBuf,
}

impl DiskLimits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.max_timeline_bytes > 0 || self.max_fs_ratio > 0.0
    }

    /// Why a timeline using `used` bytes, on a file system used to `fs_ratio`, must refuse
    /// appends; `None` if it may append.
    pub fn violation(&self, used: u64, fs_ratio: Option<f64>) -> Option<String> {
        if self.max_timeline_bytes > 0 && used >= self.max_timeline_bytes {
            return Some(format!(
                "appending WAL: the timeline uses {used} bytes, at its limit \
                 --max-timeline-disk-usage {} (appends resume once backup and removal free space)",
                self.max_timeline_bytes
            ));
        }
        if let Some(r) = fs_ratio
            && self.max_fs_ratio > 0.0
            && r >= self.max_fs_ratio
        {
            return Some(format!(
                "appending WAL: the data directory's file system is {:.1}% used, at the limit \
                 --max-disk-usage-ratio {} (appends resume once space is freed)",
                r * 100.0,
                self.max_fs_ratio
            ));
        }
        None
    }
}

/// WAL bytes appended on this node (all timelines), counted by every accepted append: what the
/// file system's usage grew by since its last measurement, at least.
pub static APPENDED_BYTES: AtomicU64 = AtomicU64::new(0);

/// A file system's usage as measured.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FsSample {
    /// The used fraction then.
    pub ratio: f64,
    /// Its size in bytes (used + available to non-root users).
    pub size: u64,
    /// [`APPENDED_BYTES`] then.
    pub appended_at: u64,
}

/// One timeline's last measurement, and the limits it is held to.
#[derive(Clone, Debug, Default)]
pub struct Gauge {
    /// `None`: no limit (the node has none, or nothing was measured yet).
    pub limits: Option<DiskLimits>,
    /// Bytes the timeline's directory used when measured.
    pub used: u64,
    /// The timeline's write LSN when measured (taken before the directory was read).
    pub at: Lsn,
    /// The file system, if `--max-disk-usage-ratio` is set and it could be measured.
    pub fs: Option<FsSample>,
}

impl Gauge {
    /// Why an append starting at `begin` must be refused; `None` if it may go. Counts the
    /// timeline's bytes from the measurement's write LSN to `begin`, and the node's appended
    /// bytes since the file system's measurement.
    pub fn refusal(&self, begin: Lsn) -> Option<String> {
        let limits = self.limits.as_ref()?;
        let used = self.used + begin.0.saturating_sub(self.at.0);
        let ratio = self.fs.map(|f| {
            let grown = APPENDED_BYTES
                .load(Ordering::Relaxed)
                .saturating_sub(f.appended_at);
            f.ratio + grown as f64 / f.size.max(1) as f64
        });
        limits.violation(used, ratio)
    }
}

/// Bytes allocated to the files of directory `dir` (not recursive).
pub fn dir_usage(dir: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir)? {
        let m = e?.metadata()?;
        if m.is_file() {
            total += m.blocks() * 512;
        }
    }
    Ok(total)
}

/// The used fraction of the file system holding `path` (as `df`: of the space non-root users
/// may use).
pub fn fs_usage_ratio(path: &Path) -> std::io::Result<f64> {
    fs_usage(path).map(|s| s.ratio)
}

/// The used fraction and size of the file system holding `path`, with [`APPENDED_BYTES`] read
/// first (so bytes appended while it is measured are counted twice, not missed).
pub fn fs_usage(path: &Path) -> std::io::Result<FsSample> {
    let appended_at = APPENDED_BYTES.load(Ordering::Relaxed);
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("path with a NUL byte"))?;
    // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path, `st` a valid, writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let used = st.f_blocks.saturating_sub(st.f_bfree) as f64;
    let avail = st.f_bavail as f64;
    let size = ((used + avail) * st.f_frsize as f64) as u64;
    let ratio = if used + avail == 0.0 {
        0.0
    } else {
        used / (used + avail)
    };
    Ok(FsSample {
        ratio,
        size,
        appended_at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_violation_names_the_limit_and_clears_below_it() {
        let l = DiskLimits {
            max_timeline_bytes: 100,
            max_fs_ratio: 0.9,
            datadir: PathBuf::from("/"),
        };
        assert!(l.violation(99, Some(0.5)).is_none());
        assert!(
            l.violation(100, None)
                .unwrap()
                .contains("--max-timeline-disk-usage 100")
        );
        assert!(
            l.violation(0, Some(0.95))
                .unwrap()
                .contains("--max-disk-usage-ratio 0.9")
        );
        let off = DiskLimits {
            max_timeline_bytes: 0,
            max_fs_ratio: 0.0,
            datadir: PathBuf::from("/"),
        };
        assert!(!off.any());
        assert!(off.violation(u64::MAX, Some(1.0)).is_none());
    }

    /// Past a limit an append is refused with the limit's error and nothing is written; once the
    /// limit clears, the same append is taken. Messages without WAL still go through.
    #[test]
    fn appends_are_refused_naming_the_limit_and_resume_when_it_clears() {
        use pg_wal::generator::WalGenerator;
        use sk_core::protocol::ProposerAcceptorMessage;
        use sk_core::types::Lsn;

        use crate::test_util::{append, elected_timeline, sim_node};
        const SEG: u64 = 1 << 20;
        let (_sim, _fs, timelines) = sim_node();
        let start = Lsn(SEG);
        let tl = elected_timeline(&timelines, 9, SEG, start);
        let mut walgen = WalGenerator::new(42, SEG, start).unwrap();
        let mut wal = Vec::new();
        walgen.fill(&mut wal, 10_000, &[1; 100]);
        let l = DiskLimits {
            max_timeline_bytes: 100,
            max_fs_ratio: 0.0,
            datadir: PathBuf::from("/"),
        };
        let gauge = |used| Gauge {
            limits: Some(l.clone()),
            used,
            at: start,
            fs: None,
        };
        assert!(tl.set_disk_gauge(gauge(200)).is_some());
        let msg = ProposerAcceptorMessage::AppendRequest(sk_core::protocol::AppendRequest {
            h: sk_core::protocol::AppendRequestHeader {
                generation: sk_core::types::Generation(0),
                term: sk_core::types::Term(1),
                begin_lsn: start,
                end_lsn: Lsn(start.0 + wal.len() as u64),
                commit_lsn: Lsn::INVALID,
                truncate_lsn: Lsn(start.0 + 100),
            },
            wal_data: bytes::Bytes::from(wal.clone()),
        });
        let err = tl.process_msg(&msg).unwrap_err().to_string();
        assert!(err.contains("--max-timeline-disk-usage 100"), "{err}");
        assert_eq!(tl.positions().flush_lsn, start, "nothing written");
        assert_eq!(
            tl.status().peer_horizon_lsn,
            Lsn(start.0 + 100),
            "the refused append's header is taken: removal below the peers' horizon frees space"
        );
        assert!(tl.set_disk_gauge(gauge(50)).is_some());
        append(&tl, 1, start, &wal, Lsn::INVALID, true);
        assert_eq!(tl.positions().flush_lsn, walgen.lsn());
    }

    /// Issue 26, defect 9: between two measurements every appended byte counts at once, so an
    /// unpaced push stops within one append of the limit, not a measurement later.
    #[test]
    fn bytes_appended_since_the_measurement_count_at_once() {
        use pg_wal::generator::WalGenerator;
        use sk_core::types::Lsn;

        use crate::test_util::{elected_timeline, sim_node};
        const SEG: u64 = 1 << 20;
        let (_sim, _fs, timelines) = sim_node();
        let start = Lsn(SEG);
        let tl = elected_timeline(&timelines, 9, SEG, start);
        let limit = 3 * SEG;
        let l = DiskLimits {
            max_timeline_bytes: limit,
            max_fs_ratio: 0.0,
            datadir: PathBuf::from("/"),
        };
        // Measured once, well under the limit; no measurement after.
        assert!(
            tl.set_disk_gauge(Gauge {
                limits: Some(l),
                used: SEG,
                at: start,
                fs: None,
            })
            .is_none()
        );
        let mut walgen = WalGenerator::new(42, SEG, start).unwrap();
        let piece = 64 << 10;
        let mut refused = None;
        for _ in 0..200 {
            let mut wal = Vec::new();
            let begin = walgen.lsn();
            walgen.fill(&mut wal, piece, &[1; 1000]);
            let msg = crate::test_util::append_msg(1, begin, &wal, Lsn::INVALID);
            match crate::blocking::section(|| tl.process_msg(&msg)) {
                Ok(_) => {}
                Err(e) => {
                    refused = Some((begin, e.to_string()));
                    break;
                }
            }
        }
        let (at, err) = refused.expect("the push is stopped at the limit");
        assert!(err.contains("--max-timeline-disk-usage"), "{err}");
        let used = SEG + (at.0 - start.0);
        assert!(
            (limit..limit + 2 * piece as u64).contains(&used),
            "stopped at {used} bytes, the limit is {limit}: within one append"
        );
    }

    /// The node-wide count feeds the file-system ratio between its measurements.
    #[test]
    fn the_file_system_ratio_counts_the_nodes_appends_since_it_was_measured() {
        let l = DiskLimits {
            max_timeline_bytes: 0,
            max_fs_ratio: 0.5,
            datadir: PathBuf::from("/"),
        };
        let now = APPENDED_BYTES.load(Ordering::Relaxed);
        let g = Gauge {
            limits: Some(l),
            used: 0,
            at: Lsn(0),
            fs: Some(FsSample {
                ratio: 0.4,
                size: 1000,
                appended_at: now.saturating_sub(200),
            }),
        };
        // 0.4 + at least 200 / 1000 >= 0.5.
        assert!(
            g.refusal(Lsn(0))
                .unwrap()
                .contains("--max-disk-usage-ratio 0.5")
        );
    }

    #[test]
    fn usage_counts_allocated_bytes_not_sparse_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(dir.path().join("sparse")).unwrap();
        f.set_len(64 << 20).unwrap();
        std::fs::write(dir.path().join("full"), vec![1u8; 1 << 20]).unwrap();
        let used = dir_usage(dir.path()).unwrap();
        assert!((1 << 20..8 << 20).contains(&used), "{used}");
        let r = fs_usage_ratio(dir.path()).unwrap();
        assert!((0.0..=1.0).contains(&r), "{r}");
    }
}
