//! Prometheus metrics of the safekeeper (default registry): process-wide statics, updated where
//! things happen. A leaf: it imports nothing of this crate.
//!
//! Not here: per-timeline gauges, which are read from the timelines at scrape time by the
//! collector that lives with them ([`crate::registry::TimelineCollector`]).

use std::sync::LazyLock;

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    exponential_buckets,
};

fn counter(name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    prometheus::register(Box::new(c.clone())).expect("metric registered once");
    c
}

fn counter_vec(name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    prometheus::register(Box::new(c.clone())).expect("metric registered once");
    c
}

fn gauge(name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    prometheus::register(Box::new(g.clone())).expect("metric registered once");
    g
}

/// `safekeeper_wal_written_bytes_total`: WAL bytes accepted from proposers.
pub static WAL_WRITTEN_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_wal_written_bytes_total",
        "WAL bytes accepted from proposers and written to segments",
    )
});

/// `safekeeper_wal_flushes_total`: batched WAL flushes.
pub static WAL_FLUSHES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_wal_flushes_total",
        "Batched WAL flushes (one fdatasync each, unless --no-sync)",
    )
});

/// `safekeeper_prepared_segments`: zero-filled segments ready in the node's pool.
pub static PREPARED_SEGMENTS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_prepared_segments",
        "Zero-filled WAL segments ready in the node's pool (--prepared-segments)",
    )
});

/// `safekeeper_prepared_segments_used_total`: segments taken from the node's pool.
pub static PREPARED_SEGMENTS_USED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_prepared_segments_used_total",
        "WAL segments a timeline took from the node's pool of zero-filled segments",
    )
});

/// `safekeeper_flush_wal_seconds`: time to make a batch of WAL durable.
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

/// `safekeeper_wal_receivers`: connected proposers.
pub static WAL_RECEIVERS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_receivers",
        "Connected proposers (START_WAL_PUSH connections)",
    )
});

/// `safekeeper_wal_readers`: connected WAL readers.
pub static WAL_READERS: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_readers",
        "Connected WAL readers (START_REPLICATION connections)",
    )
});

/// `safekeeper_wal_sent_bytes_total`: WAL bytes sent to readers.
pub static WAL_SENT_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_wal_sent_bytes_total",
        "WAL bytes sent to readers",
    )
});

/// `safekeeper_wal_receiver_queue_depth`: messages queued for WAL acceptors.
pub static RECEIVER_QUEUE_DEPTH: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_receiver_queue_depth",
        "Messages queued for queue-fed WAL acceptors (peer recovery; a proposer's wait in its socket)",
    )
});

/// `safekeeper_wal_receiver_queue_bytes`: WAL bytes queued for WAL acceptors.
pub static RECEIVER_QUEUE_BYTES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_wal_receiver_queue_bytes",
        "WAL bytes queued for queue-fed WAL acceptors (peer recovery; a proposer's wait in its socket)",
    )
});

/// `safekeeper_pg_connections_total{outcome}`: PostgreSQL-protocol connections by outcome.
pub static PG_CONNECTIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "safekeeper_pg_connections_total",
        "PostgreSQL-protocol connections by outcome",
        &["outcome"],
    )
});

/// `safekeeper_proposer_acceptor_messages_total{kind,outcome}`: proposer messages processed.
pub static PROPOSER_MESSAGES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "safekeeper_proposer_acceptor_messages_total",
        "Proposer messages processed, by kind and outcome",
        &["kind", "outcome"],
    )
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

/// `safekeeper_backup_uploaded_bytes_total`: WAL bytes this node stored in remote storage.
pub static BACKUP_UPLOADED_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_backup_uploaded_bytes_total",
        "WAL segment bytes this node stored in remote storage",
    )
});

/// `safekeeper_backup_segments_total{outcome}`: segments backed up, by outcome: `uploaded`
/// (this node stored it) or `verified` (another node had stored it; verified identical).
pub static BACKUP_SEGMENTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "safekeeper_backup_segments_total",
        "WAL segments backed up: uploaded here, or found stored and verified identical",
        &["outcome"],
    )
});

/// `safekeeper_partial_backups_total{outcome}`: partial segments (the committed part of a
/// segment not yet complete) backed up: `uploaded` here, or found stored and `verified`.
pub static PARTIAL_BACKUPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "safekeeper_partial_backups_total",
        "Partial WAL segments backed up: uploaded here, or found stored and verified identical",
        &["outcome"],
    )
});

/// `safekeeper_partial_backup_bytes_total`: WAL bytes this node stored as partial segments.
pub static PARTIAL_BACKUP_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_partial_backup_bytes_total",
        "WAL bytes this node stored in remote storage as partial segments",
    )
});

/// `safekeeper_partial_backups_removed_total`: superseded partial objects this node removed.
pub static PARTIAL_BACKUPS_REMOVED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_partial_backups_removed_total",
        "Superseded partial WAL segments removed from remote storage",
    )
});

