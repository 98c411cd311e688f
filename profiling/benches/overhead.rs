//! What profiling costs.
//!
//! - `cpu_profile/profiler={off,99hz}`: a fixed CPU-bound workload with and without a 99 Hz
//!   CPU profile running, side by side in one run.
//! - `alloc/size=N`: allocate-and-free of N bytes. Run it three times to compare allocators:
//!   `cargo bench -p profiling --bench overhead -- alloc` (jemalloc, heap profiling on),
//!   `MALLOC_CONF=prof:false cargo bench ...` (jemalloc, profiling off), and
//!   `BENCH_ALLOCATOR=glibc cargo bench ...` (glibc's malloc for every Rust allocation).

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

/// Rust allocations go to jemalloc, or to glibc's own malloc when `BENCH_ALLOCATOR=glibc`
/// (decided before `main`, so no pointer crosses allocators).
struct Dispatch;

static USE_GLIBC: AtomicBool = AtomicBool::new(false);

unsafe extern "C" {
    fn __libc_malloc(size: usize) -> *mut u8;
    fn __libc_free(ptr: *mut u8);
    fn __libc_memalign(align: usize, size: usize) -> *mut u8;
    fn __libc_realloc(ptr: *mut u8, size: usize) -> *mut u8;
}

// SAFETY: every pointer is allocated and freed by the same allocator: `USE_GLIBC` is set once,
// before `main` and before the first allocation, and never changes; each branch forwards to an
// allocator that upholds `GlobalAlloc`'s contract for the layouts it is given.
unsafe impl GlobalAlloc for Dispatch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if USE_GLIBC.load(Ordering::Relaxed) {
            if layout.align() <= 16 {
                // SAFETY: glibc's malloc returns memory aligned to 16 bytes, enough for `layout`.
                unsafe { __libc_malloc(layout.size()) }
            } else {
                // SAFETY: memalign with the layout's (power-of-two) alignment.
                unsafe { __libc_memalign(layout.align(), layout.size()) }
            }
        } else {
            // SAFETY: the caller upholds `alloc`'s contract (non-zero size), passed on as is.
            unsafe { tikv_jemallocator::Jemalloc.alloc(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if USE_GLIBC.load(Ordering::Relaxed) {
            // SAFETY: `ptr` came from glibc (the allocator never changes after start-up).
            unsafe { __libc_free(ptr) }
        } else {
            // SAFETY: `ptr` came from jemalloc with this `layout` (the caller's contract).
            unsafe { tikv_jemallocator::Jemalloc.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if USE_GLIBC.load(Ordering::Relaxed) && layout.align() <= 16 {
            // SAFETY: `ptr` came from glibc's malloc; realloc keeps its 16-byte alignment.
            unsafe { __libc_realloc(ptr, new_size) }
        } else if USE_GLIBC.load(Ordering::Relaxed) {
            // SAFETY: `layout.align()` is a valid alignment and the caller guarantees that
            // `new_size`, rounded up to it, does not overflow `isize`.
            let new =
                unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
            if !new.is_null() {
                // SAFETY: both blocks are live, distinct and at least this long.
                unsafe { std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
                // SAFETY: `ptr` was allocated by `self` with `layout` and is not used again.
                unsafe { self.dealloc(ptr, layout) };
            }
            new
        } else {
            // SAFETY: `ptr` came from jemalloc with `layout` (the caller's contract).
            unsafe { tikv_jemallocator::Jemalloc.realloc(ptr, layout, new_size) }
        }
    }
}

#[global_allocator]
static GLOBAL: Dispatch = Dispatch;

// SAFETY: the symbol jemalloc reads its options from, pointing at a static NUL-terminated
// string, as `profiling::global_allocator!` defines it.
#[allow(non_upper_case_globals)]
#[unsafe(export_name = "malloc_conf")]
pub static malloc_conf: &u8 = &profiling::__private::MALLOC_CONF_NUL[0];

/// Runs before `main` (and before the Rust runtime allocates): picks the allocator.
extern "C" fn choose_allocator() {
    // SAFETY: getenv with a NUL-terminated name; no allocation.
    let v = unsafe { libc::getenv(c"BENCH_ALLOCATOR".as_ptr()) };
    // SAFETY: a non-null getenv result is a NUL-terminated string that lives while the
    // environment is not modified (nothing modifies it before `main`).
    if !v.is_null() && unsafe { std::ffi::CStr::from_ptr(v) }.to_bytes() == b"glibc" {
        USE_GLIBC.store(true, Ordering::Relaxed);
    }
}

// SAFETY: `.init_array` holds `extern "C" fn()` pointers the loader calls before `main`;
// `choose_allocator` has that signature and only reads the environment.
#[used]
#[unsafe(link_section = ".init_array")]
static CHOOSE_ALLOCATOR: extern "C" fn() = choose_allocator;

/// The fixed CPU-bound workload: CRC-32C-like mixing over a 64 KiB buffer.
#[inline(never)]
fn workload(buf: &[u8]) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for chunk in buf.chunks_exact(8) {
        let v = u64::from_le_bytes(chunk.try_into().expect("8-byte chunk"));
        h = (h ^ v).wrapping_mul(0x100000001b3).rotate_left(17);
    }
    h
}

fn cpu_profile(c: &mut Criterion) {
    let buf: Vec<u8> = (0..64 * 1024).map(|i| (i * 31 % 251) as u8).collect();
    let mut g = c.benchmark_group("cpu_profile");
    g.throughput(Throughput::Bytes(buf.len() as u64));
    g.measurement_time(Duration::from_secs(5));
    // Interleave the two variants so drift on the machine affects both alike.
    for round in 0..2 {
        g.bench_function(BenchmarkId::new("profiler=off", round), |b| {
            b.iter(|| workload(black_box(&buf)))
        });
        g.bench_function(BenchmarkId::new("profiler=99hz", round), |b| {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(99)
                .build()
                .expect("no other profile runs in this bench");
            b.iter(|| workload(black_box(&buf)));
            drop(guard);
        });
    }
    g.finish();
}

fn alloc(c: &mut Criterion) {
    let mut g = c.benchmark_group("alloc");
    g.measurement_time(Duration::from_secs(3));
    for size in [16usize, 256, 4096, 65536] {
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::new("size", size), |b| {
            b.iter(|| {
                let v: Vec<u8> = Vec::with_capacity(black_box(size));
                black_box(&v);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, cpu_profile, alloc);
criterion_main!(benches);
