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
    run_with_ledger(proposer, opts, None).await
}

/// [`run`], also recording every pushed chunk in `ledger` (before it is pushed).
pub async fn run_with_ledger(
    proposer: &Proposer,
    opts: &SyntheticOptions,
    ledger: Option<&AckLedger>,
) -> Result<Stats, ProposerError> {
    let start = proposer.term_start_lsn();
    let prev = proposer.prev_record_start().await?;
    let seg = proposer.wal_seg_size() as u64;
    let sysid = proposer.system_id();
    let mut generator = WalGenerator::new(sysid, seg, start)
        .map_err(|e| ProposerError::Recovery(format!("cannot generate WAL at {start}: {e}")))?
        .with_major(proposer.pg_major()?)
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
        // Slow readers (`--max-replication-*-lag`) hold the next chunk back.
        proposer.throttle().await?;
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
        let buf = Bytes::from(buf);
        if let Some(ledger) = ledger {
            ledger.pushed(at, buf.clone());
        }
        proposer.push(at, buf)?;
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

/// The content ledger behind `--ack-log`: the bytes this source pushed and not yet acknowledged,
/// so that each acknowledgement (a quorum-commit advance) can carry a SHA-256 of the WAL it
/// covers, and a test can compare those bytes on every safekeeper rather than only LSNs.
#[derive(Debug, Default)]
pub struct AckLedger {
    state: Mutex<LedgerState>,
}

#[derive(Debug, Default)]
struct LedgerState {
    /// Where the next digest starts: the end of the last acknowledged range (or the first push).
    hashed_to: Option<Lsn>,
    /// Pushed chunks not yet wholly acknowledged, contiguous from `hashed_to`.
    pending: VecDeque<(Lsn, Bytes)>,
}

impl AckLedger {
    /// An empty ledger.
    pub fn new() -> AckLedger {
        AckLedger::default()
    }

    /// Records `wal`, about to be pushed at `at`. A chunk that does not continue the previous
    /// ones starts the ledger afresh.
    pub fn pushed(&self, at: Lsn, wal: Bytes) {
        let mut st = self.state.lock().expect("ledger lock");
        let next = match st.pending.back() {
            Some((lsn, b)) => Some(Lsn(lsn.0 + b.len() as u64)),
            None => st.hashed_to,
        };
        if next != Some(at) {
            st.pending.clear();
            st.hashed_to = Some(at);
        }
        st.pending.push_back((at, wal));
    }

    /// The acknowledgement of everything below `commit`: `(from, sha256 hex of [from, commit))`
    /// over the pushed bytes not acknowledged before. `None` if `commit` is not above the
    /// previous acknowledgement or goes past what was pushed (WAL this source did not push).
    pub fn acknowledge(&self, commit: Lsn) -> Option<(Lsn, String)> {
        use sha2::Digest;
        let mut st = self.state.lock().expect("ledger lock");
        let from = st.hashed_to?;
        let pushed_end = st
            .pending
            .back()
            .map(|(lsn, b)| Lsn(lsn.0 + b.len() as u64))?;
        if commit <= from || commit > pushed_end {
            return None;
        }
        let mut hasher = sha2::Sha256::new();
        while let Some((lsn, bytes)) = st.pending.front_mut() {
            let n = (commit.0 - lsn.0).min(bytes.len() as u64) as usize;
            hasher.update(&bytes[..n]);
            if n < bytes.len() {
                *lsn = Lsn(lsn.0 + n as u64);
                *bytes = bytes.slice(n..);
                break;
            }
            st.pending.pop_front();
        }
        st.hashed_to = Some(commit);
        let digest = hasher.finalize();
        Some((from, digest.iter().map(|b| format!("{b:02x}")).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn acknowledgements_digest_exactly_the_bytes_they_cover() {
        use sha2::Digest;
        let hex = |b: &[u8]| -> String {
            sha2::Sha256::digest(b)
                .iter()
                .map(|x| format!("{x:02x}"))
                .collect()
        };
        let ledger = AckLedger::new();
        assert_eq!(ledger.acknowledge(Lsn(100)), None);
        ledger.pushed(Lsn(100), Bytes::from_static(b"abcdef"));
        ledger.pushed(Lsn(106), Bytes::from_static(b"ghij"));
        assert_eq!(ledger.acknowledge(Lsn(103)), Some((Lsn(100), hex(b"abc"))));
        assert_eq!(ledger.acknowledge(Lsn(103)), None, "nothing new");
        assert_eq!(
            ledger.acknowledge(Lsn(108)),
            Some((Lsn(103), hex(b"defgh")))
        );
        assert_eq!(ledger.acknowledge(Lsn(111)), None, "past what was pushed");
        assert_eq!(ledger.acknowledge(Lsn(110)), Some((Lsn(108), hex(b"ij"))));
    }
}
