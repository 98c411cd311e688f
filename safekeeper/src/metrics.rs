//! Prometheus metrics of the safekeeper (default registry). Per-timeline LSNs are read at scrape
//! time by [`TimelineCollector`]; everything else is updated where it happens.

use std::sync::{Arc, LazyLock, Weak};

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    exponential_buckets,
};

use crate::timeline::GlobalTimelines;

fn counter(name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    prometheus::register(Box::new(c.clone())).expect("metric registered once");
    c
}

fn gauge(name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    prometheus::register(Box::new(g.clone())).expect("metric registered once");
    g
}

pub static WAL_WRITTEN_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_wal_written_bytes_total",
        "WAL bytes accepted from proposers and written to segments",
    )
});

pub static WAL_FLUSHES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_wal_flushes_total",
        "Batched WAL flushes (one fdatasync each, unless --no-sync)",
    )
});

pub static WAL_FLUSH_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    let h = Histogram::with_opts(
        HistogramOpts::new(
            "safekeeper_flush_wal_seconds",
            "Time to make a batch of written WAL durable",
        )
        .buckets(exponential_buckets(0.000_025, 2.0, 16).expect("valid buckets")),
    )
    .expect("valid metric");
    prometheus::register(Box::new(h.clone())).expect("metric registered once");
    h
});

pub static WAL_RECEIVERS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_receivers",
        "Connected proposers (START_WAL_PUSH connections)",
    )
});

pub static WAL_READERS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_readers",
        "Connected WAL readers (START_REPLICATION connections)",
    )
});

pub static WAL_SENT_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_wal_sent_bytes_total",
        "WAL bytes sent to readers",
    )
});

pub static RECEIVER_QUEUE_DEPTH: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_receiver_queue_depth",
        "Messages queued between connection readers and WAL acceptors",
    )
});

pub static RECEIVER_QUEUE_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_receiver_queue_bytes",
        "WAL bytes queued between connection readers and WAL acceptors",
    )
});

pub static PG_CONNECTIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    let c = IntCounterVec::new(
        Opts::new(
            "safekeeper_pg_connections_total",
            "PostgreSQL-protocol connections by outcome",
        ),
        &["outcome"],
    )
    .expect("valid metric");
    prometheus::register(Box::new(c.clone())).expect("metric registered once");
    c
});

pub static PROPOSER_MESSAGES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    let c = IntCounterVec::new(
        Opts::new(
            "safekeeper_proposer_acceptor_messages_total",
            "Proposer messages processed, by kind and outcome",
        ),
        &["kind", "outcome"],
    )
    .expect("valid metric");
    prometheus::register(Box::new(c.clone())).expect("metric registered once");
    c
});

/// Proposer message kinds, as labelled in `safekeeper_proposer_acceptor_messages_total`.
pub const MESSAGE_KINDS: [&str; 6] = [
    "greeting",
    "vote_request",
    "elected",
    "append",
    "append_noflush",
    "flush",
];

/// Resolved counters per kind and outcome (ok, error), so the ingest path does not hash label
/// values per message.
static MESSAGE_COUNTERS: LazyLock<Vec<[IntCounter; 2]>> = LazyLock::new(|| {
    MESSAGE_KINDS
        .iter()
        .map(|k| {
            [
                PROPOSER_MESSAGES.with_label_values(&[*k, "ok"]),
                PROPOSER_MESSAGES.with_label_values(&[*k, "error"]),
            ]
        })
        .collect()
});

/// Counts one processed proposer message of `kind` (one of [`MESSAGE_KINDS`]).
pub fn count_proposer_message(kind: &str, ok: bool) {
    if let Some(i) = MESSAGE_KINDS.iter().position(|k| *k == kind) {
        MESSAGE_COUNTERS[i][usize::from(!ok)].inc();
    }
}

/// Forces registration of every metric so `/metrics` shows them before first use.
pub fn register() {
    LazyLock::force(&WAL_WRITTEN_BYTES);
    LazyLock::force(&WAL_FLUSHES);
    LazyLock::force(&WAL_FLUSH_SECONDS);
    LazyLock::force(&WAL_RECEIVERS);
    LazyLock::force(&WAL_READERS);
    LazyLock::force(&WAL_SENT_BYTES);
    LazyLock::force(&RECEIVER_QUEUE_DEPTH);
    LazyLock::force(&RECEIVER_QUEUE_BYTES);
    LazyLock::force(&PG_CONNECTIONS);
    LazyLock::force(&PROPOSER_MESSAGES);
}

/// Per-timeline gauges, read from the timelines at scrape time.
pub struct TimelineCollector {
    timelines: Weak<GlobalTimelines>,
    descs: Vec<Desc>,
}

const TIMELINE_GAUGES: &[(&str, &str)] = &[
    (
        "safekeeper_flush_lsn",
        "Durable end of the timeline's WAL (bytes)",
    ),
    (
        "safekeeper_commit_lsn",
        "Committed end of the timeline's WAL known here (bytes)",
    ),
    (
        "safekeeper_acceptor_term",
        "Current term of the timeline's acceptor",
    ),
    (
        "safekeeper_timeline_wal_receivers",
        "Proposers connected to the timeline",
    ),
    (
        "safekeeper_timeline_wal_readers",
        "Readers connected to the timeline",
    ),
];

impl TimelineCollector {
    pub fn register(timelines: &Arc<GlobalTimelines>) {
        let descs = TIMELINE_GAUGES
            .iter()
            .map(|(name, help)| {
                Desc::new(
                    name.to_string(),
                    help.to_string(),
                    vec!["tenant_id".into(), "timeline_id".into()],
                    Default::default(),
                )
                .expect("valid metric")
            })
            .collect();
        let c = TimelineCollector {
            timelines: Arc::downgrade(timelines),
            descs,
        };
        // A second daemon in one process (tests) finds it registered already: keep the first.
        let _ = prometheus::register(Box::new(c));
    }
}

impl Collector for TimelineCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(timelines) = self.timelines.upgrade() else {
            return Vec::new();
        };
        let vecs: Vec<IntGaugeVec> = TIMELINE_GAUGES
            .iter()
            .map(|(name, help)| {
                IntGaugeVec::new(Opts::new(*name, *help), &["tenant_id", "timeline_id"])
                    .expect("valid metric")
            })
            .collect();
        for tl in timelines.all() {
            let s = tl.status();
            let t = tl.ttid.tenant_id.to_string();
            let l = tl.ttid.timeline_id.to_string();
            let labels = [t.as_str(), l.as_str()];
            let values = [
                s.flush_lsn.0 as i64,
                s.commit_lsn.0 as i64,
                s.term.0 as i64,
                s.proposers as i64,
                s.readers as i64,
            ];
            for (v, value) in vecs.iter().zip(values) {
                v.with_label_values(&labels).set(value);
            }
        }
        vecs.iter().flat_map(|v| v.collect()).collect()
    }
}
