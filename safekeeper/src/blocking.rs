//! Where a thread may block, and the lock order of a timeline, checked in debug builds.
//!
//! A timeline's acceptor lock is held across `fdatasync` (hundreds of microseconds, seconds on a
//! sick disk). A tokio worker that waits for it parks every task scheduled on that worker: two
//! HTTP status requests behind one slow fsync parked the whole runtime once (issue 26). So:
//!
//! - the acceptor lock is taken only inside a **blocking section**: a closure run by [`spawn`]
//!   (tokio's blocking pool; a proposer connection's own runtime runs inside one) or
//!   [`section`] (a thread of its own, a synchronous test). [`assert_may_block`] panics, in debug builds,
//!   when it is called inside a tokio runtime outside such a section: on an async worker;
//! - everything else of a timeline that async code reads lives behind **leaf locks**
//!   ([`LeafMutex`]): held for a copy or an update, never across I/O, and nothing is locked
//!   while one is held. The one order is therefore *acceptor lock, then at most one leaf lock*;
//!   [`LeafMutex::lock`] and [`assert_may_block`] panic, in debug builds, when a lock is taken
//!   while a leaf lock is held on the same thread.
//!
//! Release builds check nothing (the counters are not even touched): the rules are kept by
//! construction, the debug checks make the test suite prove it.
//!
//! Not here: what a timeline keeps behind which lock ([`crate::timeline`]).

use std::cell::Cell;
use std::sync::{Mutex, MutexGuard};

thread_local! {
    /// Blocking sections entered on this thread (and not left).
    static BLOCKING: Cell<u32> = const { Cell::new(0) };
    /// Leaf locks held by this thread.
    static LEAVES: Cell<u32> = const { Cell::new(0) };
}

/// Leaves a blocking section on drop.
struct SectionGuard;

impl Drop for SectionGuard {
    fn drop(&mut self) {
        BLOCKING.with(|b| b.set(b.get() - 1));
    }
}

/// Runs `f` as a blocking section on the current thread (the caller is on a thread that may
/// block: tokio's blocking pool, a dedicated thread, a synchronous test).
pub fn section<R>(f: impl FnOnce() -> R) -> R {
    BLOCKING.with(|b| b.set(b.get() + 1));
    let _guard = SectionGuard;
    f()
}

/// `tokio::task::spawn_blocking` whose closure is a blocking section.
pub fn spawn<F, R>(f: F) -> tokio::task::JoinHandle<R>
where
    F: FnOnce() -> R + Send + 'static,
    R: Send + 'static,
{
    tokio::task::spawn_blocking(move || section(f))
}

/// Debug builds: panics if the current thread must not block here: a tokio runtime is
/// current and no blocking section was entered (an async worker), or a leaf lock is held
/// (the lock order). `what` names the caller for the message.
#[track_caller]
pub fn assert_may_block(what: &str) {
    if !cfg!(debug_assertions) {
        return;
    }
    if LEAVES.with(Cell::get) > 0 {
        panic!("{what} while a leaf lock is held: the lock order is acceptor, then one leaf");
    }
    if BLOCKING.with(Cell::get) == 0 && tokio::runtime::Handle::try_current().is_ok() {
        panic!(
            "{what} on an async worker: it may wait for an fdatasync; run it in \
             blocking::spawn or blocking::section"
        );
    }
}

/// A mutex that is a leaf of the lock order: held only for a copy or an update (never across
/// I/O), and no other lock is taken while it is held (checked in debug builds).
#[derive(Debug, Default)]
pub struct LeafMutex<T>(Mutex<T>);

/// The guard of a [`LeafMutex`].
pub struct LeafGuard<'a, T>(MutexGuard<'a, T>);

impl<T> LeafMutex<T> {
    /// A leaf lock around `value`.
    pub fn new(value: T) -> LeafMutex<T> {
        LeafMutex(Mutex::new(value))
    }

    /// Locks it. Panics (debug builds) if this thread already holds a leaf lock.
    #[track_caller]
    pub fn lock(&self) -> LeafGuard<'_, T> {
        if cfg!(debug_assertions) {
            let held = LEAVES.with(Cell::get);
            assert!(
                held == 0,
                "a leaf lock taken while another is held: leaf locks never nest"
            );
            LEAVES.with(|l| l.set(held + 1));
        }
        LeafGuard(self.0.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl<T> std::ops::Deref for LeafGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for LeafGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T> Drop for LeafGuard<'_, T> {
    fn drop(&mut self) {
        if cfg!(debug_assertions) {
            LEAVES.with(|l| l.set(l.get() - 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(debug_assertions)]
    fn blocking_on_an_async_worker_panics_in_debug_builds() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let on_worker = rt.block_on(async {
            tokio::spawn(async { std::panic::catch_unwind(|| assert_may_block("test")).is_err() })
                .await
                .unwrap()
        });
        assert!(on_worker, "an async worker may not block");
        let in_pool = rt.block_on(async {
            spawn(|| std::panic::catch_unwind(|| assert_may_block("test")).is_ok())
                .await
                .unwrap()
        });
        assert!(in_pool, "a blocking section may block");
        assert!(
            std::panic::catch_unwind(|| assert_may_block("test")).is_ok(),
            "outside any runtime a thread may block"
        );
    }

    #[test]
    #[cfg(debug_assertions)]
    fn nothing_is_locked_under_a_leaf_lock() {
        let (a, b) = (LeafMutex::new(1), LeafMutex::new(2));
        let held = a.lock();
        assert!(std::panic::catch_unwind(|| *b.lock()).is_err());
        assert!(std::panic::catch_unwind(|| assert_may_block("acceptor lock")).is_err());
        drop(held);
        assert_eq!(*b.lock(), 2);
        assert_may_block("acceptor lock");
    }
}
