//! Durability primitives shared by the file stores: fsync that aborts the process on failure,
//! directory fsync, and durable rename.
//!
//! Why abort: after a failed `fsync` the kernel may have dropped the dirty pages and cleared the
//! error, so a retry can "succeed" without the data being on disk (the PostgreSQL "fsyncgate"
//! lesson). The only safe reaction is to stop and recover from what is really on disk. Every
//! fsync in this crate goes through [`fsync_or_abort`]. A full disk on `write`/`set_len` is not
//! fatal: callers map it to [`super::Error::NoSpace`] with [`super::Error::io`].

use std::path::Path;

use super::fs::{FileHandle, Fs, SyncKind};

/// Syncs `file` (named `path` in the log) or aborts the process: the one place a failed fsync
/// is handled.
pub fn fsync_or_abort(file: &dyn FileHandle, path: &Path, kind: SyncKind) {
    check_or_abort(file.sync(kind), path);
}

fn check_or_abort(res: std::io::Result<()>, path: &Path) {
    let res = if crate::failpoint::active("wal-fsync-error") {
        Err(std::io::Error::from_raw_os_error(libc::EIO))
    } else {
        res
    };
    if let Err(e) = res {
        tracing::error!(path = %path.display(), error = %e, "fsync failed: aborting (a retried fsync can falsely succeed)");
        eprintln!("FATAL: fsync of {} failed: {e}; aborting", path.display());
        std::process::abort();
    }
}

/// Makes the entries of directory `dir` (creations, renames, deletions) durable, or aborts.
pub fn fsync_dir(fs: &Fs, dir: &Path) {
    check_or_abort(fs.sync_dir(dir), dir);
}

/// Renames `from` to `to` (both in `dir`) and, unless `no_sync`, makes the rename durable by
/// syncing the directory. The caller has made the file's content durable before.
pub fn durable_rename(
    fs: &Fs,
    from: &Path,
    to: &Path,
    dir: &Path,
    no_sync: bool,
) -> super::Result<()> {
    fs.rename(from, to).map_err(|e| {
        super::Error::io(
            format!("renaming {} to {}", from.display(), to.display()),
            e,
        )
    })?;
    if !no_sync {
        fsync_dir(fs, dir);
    }
    Ok(())
}
