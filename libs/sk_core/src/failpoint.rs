//! Failpoints: named switches that make a code path fail on purpose, so tests can prove what
//! happens on a failed fsync or a full disk. Compiled in only with the `testing` feature; without
//! it [`active`] is a constant `false` the optimizer removes.
//!
//! Known failpoints:
//! - `wal-write-enospc`: every WAL append fails with ENOSPC before touching the file;
//! - `wal-fsync-error`: the next WAL or control-file fsync fails (and the process aborts, as it
//!   must after a failed fsync).
//! - `pull-slow`: a `pull_timeline` sleeps 100 ms after each MiB it receives (so a test can
//!   kill the puller mid-transfer).
//! - `recovery-slow`: peer recovery sleeps 50 ms after each message of WAL it receives (so a
//!   test can connect a proposer mid-recovery).

/// Every failpoint the code checks.
pub const KNOWN: &[&str] = &[
    "wal-write-enospc",
    "wal-fsync-error",
    "pull-slow",
    "recovery-slow",
];

#[cfg(feature = "testing")]
static ACTIVE: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());

/// Whether failpoint `name` is switched on.
#[inline]
pub fn active(name: &str) -> bool {
    #[cfg(feature = "testing")]
    {
        ACTIVE.lock().expect("failpoint lock").contains(&name)
    }
    #[cfg(not(feature = "testing"))]
    {
        let _ = name;
        false
    }
}

/// Switches failpoint `name` on or off. Errors for an unknown name (listing the known ones) or
/// in a build without the `testing` feature.
pub fn set(name: &str, on: bool) -> Result<(), String> {
    let Some(&known) = KNOWN.iter().find(|k| **k == name) else {
        return Err(format!(
            "unknown failpoint {name:?}: known failpoints are {}",
            KNOWN.join(", ")
        ));
    };
    #[cfg(feature = "testing")]
    {
        let mut active = ACTIVE.lock().expect("failpoint lock");
        active.retain(|a| *a != known);
        if on {
            active.push(known);
        }
        tracing::warn!(failpoint = known, on, "failpoint switched");
        Ok(())
    }
    #[cfg(not(feature = "testing"))]
    {
        let _ = (known, on);
        Err("failpoints need a build with the `testing` feature".into())
    }
}
