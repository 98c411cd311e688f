//! The symbolizer's memory, given back after each use.
//!
//! Symbolizing (a CPU report, a heap profile, and pprof-rs's first profile, which resolves one
//! backtrace to warm itself up) goes through the `backtrace` crate, whose global cache parses the
//! binary's DWARF onto the heap and keeps it, with the binary's mapping, for the life of the
//! process: ~150 MiB for the safekeeper, which made the idle daemon ten times bigger than its work.
//! A [`Symbolizing`] guard marks one symbolization; when the last one ends, the cache is cleared
//! and jemalloc hands the freed pages back to the kernel at once. The next profile parses the
//! debug info again (~0.1 s of CPU, measured in `profiling/README.md`), a price paid only while
//! profiles are being taken.

use std::sync::Mutex;

/// Symbolizations in progress.
static ACTIVE: Mutex<usize> = Mutex::new(0);

/// Held while symbolizing; the last one dropped frees the symbolizer's cache.
pub(crate) struct Symbolizing(());

impl Symbolizing {
    pub(crate) fn begin() -> Self {
        *ACTIVE.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Symbolizing(())
    }
}

impl Drop for Symbolizing {
    fn drop(&mut self) {
        let mut active = ACTIVE.lock().unwrap_or_else(|e| e.into_inner());
        *active -= 1;
        if *active == 0 {
            // Under the lock, so that no symbolization starts while the cache is being freed
            // (it would only have to parse again; backtrace's own lock keeps it safe either way).
            backtrace::clear_symbol_cache();
            purge();
        }
    }
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
