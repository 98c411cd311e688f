//! The proposer side of neon's protocol: elect this proposer over N safekeepers, recover the
//! newest WAL from the donor, and stream WAL to every safekeeper, committing on a quorum.
//!
//! Steps (neon's walproposer, `reference/neon-safekeeper.md` §1):
//! 1. greet every safekeeper; with a quorum of greetings, take term = max(seen) + 1;
//! 2. ask for votes; with a quorum, the **donor** is the voter with the highest
//!    `(last_log_term, flush_lsn)`; the term starts at the donor's `flush_lsn`; the proposer's
//!    history is the donor's plus `(term, start)`;
//! 3. fetch the WAL other safekeepers lack from the donor (`START_REPLICATION … (term='N')`);
//! 4. send each safekeeper `elected` with its own `start_streaming_at` (the highest common point
//!    of the two histories), then stream appends, pipelined;
//! 5. commit: the highest LSN a quorum has flushed, counting no safekeeper whose flush is below
//!    the term start (an earlier term's WAL is never committed on its own: Raft's figure 8).
//!
//! A safekeeper that fails is reconnected with backoff and caught up from the proposer's buffer;
//! a higher term seen anywhere makes the proposer step down with [`ProposerError::SteppedDown`].

pub mod conn;
pub mod fetch;
pub mod postgres;
pub mod synthetic;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::watch;
use tokio::task::JoinSet;

use conn::{ConnError, PushReader, PushWriter, SafekeeperAddr, connect_push};
use pg_wal::decoder::WalStreamDecoder;
use pg_wal::format::page_header_size;
use sk_core::protocol::{
    AcceptorProposerMessage, AppendRequest, AppendRequestHeader, MAX_SEND_SIZE,
    ProposerAcceptorMessage, ProposerElected, ProposerGreeting, VoteRequest, VoteResponse,
};
use sk_core::state::Configuration;
use sk_core::types::{Generation, Lsn, TenantTimelineId, Term, TermHistory, TermLsn};

/// WAL sent to one safekeeper beyond what it acknowledged.
const MAX_IN_FLIGHT: u64 = 16 << 20;
/// How long an election waits for a quorum.
const ELECTION_TIMEOUT: Duration = Duration::from_secs(10);

/// What the proposer needs to know.
#[derive(Clone, Debug)]
pub struct ProposerConfig {
    /// The safekeepers to elect this proposer and to stream to.
    pub safekeepers: Vec<SafekeeperAddr>,
    /// The timeline written.
    pub ttid: TenantTimelineId,
    /// PostgreSQL system identifier of the WAL.
    pub system_id: u64,
    /// PostgreSQL version of the WAL's server.
    pub pg_version: u32,
    /// WAL segment size in bytes.
    pub wal_seg_size: u32,
    /// Where WAL begins if every safekeeper is empty (a record boundary).
    pub start_lsn: Lsn,
    /// Whether the greeting may create the timeline on a safekeeper that lacks it.
    pub allow_timeline_creation: bool,
}

impl ProposerConfig {
    /// How many safekeepers make a majority.
    pub fn quorum(&self) -> usize {
        self.safekeepers.len() / 2 + 1
    }
}

/// Why the proposer stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProposerError {
    /// Too few safekeepers answered within the election timeout.
    #[error("no quorum: {got} of {need} safekeepers answered ({details})")]
    NoQuorum {
        /// Answers received.
        got: usize,
        /// Answers needed.
        need: usize,
        /// Why the others did not answer.
        details: String,
    },
    /// A safekeeper has seen a higher term: another proposer took over.
    #[error("stepped down: a safekeeper is at term {seen}, above ours ({ours})")]
    SteppedDown {
        /// Our term.
        ours: Term,
        /// The higher term seen.
        seen: Term,
    },
    /// The donor's WAL could not be fetched.
    #[error("recovering WAL from the donor: {0}")]
    Recovery(String),
    /// WAL pushed somewhere else than at the current end.
    #[error("WAL must continue at {expected}, got {got}")]
    Discontinuous {
        /// The current end.
        expected: Lsn,
        /// Where the WAL was pushed.
        got: Lsn,
    },
}

