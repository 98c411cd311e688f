//! Zero-filling the rest of the open segment in the background, for a commit-bound stream that
//! reached a sparse segment (the first segments after a start, before any was prepared: see
//! [`super::prepare`]).
//!
//! Without it, such a stream allocates its blocks by zeros written ahead on the ingest path
//! ([`super::ZERO_AHEAD`] at a time): every 32nd commit of 8 KiB then waits for 256 KiB of zeros
//! and their block allocation in its `fdatasync` (~2 ms against ~0.2 ms, the p99 of the first
//! two segments after every start). Here a helper writes the zeros instead, a piece at a time,
//! each written back before the next and followed by a pause, so a commit finds at most one
//! small piece in its `fdatasync`; a 16 MiB segment is done in a fraction of a second.
//!
//! Safety of the WAL: the helper and the writer share [`Shared`]. The helper writes zeros only
//! into the piece it claimed, at or past `next`, and claims pieces in ascending order; the
//! writer claims everything up to the end of each write (plus its own zero-ahead) before it
//! writes there, waiting if the helper's piece overlaps. So no zero is ever written over an
//! accepted byte, whatever the two threads' timing.
//!
//! Not here: when the fill is started and stopped (the store: at zero-ahead, and at every
//! segment switch, truncation and drop).

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use sk_core::storage::Error;
use sk_core::storage::fs::{Fs, OpenMode};

use super::prepare::{Background, Task};
use super::segment::{Zeros, write_zeros};

/// Bytes of zeros the helper writes (page by page, see [`Zeros::Pages`]) and writes back at a
/// time.
const PIECE: u64 = 64 << 10;

/// What the helper and the writer agree on.
#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    /// Every byte below this is claimed: zeroed by the helper (unless its piece is in flight),
    /// or by the writer, or holding WAL.
    next: u64,
    /// The piece the helper is writing now.
    in_flight: Option<(u64, u64)>,
    /// Set by the store: the helper stops after its current piece.
    stop: bool,
    /// The helper has ended (done, stopped or failed): `next` no longer moves by itself.
    ended: bool,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A background zero-fill of one segment, from its start offset to the segment's end.
///
/// Invariant: the helper has ended before this value is gone (dropping it stops and waits for
/// it), so no helper outlives its store or writes into a segment after a switch or truncation.
#[derive(Debug)]
pub(super) struct Fill {
    segno: u64,
    shared: Arc<Shared>,
    task: Option<Task>,
}

/// What the writer must do before it writes WAL at `[off, end)` of the filled segment.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Claim {
    /// Every block up to `allocated` (`>= end`) is zeroed or holds WAL.
    Allocated { allocated: u64 },
    /// The writer now owns `[from, to)` and must zero it itself (the helper is behind the writer,
    /// has ended, or failed); the helper goes on past `to`.
    ZeroItself { from: u64 },
}

impl Fill {
    /// Starts zero-filling `[from, seg_size)` of the segment file at `path` on `background`'s
    /// runner, pausing after each written-back piece. `None` if the file cannot be opened or the
    /// runner cannot start it (the writer then zeroes ahead by itself, as without a fill).
    pub(super) fn start(
        fs: &Fs,
        path: &Path,
        segno: u64,
        from: u64,
        seg_size: u64,
        background: &Background,
    ) -> Option<Fill> {
        let file = match fs.open(path, OpenMode::ReadWrite) {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "no background zero-fill");
                return None;
            }
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                next: from,
                in_flight: None,
                stop: false,
                ended: false,
            }),
            changed: Condvar::new(),
        });
        let pause = background.runner().write_back_pause();
        let helper = shared.clone();
        let path = path.to_path_buf();
        let task = background.runner().spawn(Box::new(move || {
            // Ended however the helper ends, a panic included: a writer waiting on its piece
            // in flight must not wait forever.
            let _ended = Ended(&helper);
            fill(&helper, &*file, seg_size, pause)
                .map_err(|e| Error::io(format!("zero-filling {}", path.display()), e))
        }));
        let Some(task) = task else {
            shared.lock().ended = true;
            return None;
        };
        Some(Fill {
            segno,
            shared,
            task: Some(task),
        })
    }

    /// The segment being filled.
    pub(super) fn segno(&self) -> u64 {
        self.segno
    }

    /// The writer is about to write WAL at `[off, end)`, and would zero `[.., to)` ahead of
    /// it (`off < end <= to <= seg_size`): waits while the helper's piece overlaps the WAL, then
    /// says whether the blocks are there or which part of `[.., to)` the writer must zero.
    pub(super) fn claim(&self, off: u64, end: u64, to: u64) -> Claim {
        let mut st = self.shared.lock();
        while st.in_flight.is_some_and(|(a, b)| a < end && off < b) {
            st = self
                .shared
                .changed
                .wait(st)
                .unwrap_or_else(|e| e.into_inner());
        }
        if end <= st.next {
            // Below `next` and not in flight: written.
            // The helper's piece in flight (its last one too) lies at or past `end`: only what
            // is certainly written counts, or a later write past `allocated` would skip the
            // claim and land under zeros still to come.
            let allocated = st.in_flight.map_or(st.next, |(a, _)| a);
            return Claim::Allocated { allocated };
        }
        let from = st.next.max(off);
        st.next = to;
        Claim::ZeroItself { from }
    }

    /// Waits until the helper has ended by itself (tests).
    #[cfg(test)]
    pub(super) fn wait(&self) {
        if let Some(t) = &self.task {
            t.wait_finished();
        }
    }

    /// A fill whose helper is in the given state (and runs nowhere): for the claim rules.
    #[cfg(test)]
    fn in_state(next: u64, in_flight: Option<(u64, u64)>) -> Fill {
        Fill {
            segno: 1,
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    next,
                    in_flight,
                    stop: false,
                    ended: false,
                }),
                changed: Condvar::new(),
            }),
            task: None,
        }
    }

    /// Stops the helper and waits for it. A failure only means fewer zeros ahead.
    fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            self.shared.lock().stop = true;
            self.shared.changed.notify_all();
            if let Some(Err(e)) = task.join() {
                tracing::debug!(error = %e, "background zero-fill failed");
            }
        }
    }
}

