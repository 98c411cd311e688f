//! A tiny axum service with the `profiling` crate mounted: everything a service author adds to
//! get the same CPU and heap profiles as the safekeeper (see `profiling/README.md`).
//!
//! ```sh
//! cargo run --release -p profiling --example profiled_service -- 127.0.0.1:7677
//! go tool pprof -seconds 5 -top http://127.0.0.1:7677      # /debug/pprof/profile
//! go tool pprof -top http://127.0.0.1:7677/debug/pprof/heap
//! curl -o cpu.svg 'http://127.0.0.1:7677/profile/cpu?seconds=5&format=svg'
//! ```
//!
//! Its own routes, to have something to profile: `GET /` (cheap), `GET /work?ms=N` (burns
//! N ms of CPU), `PUT /retain?mib=N` (keeps N MiB: a leak for the heap delta profile to find;
//! `DELETE /retain` frees it), and `GET /metrics` (Prometheus text with the profiling crate's metrics).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::Query;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, put};

// 1. jemalloc with heap profiling on, as the global allocator (once, in the binary).
profiling::global_allocator!();

fn main() -> anyhow::Result<()> {
    // 1b. First of all: this process may be started as the symbol-index builder (it exits then).
    profiling::maybe_run_helper();
    let addr: SocketAddr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:7677".into())
        .parse()?;
    // 2. Build the CPU profiler's unwinder before any other thread exists.
    profiling::warm_up();
    // 3. The profiling crate's metrics (profile requests, jemalloc statistics).
    profiling::register_metrics();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(serve(addr))
}

async fn serve(addr: SocketAddr) -> anyhow::Result<()> {
    // 4. Merge the profiling routes into the service's router (put authentication in front of
    //    them as for any other admin route).
    let app = Router::new()
        .route("/", get(|| async { "hello\n" }))
        .route("/work", get(work))
        .route("/retain", put(retain).delete(release))
        .route("/metrics", get(metrics))
        .merge(profiling::router());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    eprintln!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// `GET /work?ms=N`: burns N ms (at most 1000) of CPU on a blocking thread.
async fn work(Query(q): Query<HashMap<String, String>>) -> impl IntoResponse {
    let ms = q
        .get("ms")
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(10);
    let ms = ms.min(1000);
    let x = tokio::task::spawn_blocking(move || burn(Duration::from_millis(ms)))
        .await
        .unwrap_or(0);
    format!("{x}\n")
}

#[inline(never)]
fn burn(d: Duration) -> u64 {
    let start = Instant::now();
    let mut x = 88172645463325252u64;
    while start.elapsed() < d {
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
    }
    x
}

/// Memory the service was asked to keep.
static RETAINED: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// `PUT /retain?mib=N`: allocates N MiB (1–1024) and keeps it.
async fn retain(Query(q): Query<HashMap<String, String>>) -> impl IntoResponse {
    let Some(mib) = q
        .get("mib")
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|v| (1..=1024).contains(v))
    else {
        return (
            StatusCode::BAD_REQUEST,
            "mib must be an integer from 1 to 1024\n".to_string(),
        );
    };
    let chunks = retain_memory(mib);
    let mut held = RETAINED.lock().unwrap_or_else(|e| e.into_inner());
    held.extend(chunks);
    (StatusCode::OK, format!("retaining {} MiB\n", held.len()))
}

/// `DELETE /retain`: frees what was retained.
async fn release() -> &'static str {
    RETAINED.lock().unwrap_or_else(|e| e.into_inner()).clear();
    "released\n"
}

#[inline(never)]
fn retain_memory(mib: usize) -> Vec<Vec<u8>> {
    let chunks: Vec<Vec<u8>> = (0..mib)
        .map(|i| vec![(i % 251) as u8 + 1; 1 << 20])
        .collect();
    std::hint::black_box(&chunks);
    chunks
}

async fn metrics() -> impl IntoResponse {
    let mut out = String::new();
    match prometheus::TextEncoder::new().encode_utf8(&prometheus::gather(), &mut out) {
        Ok(()) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)],
            out,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("{e}\n"),
        ),
    }
}