/// What the proposer publishes as it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// End of WAL in the proposer's buffer.
    pub end_lsn: Lsn,
    /// Highest LSN flushed on a quorum in this term.
    pub commit_lsn: Lsn,
    /// Set once the proposer stepped down (and stops streaming).
    pub stepped_down: Option<Term>,
    /// Safekeepers whose *persisted* commit LSN reached the term start (sync mode waits for a
    /// quorum of them).
    pub synced: usize,
    /// Set by [`Proposer::finish`]: stream what is buffered, pass on the commit LSN, then end.
    pub finishing: bool,
}

/// WAL kept in memory: `[start, start + bytes.len())`, trimmed below what every safekeeper has
/// acknowledged.
struct WalBuffer {
    start: Lsn,
    bytes: VecDeque<u8>,
}

impl WalBuffer {
    fn end(&self) -> Lsn {
        Lsn(self.start.0 + self.bytes.len() as u64)
    }

    /// Copies `[from, from + max)` (bounded by the end) into `out`; false if `from` was trimmed.
    fn read(&self, from: Lsn, max: usize, out: &mut Vec<u8>) -> bool {
        if from < self.start {
            return false;
        }
        let off = (from.0 - self.start.0) as usize;
        let n = max.min(self.bytes.len().saturating_sub(off));
        out.clear();
        let (a, b) = self.bytes.as_slices();
        if off < a.len() {
            let from_a = n.min(a.len() - off);
            out.extend_from_slice(&a[off..off + from_a]);
            out.extend_from_slice(&b[..n - from_a]);
        } else {
            out.extend_from_slice(&b[off - a.len()..off - a.len() + n]);
        }
        true
    }

    fn trim_to(&mut self, lsn: Lsn) {
        if lsn > self.start {
            let n = ((lsn.0 - self.start.0) as usize).min(self.bytes.len());
            self.bytes.drain(..n);
            self.start = Lsn(self.start.0 + n as u64);
        }
    }
}

struct Shared {
    cfg: ProposerConfig,
    term: Term,
    term_start: Lsn,
    history: TermHistory,
    wal: Mutex<WalBuffer>,
    /// Last acknowledged flush LSN of each safekeeper.
    flush: Mutex<Vec<Lsn>>,
    /// Last persisted commit LSN each safekeeper reported.
    sk_commit: Mutex<Vec<Lsn>>,
    progress: watch::Sender<Progress>,
}

impl Shared {
    /// Recomputes the commit LSN from the safekeepers' flush LSNs and trims the buffer.
    fn update_commit(&self) {
        let flush = self.flush.lock().expect("flush lock").clone();
        let commit = commit_lsn(&flush, self.cfg.quorum(), self.term_start);
        let min_flush = flush.iter().copied().min().unwrap_or(Lsn::INVALID);
        self.wal
            .lock()
            .expect("wal lock")
            .trim_to(min_flush.min(commit));
        self.progress.send_if_modified(|p| {
            if commit > p.commit_lsn {
                p.commit_lsn = commit;
                true
            } else {
                false
            }
        });
    }

    fn truncate_lsn(&self) -> Lsn {
        let flush = self.flush.lock().expect("flush lock");
        let min = flush.iter().copied().min().unwrap_or(Lsn::INVALID);
        min.min(self.progress.borrow().commit_lsn)
    }

    fn step_down(&self, seen: Term) {
        self.progress.send_modify(|p| p.stepped_down = Some(seen));
    }
}

/// The commit rule: the LSN flushed on a quorum, counting only flushes at or above the term
/// start (WAL of earlier terms is committed only together with the new term's).
pub fn commit_lsn(flush: &[Lsn], quorum: usize, term_start: Lsn) -> Lsn {
    let mut v: Vec<Lsn> = flush
        .iter()
        .map(|&f| if f < term_start { Lsn::INVALID } else { f })
        .collect();
    v.sort();
    if quorum == 0 || quorum > v.len() {
        return Lsn::INVALID;
    }
    v[v.len() - quorum]
}

/// An elected proposer streaming to its safekeepers.
pub struct Proposer {
    shared: Arc<Shared>,
    tasks: JoinSet<()>,
}

/// A safekeeper's answer to the vote, with its connection.
struct Voter {
    idx: usize,
    reader: PushReader,
    writer: PushWriter,
    vote: VoteResponse,
}

