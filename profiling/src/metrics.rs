//! Prometheus metrics of the profiling crate: request counters per profile kind and outcome, and
//! jemalloc's memory statistics, in the default registry.

use std::sync::LazyLock;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntCounterVec, IntGauge, Opts};

use crate::error::ProfileError;

static REQUESTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    IntCounterVec::new(
        Opts::new(
            "profile_requests_total",
            "Profile requests served, by profile kind and outcome",
        ),
        &["profile", "outcome"],
    )
    .expect("valid metric definition")
});

#[derive(Clone, Copy)]
pub(crate) enum Outcome {
    Ok,
    /// Served, but a newer request with `force=true` ended it early.
    CutShort,
    BadRequest,
    Conflict,
    Unavailable,
    Error,
}

impl Outcome {
    pub(crate) fn of<T>(r: &Result<T, ProfileError>) -> Outcome {
        match r {
            Ok(_) => Outcome::Ok,
            Err(e) => Outcome::of_error(e),
        }
    }

    pub(crate) fn of_error(e: &ProfileError) -> Outcome {
        match e {
            ProfileError::BadRequest(_) => Outcome::BadRequest,
            ProfileError::Conflict(_) => Outcome::Conflict,
            ProfileError::Unavailable(_) => Outcome::Unavailable,
            ProfileError::Internal(_) => Outcome::Error,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::CutShort => "cut_short",
            Outcome::BadRequest => "bad_request",
            Outcome::Conflict => "conflict",
            Outcome::Unavailable => "unavailable",
            Outcome::Error => "error",
        }
    }
}

pub(crate) fn record(profile: &str, outcome: Outcome) {
    REQUESTS
        .with_label_values(&[profile, outcome.label()])
        .inc();
}

/// Reads one jemalloc statistic.
type StatReader = fn() -> Result<usize, tikv_jemalloc_ctl::Error>;

/// jemalloc's statistics, read fresh on every scrape.
struct JemallocCollector {
    gauges: Vec<(IntGauge, StatReader)>,
}

/// The jemalloc statistics exported, as (gauge name, help, reader).
const JEMALLOC_STATS: [(&str, &str, StatReader); 6] = {
    use tikv_jemalloc_ctl::stats::{active, allocated, mapped, metadata, resident, retained};
    [
        (
            "jemalloc_allocated_bytes",
            "Bytes allocated by the application",
            allocated::read,
        ),
        (
            "jemalloc_active_bytes",
            "Bytes in active pages allocated by the application",
            active::read,
        ),
        (
            "jemalloc_resident_bytes",
            "Bytes in resident pages mapped by the allocator",
            resident::read,
        ),
        (
            "jemalloc_mapped_bytes",
            "Bytes in active extents mapped by the allocator",
            mapped::read,
        ),
        (
            "jemalloc_retained_bytes",
            "Bytes in mappings retained for reuse",
            retained::read,
        ),
        (
            "jemalloc_metadata_bytes",
            "Bytes dedicated to allocator metadata",
            metadata::read,
        ),
    ]
};

impl JemallocCollector {
    fn new() -> JemallocCollector {
        let gauges = JEMALLOC_STATS
            .iter()
            .map(|&(name, help, read)| {
                let gauge = IntGauge::new(name, help).expect("valid metric definition");
                (gauge, read)
            })
            .collect();
        JemallocCollector { gauges }
    }
}

impl Collector for JemallocCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.gauges.iter().flat_map(|(g, _)| g.desc()).collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // Statistics are cached by jemalloc until the epoch advances.
        if tikv_jemalloc_ctl::epoch::advance().is_err() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (gauge, read) in &self.gauges {
            if let Ok(v) = read() {
                gauge.set(v as i64);
                out.extend(gauge.collect());
            }
        }
        out
    }
}

/// Registers the profiling crate's metrics in the default Prometheus registry (idempotent).
/// jemalloc gauges are only registered when jemalloc statistics are readable.
pub fn register_metrics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let registry = prometheus::default_registry();
        if let Err(e) = registry.register(Box::new(REQUESTS.clone())) {
            tracing::warn!("registering profile request metrics: {e}");
        }
        if tikv_jemalloc_ctl::epoch::advance().is_ok()
            && let Err(e) = registry.register(Box::new(JemallocCollector::new()))
        {
            tracing::warn!("registering jemalloc metrics: {e}");
        }
    });
}
