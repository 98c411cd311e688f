//! The proposer side of neon's protocol: elect this proposer over N safekeepers, recover the
//! newest WAL from the donor, and stream WAL to every safekeeper, committing on a quorum.
//!
//! The consensus rules (term and donor choice, start points, the commit rule) live in the
//! sans-IO [`consensus::ProposerCore`]; this module is its tokio driver and keeps only sockets,
//! reconnection with backoff, timeouts and fetching WAL over the network:
//! - one task per safekeeper connects (`START_WAL_PUSH`), reports the connection, feeds every
//!   reply to the core, and writes what the core queued for it; when the connection breaks it
//!   reports that and reconnects with backoff;
//! - a ticker gives the core its heartbeat tick every second and logs, every few seconds, why
//!   the commit LSN is stalled if it is;
//! - [`consensus::Action::Fetch`] runs `START_REPLICATION … (term='N')` on a task of its own;
//! - a newer membership configuration adds a task for each new member
//!   ([`consensus::Action::AddSafekeeper`]) and ends the tasks of removed ones; the core
//!   re-elects itself in the new generation while pushed WAL waits in its buffer.
//!
//! Callers use [`Proposer`]: [`Proposer::elect`], then [`Proposer::push`] WAL and watch
//! [`Progress`]; a higher term seen anywhere makes the proposer step down
//! ([`ProposerError::SteppedDown`]).

pub mod conn;
pub mod consensus;
pub mod fetch;
pub mod postgres;
pub mod synthetic;
pub mod tls;

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{Notify, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use conn::{PushReader, PushWriter, SafekeeperAddr, connect_push};
use consensus::{Action, Backpressure, ConnId, CoreConfig, Event, ProposerCore, PushError, SkId};
use pg_wal::decoder::WalStreamDecoder;
use pg_wal::lsn::XLOG_BLCKSZ;
use sk_core::protocol::{HotStandbyFeedback, ProposerAcceptorMessage};
use sk_core::types::{Lsn, TenantTimelineId, Term, TermHistory};

pub use sk_core::protocol::MAX_SEND_SIZE;

/// How long an election waits for a quorum.
const ELECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one connection attempt may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Period of the core's tick (heartbeats to idle safekeepers).
const TICK: Duration = Duration::from_secs(1);
/// After this long without a commit while WAL waits, the proposer says why.
const STALL_REPORT: Duration = Duration::from_secs(5);

/// What the proposer needs to know.
#[derive(Clone, Debug)]
pub struct ProposerConfig {
    /// The safekeepers to elect this proposer and to stream to.
    pub safekeepers: Vec<SafekeeperAddr>,
    /// The timeline written.
    pub ttid: TenantTimelineId,
    /// PostgreSQL system identifier of the WAL.
    pub system_id: u64,
    /// PostgreSQL version of the WAL's server (e.g. 150018).
    pub pg_version: u32,
    /// WAL segment size in bytes.
    pub wal_seg_size: u32,
    /// Where WAL begins if every safekeeper is empty (a record boundary).
    pub start_lsn: Lsn,
    /// Whether a safekeeper that does not know the timeline creates it on our greeting.
    pub allow_timeline_creation: bool,
    /// `--max-replication-flush-lag` ([`CoreConfig::max_replication_flush_lag`]; 0: none).
    pub max_replication_flush_lag: u64,
    /// `--max-replication-apply-lag` ([`CoreConfig::max_replication_apply_lag`]; 0: none).
    pub max_replication_apply_lag: u64,
}

impl ProposerConfig {
    fn core_config(&self) -> CoreConfig {
        let mut cfg = CoreConfig::new(
            self.safekeepers.len(),
            self.ttid,
            self.system_id,
            self.pg_version,
            self.wal_seg_size,
            self.start_lsn,
        );
        cfg.addrs = self
            .safekeepers
            .iter()
            .map(|a| format!("{}:{}", a.host, a.port))
            .collect();
        cfg.max_replication_flush_lag = self.max_replication_flush_lag;
        cfg.max_replication_apply_lag = self.max_replication_apply_lag;
        cfg
    }
}

/// Why the proposer stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProposerError {
    /// The election found no quorum in time.
    #[error(
        "no quorum: {got} safekeepers voted for us within {timeout:?}, {need} is needed ({details})"
    )]
    NoQuorum {
        /// Votes granted.
        got: usize,
        /// What a quorum is.
        need: String,
        /// How long the election waited.
        timeout: Duration,
        /// Each safekeeper's state and last error.
        details: String,
    },
    /// A safekeeper is at a higher term: another proposer took over.
    #[error("stepped down: a safekeeper is at term {seen}, above ours ({ours})")]
    SteppedDown {
        /// Our term.
        ours: Term,
        /// The higher term seen.
        seen: Term,
    },
    /// Fetching WAL from a safekeeper failed, or the WAL was unusable.
    #[error("recovering WAL: {0}")]
    Recovery(
        /// What failed.
        String,
    ),
    /// Pushed WAL does not continue the proposer's WAL.
    #[error("WAL must continue at {expected}, got {got}")]
    Discontinuous {
        /// The end of the proposer's WAL.
        expected: Lsn,
        /// Where the pushed WAL started.
        got: Lsn,
    },
}

