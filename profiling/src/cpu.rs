//! `GET /profile/cpu`: sampled CPU profiles from pprof-rs.
//!
//! One profile runs at a time (pprof-rs's profiler is process-wide). The running profile holds a
//! slot for its whole life, including report building; a request with `force=true` cancels the
//! holder, which still answers with what it sampled (marked as cut short), and waits for the
//! slot. The profiler guard lives inside the request future, so a client
//! that disconnects drops the future and the guard with it: sampling stops at once.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex as StdMutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Context;
use axum::extract::Query;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use flate2::Compression;
use flate2::write::GzEncoder;
use pprof::protos::Message;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio_util::sync::CancellationToken;

use crate::error::{ProfileError, parse_bounded, parse_choice, parse_flag, reject_unknown};
use crate::metrics::{Outcome, record};
use crate::{svg, symbolize};

const DEFAULT_SECONDS: u64 = 5;
/// Go's `net/http/pprof` default for `/debug/pprof/profile`.
const GO_DEFAULT_SECONDS: u64 = 30;
const DEFAULT_FREQUENCY: u64 = 99;
const MAX_REQUESTABLE_FREQUENCY: u64 = 1000;
/// How long a forced request waits for the cancelled profile to release the profiler.
const FORCE_TAKEOVER_TIMEOUT: Duration = Duration::from_secs(10);

/// The slot a running profile holds, and the token that cancels it.
struct Slot {
    lock: Arc<Mutex<()>>,
    cancel: StdMutex<CancellationToken>,
}

fn slot() -> &'static Slot {
    static SLOT: OnceLock<Slot> = OnceLock::new();
    SLOT.get_or_init(|| Slot {
        lock: Arc::new(Mutex::new(())),
        cancel: StdMutex::new(CancellationToken::new()),
    })
}

/// The highest sampling frequency this machine delivers, in Hz.
///
/// pprof-rs samples with `setitimer(ITIMER_PROF)`, which the kernel checks once per scheduler
/// tick, so the rate cannot exceed `CONFIG_HZ`. The tick length is the resolution of
/// `CLOCK_MONOTONIC_COARSE` (4 ms with `CONFIG_HZ=250`). Falls back to 100 Hz if unknown.
pub fn max_sampling_frequency() -> u64 {
    static MAX: OnceLock<u64> = OnceLock::new();
    *MAX.get_or_init(|| {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_getres writes into the timespec we own.
        let rc = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        let nanos = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
        if rc != 0 || nanos == 0 {
            100
        } else {
            (1_000_000_000 / nanos).clamp(1, MAX_REQUESTABLE_FREQUENCY)
        }
    })
}

/// Builds the stack unwinder before any real profile runs.
///
/// pprof-rs's framehop unwinder is created lazily inside the first SIGPROF handler, and creating
/// it allocates and reads the module list: unsafe if that first signal interrupts a thread inside
/// malloc. Calling this once at start-up, before other threads exist, runs that first handler on a
/// thread that is only spinning. Later handlers do not allocate. Takes a few milliseconds of CPU
/// and no symbolization (pprof-rs's own start-up resolve is patched out: third_party/README.md).
pub fn warm_up() {
    build_unwinder();
}

fn build_unwinder() {
    let Ok(guard) = pprof::ProfilerGuardBuilder::default()
        .frequency(max_sampling_frequency() as i32)
        .build()
    else {
        return; // another profile is running: the unwinder exists already
    };
    let deadline = Instant::now() + Duration::from_millis(500);
    while Instant::now() < deadline {
        spin(Duration::from_millis(5));
        let sampled = guard
            .report()
            .build_unresolved()
            .map(|r| !r.data.is_empty())
            .unwrap_or(false);
        if sampled {
            break;
        }
    }
}

#[inline(never)]
fn spin(d: Duration) {
    let start = Instant::now();
    let mut x = 1u64;
    while start.elapsed() < d {
        for _ in 0..1000 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
    }
}

pub(crate) async fn handler(Query(params): Query<HashMap<String, String>>) -> Response {
    respond(profile(params, DEFAULT_SECONDS).await)
}

/// `GET /debug/pprof/profile`: Go's `net/http/pprof` path (what `go tool pprof URL`, Grafana
/// Alloy's `pyroscope.scrape` and Parca fetch by default). Same profile and parameters as
/// `/profile/cpu`; like Go, `seconds` defaults to 30.
pub(crate) async fn go_handler(Query(params): Query<HashMap<String, String>>) -> Response {
    respond(profile(params, GO_DEFAULT_SECONDS).await)
}

fn respond(result: Result<(Response, bool), ProfileError>) -> Response {
    match result {
        Ok((resp, cut_short)) => {
            record(
                "cpu",
                if cut_short {
                    Outcome::CutShort
                } else {
                    Outcome::Ok
                },
            );
            resp
        }
        Err(e) => {
            record("cpu", Outcome::of_error(&e));
            e.into_response()
        }
    }
}