impl Proposer {
    /// Runs an election over the configured safekeepers and starts streaming to them.
    pub async fn elect(cfg: ProposerConfig) -> Result<Proposer, ProposerError> {
        let n = cfg.safekeepers.len();
        let quorum = cfg.quorum();
        // 1. Greetings.
        let mut greeted = Vec::new();
        let mut failures = Vec::new();
        let mut connecting = JoinSet::new();
        for (idx, addr) in cfg.safekeepers.iter().enumerate() {
            let (addr, cfg) = (addr.clone(), cfg.clone());
            connecting.spawn(async move {
                let r = tokio::time::timeout(ELECTION_TIMEOUT, greet(&addr, &cfg)).await;
                (idx, addr, r)
            });
        }
        while let Some(res) = connecting.join_next().await {
            let Ok((idx, addr, r)) = res else { continue };
            match r {
                Ok(Ok((reader, writer, term))) => greeted.push((idx, reader, writer, term)),
                Ok(Err(e)) => failures.push(format!("{addr}: {e}")),
                Err(_) => failures.push(format!("{addr}: timed out")),
            }
        }
        if greeted.len() < quorum {
            return Err(ProposerError::NoQuorum {
                got: greeted.len(),
                need: quorum,
                details: failures.join("; "),
            });
        }
        let term = Term(greeted.iter().map(|g| g.3.0).max().unwrap_or(0) + 1);

        // 2. Votes.
        let mut voters = Vec::new();
        let mut voting = JoinSet::new();
        for (idx, mut reader, mut writer, _) in greeted {
            voting.spawn(async move {
                let r = async {
                    writer
                        .send(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
                            generation: Generation::INVALID,
                            term,
                        }))
                        .await?;
                    match reader.recv().await? {
                        AcceptorProposerMessage::VoteResponse(v) => Ok(v),
                        other => Err(ConnError::Unexpected(format!("{other:?}"))),
                    }
                };
                let r = tokio::time::timeout(ELECTION_TIMEOUT, r).await;
                (idx, reader, writer, r)
            });
        }
        let mut higher = None;
        while let Some(res) = voting.join_next().await {
            let Ok((idx, reader, writer, r)) = res else {
                continue;
            };
            match r {
                Ok(Ok(vote)) if vote.vote_given => voters.push(Voter {
                    idx,
                    reader,
                    writer,
                    vote,
                }),
                Ok(Ok(vote)) => {
                    if vote.term > term {
                        higher = Some(vote.term);
                    }
                    failures.push(format!(
                        "safekeeper {idx} refused the vote (term {})",
                        vote.term
                    ));
                }
                Ok(Err(e)) => failures.push(format!("safekeeper {idx}: {e}")),
                Err(_) => failures.push(format!("safekeeper {idx}: vote timed out")),
            }
        }
        if voters.len() < quorum {
            if let Some(seen) = higher {
                return Err(ProposerError::SteppedDown { ours: term, seen });
            }
            return Err(ProposerError::NoQuorum {
                got: voters.len(),
                need: quorum,
                details: failures.join("; "),
            });
        }

        // 3. The donor and the new history.
        let donor = voters
            .iter()
            .max_by_key(|v| (v.vote.term_history.last_log_term(), v.vote.flush_lsn))
            .expect("a quorum is not empty");
        let donor_flush = donor.vote.flush_lsn;
        let (term_start, mut history) = if donor_flush.is_valid() {
            (donor_flush, donor.vote.term_history.clone())
        } else {
            (cfg.start_lsn, TermHistory::empty())
        };
        history.0.push(TermLsn {
            term,
            lsn: term_start,
        });
        let starts: Vec<Lsn> = voters
            .iter()
            .map(|v| start_streaming_at(&history, &v.vote))
            .collect::<Result<_, _>>()?;
        let buffer_start = starts.iter().copied().min().unwrap_or(term_start);
        let recovered = if buffer_start < term_start {
            let addr = &cfg.safekeepers[donor.idx];
            fetch::fetch_wal(addr, cfg.ttid, term, buffer_start, term_start)
                .await
                .map_err(|e| ProposerError::Recovery(format!("from {addr}: {e}")))?
        } else {
            Vec::new()
        };
        tracing::info!(%term, %term_start, donor = donor.idx, recovered = recovered.len(), "elected");

        let (progress, _) = watch::channel(Progress {
            end_lsn: term_start,
            commit_lsn: Lsn::INVALID,
            stepped_down: None,
            synced: 0,
            finishing: false,
        });
        let shared = Arc::new(Shared {
            term,
            term_start,
            history: history.clone(),
            wal: Mutex::new(WalBuffer {
                start: buffer_start,
                bytes: recovered.into(),
            }),
            flush: Mutex::new(vec![Lsn::INVALID; n]),
            sk_commit: Mutex::new(vec![Lsn::INVALID; n]),
            progress,
            cfg,
        });

        // 4. Elected, then streaming, one task per safekeeper.
        let mut tasks = JoinSet::new();
        let mut connected = vec![false; n];
        for (voter, start) in voters.into_iter().zip(starts) {
            connected[voter.idx] = true;
            let shared = shared.clone();
            tasks.spawn(async move {
                run_safekeeper(shared, voter.idx, Some((voter.reader, voter.writer, start))).await
            });
        }
        for (idx, up) in connected.into_iter().enumerate() {
            if !up {
                let shared = shared.clone();
                tasks.spawn(async move { run_safekeeper(shared, idx, None).await });
            }
        }
        Ok(Proposer { shared, tasks })
    }

    /// The term this proposer was elected in.
    pub fn term(&self) -> Term {
        self.shared.term
    }

    /// Where this term's WAL begins (the donor's flush LSN).
    pub fn term_start_lsn(&self) -> Lsn {
        self.shared.term_start
    }

    /// The proposer's term history (the donor's plus this term).
    pub fn history(&self) -> &TermHistory {
        &self.shared.history
    }

    /// The latest progress.
    pub fn progress(&self) -> Progress {
        *self.shared.progress.borrow()
    }

    /// A receiver that wakes on every change of the progress.
    pub fn subscribe(&self) -> watch::Receiver<Progress> {
        self.shared.progress.subscribe()
    }

    /// Appends new WAL at `lsn` (which must be the current end) for streaming.
    pub fn push(&self, lsn: Lsn, wal: &[u8]) -> Result<(), ProposerError> {
        let mut buf = self.shared.wal.lock().expect("wal lock");
        if lsn != buf.end() {
            return Err(ProposerError::Discontinuous {
                expected: buf.end(),
                got: lsn,
            });
        }
        buf.bytes.extend(wal);
        let end = buf.end();
        drop(buf);
        self.shared.progress.send_modify(|p| p.end_lsn = end);
        Ok(())
    }

    /// Waits until `lsn` is committed on a quorum. Cancellation-safe.
    pub async fn wait_commit(&self, lsn: Lsn) -> Result<Lsn, ProposerError> {
        self.wait_for(|p| p.commit_lsn >= lsn)
            .await
            .map(|p| p.commit_lsn)
    }

    /// Sync mode: waits until the term start is committed and a quorum of safekeepers persisted
    /// a commit LSN at or above it. Returns the LSN (the end of WAL after the election).
    pub async fn sync(&self) -> Result<Lsn, ProposerError> {
        let start = self.shared.term_start;
        let quorum = self.shared.cfg.quorum();
        self.wait_for(|p| p.commit_lsn >= start && p.synced >= quorum)
            .await?;
        Ok(start)
    }

    /// Waits until the progress satisfies `done`, or the proposer stepped down or stopped.
    /// Cancellation-safe.
    async fn wait_for(&self, done: impl Fn(&Progress) -> bool) -> Result<Progress, ProposerError> {
        let mut rx = self.subscribe();
        loop {
            let p = *rx.borrow_and_update();
            if let Some(seen) = p.stepped_down {
                return Err(ProposerError::SteppedDown {
                    ours: self.shared.term,
                    seen,
                });
            }
            if done(&p) {
                return Ok(p);
            }
            if rx.changed().await.is_err() {
                return Err(ProposerError::Recovery("proposer stopped".into()));
            }
        }
    }

    /// The start of the last record before the term start, for a WAL source that must continue
    /// the `xl_prev` chain (the synthetic generator). Reads the tail from the buffer or the
    /// donor's history entries; `Lsn(0)` if there is no earlier WAL.
    pub async fn prev_record_start(&self) -> Result<Lsn, ProposerError> {
        let end = self.shared.term_start;
        // Record boundaries we know below the end: earlier term starts and the truncate LSN.
        let mut candidates: Vec<Lsn> = self.shared.history.0.iter().map(|e| e.lsn).collect();
        candidates.push(self.shared.truncate_lsn());
        let Some(from) = candidates
            .into_iter()
            .filter(|&l| l.is_valid() && l < end)
            .max()
        else {
            return Ok(Lsn(0));
        };
        let mut tail = Vec::new();
        let have = self.shared.wal.lock().expect("wal lock").read(
            from,
            (end.0 - from.0) as usize,
            &mut tail,
        ) && tail.len() as u64 == end.0 - from.0;
        if !have {
            let mut last_err = String::from("no safekeeper to read from");
            tail.clear();
            for addr in &self.shared.cfg.safekeepers {
                match fetch::fetch_wal(addr, self.shared.cfg.ttid, self.shared.term, from, end)
                    .await
                {
                    Ok(t) => {
                        tail = t;
                        break;
                    }
                    Err(e) => last_err = format!("{addr}: {e}"),
                }
            }
            if tail.len() as u64 != end.0 - from.0 {
                return Err(ProposerError::Recovery(last_err));
            }
        }
        let seg = self.shared.cfg.wal_seg_size as u64;
        let mut dec = WalStreamDecoder::new(from, seg);
        let mut ends = vec![from];
        dec.feed_with(&tail, |e| ends.push(e))
            .map_err(|e| ProposerError::Recovery(format!("decoding WAL before {end}: {e}")))?;
        if *ends.last().expect("not empty") != end {
            return Err(ProposerError::Recovery(format!(
                "WAL before the term start {end} does not end on a record boundary"
            )));
        }
        if ends.len() < 2 {
            return Ok(Lsn(0));
        }
        // The last record starts where the one before it ended (after a page header when that
        // end is a page boundary).
        let before = ends[ends.len() - 2];
        Ok(if before.page_offset() == 0 {
            Lsn(before.0 + page_header_size(before, seg) as u64)
        } else {
            before
        })
    }

    /// Ends streaming gracefully: every connected safekeeper gets the buffered WAL and the final
    /// commit LSN before its stream is closed. Waits at most `timeout`, then stops anyway.
    pub async fn finish(mut self, timeout: Duration) {
        self.shared.progress.send_modify(|p| p.finishing = true);
        let all = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(timeout, all).await.is_err() {
            tracing::warn!("some safekeepers did not finish within {timeout:?}");
        }
        self.shutdown().await;
    }

    /// Stops streaming at once.
    pub async fn shutdown(mut self) {
        self.tasks.abort_all();
        while self.tasks.join_next().await.is_some() {}
    }
}