/// What the proposer publishes as it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Set once elected.
    pub elected: bool,
    /// End of WAL in the proposer's buffer.
    pub end_lsn: Lsn,
    /// Highest LSN flushed on a quorum in this term.
    pub commit_lsn: Lsn,
    /// Set once the proposer stepped down (and stops streaming).
    pub stepped_down: Option<Term>,
    /// Set when the election failed (recovering the donor's WAL did not work).
    pub failed: bool,
    /// Whether a quorum of safekeepers *persisted* a commit LSN at or above the term start
    /// (sync mode waits for it).
    pub synced: bool,
    /// Set by [`Proposer::finish`]: stream what is buffered, pass on the commit LSN, then end.
    pub finishing: bool,
    /// What the safekeepers' readers need kept ([`ProposerCore::hs_feedback`]).
    pub hs_feedback: HotStandbyFeedback,
    /// Whether pushing must slow down or pause for slow readers ([`ProposerCore::backpressure`]).
    pub backpressure: Backpressure,
}

/// The log line of a change of backpressure between off, slowed and paused.
fn log_backpressure(was: &Backpressure, now: &Backpressure, cfg: &ProposerConfig) {
    let limits = format!(
        "--max-replication-flush-lag {}, --max-replication-apply-lag {}",
        cfg.max_replication_flush_lag, cfg.max_replication_apply_lag
    );
    match (was, now) {
        (Backpressure::Paused { .. }, Backpressure::Paused { .. })
        | (Backpressure::Slow { .. }, Backpressure::Slow { .. })
        | (Backpressure::Off, Backpressure::Off) => {}
        (_, Backpressure::Paused { lag }) => tracing::warn!(
            lag,
            "backpressure: pausing appends, the slowest required reader lags {lag} bytes ({limits})"
        ),
        (_, Backpressure::Slow { lag, .. }) => tracing::info!(
            lag,
            "backpressure: slowing appends, the slowest required reader lags {lag} bytes ({limits})"
        ),
        (_, Backpressure::Off) => {
            tracing::info!("backpressure: released, appends at full speed")
        }
    }
}

/// What a safekeeper's task is to do next on its connection.
enum Out {
    Msg(ConnId, ProposerAcceptorMessage),
    Close(ConnId, String),
    /// Close and connect again without a backoff (logged when queued).
    Reconnect(ConnId),
}

/// The core and what the driver keeps beside it, under one lock.
struct State {
    core: ProposerCore,
    /// Per safekeeper: where it listens (configured, then added by membership changes).
    addrs: Vec<SafekeeperAddr>,
    /// Per safekeeper: "something was queued for you".
    wake: Vec<Arc<Notify>>,
    /// Per safekeeper: what its task must write (or do) next.
    out: Vec<VecDeque<Out>>,
    /// Per safekeeper: whether its task runs (it ends when the safekeeper is retired).
    running: Vec<bool>,
    /// Per safekeeper: why its last connection failed or ended.
    errors: Vec<Option<String>>,
    next_conn: ConnId,
    /// Why the election failed, if it did.
    failure: Option<String>,
    /// The higher term that made the core step down.
    stepped_down: Option<Term>,
}

