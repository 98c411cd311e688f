//! What profiling costs.
//!
//! - `cpu_profile/profiler={off,99hz}`: a fixed CPU-bound workload with and without a 99 Hz
//!   CPU profile running, side by side in one run.
//! - `alloc/size=N`: allocate-and-free of N bytes. Run it three times to compare allocators:
//!   `cargo bench -p profiling --bench overhead -- alloc` (jemalloc, heap profiling on),
//!   `MALLOC_CONF=prof:false cargo bench ...` (jemalloc, profiling off), and
//!   `BENCH_ALLOCATOR=glibc cargo bench ...` (glibc's malloc for every Rust allocation).

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

unsafe impl GlobalAlloc for Dispatch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if USE_GLIBC.load(Ordering::Relaxed) {
            if layout.align() <= 16 {
                unsafe { __libc_malloc(layout.size()) }
            } else {
                unsafe { __libc_memalign(layout.align(), layout.size()) }
            }
        } else {
            unsafe { tikv_jemallocator::Jemalloc.alloc(layout) }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if USE_GLIBC.load(Ordering::Relaxed) {
            unsafe { __libc_free(ptr) }
        } else {
            unsafe { tikv_jemallocator::Jemalloc.dealloc(ptr, layout) }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if USE_GLIBC.load(Ordering::Relaxed) && layout.align() <= 16 {
            unsafe { __libc_realloc(ptr, new_size) }
        } else if USE_GLIBC.load(Ordering::Relaxed) {
            let new =
                unsafe { self.alloc(Layout::from_size_align_unchecked(new_size, layout.align())) };
            if !new.is_null() {
                unsafe { std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size)) };
                unsafe { self.dealloc(ptr, layout) };
            }
            new
        } else {
            unsafe { tikv_jemallocator::Jemalloc.realloc(ptr, layout, new_size) }
        }
    }
}

#[global_allocator]
static GLOBAL: Dispatch = Dispatch;

#[allow(non_upper_case_globals)]
#[unsafe(export_name = "malloc_conf")]
pub static malloc_conf: &u8 = &profiling::__private::MALLOC_CONF_NUL[0];

/// Runs before `main` (and before the Rust runtime allocates): picks the allocator.
extern "C" fn choose_allocator() {
    // SAFETY: getenv with a NUL-terminated name; no allocation.
    let v = unsafe { libc::getenv(c"BENCH_ALLOCATOR".as_ptr()) };
    if !v.is_null() && unsafe { std::ffi::CStr::from_ptr(v) }.to_bytes() == b"glibc" {
        USE_GLIBC.store(true, Ordering::Relaxed);
    }
}

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
