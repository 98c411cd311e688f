//! The CPU profile tells the truth: self time lands on the true leaf function, stacks are deep,
//! the period is the rate actually sampled (frequencies above the kernel tick are clamped and
//! labelled as such), and there are never more samples than that rate allows for the CPU time
//! the process used.
//!
//! One test function: a CPU profile is process-wide, so these checks must not run concurrently
//! with each other.

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use pprof::protos::Message;
use tower::ServiceExt;

const THREAD: &str = "leaf-burner";

/// The known leaf: only operators, so no call appears even in an unoptimized build.
#[inline(never)]
fn burn_leaf(mut x: u64) -> u64 {
    let mut i = 0u32;
    while i < 200_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        i += 1;
    }
    x
}

#[inline(never)]
fn burn_level_2(x: u64) -> u64 {
    burn_leaf(x) | 1
}

#[inline(never)]
fn burn_level_1(stop: &AtomicBool) -> u64 {
    let mut x = 88172645463325252u64;
    while !stop.load(Ordering::Relaxed) {
        x = burn_level_2(x);
    }
    x
}

struct Profile {
    proto: pprof::protos::Profile,
    frequency_header: String,
}

async fn take_profile(query: &str) -> Profile {
    let resp = profiling::router::<()>()
        .oneshot(
            Request::get(format!("/profile/cpu?{query}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "application/octet-stream");
    assert!(
        resp.headers()["content-disposition"]
            .to_str()
            .unwrap()
            .contains("profile.pb.gz")
    );
    let frequency_header = resp.headers()["x-profile-frequency"]
        .to_str()
        .unwrap()
        .to_string();
    let gz = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&gz[..2], &[0x1f, 0x8b], "pprof output is gzip-compressed");
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut raw)
        .unwrap();
    Profile {
        proto: pprof::protos::Profile::decode(&raw[..]).unwrap(),
        frequency_header,
    }
}

/// (leaf function name, all function names bottom-up... as a Vec, sample count) for each sample
/// of the burner thread.
fn burner_samples(p: &pprof::protos::Profile) -> Vec<(Vec<String>, i64)> {
    let s = |i: i64| p.string_table[i as usize].clone();
    let fn_name = |loc_id: u64| {
        let loc = p.location.iter().find(|l| l.id == loc_id).unwrap();
        let f = p
            .function
            .iter()
            .find(|f| f.id == loc.line[0].function_id)
            .unwrap();
        s(f.name)
    };
    p.sample
        .iter()
        .filter(|smp| {
            smp.label
                .iter()
                .any(|l| s(l.key) == "thread" && s(l.str) == THREAD)
        })
        .map(|smp| {
            let names = smp.location_id.iter().map(|&l| fn_name(l)).collect();
            (names, smp.value[0])
        })
        .collect()
}

/// CPU time the thread has used so far. `ITIMER_PROF` counts CPU time, not wall time (on a
/// loaded machine the burner gets less than a core).
fn thread_cpu_time(thread: &std::thread::JoinHandle<u64>) -> f64 {
    use std::os::unix::thread::JoinHandleExt;
    let mut clock: libc::clockid_t = 0;
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: the thread has not been joined, so its pthread_t is valid; both calls only write
    // into locals we own.
    let ok = unsafe {
        libc::pthread_getcpuclockid(thread.as_pthread_t(), &mut clock) == 0
            && libc::clock_gettime(clock, &mut ts) == 0
    };
    assert!(ok, "reading the burner's CPU clock");
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// CPU time the whole process (every thread) has used so far: what `ITIMER_PROF` counts down.
fn process_cpu_time() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes into a local we own.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) == 0 };
    assert!(ok, "reading the process's CPU clock");
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Takes a profile and measures the CPU time the burner and the whole process used while it was
/// being sampled: from the profile's start (`time_nanos`) for its `duration_nanos`, read off a
/// record of the CPU clocks taken every 2 ms during the request. (The first profile builds the
/// test binary's symbol index, which takes a while in a debug build; the burner runs on
/// meanwhile, and on a loaded machine not at the same pace.)
async fn sampled_cpu_time(burner: &std::thread::JoinHandle<u64>, query: &str) -> (Profile, Cpu) {
    let now_nanos = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as i64
    };
    // A reading before the request and one after it bound the profile's window.
    let reading = || (now_nanos(), thread_cpu_time(burner), process_cpu_time());
    let record = std::sync::Mutex::new(vec![reading()]);
    let done = AtomicBool::new(false);
    let p = std::thread::scope(|scope| {
        scope.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                let r = reading();
                record.lock().unwrap().push(r);
                std::thread::sleep(Duration::from_millis(2));
            }
        });
        let p = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(take_profile(query))
        });
        done.store(true, Ordering::Relaxed);
        p
    });
    let mut record = record.into_inner().unwrap();
    record.push(reading());
    // Linear interpolation of clock `c` (0: the burner's, 1: the process's) at time `t`.
    let cpu_at = |t: i64, c: usize| {
        let i = record.partition_point(|&(at, _, _)| at <= t);
        assert!(i > 0 && i < record.len(), "the record covers the profile");
        let clock = |r: &(i64, f64, f64)| if c == 0 { r.1 } else { r.2 };
        let (r0, r1) = (&record[i - 1], &record[i]);
        let (t0, t1) = (r0.0, r1.0);
        clock(r0) + (clock(r1) - clock(r0)) * (t - t0) as f64 / (t1 - t0).max(1) as f64
    };
    let (from, to) = (
        p.proto.time_nanos,
        p.proto.time_nanos + p.proto.duration_nanos,
    );
    let cpu = Cpu {
        burner: cpu_at(to, 0) - cpu_at(from, 0),
        process: cpu_at(to, 1) - cpu_at(from, 1),
    };
    (p, cpu)
}