struct Shared {
    cfg: ProposerConfig,
    state: Mutex<State>,
    progress: watch::Sender<Progress>,
    /// One task per safekeeper.
    tasks: Mutex<Vec<JoinHandle<()>>>,
    stop: CancellationToken,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("proposer state lock")
    }

    /// Feeds `event` to the core and carries out what it asks.
    fn step(self: &Arc<Self>, event: Event) {
        let mut st = self.lock();
        st.core.step(event);
        self.dispatch(&mut st);
    }

    /// Routes the core's queued actions to the safekeeper tasks, fetches and [`Progress`].
    fn dispatch(self: &Arc<Self>, st: &mut State) {
        let actions = st.core.take_actions();
        for action in actions {
            match action {
                Action::Send { sk, conn, msg } => {
                    if let ProposerAcceptorMessage::AppendRequest(a) = &msg {
                        tracing::trace!(sk, begin = %a.h.begin_lsn, end = %a.h.end_lsn, commit = %a.h.commit_lsn, truncate = %a.h.truncate_lsn, "append");
                    }
                    st.out[sk].push_back(Out::Msg(conn, msg));
                    st.wake[sk].notify_one();
                }
                Action::Close { sk, conn, reason } => {
                    tracing::warn!(safekeeper = %st.addrs[sk], "closing: {reason}");
                    st.out[sk].push_back(Out::Close(conn, reason));
                    st.wake[sk].notify_one();
                }
                Action::Reconnect { sk, conn, reason } => {
                    tracing::info!(safekeeper = %st.addrs[sk], "reconnecting: {reason}");
                    st.out[sk].push_back(Out::Reconnect(conn));
                    st.wake[sk].notify_one();
                }
                Action::Fetch {
                    id,
                    sk,
                    term,
                    from,
                    to,
                } => self.spawn_fetch(st.addrs[sk].clone(), id, term, from, to),
                Action::Reconfigured { mconf } => {
                    tracing::info!(
                        generation = %mconf.generation,
                        "membership changed: re-electing with {}",
                        st.core.quorum_description()
                    );
                }
                Action::AddSafekeeper { sk, id } => {
                    let addr = SafekeeperAddr {
                        host: id.host.clone(),
                        port: id.pg_port,
                        password: self
                            .cfg
                            .safekeepers
                            .first()
                            .and_then(|a| a.password.clone()),
                        tls: self.cfg.safekeepers.first().and_then(|a| a.tls.clone()),
                    };
                    tracing::info!(safekeeper = %addr, node = %id.id, "new member");
                    if sk == st.addrs.len() {
                        st.addrs.push(addr);
                        st.wake.push(Arc::new(Notify::new()));
                        st.out.push(VecDeque::new());
                        st.errors.push(None);
                        st.running.push(false);
                    } else {
                        st.addrs[sk] = addr;
                    }
                    if !st.running[sk] {
                        st.running[sk] = true;
                        self.spawn_safekeeper(sk);
                    }
                }
                Action::RetireSafekeeper { sk } => {
                    tracing::info!(safekeeper = %st.addrs[sk], "not a member any more");
                    st.wake[sk].notify_one();
                }
                Action::Elected {
                    term, term_start, ..
                } => {
                    tracing::info!(%term, %term_start, donor = ?st.core.donor(), "elected");
                }
                Action::SteppedDown { seen } => {
                    tracing::warn!(ours = %st.core.term(), %seen, "stepping down: a safekeeper is at a higher term");
                    st.stepped_down = Some(seen);
                }
                Action::Commit(_) => {}
                Action::ElectionFailed { reason } => {
                    tracing::error!("election failed: {reason}");
                    st.failure = Some(reason);
                }
            }
        }
        let core = &st.core;
        let failed = st.failure.is_some();
        let stepped_down = st.stepped_down;
        let backpressure = core.backpressure();
        self.progress.send_if_modified(|p| {
            log_backpressure(&p.backpressure, &backpressure, &self.cfg);
            let next = Progress {
                elected: matches!(
                    core.phase(),
                    consensus::Phase::Elected | consensus::Phase::Stopped
                ) && core.term_start().is_valid()
                    && !failed,
                end_lsn: core.end_lsn(),
                commit_lsn: core.commit_lsn(),
                stepped_down,
                failed,
                synced: core.synced(),
                finishing: p.finishing,
                hs_feedback: core.hs_feedback(),
                backpressure,
            };
            let changed = next != *p;
            *p = next;
            changed
        });
    }

    fn spawn_fetch(
        self: &Arc<Self>,
        addr: SafekeeperAddr,
        id: u64,
        term: Term,
        from: Lsn,
        to: Lsn,
    ) {
        let shared = self.clone();
        let ttid = self.cfg.ttid;
        tokio::spawn(async move {
            tracing::info!(safekeeper = %addr, %from, %to, "fetching WAL");
            let event = match fetch::fetch_wal(&addr, ttid, term, from, to).await {
                Ok(wal) => Event::Fetched {
                    id,
                    from,
                    wal: Bytes::from(wal),
                },
                Err(e) => Event::FetchFailed {
                    id,
                    reason: format!("from {addr}: {e}"),
                },
            };
            shared.step(event);
        });
    }

    fn spawn_safekeeper(self: &Arc<Self>, sk: SkId) {
        let task = tokio::spawn(run_safekeeper(self.clone(), sk));
        self.tasks.lock().expect("tasks lock").push(task);
    }
}