impl Drop for Fill {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Marks the helper ended (nothing in flight) when dropped.
struct Ended<'a>(&'a Shared);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.in_flight = None;
        st.ended = true;
        drop(st);
        self.0.changed.notify_all();
    }
}

/// The helper: claims, writes and writes back one piece at a time until the segment's end or
/// a stop, resting `pause` (interrupted by a stop) after each piece.
fn fill(
    shared: &Shared,
    file: &dyn sk_core::storage::fs::FileHandle,
    seg_size: u64,
    pause: Duration,
) -> std::io::Result<()> {
    loop {
        let (a, b) = {
            let mut st = shared.lock();
            if st.stop || st.next >= seg_size {
                return Ok(());
            }
            let piece = (st.next, (st.next + PIECE).min(seg_size));
            st.next = piece.1;
            st.in_flight = Some(piece);
            piece
        };
        let written =
            write_zeros(file, a, b, Zeros::Pages).and_then(|()| file.write_back(a, b - a));
        let mut st = shared.lock();
        st.in_flight = None;
        shared.changed.notify_all();
        written?;
        if !pause.is_zero() && !st.stop {
            st = shared
                .changed
                .wait_timeout(st, pause)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(st);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: u64 = 1 << 20;

    /// While the helper writes its last piece, a write below it is told only what lies below
    /// the piece is allocated: a later write across the piece must claim (and wait) again.
    #[test]
    fn the_last_piece_in_flight_is_not_reported_allocated() {
        let a = SEG - PIECE;
        let fill = Fill::in_state(SEG, Some((a, SEG)));
        assert_eq!(
            fill.claim(a - 8192, a, a),
            Claim::Allocated { allocated: a }
        );
        // Nothing in flight: everything claimed counts.
        let fill = Fill::in_state(3 * PIECE, None);
        assert_eq!(
            fill.claim(0, 8192, 8192),
            Claim::Allocated {
                allocated: 3 * PIECE
            }
        );
        // Past the helper's claims: the writer zeroes from there and claims up to `to`.
        let fill = Fill::in_state(PIECE, None);
        assert_eq!(
            fill.claim(PIECE + 100, PIECE + 8292, 2 * PIECE),
            Claim::ZeroItself { from: PIECE + 100 }
        );
        assert_eq!(fill.shared.lock().next, 2 * PIECE);
    }

    /// A helper that panics mid-piece leaves nothing in flight: a writer waiting on that piece
    /// goes on.
    #[test]
    fn a_helper_that_panics_releases_its_piece() {
        let fill = Fill::in_state(2 * PIECE, Some((PIECE, 2 * PIECE)));
        let shared = fill.shared.clone();
        let helper = std::thread::spawn(move || {
            let _ended = Ended(&shared);
            std::thread::sleep(Duration::from_millis(20));
            panic!("the helper dies mid-piece");
        });
        assert_eq!(
            fill.claim(PIECE, PIECE + 8192, PIECE + 8192),
            Claim::Allocated {
                allocated: 2 * PIECE
            }
        );
        assert!(helper.join().is_err());
    }
}