/// CPU seconds used during a profile.
#[derive(Debug)]
struct Cpu {
    burner: f64,
    process: f64,
}

fn check(p: &Profile, frequency: u64, cpu: &Cpu) {
    let samples = burner_samples(&p.proto);
    let total: i64 = samples.iter().map(|(_, n)| n).sum();
    let on_leaf: i64 = samples
        .iter()
        .filter(|(names, _)| names.first().is_some_and(|n| n.contains("burn_leaf")))
        .map(|(_, n)| n)
        .sum();
    let deep: i64 = samples
        .iter()
        .filter(|(names, _)| {
            names.iter().any(|n| n.contains("burn_level_2"))
                && names.iter().any(|n| n.contains("burn_level_1"))
        })
        .map(|(_, n)| n)
        .sum();
    assert!(total > 0, "no samples from the burner thread");
    let leaf_share = on_leaf as f64 / total as f64;
    assert!(
        leaf_share >= 0.9,
        "only {on_leaf}/{total} samples name burn_leaf as the leaf; samples: {samples:?}"
    );
    assert!(
        deep as f64 / total as f64 >= 0.9,
        "only {deep}/{total} samples have the full burn_level_1 > burn_level_2 stack"
    );
    // The rate: at most one SIGPROF per period of the process's CPU time (ITIMER_PROF counts
    // every thread's), so all samples of every thread stay within frequency x that time (the
    // slack: the timer is armed a moment before the profile's recorded start). There is no lower
    // bound: the count the burner gets is not a measure of the rate on a loaded machine (pending
    // SIGPROFs coalesce, and a signal for CPU time burnt by another thread can land on any), and
    // that flaked while cargo ran other tests beside this one.
    let all: i64 = p.proto.sample.iter().map(|smp| smp.value[0]).sum();
    eprintln!(
        "{all} samples ({total} of the burner) at {frequency} Hz over {:.2} s of the process's \
         CPU ({:.2} s of the burner's)",
        cpu.process, cpu.burner
    );
    let allowed = frequency as f64 * cpu.process * 1.25 + 3.0;
    assert!(
        all as f64 <= allowed,
        "{all} samples at {frequency} Hz over {cpu:?} s of CPU: more than {allowed:.0} the rate allows"
    );
    assert_eq!(
        p.proto.period,
        1_000_000_000 / frequency as i64,
        "the period must match the rate actually sampled"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn cpu_profile_names_true_leaf_and_rate_matches_samples() {
    profiling::warm_up();
    let stop = Arc::new(AtomicBool::new(false));
    let burner = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name(THREAD.into())
            .spawn(move || burn_level_1(&stop))
            .unwrap()
    };
    tokio::time::sleep(Duration::from_millis(100)).await;

    let (p, cpu) = sampled_cpu_time(&burner, "seconds=2&frequency=99").await;
    assert_eq!(p.frequency_header, "99");
    check(&p, 99, &cpu);

    // Above the kernel tick: clamped, and the response says so.
    let max = profiling::max_sampling_frequency();
    let (p, cpu) = sampled_cpu_time(&burner, "seconds=2&frequency=1000").await;
    if max < 1000 {
        assert!(
            p.frequency_header
                .starts_with(&format!("{max}; requested=1000; clamped")),
            "{}",
            p.frequency_header
        );
    }
    check(&p, max, &cpu);

    stop.store(true, Ordering::Relaxed);
    burner.join().unwrap();
}