/// Takes one CPU profile. The `bool` says whether a forced request cut it short.
async fn profile(
    params: HashMap<String, String>,
    default_seconds: u64,
) -> Result<(Response, bool), ProfileError> {
    reject_unknown(&params, &["format", "seconds", "frequency", "force"])?;
    let format = parse_choice("format", params.get("format"), &["pprof", "svg"])?;
    let seconds = parse_bounded("seconds", params.get("seconds"), default_seconds, 1..=60)?;
    let requested = parse_bounded(
        "frequency",
        params.get("frequency"),
        DEFAULT_FREQUENCY,
        1..=MAX_REQUESTABLE_FREQUENCY,
    )?;
    let force = parse_flag("force", params.get("force"))?;
    let max = max_sampling_frequency();
    // Sample at the rate the kernel can deliver, and label the profile with that rate, so the
    // CPU time it reports is true.
    let frequency = requested.min(max);

    let (held, cancel) = acquire(force).await?;
    // Starting a profile captures one backtrace (pprof-rs warms its unwinder that way):
    // blocking work, kept off the executor threads.
    let guard = tokio::task::spawn_blocking(move || {
        pprof::ProfilerGuardBuilder::default()
            .frequency(frequency as i32)
            .build()
    })
    .await
    .context("CPU profiler start task")?
    .map_err(|e| {
        ProfileError::Conflict(format!(
            "the CPU profiler is busy ({e}); retry later or add force=true"
        ))
    })?;
    tracing::info!(seconds, frequency, format, "CPU profile started");

    // A newer request with force=true ends this profile early: it is still answered, with what
    // was sampled so far (continuous profilers hold a profile at all times; their samples must
    // not be lost to an ad hoc request), and the headers say so.
    let cut_short = tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs(seconds)) => false,
        _ = cancel.cancelled() => true,
    };

    // Symbolization, encoding and rendering are CPU-heavy: keep them off the executor threads.
    let (body, duration) = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let _held = held;
        // The report must be built before the guard is dropped: dropping resets the samples.
        // Unresolved: we symbolize through our own index (symbolize.rs), never through the
        // `backtrace` crate's DWARF cache.
        let report = guard
            .report()
            .build_unresolved()
            .context("building the CPU report")?;
        drop(guard);
        let duration = report.timing.duration;
        let samples: isize = report.data.values().sum();
        let body = match format {
            "svg" if samples == 0 => svg::message(
                "CPU profile",
                &format!(
                    "no samples in {:.1} s at {frequency} Hz (the process was idle)",
                    duration.as_secs_f64()
                ),
            ),
            "svg" => {
                let mut opts = pprof::flamegraph::Options::default();
                opts.title = format!(
                    "CPU: {samples} samples in {:.1} s at {frequency} Hz{}",
                    duration.as_secs_f64(),
                    if cut_short {
                        " (cut short by a request with force=true)"
                    } else {
                        ""
                    }
                );
                let lines = symbolize::cpu_folded(&report);
                let mut svg = Vec::new();
                pprof::flamegraph::from_lines(
                    &mut opts,
                    lines.iter().map(String::as_str),
                    &mut svg,
                )
                .context("rendering the flamegraph")?;
                svg
            }
            _ => {
                // A profile with no samples is still a valid profile (types, period, duration).
                gzip(&symbolize::cpu_pprof(&report).encode_to_vec())?
            }
        };
        drop(report);
        symbolize::purge();
        Ok((body, duration))
    })
    .await
    .context("CPU report task")??;

    let (content_type, disposition) = match format {
        "svg" => ("image/svg+xml", "inline; filename=\"profile.svg\""),
        _ => (
            "application/octet-stream",
            "attachment; filename=\"profile.pb.gz\"",
        ),
    };
    let mut resp = (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        body,
    )
        .into_response();
    let note = if requested > frequency {
        format!("{frequency}; requested={requested}; clamped to the kernel tick rate ({max} Hz)")
    } else {
        frequency.to_string()
    };
    let headers = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&note) {
        headers.insert("x-profile-frequency", v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("{:.3}", duration.as_secs_f64())) {
        headers.insert("x-profile-duration-seconds", v);
    }
    if cut_short {
        let why = format!(
            "true; ran {:.3} s of the {seconds} s requested; a newer request with force=true \
             took over",
            duration.as_secs_f64()
        );
        if let Ok(v) = HeaderValue::from_str(&why) {
            headers.insert("x-profile-cut-short", v);
        }
        tracing::info!(
            seconds = duration.as_secs_f64(),
            requested = seconds,
            "CPU profile cut short by a forced request"
        );
    }
    Ok((resp, cut_short))
}

/// Takes the profiler slot; with `force`, cancels the holder and waits for it.
///
/// Cancellation-safe: dropping the future before it resolves leaves the slot as it was (a forced
/// request that is dropped has already cancelled the holder, which is what it asked for).
async fn acquire(force: bool) -> Result<(OwnedMutexGuard<()>, CancellationToken), ProfileError> {
    let s = slot();
    let held = match s.lock.clone().try_lock_owned() {
        Ok(held) => held,
        Err(_) if !force => {
            return Err(ProfileError::Conflict(
                "a CPU profile is already running; wait for it, or add force=true to cancel it \
                 and take over"
                    .into(),
            ));
        }
        Err(_) => {
            s.cancel
                .lock()
                .expect("cancel token lock poisoned")
                .cancel();
            tokio::time::timeout(FORCE_TAKEOVER_TIMEOUT, s.lock.clone().lock_owned())
                .await
                .map_err(|_| {
                    ProfileError::Conflict(
                        "the running CPU profile did not stop in time; retry".into(),
                    )
                })?
        }
    };
    let token = CancellationToken::new();
    *s.cancel.lock().expect("cancel token lock poisoned") = token.clone();
    Ok((held, token))
}

pub(crate) fn gzip(bytes: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut gz = GzEncoder::new(Vec::with_capacity(bytes.len() / 4), Compression::default());
    gz.write_all(bytes).context("gzip")?;
    gz.finish().context("gzip")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_frequency_is_a_plausible_tick_rate() {
        let max = max_sampling_frequency();
        assert!((1..=1000).contains(&max), "max frequency {max}");
    }
}