/// A proposer: elected over its safekeepers, streaming to them.
pub struct Proposer {
    shared: Arc<Shared>,
    ticker: JoinHandle<()>,
    term: Term,
    term_start: Lsn,
    history: TermHistory,
}

impl Proposer {
    /// Connects to the configured safekeepers and runs an election. Fails with
    /// [`ProposerError::NoQuorum`] if no quorum votes for us within 10 s, with
    /// [`ProposerError::SteppedDown`] if a safekeeper is at a higher term.
    pub async fn elect(cfg: ProposerConfig) -> Result<Proposer, ProposerError> {
        let n = cfg.safekeepers.len();
        let (progress, _) = watch::channel(Progress {
            elected: false,
            end_lsn: cfg.start_lsn,
            commit_lsn: Lsn::INVALID,
            stepped_down: None,
            failed: false,
            synced: false,
            finishing: false,
            hs_feedback: HotStandbyFeedback::default(),
            backpressure: Backpressure::Off,
        });
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                core: ProposerCore::new(cfg.core_config()),
                addrs: cfg.safekeepers.clone(),
                wake: (0..n).map(|_| Arc::new(Notify::new())).collect(),
                out: (0..n).map(|_| VecDeque::new()).collect(),
                running: vec![true; n],
                errors: vec![None; n],
                next_conn: 1,
                failure: None,
                stepped_down: None,
            }),
            progress,
            tasks: Mutex::new(Vec::new()),
            stop: CancellationToken::new(),
            cfg,
        });
        for sk in 0..n {
            shared.spawn_safekeeper(sk);
        }
        let ticker = tokio::spawn(run_ticker(shared.clone()));
        let mut proposer = Proposer {
            shared,
            ticker,
            term: Term(0),
            term_start: Lsn::INVALID,
            history: TermHistory::empty(),
        };
        let elected = tokio::time::timeout(
            ELECTION_TIMEOUT,
            proposer.wait_for(|p| p.elected || p.failed),
        )
        .await;
        let outcome = match elected {
            Ok(Ok(p)) if p.failed => Err(ProposerError::Recovery(
                proposer.shared.lock().failure.clone().unwrap_or_default(),
            )),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                let st = proposer.shared.lock();
                let errors: Vec<String> = st
                    .errors
                    .iter()
                    .enumerate()
                    .filter_map(|(i, e)| e.as_ref().map(|e| format!("{}: {e}", st.addrs[i])))
                    .collect();
                Err(ProposerError::NoQuorum {
                    got: st.core.votes_granted(),
                    need: st.core.quorum_description(),
                    timeout: ELECTION_TIMEOUT,
                    details: format!("{}; {}", st.core.describe(), errors.join("; ")),
                })
            }
        };
        if let Err(e) = outcome {
            proposer.shutdown().await;
            return Err(e);
        }
        {
            let st = proposer.shared.lock();
            proposer.term = st.core.term();
            proposer.term_start = st.core.term_start();
            proposer.history = st.core.history().clone();
        }
        Ok(proposer)
    }

    /// Our term (it grows when a membership change makes the proposer re-elect itself).
    pub fn term(&self) -> Term {
        self.shared.lock().core.term()
    }

    /// Where this term's WAL begins (the donor's flush LSN).
    pub fn term_start_lsn(&self) -> Lsn {
        self.term_start
    }

    /// Our term history: the donor's plus `(term, term start)`.
    pub fn history(&self) -> &TermHistory {
        &self.history
    }

    /// WAL segment size of the timeline.
    pub fn wal_seg_size(&self) -> u32 {
        self.shared.cfg.wal_seg_size
    }

    /// PostgreSQL system identifier of the timeline.
    pub fn system_id(&self) -> u64 {
        self.shared.cfg.system_id
    }

    /// The PostgreSQL major version of the timeline's WAL (from `pg_version`).
    pub fn pg_major(&self) -> Result<pg_wal::PgMajor, ProposerError> {
        pg_wal::PgMajor::from_server_version(self.shared.cfg.pg_version)
            .map_err(|e| ProposerError::Recovery(e.to_string()))
    }

    /// The current progress.
    pub fn progress(&self) -> Progress {
        *self.shared.progress.borrow()
    }

    /// A receiver of every change of [`Progress`].
    pub fn subscribe(&self) -> watch::Receiver<Progress> {
        self.shared.progress.subscribe()
    }

    /// Appends new WAL at `lsn` (which must be the current end) for streaming.
    pub fn push(&self, lsn: Lsn, wal: Bytes) -> Result<(), ProposerError> {
        let mut st = self.shared.lock();
        match st.core.push(lsn, wal) {
            Ok(()) => {}
            Err(PushError::Discontinuous { expected, got }) => {
                return Err(ProposerError::Discontinuous { expected, got });
            }
            Err(PushError::NotElected) => {
                if let Some(reason) = st.failure.clone() {
                    return Err(ProposerError::Recovery(reason));
                }
                return Err(ProposerError::SteppedDown {
                    ours: self.term,
                    seen: self.progress().stepped_down.unwrap_or(self.term),
                });
            }
        }
        self.shared.dispatch(&mut st);
        Ok(())
    }

    /// Waits as backpressure asks before new WAL is pushed: not at all when it is off, its
    /// delay when slowed down, until it is no longer paused when paused (or the proposer
    /// stopped). Cancellation-safe.
    pub async fn throttle(&self) -> Result<(), ProposerError> {
        let p = self
            .wait_for(|p| !matches!(p.backpressure, Backpressure::Paused { .. }))
            .await?;
        if let Backpressure::Slow { delay_ms, .. } = p.backpressure {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        }
        Ok(())
    }

    /// Waits until the commit LSN reaches `lsn`. Cancellation-safe.
    pub async fn wait_commit(&self, lsn: Lsn) -> Result<Lsn, ProposerError> {
        self.wait_for(|p| p.commit_lsn >= lsn)
            .await
            .map(|p| p.commit_lsn)
    }

    /// Sync mode: waits until the term start is committed and a quorum of safekeepers persisted
    /// a commit LSN at or above it. Returns the LSN (the end of WAL after the election).
    pub async fn sync(&self) -> Result<Lsn, ProposerError> {
        let start = self.term_start;
        self.wait_for(|p| p.commit_lsn >= start && p.synced).await?;
        Ok(start)
    }

    /// Waits until the progress satisfies `done`, or the proposer stepped down or stopped.
    /// Cancellation-safe.
    async fn wait_for(&self, done: impl Fn(&Progress) -> bool) -> Result<Progress, ProposerError> {
        let mut rx = self.subscribe();
        loop {
            let p = *rx.borrow_and_update();
            if done(&p) {
                return Ok(p);
            }
            if let Some(seen) = p.stepped_down {
                return Err(ProposerError::SteppedDown {
                    ours: self.shared.lock().core.term(),
                    seen,
                });
            }
            if rx.changed().await.is_err() {
                return Err(ProposerError::Recovery("proposer stopped".into()));
            }
        }
    }

    /// Copies buffered WAL `[from, to)`; `None` if it is not all in memory.
    fn read_buffered(&self, from: Lsn, to: Lsn) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        self.shared
            .lock()
            .core
            .read_buffered(from, to, &mut out)
            .then_some(out)
    }

    /// The start of the last record before the term start, for a WAL source that must continue
    /// the `xl_prev` chain (the synthetic generator). Reads the tail from the buffer or from the
    /// safekeepers; `Lsn(0)` if there is no earlier WAL.
    ///
    /// It reads as little as it can: from the last page before the term start (the decoder
    /// skips a record tail that continues onto that page), going back page by page, four times
    /// further each time, to the last record boundary it knows (an earlier term start or the
    /// truncate LSN). The safekeepers keep local WAL from their peers' horizon on, so a new
    /// proposer starts while remote storage is down (issue 19).
    pub async fn prev_record_start(&self) -> Result<Lsn, ProposerError> {
        let end = self.term_start;
        // Record boundaries we know below the end: earlier term starts and the truncate LSN.
        let truncate = self.shared.lock().core.truncate_lsn();
        let Some(known) = self
            .history
            .0
            .iter()
            .map(|e| e.lsn)
            .chain([truncate])
            .filter(|&l| l.is_valid() && l < end)
            .max()
        else {
            return Ok(Lsn(0));
        };
        let seg = self.shared.cfg.wal_seg_size as u64;
        let major = self.pg_major()?;
        let mut back = XLOG_BLCKSZ;
        loop {
            let from = known.max(Lsn(end.0.saturating_sub(back)).page_start());
            let tail = self.read_wal(from, end).await?;
            let mut dec = WalStreamDecoder::new(from, seg, major);
            let mut last_end = from;
            dec.feed_with(&tail, |e| last_end = e)
                .map_err(|e| ProposerError::Recovery(format!("decoding WAL before {end}: {e}")))?;
            if last_end != end {
                return Err(ProposerError::Recovery(format!(
                    "WAL before the term start {end} does not end on a record boundary"
                )));
            }
            match dec.last_valid_record_start() {
                Some(start) => return Ok(start),
                // From a known boundary and no record before the end: there is none.
                None if from == known => return Ok(Lsn(0)),
                // Only the tail of a record that began further back: read more.
                None => back = back.saturating_mul(4),
            }
        }
    }

    /// WAL `[from, end)` from the buffer, or else from the first safekeeper that serves it.
    async fn read_wal(&self, from: Lsn, end: Lsn) -> Result<Vec<u8>, ProposerError> {
        if let Some(t) = self.read_buffered(from, end) {
            return Ok(t);
        }
        let mut last_err = String::from("no safekeeper to read from");
        let addrs = self.shared.lock().addrs.clone();
        for addr in &addrs {
            match fetch::fetch_wal(addr, self.shared.cfg.ttid, self.term, from, end).await {
                Ok(t) if t.len() as u64 == end.0 - from.0 => return Ok(t),
                Ok(_) => last_err = format!("{addr}: WAL [{from}, {end}) is incomplete"),
                Err(e) => last_err = format!("{addr}: {e}"),
            }
        }
        Err(ProposerError::Recovery(last_err))
    }

    /// Ends streaming gracefully: every connected safekeeper gets the buffered WAL and the final
    /// commit LSN before its stream is closed. Waits at most `timeout`, then stops anyway.
    pub async fn finish(self, timeout: Duration) {
        self.shared.progress.send_modify(|p| p.finishing = true);
        self.shared.step(Event::Finishing);
        for w in &self.shared.lock().wake {
            w.notify_one();
        }
        let shared = self.shared.clone();
        let all = async {
            loop {
                let tasks = std::mem::take(&mut *shared.tasks.lock().expect("tasks lock"));
                if tasks.is_empty() {
                    break;
                }
                for t in tasks {
                    let _ = t.await;
                }
            }
        };
        if tokio::time::timeout(timeout, all).await.is_err() {
            tracing::warn!(
                "some safekeepers did not finish within {timeout:?}: {}",
                shared.lock().core.describe()
            );
        }
        self.shutdown().await;
    }

    /// Stops streaming at once.
    pub async fn shutdown(self) {
        self.shared.stop.cancel();
        self.ticker.abort();
        let tasks = std::mem::take(&mut *self.shared.tasks.lock().expect("tasks lock"));
        for t in &tasks {
            t.abort();
        }
        for t in tasks {
            let _ = t.await;
        }
    }
}

