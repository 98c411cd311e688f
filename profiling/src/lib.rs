//! CPU and heap profiling for any axum service, served over HTTP.
//!
//! Mount [`router`] into a service's `Router` and it answers:
//!
//! - `GET /profile/cpu`: a CPU profile sampled with pprof-rs for `seconds` (1–60, default 5) at
//!   `frequency` Hz (1–1000, default 99), as a gzip-compressed pprof protobuf (`format=pprof`,
//!   the default) or an SVG flamegraph (`format=svg`). One CPU profile runs at a time: another
//!   request gets `409 Conflict` unless it says `force=true`, which cancels the running profile
//!   and takes over. A client that disconnects ends its profile at once.
//! - `GET /profile/heap`: jemalloc's sampled heap profile as a symbolized, gzip-compressed pprof
//!   (`format=pprof`, the default), the raw dump `jeprof` reads (`format=jemalloc`), or an SVG
//!   flamegraph (`format=svg`). With `seconds=N` (1–300) it returns a *delta*: what was allocated
//!   during those N seconds and is still live at the end, so a leak shows as growth.
//! - Go's `net/http/pprof` paths, so `go tool pprof http://host:port`, Grafana Alloy's
//!   `pyroscope.scrape` and Parca work with their defaults: `GET /debug/pprof/profile` (the CPU
//!   profile; `seconds` defaults to 30 as in Go), `GET /debug/pprof/heap` (the heap profile) and
//!   `GET /debug/pprof/allocs` (the same with `alloc_space` as its default type). Heap profiles
//!   carry Go's sample types `alloc_objects/count`, `alloc_space/bytes`, `inuse_objects/count`,
//!   `inuse_space/bytes` and period type `space/bytes`; the `alloc_` ones (cumulative since
//!   start-up) only when jemalloc counts them (`prof_accum:true`, in [`MALLOC_CONF`]).
//!
//! No answer is empty: a CPU profile that caught no samples is a valid pprof with zero samples,
//! or an SVG that says "no samples in N s at F Hz". A profile that a `force=true` request cut
//! short is still answered (200) with what it sampled, and the `X-Profile-Cut-Short` and
//! `X-Profile-Duration-Seconds` headers say so.
//!
//! A binary opts into jemalloc with heap profiling by calling [`global_allocator!`] once at its
//! crate root. Without it the heap route answers `503` with an explanation.
//!
//! What this crate leaves to others: authentication (mount it behind your own middleware), and
//! the service's own metrics (it only adds its request counters and jemalloc's statistics to the
//! default Prometheus registry, see [`register_metrics`]).
//!
//! Truthfulness notes (measured; see `profiling/README.md`):
//! - stacks are unwound with framehop (DWARF CFI from `.eh_frame`), which starts at the
//!   interrupted instruction, so self time lands on the true leaf. Its unwinder is built lazily
//!   inside the first SIGPROF handler; [`warm_up`] builds it at start-up on a thread that
//!   holds no locks, so that allocation never happens inside a handler that interrupted malloc.
//! - `setitimer(ITIMER_PROF)` fires at most once per kernel tick. [`max_sampling_frequency`]
//!   reads the tick from `CLOCK_MONOTONIC_COARSE`'s resolution; a higher `frequency` is clamped
//!   to it (the response says so in `X-Profile-Frequency`), and the profile's period is that
//!   of the rate actually sampled.

mod cpu;
mod error;
mod heap;
mod jeheap;
mod metrics;
mod svg;
mod symbolize;
mod symindex;

use axum::Router;
use axum::routing::get;

pub use cpu::{max_sampling_frequency, warm_up};
pub use error::ProfileError;
pub use metrics::register_metrics;
pub use symindex::{INDEX_DIR_ENV, maybe_run_helper, set_symbol_index_dir};

/// Returns every jemalloc arena's unused dirty pages to the kernel now, instead of after
/// jemalloc's decay time (a service calls it after a one-off burst of allocations, such as
/// loading its state at start-up on many threads).
pub fn purge_unused_memory() {
    symbolize::purge();
}

/// The malloc_conf every profiled binary uses: heap profiling on from the start, one sample per
/// 2 MiB allocated on average (`lg_prof_sample:21`: ~3% overhead measured by neon, against ~7%
/// at jemalloc's default 512 KiB), cumulative allocation counts per stack (`prof_accum:true`:
/// what `/debug/pprof/allocs` reports; it keeps every distinct sampled stack for the life of the
/// process), and a background thread that returns idle dirty pages so RSS comes back down after
/// bursts (e.g. a CPU profile's sample table).
pub const MALLOC_CONF: &str =
    "prof:true,prof_active:true,prof_accum:true,lg_prof_sample:21,background_thread:true";

/// Makes the calling binary run on jemalloc with heap profiling on.
///
/// Call it once at the crate root of a binary (not a library):
///
/// ```ignore
/// profiling::global_allocator!();
/// ```
///
/// It sets the global allocator and exports the `malloc_conf` symbol jemalloc reads at start-up
/// (it must be in the final binary; a library cannot be relied on to keep it linked). The
/// `MALLOC_CONF` environment variable still overrides it at run time, e.g.
/// `MALLOC_CONF=prof:false` to compare with profiling off.
#[macro_export]
macro_rules! global_allocator {
    () => {
        #[global_allocator]
        static GLOBAL_ALLOCATOR: $crate::__private::Jemalloc = $crate::__private::Jemalloc;

        /// jemalloc's options, read by jemalloc itself at start-up (`profiling::MALLOC_CONF`).
        // SAFETY: `malloc_conf` is the symbol jemalloc reads its options from: a pointer to a
        // NUL-terminated string with static lifetime, which `MALLOC_CONF_NUL` is; no other
        // symbol of the binary has this name.
        #[allow(non_upper_case_globals)]
        #[unsafe(export_name = "malloc_conf")]
        pub static malloc_conf: &u8 = &$crate::__private::MALLOC_CONF_NUL[0];
    };
}

#[doc(hidden)]
pub mod __private {
    pub use tikv_jemallocator::Jemalloc;

    /// [`crate::MALLOC_CONF`] as a C string.
    pub const MALLOC_CONF_NUL: &[u8] =
        b"prof:true,prof_active:true,prof_accum:true,lg_prof_sample:21,background_thread:true\0";
}

/// The profiling routes, ready to merge into a service's router:
/// `app.merge(profiling::router())`. Every route is in this one router, so a layer the service
/// puts on it (authentication) covers them all.
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/profile/cpu", get(cpu::handler))
        .route("/profile/heap", get(heap::handler))
        .route("/debug/pprof/profile", get(cpu::go_handler))
        .route("/debug/pprof/heap", get(heap::go_heap_handler))
        .route("/debug/pprof/allocs", get(heap::go_allocs_handler))
}

#[cfg(test)]
mod tests {
    #[test]
    fn malloc_conf_constants_agree() {
        let nul = super::__private::MALLOC_CONF_NUL;
        assert_eq!(nul.last(), Some(&0));
        assert_eq!(&nul[..nul.len() - 1], super::MALLOC_CONF.as_bytes());
    }
}
