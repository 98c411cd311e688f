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
///
/// A directory that is gone (renamed or removed by a concurrent delete of its timeline) is an
/// error, not a reason to abort: nothing in it is there to be made durable, and the caller's
/// operation fails. Opening the directory is the only step that can report it: fsync itself
/// never returns `ENOENT` or `ENOTDIR`, so every other failure still aborts.
pub fn fsync_dir(fs: &Fs, dir: &Path) -> super::Result<()> {
    match fs.sync_dir(dir) {
        Err(e) if gone(&e) && !crate::failpoint::active("wal-fsync-error") => Err(
            super::Error::io(format!("syncing directory {}", dir.display()), e),
        ),
        res => {
            check_or_abort(res, dir);
            Ok(())
        }
    }
}

fn gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
    )
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
        fsync_dir(fs, dir)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;

    use super::*;

    /// Set in the child process [`a_failed_fsync_aborts_the_process`] starts.
    const CHILD: &str = "SK_CORE_DURABLE_TEST_CHILD";

    /// The child's body: syncs a directory whose fsync fails (procfs answers EINVAL). Does
    /// nothing unless started by [`a_failed_fsync_aborts_the_process`].
    #[test]
    fn child_syncs_a_directory_whose_fsync_fails() {
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        let res = fsync_dir(&Fs::real(), Path::new("/proc/self"));
        // Not reached when the abort works.
        println!("fsync_dir returned {res:?}");
        std::process::exit(0);
    }

    #[test]
    fn a_failed_fsync_aborts_the_process() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "storage::durable::tests::child_syncs_a_directory_whose_fsync_fails",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD, "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.signal(),
            Some(libc::SIGABRT),
            "{:?}\nstdout: {}\nstderr: {stderr}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
        assert!(
            stderr.contains("FATAL: fsync of /proc/self failed"),
            "{stderr}"
        );
    }

    #[test]
    fn syncing_a_directory_that_is_gone_is_an_error_not_an_abort() {
        let tmp = tempfile::tempdir().unwrap();
        let fs = Fs::real();
        let gone = tmp.path().join("timeline");
        assert!(matches!(
            fsync_dir(&fs, &gone),
            Err(crate::storage::Error::Io { ref source, .. }) if source.kind() == std::io::ErrorKind::NotFound
        ));
        // A file where the directory was (ENOTDIR on a path through it).
        std::fs::write(&gone, b"x").unwrap();
        assert!(fsync_dir(&fs, &gone.join("sub")).is_err());
        // A directory that exists syncs.
        fsync_dir(&fs, tmp.path()).unwrap();
    }
}