/// Streams to safekeeper `sk` for the life of the proposer, reconnecting with backoff.
async fn run_safekeeper(shared: Arc<Shared>, sk: SkId) {
    let (addr, wake) = {
        let st = shared.lock();
        (st.addrs[sk].clone(), st.wake[sk].clone())
    };
    let mut backoff = Duration::from_millis(100);
    loop {
        let p = *shared.progress.borrow();
        if shared.stop.is_cancelled() || p.stepped_down.is_some() || p.failed || p.finishing {
            return;
        }
        {
            let mut st = shared.lock();
            if st.core.retired(sk) {
                st.running[sk] = false;
                return;
            }
        }
        let connect = connect_push(
            &addr,
            shared.cfg.ttid,
            shared.cfg.allow_timeline_creation,
            "walproposer",
        );
        let connected_at = Instant::now();
        let result = match tokio::time::timeout(CONNECT_TIMEOUT, connect).await {
            Ok(Ok((reader, writer))) => {
                let conn = {
                    let mut st = shared.lock();
                    let id = st.next_conn;
                    st.next_conn += 1;
                    st.out[sk].clear();
                    id
                };
                shared.step(Event::Connected { sk, conn });
                let r = serve(&shared, sk, conn, &wake, reader, writer).await;
                shared.step(Event::Disconnected { sk, conn });
                r
            }
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("connecting timed out after {CONNECT_TIMEOUT:?}")),
        };
        match result {
            Ok(Done::Finished) => return,
            Ok(Done::Stopped) => return,
            Ok(Done::Reconnect) => backoff = Duration::from_millis(100),
            Err(e) => {
                // A stream that worked for a while starts the backoff over; one that fails at
                // once (refused, rejected by the safekeeper) backs off more.
                if connected_at.elapsed() > Duration::from_secs(10) {
                    backoff = Duration::from_millis(100);
                }
                tracing::warn!(safekeeper = %addr, "streaming failed: {e}; reconnecting in {backoff:?}");
                shared.lock().errors[sk] = Some(e);
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = shared.stop.cancelled() => return,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// How a connection ended without an error.
enum Done {
    /// Everything was sent and the stream closed gracefully ([`Proposer::finish`]).
    Finished,
    /// The proposer stopped.
    Stopped,
    /// The core asked for a new connection.
    Reconnect,
}

/// Runs one connection: writes what the core queued for it, feeds replies to the core.
async fn serve(
    shared: &Arc<Shared>,
    sk: SkId,
    conn: ConnId,
    wake: &Notify,
    mut reader: PushReader,
    mut writer: PushWriter,
) -> Result<Done, String> {
    let mut batch = Vec::new();
    loop {
        let (mut close, mut finish) = take_queued(shared, sk, conn, &mut batch);
        if close.is_none() && !finish && !batch.is_empty() && batch.iter().all(is_bare_append) {
            // Only a commit LSN to pass on (the proposer just committed): give the WAL source,
            // woken by the same commit, one turn to push more, so the commit LSN rides on that
            // append instead of costing every member a message and a wake-up of its own.
            tokio::task::yield_now().await;
            (close, finish) = take_queued(shared, sk, conn, &mut batch);
        }
        for msg in batch.drain(..) {
            writer.queue(&msg).map_err(|e| e.to_string())?;
        }
        writer.flush().await.map_err(|e| e.to_string())?;
        if let Some(done) = close {
            return done;
        }
        if finish {
            // Everything sent, the commit LSN included: end the stream and let the safekeeper
            // process what is queued (it flushes on disconnect) before it closes its side.
            writer.finish().await.map_err(|e| e.to_string())?;
            while let Ok(msg) = reader.recv().await {
                shared.step(Event::Received { sk, conn, msg });
            }
            return Ok(Done::Finished);
        }
        tokio::select! {
            // Cancellation-safe (PushReader::recv).
            reply = reader.recv() => {
                let msg = reply.map_err(|e| e.to_string())?;
                shared.step(Event::Received { sk, conn, msg });
            }
            _ = wake.notified() => {}
            _ = shared.stop.cancelled() => return Ok(Done::Stopped),
        }
        let p = *shared.progress.borrow();
        if p.stepped_down.is_some() || p.failed {
            return Ok(Done::Stopped);
        }
    }
}

/// Moves what the core queued for connection `conn` of `sk` into `batch`. Returns whether the
/// connection is to end, and (under the same lock, so nothing queued is left behind) whether
/// a finishing stream has been given everything.
fn take_queued(
    shared: &Shared,
    sk: SkId,
    conn: ConnId,
    batch: &mut Vec<ProposerAcceptorMessage>,
) -> (Option<Result<Done, String>>, bool) {
    let mut st = shared.lock();
    let mut close = None;
    while let Some(out) = st.out[sk].pop_front() {
        match out {
            Out::Msg(c, msg) if c == conn => push_coalesced(batch, msg),
            Out::Close(c, reason) if c == conn => {
                close = Some(Err(reason));
                break;
            }
            Out::Reconnect(c) if c == conn => {
                close = Some(Ok(Done::Reconnect));
                break;
            }
            _ => {} // for a connection that is gone
        }
    }
    let finish = shared.progress.borrow().finishing && st.core.caught_up(sk);
    (close, finish)
}

/// An append that carries no WAL: it only passes on the commit and truncate LSNs (or probes).
fn is_bare_append(m: &ProposerAcceptorMessage) -> bool {
    matches!(m, ProposerAcceptorMessage::AppendRequest(a) if a.wal_data.is_empty())
}

/// Adds `msg` to a batch about to be written, leaving out a bare append (no WAL) just before it
/// that it makes redundant: an append at the same position, in the same term and generation,
/// carrying commit and truncate LSNs at least as high.
fn push_coalesced(batch: &mut Vec<ProposerAcceptorMessage>, msg: ProposerAcceptorMessage) {
    if let ProposerAcceptorMessage::AppendRequest(next) = &msg
        && let Some(ProposerAcceptorMessage::AppendRequest(prev)) = batch.last()
        && prev.wal_data.is_empty()
        && prev.h.begin_lsn == next.h.begin_lsn
        && prev.h.term == next.h.term
        && prev.h.generation == next.h.generation
        && prev.h.commit_lsn <= next.h.commit_lsn
        && prev.h.truncate_lsn <= next.h.truncate_lsn
    {
        batch.pop();
    }
    batch.push(msg);
}

/// Ticks the core, and says why the commit LSN does not move when WAL is waiting.
async fn run_ticker(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_commit = Lsn::INVALID;
    let mut since = Instant::now();
    let mut reported = Instant::now();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shared.stop.cancelled() => return,
        }
        shared.step(Event::Tick);
        let p = *shared.progress.borrow();
        if p.commit_lsn != last_commit || p.end_lsn <= p.commit_lsn || !p.elected {
            last_commit = p.commit_lsn;
            since = Instant::now();
            continue;
        }
        if since.elapsed() >= STALL_REPORT && reported.elapsed() >= STALL_REPORT {
            reported = Instant::now();
            let st = shared.lock();
            tracing::warn!(
                commit = %p.commit_lsn,
                end = %p.end_lsn,
                "commit stalled for {:?}: {} has not acknowledged; {}",
                since.elapsed(),
                st.core.quorum_description(),
                st.core.describe()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sk_core::protocol::{AppendRequest, AppendRequestHeader};
    use sk_core::types::Generation;

    fn append(begin: u64, commit: u64, wal: &'static [u8]) -> ProposerAcceptorMessage {
        ProposerAcceptorMessage::AppendRequest(AppendRequest {
            h: AppendRequestHeader {
                generation: Generation(1),
                term: Term(3),
                begin_lsn: Lsn(begin),
                end_lsn: Lsn(begin + wal.len() as u64),
                commit_lsn: Lsn(commit),
                truncate_lsn: Lsn(commit),
            },
            wal_data: Bytes::from_static(wal),
        })
    }

    fn shape(batch: &[ProposerAcceptorMessage]) -> Vec<(u64, u64, usize)> {
        batch
            .iter()
            .map(|m| match m {
                ProposerAcceptorMessage::AppendRequest(a) => {
                    (a.h.begin_lsn.0, a.h.commit_lsn.0, a.wal_data.len())
                }
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_bare_append_made_redundant_by_the_next_one_is_left_out() {
        let mut batch = Vec::new();
        // Commit-only, then WAL at the same position with that commit LSN: one message.
        push_coalesced(&mut batch, append(100, 90, b""));
        push_coalesced(&mut batch, append(100, 90, b"wal"));
        assert_eq!(shape(&batch), vec![(100, 90, 3)]);
        // WAL, then a commit-only append after it: both (it carries a newer commit LSN).
        push_coalesced(&mut batch, append(103, 103, b""));
        assert_eq!(shape(&batch), vec![(100, 90, 3), (103, 103, 0)]);
        // Two commit-only appends: the newer one.
        push_coalesced(&mut batch, append(103, 104, b""));
        assert_eq!(shape(&batch), vec![(100, 90, 3), (103, 104, 0)]);
        // Never one that would carry an older commit LSN than the one it replaces.
        push_coalesced(&mut batch, append(103, 100, b"x"));
        assert_eq!(
            shape(&batch),
            vec![(100, 90, 3), (103, 104, 0), (103, 100, 1)]
        );
    }
}
