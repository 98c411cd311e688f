//! `GET /profile/cpu`: sampled CPU profiles from pprof-rs.
//!
//! One profile runs at a time (pprof-rs's profiler is process-wide). The running profile holds a
//! slot for its whole life, including report building; a request with `force=true` cancels the
//! holder and waits for the slot. The profiler guard lives inside the request future, so a client
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

const DEFAULT_SECONDS: u64 = 5;
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
/// thread that is only spinning. Later handlers do not allocate. Takes a few milliseconds of CPU.
pub fn warm_up() {
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
    let result = profile(params).await;
    record("cpu", Outcome::of(&result));
    match result {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn profile(params: HashMap<String, String>) -> Result<Response, ProfileError> {
    reject_unknown(&params, &["format", "seconds", "frequency", "force"])?;
    let format = parse_choice("format", params.get("format"), &["pprof", "svg"])?;
    let seconds = parse_bounded("seconds", params.get("seconds"), DEFAULT_SECONDS, 1..=60)?;
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
    let guard = pprof::ProfilerGuardBuilder::default()
        .frequency(frequency as i32)
        .build()
        .map_err(|e| {
            ProfileError::Conflict(format!(
                "the CPU profiler is busy ({e}); retry later or add force=true"
            ))
        })?;
    tracing::info!(seconds, frequency, format, "CPU profile started");

    tokio::select! {
        _ = tokio::time::sleep(Duration::from_secs(seconds)) => {}
        _ = cancel.cancelled() => {
            return Err(ProfileError::Conflict(
                "this CPU profile was cancelled by a newer request with force=true".into(),
            ));
        }
    }

    // Symbolization, encoding and rendering are CPU-heavy: keep them off the executor threads.
    let body = tokio::task::spawn_blocking(move || -> anyhow::Result<Vec<u8>> {
        let _held = held;
        // The report must be built before the guard is dropped: dropping resets the samples.
        let report = guard.report().build().context("building the CPU report")?;
        drop(guard);
        match format {
            "svg" => {
                let mut svg = Vec::new();
                report
                    .flamegraph(&mut svg)
                    .context("rendering the flamegraph")?;
                Ok(svg)
            }
            _ => {
                let proto = report.pprof().context("encoding the pprof profile")?;
                gzip(&proto.encode_to_vec())
            }
        }
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
    if let Ok(v) = HeaderValue::from_str(&note) {
        resp.headers_mut().insert("x-profile-frequency", v);
    }
    Ok(resp)
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