async fn greet(
    addr: &SafekeeperAddr,
    cfg: &ProposerConfig,
) -> Result<(PushReader, PushWriter, Term), ConnError> {
    let (mut reader, mut writer) =
        connect_push(addr, cfg.ttid, cfg.allow_timeline_creation, "walproposer").await?;
    writer
        .send(&ProposerAcceptorMessage::Greeting(ProposerGreeting {
            tenant_id: cfg.ttid.tenant_id,
            timeline_id: cfg.ttid.timeline_id,
            mconf: Configuration::default(),
            pg_version: cfg.pg_version,
            system_id: cfg.system_id,
            wal_seg_size: cfg.wal_seg_size,
        }))
        .await?;
    match reader.recv().await? {
        AcceptorProposerMessage::Greeting(g) => Ok((reader, writer, g.term)),
        other => Err(ConnError::Unexpected(format!("{other:?}"))),
    }
}

/// Where a safekeeper must start receiving: the highest common point of the histories, or the
/// proposer's first entry if they share none.
fn start_streaming_at(history: &TermHistory, vote: &VoteResponse) -> Result<Lsn, ProposerError> {
    let hcp = TermHistory::find_highest_common_point(history, &vote.term_history, vote.flush_lsn)
        .map_err(|e| ProposerError::Recovery(e.to_string()))?;
    Ok(match hcp {
        Some(p) => p.lsn,
        None => history.0.first().map(|e| e.lsn).unwrap_or(Lsn::INVALID),
    })
}