/// `safekeeper_backup_errors_total`: failed segment uploads or verifications (each retried).
pub static BACKUP_ERRORS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_backup_errors_total",
        "Failed WAL segment uploads or verifications (retried with backoff)",
    )
});

/// `safekeeper_backup_upload_seconds`: time to back up one segment.
pub static BACKUP_SECONDS: LazyLock<Histogram> = LazyLock::new(|| {
    let h = Histogram::with_opts(
        HistogramOpts::new(
            "safekeeper_backup_upload_seconds",
            "Time to back up one WAL segment (upload or verification)",
        )
        .buckets(exponential_buckets(0.001, 2.0, 16).expect("valid buckets")),
    )
    .expect("valid metric");
    prometheus::register(Box::new(h.clone())).expect("metric registered once");
    h
});

/// `safekeeper_wal_removed_segments_total`: local segments removed below the horizon.
pub static WAL_REMOVED_SEGMENTS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_wal_removed_segments_total",
        "Local WAL segments removed below the removal horizon",
    )
});

/// `safekeeper_remote_read_buffered_bytes`: WAL read from remote storage for readers and held
/// in their buffers now (bounded by `--remote-read-budget`).
pub static REMOTE_READ_BUFFERED: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_remote_read_buffered_bytes",
        "WAL read from remote storage for readers, buffered now (at most --remote-read-budget)",
    )
});

/// `safekeeper_remote_read_bytes_total`: WAL read from remote storage for readers.
pub static REMOTE_READ_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_remote_read_bytes_total",
        "WAL bytes read from remote storage for readers (range requests)",
    )
});

/// `safekeeper_recovery_bytes_total`: WAL bytes fetched from peers by peer recovery.
pub static RECOVERY_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_recovery_bytes_total",
        "WAL bytes fetched from peers by peer recovery and fed to the acceptor",
    )
});

/// `safekeeper_recovery_active`: timelines recovering WAL from a peer now.
pub static RECOVERY_ACTIVE: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_recovery_active",
        "Timelines fetching WAL from a peer now (peer recovery)",
    )
});

/// `safekeeper_open_segment_files`: WAL segment files held open for writing (at most
/// `--max-open-segment-files`; idle timelines' files are closed first).
pub static OPEN_SEGMENT_FILES: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "safekeeper_open_segment_files",
        "WAL segment files held open for writing (capped by --max-open-segment-files)",
    )
});

/// `safekeeper_segment_file_evictions_total`: segment files closed to stay under the cap.
pub static SEGMENT_FILE_EVICTIONS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "safekeeper_segment_file_evictions_total",
        "WAL segment files closed (fsynced first if written) to stay under --max-open-segment-files",
    )
});

/// `safekeeper_evictions_total{outcome}`: timelines evicted (`done`) or whose eviction was
/// refused at its last check (`refused`: a connection arrived, the WAL moved) or failed.
pub static EVICTIONS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "safekeeper_evictions_total",
        "Timeline evictions: done, or refused/failed at the last check",
        &["outcome"],
    )
});

/// `safekeeper_restores_total{outcome}`: evicted timelines brought back (`ok`) or not (`error`).
pub static RESTORES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter_vec(
        "safekeeper_restores_total",
        "Restores of evicted timelines, by outcome",
        &["outcome"],
    )
});

/// `safekeeper_eviction_seconds{op}`: time to evict (`evict`) or restore (`restore`) one
/// timeline, download included.
pub static EVICTION_SECONDS: LazyLock<HistogramVec> = LazyLock::new(|| {
    let h = HistogramVec::new(
        HistogramOpts::new(
            "safekeeper_eviction_seconds",
            "Time to evict (op=evict) or restore (op=restore) one timeline",
        )
        .buckets(exponential_buckets(0.0005, 2.0, 16).expect("valid buckets")),
        &["op"],
    )
    .expect("valid metric");
    prometheus::register(Box::new(h.clone())).expect("metric registered once");
    h
});

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
    LazyLock::force(&BACKUP_UPLOADED_BYTES);
    LazyLock::force(&BACKUP_SEGMENTS);
    LazyLock::force(&PARTIAL_BACKUPS);
    LazyLock::force(&PARTIAL_BACKUP_BYTES);
    LazyLock::force(&PARTIAL_BACKUPS_REMOVED);
    LazyLock::force(&BACKUP_ERRORS);
    LazyLock::force(&BACKUP_SECONDS);
    LazyLock::force(&WAL_REMOVED_SEGMENTS);
    LazyLock::force(&REMOTE_READ_BUFFERED);
    LazyLock::force(&REMOTE_READ_BYTES);
    LazyLock::force(&RECOVERY_BYTES);
    LazyLock::force(&RECOVERY_ACTIVE);
    LazyLock::force(&OPEN_SEGMENT_FILES);
    LazyLock::force(&SEGMENT_FILE_EVICTIONS);
    LazyLock::force(&PREPARED_SEGMENTS);
    LazyLock::force(&PREPARED_SEGMENTS_USED);
    LazyLock::force(&EVICTIONS);
    LazyLock::force(&RESTORES);
    LazyLock::force(&EVICTION_SECONDS);
}
