//! The synthetic WAL source: valid logical-message WAL from the generator, pushed through an
//! elected [`Proposer`] at a given rate (or as fast as the quorum commits), with commit latency
//! measured per pushed chunk.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;

use super::{Proposer, ProposerError};
use pg_wal::generator::WalGenerator;
use sk_core::types::Lsn;

/// What to generate.
#[derive(Clone, Debug)]
pub struct SyntheticOptions {
    /// Payload bytes per logical message record.
    pub record_size: usize,
    /// Total WAL bytes to generate.
    pub total_bytes: u64,
    /// WAL bytes per second; `None` = as fast as possible.
    pub rate: Option<u64>,
    /// WAL bytes generated and pushed at once.
    pub chunk_bytes: usize,
    /// Most WAL allowed ahead of the commit LSN (back-pressure).
    pub window: u64,
}

impl Default for SyntheticOptions {
    fn default() -> Self {
        SyntheticOptions {
            record_size: 1024,
            total_bytes: 64 << 20,
            rate: None,
            chunk_bytes: 128 << 10,
            window: 32 << 20,
        }
    }
}

/// What a run achieved.
#[derive(Clone, Debug, Serialize)]
pub struct Stats {
    /// WAL bytes pushed.
    pub bytes: u64,
    /// Records generated.
    pub records: u64,
    /// How long the run took.
    pub seconds: f64,
    /// `bytes` per second, in MB (10^6).
    pub mb_per_second: f64,
    /// Where the WAL started.
    pub start_lsn: Lsn,
    /// Where it ended.
    pub end_lsn: Lsn,
    /// Committed on a quorum at the end.
    pub commit_lsn: Lsn,
    /// Median time from pushing a chunk to its commit, in ms.
    pub commit_latency_p50_ms: f64,
    /// 99th percentile of that time, in ms.
    pub commit_latency_p99_ms: f64,
    /// Its maximum, in ms.
    pub commit_latency_max_ms: f64,
}

/// Generates and commits `opts.total_bytes` of WAL through `proposer`.
pub async fn run(proposer: &Proposer, opts: &SyntheticOptions) -> Result<Stats, ProposerError> {
    let start = proposer.term_start_lsn();
    let prev = proposer.prev_record_start().await?;
    let seg = proposer.wal_seg_size() as u64;
    let sysid = proposer.system_id();
    let mut generator = WalGenerator::new(sysid, seg, start)
        .map_err(|e| ProposerError::Recovery(format!("cannot generate WAL at {start}: {e}")))?
        .with_prev(prev);
    let message = vec![b'x'; opts.record_size];

    // Chunks waiting for their commit, with the time they were pushed.
    let pending: Arc<Mutex<VecDeque<(Lsn, Instant)>>> = Arc::default();
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let watcher = {
        let (pending, latencies) = (pending.clone(), latencies.clone());
        let mut rx = proposer.subscribe();
        tokio::spawn(async move {
            loop {
                let commit = rx.borrow_and_update().commit_lsn;
                let now = Instant::now();
                {
                    let mut p = pending.lock().expect("pending lock");
                    let mut l = latencies.lock().expect("latency lock");
                    while p.front().is_some_and(|(end, _)| *end <= commit) {
                        let (_, t) = p.pop_front().expect("front exists");
                        l.push(now - t);
                    }
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
    };

    let started = Instant::now();
    let mut produced = 0u64;
    let mut records = 0u64;
    let capacity = opts.chunk_bytes + opts.record_size + 8192;
    while produced < opts.total_bytes {
        let at = generator.lsn();
        let mut buf = Vec::with_capacity(capacity);
        let want = opts
            .chunk_bytes
            .min((opts.total_bytes - produced) as usize)
            .max(1);
        records += generator.fill(&mut buf, want, &message) as u64;
        let end = generator.lsn();
        pending
            .lock()
            .expect("pending lock")
            .push_back((end, Instant::now()));
        produced += buf.len() as u64;
        proposer.push(at, Bytes::from(buf))?;
        if let Some(rate) = opts.rate {
            let due = started + Duration::from_secs_f64(produced as f64 / rate as f64);
            tokio::time::sleep_until(due.into()).await;
        }
        if end.0.saturating_sub(opts.window) > proposer.progress().commit_lsn.0 {
            proposer.wait_commit(Lsn(end.0 - opts.window)).await?;
        }
    }
    let end = generator.lsn();
    let commit = proposer.wait_commit(end).await?;
    let seconds = started.elapsed().as_secs_f64();
    // Let the watcher record the last chunks.
    tokio::time::sleep(Duration::from_millis(10)).await;
    watcher.abort();
    let mut l = latencies.lock().expect("latency lock").clone();
    l.sort();
    let pct = |q: f64| -> f64 {
        if l.is_empty() {
            return 0.0;
        }
        let i = ((l.len() as f64 - 1.0) * q).round() as usize;
        l[i].as_secs_f64() * 1000.0
    };
    Ok(Stats {
        bytes: produced,
        records,
        seconds,
        mb_per_second: produced as f64 / seconds / 1e6,
        start_lsn: start,
        end_lsn: end,
        commit_lsn: commit,
        commit_latency_p50_ms: pct(0.5),
        commit_latency_p99_ms: pct(0.99),
        commit_latency_max_ms: pct(1.0),
    })
}
