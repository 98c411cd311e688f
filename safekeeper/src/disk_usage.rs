//! Disk-usage limits (`--max-timeline-disk-usage`, `--max-disk-usage-ratio`): a task measures
//! each timeline's directory (allocated bytes, so sparse segments count as what they use) and
//! the data directory's file system, and marks the timelines past a limit; their appends are
//! then refused with an error naming the limit (reads, backup and removal go on), until a later
//! measurement finds them back under it (backup and removal freed space): ingestion resumes by
//! itself.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::registry::GlobalTimelines;

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
    if used + avail == 0.0 {
        return Ok(0.0);
    }
    Ok(used / (used + avail))
}

/// Measures every `tick` and marks the timelines past a limit (see the module docs). Runs
/// until `cancel`.
pub async fn run(
    timelines: Arc<GlobalTimelines>,
    limits: DiskLimits,
    tick: Duration,
    cancel: CancellationToken,
) {
    let mut ticker = crate::ticker::Ticker::new(tick);
    while ticker.tick(&cancel).await {
        let (timelines, limits) = (timelines.clone(), limits.clone());
        let _ = tokio::task::spawn_blocking(move || measure(&timelines, &limits)).await;
    }
}

/// One measurement of every timeline (blocking).
pub fn measure(timelines: &GlobalTimelines, limits: &DiskLimits) {
    let ratio = if limits.max_fs_ratio > 0.0 {
        match fs_usage_ratio(&limits.datadir) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!("measuring the data directory's file system: {e}");
                None
            }
        }
    } else {
        None
    };
    for tl in timelines.all() {
        let used = match dir_usage(&tl.dir) {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!("measuring {}: {e}", tl.dir.display());
                continue;
            }
        };
        let v = limits.violation(used, ratio);
        if tl.set_disk_limit(v.clone()) {
            let _span = crate::timeline::span(&tl.ttid).entered();
            match v {
                Some(why) => tracing::warn!("refusing appends: {why}"),
                None => tracing::info!("disk usage back under the limits: appends resume"),
            }
        }
    }
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
        assert!(tl.set_disk_limit(l.violation(200, None)));
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
        assert!(tl.set_disk_limit(l.violation(50, None)));
        append(&tl, 1, start, &wal, Lsn::INVALID, true);
        assert_eq!(tl.positions().flush_lsn, walgen.lsn());
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
