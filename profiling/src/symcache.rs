//! The symbolizer's memory, given back when profiles stop being taken.
//!
//! Symbolizing (a CPU report, a heap profile, and pprof-rs's start of every CPU profile, which
//! resolves one backtrace to warm itself up) goes through the `backtrace` crate, whose global
//! cache parses the binary's DWARF onto the heap and keeps it, with the binary's mapping, for the
//! life of the process: ~150 MiB for the safekeeper, which made the idle daemon ten times bigger
//! than its work. A [`Symbolizing`] guard marks one symbolization. Once none has run for
//! `PROFILING_SYMBOL_CACHE_SECS` seconds (default 60: an always-on scraper, every 10-60 s, keeps
//! the cache and does not parse ~0.5 s of debug info per profile), a reaper thread clears the
//! cache and jemalloc hands the freed pages back to the kernel at once. `0` frees right after each
//! profile.

use std::sync::{Condvar, Mutex, MutexGuard, Once, OnceLock};
use std::time::{Duration, Instant};

/// The environment variable that sets how long the cache outlives the last symbolization.
const LINGER_ENV: &str = "PROFILING_SYMBOL_CACHE_SECS";
const DEFAULT_LINGER: Duration = Duration::from_secs(60);

struct State {
    /// Symbolizations in progress.
    active: usize,
    /// When the last one ended, while the cache is still held.
    idle_since: Option<Instant>,
}

static STATE: Mutex<State> = Mutex::new(State {
    active: 0,
    idle_since: None,
});
static WAKE: Condvar = Condvar::new();

fn state() -> MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long the cache is kept after the last symbolization (`PROFILING_SYMBOL_CACHE_SECS`; an
/// unreadable value is the default, with a warning).
fn linger() -> Duration {
    static LINGER: OnceLock<Duration> = OnceLock::new();
    *LINGER.get_or_init(|| match std::env::var(LINGER_ENV) {
        Err(_) => DEFAULT_LINGER,
        Ok(v) => v
            .trim()
            .parse()
            .map(Duration::from_secs)
            .unwrap_or_else(|_| {
                tracing::warn!(value = %v, "{LINGER_ENV} is not a number of seconds; using 60");
                DEFAULT_LINGER
            }),
    })
}

/// Held while symbolizing.
pub(crate) struct Symbolizing(());

impl Symbolizing {
    pub(crate) fn begin() -> Self {
        let mut s = state();
        s.active += 1;
        s.idle_since = None;
        Symbolizing(())
    }
}

impl Drop for Symbolizing {
    fn drop(&mut self) {
        let mut s = state();
        s.active -= 1;
        if s.active > 0 {
            return;
        }
        if linger().is_zero() {
            free();
        } else {
            s.idle_since = Some(Instant::now());
            start_reaper();
            WAKE.notify_one();
        }
    }
}

/// Frees the cache now if nothing is being symbolized (start-up's warm-up: nobody profiles yet).
pub(crate) fn free_now() {
    let mut s = state();
    if s.active == 0 {
        s.idle_since = None;
        free();
    }
}

fn start_reaper() {
    static STARTED: Once = Once::new();
    STARTED.call_once(|| {
        let spawned = std::thread::Builder::new()
            .name("symbol-cache".into())
            .spawn(reap);
        if let Err(e) = spawned {
            tracing::warn!("cannot start the symbol cache reaper, the cache is kept: {e}");
        }
    });
}

/// Frees the cache once it has been idle for the linger time.
fn reap() {
    let mut s = state();
    loop {
        s = match (s.active, s.idle_since) {
            (0, Some(since)) => {
                let due = since + linger();
                let now = Instant::now();
                if now >= due {
                    s.idle_since = None;
                    // Under the lock: no symbolization starts while the cache is freed (it would
                    // only have to parse again; backtrace's own lock keeps it safe either way).
                    free();
                    s
                } else {
                    WAKE.wait_timeout(s, due - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            }
            _ => WAKE.wait(s).unwrap_or_else(|e| e.into_inner()),
        };
    }
}

fn free() {
    backtrace::clear_symbol_cache();
    purge();
}

/// Returns every arena's unused dirty pages to the kernel now, instead of after jemalloc's decay
/// time.
fn purge() {
    // MALLCTL_ARENAS_ALL (4096): every arena.
    const PURGE_ALL: &[u8] = b"arena.4096.purge\0";
    // SAFETY: `arena.<i>.purge` must be called with no old and no new value (null pointers,
    // zero length), which is what we pass; the name is NUL-terminated.
    let rc = unsafe {
        tikv_jemalloc_sys::mallctl(
            PURGE_ALL.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        )
    };
    if rc != 0 {
        tracing::debug!(errno = rc, "jemalloc arena purge failed");
    }
}