/// Streams to safekeeper `idx` for the life of the proposer, reconnecting with backoff.
async fn run_safekeeper(
    shared: Arc<Shared>,
    idx: usize,
    mut conn: Option<(PushReader, PushWriter, Lsn)>,
) {
    let addr = shared.cfg.safekeepers[idx].clone();
    let mut backoff = Duration::from_millis(100);
    loop {
        let p = *shared.progress.borrow();
        if p.stepped_down.is_some() || (p.finishing && conn.is_none()) {
            return;
        }
        let established = match conn.take() {
            Some(c) => Ok(c),
            None => reconnect(&shared, &addr).await,
        };
        let connected_at = std::time::Instant::now();
        let result = match established {
            Ok((reader, mut writer, start)) => {
                let elected = ProposerAcceptorMessage::Elected(ProposerElected {
                    generation: Generation::INVALID,
                    term: shared.term,
                    start_streaming_at: start,
                    term_history: shared.history.clone(),
                });
                match writer.send(&elected).await {
                    Ok(()) => stream_to(&shared, idx, reader, writer, start).await,
                    Err(e) => Err(e.to_string()),
                }
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => return,
            Err(e) => {
                // A stream that worked for a while starts the backoff over; one that fails at
                // once (a refused append, a safekeeper that keeps rejecting us) backs off more.
                if connected_at.elapsed() > Duration::from_secs(10) {
                    backoff = Duration::from_millis(100);
                }
                tracing::warn!(safekeeper = %addr, "streaming failed: {e}; reconnecting in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Reconnects after an election: greeting and vote in our term (a safekeeper at our term
/// already voted for us or follows us), then the highest common point.
async fn reconnect(
    shared: &Shared,
    addr: &SafekeeperAddr,
) -> Result<(PushReader, PushWriter, Lsn), String> {
    let (mut reader, mut writer, sk_term) =
        greet(addr, &shared.cfg).await.map_err(|e| e.to_string())?;
    if sk_term > shared.term {
        shared.step_down(sk_term);
        return Err(format!("safekeeper is at term {sk_term}"));
    }
    writer
        .send(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation::INVALID,
            term: shared.term,
        }))
        .await
        .map_err(|e| e.to_string())?;
    let vote = match reader.recv().await.map_err(|e| e.to_string())? {
        AcceptorProposerMessage::VoteResponse(v) => v,
        other => return Err(format!("unexpected reply {other:?}")),
    };
    if vote.term > shared.term {
        shared.step_down(vote.term);
        return Err(format!("safekeeper is at term {}", vote.term));
    }
    let start = start_streaming_at(&shared.history, &vote).map_err(|e| e.to_string())?;
    Ok((reader, writer, start))
}

/// Sends WAL from `next` on and processes acknowledgements until an error.
async fn stream_to(
    shared: &Shared,
    idx: usize,
    mut reader: PushReader,
    mut writer: PushWriter,
    mut next: Lsn,
) -> Result<(), String> {
    let mut progress = shared.progress.subscribe();
    // What the safekeeper holds of our WAL: at least the common point it starts from.
    let mut acked = {
        let mut flush = shared.flush.lock().expect("flush lock");
        flush[idx] = flush[idx].max(next);
        flush[idx]
    };
    shared.update_commit();
    let mut sent_commit = Lsn::INVALID;
    let mut chunk = Vec::with_capacity(MAX_SEND_SIZE);
    loop {
        let p = *progress.borrow_and_update();
        if let Some(seen) = p.stepped_down {
            return Err(format!("stepped down (term {seen} seen)"));
        }
        // Send what there is, up to the in-flight window.
        while next < p.end_lsn && next.0.saturating_sub(acked.0) < MAX_IN_FLIGHT {
            let ok = shared
                .wal
                .lock()
                .expect("wal lock")
                .read(next, MAX_SEND_SIZE, &mut chunk);
            if !ok {
                return Err(format!("WAL at {next} is no longer buffered"));
            }
            if chunk.is_empty() {
                break;
            }
            let commit = p.commit_lsn;
            let msg = append(shared, next, Bytes::copy_from_slice(&chunk), commit);
            writer.queue(&msg).map_err(|e| e.to_string())?;
            sent_commit = commit;
            next = Lsn(next.0 + chunk.len() as u64);
            if writer.buffered() > 1 << 20 {
                writer.flush().await.map_err(|e| e.to_string())?;
            }
        }
        if next >= p.end_lsn && p.commit_lsn > sent_commit {
            // Nothing new to send: tell the safekeeper the commit LSN with an empty append.
            let msg = append(shared, next, Bytes::new(), p.commit_lsn);
            writer.queue(&msg).map_err(|e| e.to_string())?;
            sent_commit = p.commit_lsn;
        }
        writer.flush().await.map_err(|e| e.to_string())?;
        if p.finishing && next >= p.end_lsn && sent_commit >= p.commit_lsn {
            // Everything sent, the commit LSN included: end the stream and let the safekeeper
            // process what is queued (it flushes on disconnect) before it closes its side.
            writer.finish().await.map_err(|e| e.to_string())?;
            while reader.recv().await.is_ok() {}
            return Ok(());
        }

        tokio::select! {
            reply = reader.recv() => match reply.map_err(|e| e.to_string())? {
                AcceptorProposerMessage::AppendResponse(r) => {
                    if r.term > shared.term {
                        shared.step_down(r.term);
                        return Err(format!("safekeeper is at term {}", r.term));
                    }
                    let synced = {
                        let mut c = shared.sk_commit.lock().expect("commit lock");
                        c[idx] = c[idx].max(r.commit_lsn);
                        c.iter().filter(|&&l| l >= shared.term_start && l.is_valid()).count()
                    };
                    shared.progress.send_if_modified(|p| {
                        let changed = p.synced != synced;
                        p.synced = synced;
                        changed
                    });
                    if r.flush_lsn > acked {
                        acked = r.flush_lsn;
                        shared.flush.lock().expect("flush lock")[idx] = acked;
                        shared.update_commit();
                    }
                }
                other => return Err(format!("unexpected reply {other:?}")),
            },
            changed = progress.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
            }
        }
    }
}

fn append(shared: &Shared, begin: Lsn, data: Bytes, commit: Lsn) -> ProposerAcceptorMessage {
    ProposerAcceptorMessage::AppendRequest(AppendRequest {
        h: AppendRequestHeader {
            generation: Generation::INVALID,
            term: shared.term,
            begin_lsn: begin,
            end_lsn: Lsn(begin.0 + data.len() as u64),
            commit_lsn: commit,
            truncate_lsn: shared.truncate_lsn(),
        },
        wal_data: data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_is_the_quorum_flush_at_or_above_term_start() {
        let l = |v: &[u64]| v.iter().map(|&x| Lsn(x)).collect::<Vec<_>>();
        assert_eq!(commit_lsn(&l(&[30, 10, 20]), 2, Lsn(0)), Lsn(20));
        assert_eq!(commit_lsn(&l(&[30, 10, 20]), 3, Lsn(0)), Lsn(10));
        // A safekeeper below the term start does not count: with 2 of 3 needed and only one at
        // or above the start, nothing of the new term is committed yet.
        assert_eq!(commit_lsn(&l(&[30, 10, 15]), 2, Lsn(20)), Lsn(0));
        assert_eq!(commit_lsn(&l(&[30, 25, 15]), 2, Lsn(20)), Lsn(25));
        assert_eq!(commit_lsn(&l(&[5]), 1, Lsn(0)), Lsn(5));
        assert_eq!(commit_lsn(&l(&[]), 1, Lsn(0)), Lsn(0));
    }

    #[test]
    fn wal_buffer_reads_across_its_ring_and_trims() {
        let mut b = WalBuffer {
            start: Lsn(100),
            bytes: VecDeque::with_capacity(4),
        };
        b.bytes.extend([1, 2, 3, 4]);
        b.trim_to(Lsn(102));
        b.bytes.extend([5, 6]);
        let mut out = Vec::new();
        assert!(b.read(Lsn(102), 10, &mut out));
        assert_eq!(out, vec![3, 4, 5, 6]);
        assert!(b.read(Lsn(105), 10, &mut out));
        assert_eq!(out, vec![6]);
        assert!(!b.read(Lsn(101), 10, &mut out));
        assert_eq!(b.end(), Lsn(106));
    }
}
