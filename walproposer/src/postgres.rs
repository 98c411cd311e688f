//! The `postgres` WAL source: a physical replication client of a real PostgreSQL primary whose
//! WAL is pushed, byte for byte, through an elected [`Proposer`].
//!
//! Order of operations (see `reference/postgres-replication.md` §3 and §6):
//! 1. [`Primary::connect`]: a replication connection; `IDENTIFY_SYSTEM` (system id, timeline 1
//!    only, current end of WAL), `SHOW wal_segment_size`, `SHOW server_version_num` (14 to 18),
//!    and the physical slot (read with `READ_REPLICATION_SLOT`, or from `pg_replication_slots`
//!    over a plain connection on PostgreSQL 14, which lacks that command; created with
//!    `RESERVE_WAL` if missing) so the primary keeps WAL the safekeepers have not committed yet;
//! 2. the caller elects a proposer with [`Primary::proposer_config`]: the primary's system id,
//!    version and segment size, and `start_lsn` = [`Primary::empty_start_lsn`] (the start of the
//!    segment holding the slot's `restart_lsn`), where WAL begins if every safekeeper is empty;
//! 3. [`Primary::relay`]: `START_REPLICATION SLOT s PHYSICAL <term start> TIMELINE 1`. The term
//!    start is the donor's flush LSN when the safekeepers already hold WAL (the primary's WAL must
//!    continue exactly there), else the segment start of step 2. Every XLogData payload is pushed
//!    in order (a gap is an error); keepalives asking for a reply are answered; the quorum-committed
//!    LSN is reported as write, flush and apply position, every second and whenever it advances,
//!    so the primary recycles only WAL that a quorum holds. The safekeepers' readers' oldest
//!    xmin and catalog xmin ([`super::Progress::hs_feedback`]) go to the primary as hot-standby
//!    feedback whenever they change (and once at the start of each stream), so its vacuum keeps
//!    what their queries see; while slow readers pause the proposer
//!    ([`super::consensus::Backpressure`]) nothing more is read from the primary, and while they
//!    slow it each message read is followed by the delay it asks for.
//!
//! Trust and cleartext-password authentication only (what [`pq_proto::client`] implements); no
//! TLS; timeline 1 only. Not here: the election and streaming to safekeepers ([`super`]).

use std::future::Future;
use std::str::FromStr;
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::consensus::Backpressure;
use super::{Proposer, ProposerError};
use pg_wal::format::is_valid_seg_size;
use pq_proto::client::{ClientConfig, ClientConn};
use pq_proto::replication::{ReplicationError, ReplicationMessage, StandbyMessage};
use pq_proto::{BackendMessage, PqError};
use sk_core::protocol::HotStandbyFeedback;
use sk_core::types::Lsn;

/// Default name of the physical slot on the primary.
pub const DEFAULT_SLOT: &str = "walproposer";

/// Why the relay stopped.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// The connection string does not parse.
    #[error("invalid conninfo: {0}")]
    Conninfo(String),
    /// A slot name PostgreSQL would refuse.
    #[error("invalid slot name {0:?}: use lower-case letters, digits and underscores")]
    SlotName(String),
    /// The connection to the primary failed, or the primary sent an error.
    #[error("primary: {0}")]
    Pq(Box<PqError>),
    /// The primary sent a replication message that does not decode.
    #[error("primary sent an invalid replication message: {0}")]
    Replication(#[from] ReplicationError),
    /// A query's answer has not the shape we expect.
    #[error("unexpected answer to {query}: {detail}")]
    BadAnswer {
        /// The query.
        query: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// The primary runs a PostgreSQL version whose WAL the safekeepers do not support.
    #[error("primary: {0}")]
    Unsupported(#[from] pg_wal::UnsupportedVersion),
    /// The primary is past a timeline switch.
    #[error("primary is on timeline {0}; only timeline 1 is supported")]
    Timeline(u32),
    /// WAL that does not continue what was received.
    #[error("primary sent WAL at {got}, expected {expected}")]
    Gap {
        /// Where the WAL had to continue.
        expected: Lsn,
        /// Where it did.
        got: Lsn,
    },
    /// The primary ended the stream.
    #[error("primary ended the replication stream")]
    StreamEnded,
    /// A reconnection reached another cluster.
    #[error("the primary's system id changed from {was} to {now}")]
    SystemIdChanged {
        /// The first connection's system id.
        was: u64,
        /// This connection's.
        now: u64,
    },
    /// The proposer stopped.
    #[error(transparent)]
    Proposer(#[from] ProposerError),
}

impl SourceError {
    /// Whether reconnecting to the primary may help: the connection broke or could not be
    /// made, the primary ended the stream, or it is shutting down or starting up (SQLSTATE
    /// class 57, e.g. `57P01` admin shutdown, `57P03` cannot connect now).
    pub fn is_transient(&self) -> bool {
        match self {
            SourceError::StreamEnded => true,
            SourceError::Pq(e) => match &**e {
                PqError::Io(_) | PqError::ConnectionClosed => true,
                PqError::Server(f) => f.code.starts_with("57"),
                _ => false,
            },
            _ => false,
        }
    }
}

impl From<PqError> for SourceError {
    fn from(e: PqError) -> Self {
        SourceError::Pq(Box::new(e))
    }
}

/// The parts of a libpq `key=value` connection string we use. Unknown keys are ignored; values
/// may be single-quoted with `\'` and `\\` escapes.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnInfo {
    /// `host` (default `localhost`).
    pub host: String,
    /// `port` (default 5432).
    pub port: u16,
    /// `user` (default `postgres`).
    pub user: String,
    /// `password`, if any.
    pub password: Option<String>,
    /// `application_name` (what the primary's `pg_stat_replication` shows).
    pub application_name: String,
    /// `dbname`: only PostgreSQL 14 needs one, for the plain connection that reads the slot
    /// (its walsender has no `READ_REPLICATION_SLOT`); the user name when absent, as in libpq.
    pub dbname: Option<String>,
}

impl std::fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnInfo")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("application_name", &self.application_name)
            .field("dbname", &self.dbname)
            .finish()
    }
}

impl Default for ConnInfo {
    fn default() -> Self {
        ConnInfo {
            host: "127.0.0.1".into(),
            port: 5432,
            user: "postgres".into(),
            password: None,
            application_name: "walproposer".into(),
            dbname: None,
        }
    }
}

impl FromStr for ConnInfo {
    type Err = SourceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |m: String| SourceError::Conninfo(m);
        let mut info = ConnInfo::default();
        let mut chars = s.chars().peekable();
        loop {
            while chars.peek().is_some_and(|c| c.is_whitespace()) {
                chars.next();
            }
            if chars.peek().is_none() {
                break;
            }
            let mut key = String::new();
            while let Some(&c) = chars.peek() {
                if c == '=' || c.is_whitespace() {
                    break;
                }
                key.push(c);
                chars.next();
            }
            while chars.peek().is_some_and(|c| c.is_whitespace()) {
                chars.next();
            }
            if chars.next() != Some('=') {
                return Err(bad(format!("expected '=' after {key:?}")));
            }
            while chars.peek().is_some_and(|c| c.is_whitespace()) {
                chars.next();
            }
            let mut value = String::new();
            if chars.peek() == Some(&'\'') {
                chars.next();
                loop {
                    match chars.next() {
                        Some('\\') => match chars.next() {
                            Some(c) => value.push(c),
                            None => return Err(bad("unterminated quoted value".into())),
                        },
                        Some('\'') => break,
                        Some(c) => value.push(c),
                        None => return Err(bad("unterminated quoted value".into())),
                    }
                }
            } else {
                while let Some(&c) = chars.peek() {
                    if c.is_whitespace() {
                        break;
                    }
                    chars.next();
                    if c == '\\' {
                        match chars.next() {
                            Some(e) => value.push(e),
                            None => return Err(bad("trailing backslash".into())),
                        }
                    } else {
                        value.push(c);
                    }
                }
            }
            match key.as_str() {
                "host" | "hostaddr" => info.host = value,
                "port" => {
                    info.port = value
                        .parse()
                        .map_err(|_| bad(format!("invalid port {value:?}")))?
                }
                "user" => info.user = value,
                "password" => info.password = Some(value),
                "application_name" => info.application_name = value,
                "dbname" => info.dbname = Some(value),
                "" => return Err(bad("empty key".into())),
                _ => {} // sslmode, ...: not used by a physical replication client.
            }
        }
        if info.host.starts_with('/') {
            return Err(bad(
                "Unix-socket hosts are not supported; use a TCP host".into()
            ));
        }
        Ok(info)
    }
}

impl ConnInfo {
    fn client_config(&self) -> ClientConfig {
        let mut c = ClientConfig::new(self.host.clone(), self.port, self.user.clone());
        c.password = self.password.clone();
        c.application_name = Some(self.application_name.clone());
        c
    }

    /// A plain SQL connection to the same server (`dbname`).
    fn sql_config(&self) -> ClientConfig {
        let mut c = self.client_config();
        c.replication = false;
        c.database = self.dbname.clone();
        c
    }
}

/// How to relay.
#[derive(Clone, Debug)]
pub struct SourceOptions {
    /// How to reach the primary.
    pub conninfo: ConnInfo,
    /// Physical slot on the primary; created if missing.
    pub slot: String,
    /// Period of status updates to the primary (they are also sent when the commit LSN
    /// advances, and when the primary asks).
    pub status_interval: Duration,
    /// Most WAL read from the primary ahead of the commit LSN; reading pauses beyond it.
    pub window: u64,
    /// Period of the progress callback of [`Primary::relay`].
    pub report_interval: Duration,
}

impl SourceOptions {
    /// Defaults: slot `DEFAULT_SLOT`, 1 s status updates, 64 MiB window, 5 s reports.
    pub fn new(conninfo: ConnInfo) -> Self {
        SourceOptions {
            conninfo,
            slot: DEFAULT_SLOT.into(),
            status_interval: Duration::from_secs(1),
            window: 64 << 20,
            report_interval: Duration::from_secs(5),
        }
    }
}

/// What the primary told us before streaming.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrimaryInfo {
    /// PostgreSQL system identifier.
    pub system_id: u64,
    /// The primary's end of WAL at connection time.
    pub xlogpos: Lsn,
    /// `wal_segment_size` in bytes.
    pub wal_seg_size: u32,
    /// `server_version_num`, e.g. 150018.
    pub pg_version: u32,
    /// The slot's `restart_lsn` (the oldest WAL the primary keeps for us); invalid if the
    /// primary reported none.
    pub slot_restart_lsn: Lsn,
}

/// What the relay has done so far.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct RelayStats {
    /// Where streaming from the primary started.
    pub start_lsn: Lsn,
    /// End of the WAL received from the primary and pushed to the proposer.
    pub received_lsn: Lsn,
    /// Committed on a quorum of safekeepers (and reported to the primary as flushed).
    pub commit_lsn: Lsn,
    /// WAL bytes relayed.
    pub bytes: u64,
    /// How long the relay ran.
    pub seconds: f64,
    /// `bytes` per second, in MB (10^6).
    pub mb_per_second: f64,
    /// Status updates sent to the primary.
    pub status_updates: u64,
    /// Hot-standby feedback messages sent to the primary (the safekeepers' readers' oldest
    /// xmins, each time they changed).
    pub hs_feedback_sent: u64,
    /// Times the relay paused reading for slow readers (backpressure).
    pub backpressure_pauses: u64,
    /// Seconds spent paused for slow readers.
    pub backpressure_paused_seconds: f64,
    /// Seconds spent waiting while slowed down for slow readers.
    pub backpressure_slowed_seconds: f64,
}

/// A replication connection to a primary, identified and with its slot in place.
pub struct Primary {
    conn: ClientConn<TcpStream>,
    info: PrimaryInfo,
    opts: SourceOptions,
}

/// A slot name PostgreSQL accepts (`ReplicationSlotValidateName`).
fn valid_slot_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() < 64
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// Parses `SHOW wal_segment_size` (`16MB`, `1GB`, `1024kB`) into bytes.
pub fn parse_wal_segment_size(s: &str) -> Option<u32> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: u64 = s[..split].parse().ok()?;
    let mult: u64 = match s[split..].trim() {
        "" | "B" => 1,
        "kB" => 1 << 10,
        "MB" => 1 << 20,
        "GB" => 1 << 30,
        _ => return None,
    };
    let bytes = u32::try_from(n.checked_mul(mult)?).ok()?;
    is_valid_seg_size(bytes as u64).then_some(bytes)
}

fn one_value(
    rows: &[Vec<Option<String>>],
    query: &'static str,
    col: usize,
) -> Result<Option<String>, SourceError> {
    match rows {
        [row] => row.get(col).cloned().ok_or(SourceError::BadAnswer {
            query,
            detail: format!("no column {col}"),
        }),
        _ => Err(SourceError::BadAnswer {
            query,
            detail: format!("{} rows", rows.len()),
        }),
    }
}

fn required(v: Option<String>, query: &'static str) -> Result<String, SourceError> {
    v.ok_or(SourceError::BadAnswer {
        query,
        detail: "NULL".into(),
    })
}

fn parse_lsn(v: &str, query: &'static str) -> Result<Lsn, SourceError> {
    v.parse().map_err(|_| SourceError::BadAnswer {
        query,
        detail: format!("invalid LSN {v:?}"),
    })
}

impl Primary {
    /// Connects, identifies the primary and makes sure the slot exists. Not cancellation-safe
    /// (a cancelled call may leave a newly created slot behind, which is harmless).
    pub async fn connect(opts: SourceOptions) -> Result<Primary, SourceError> {
        if !valid_slot_name(&opts.slot) {
            return Err(SourceError::SlotName(opts.slot.clone()));
        }
        let mut conn = ClientConn::connect(&opts.conninfo.client_config()).await?;

        const IDENTIFY: &str = "IDENTIFY_SYSTEM";
        let rows = conn.simple_query(IDENTIFY).await?;
        let system_id = required(one_value(&rows, IDENTIFY, 0)?, IDENTIFY)?;
        let system_id: u64 = system_id.parse().map_err(|_| SourceError::BadAnswer {
            query: IDENTIFY,
            detail: format!("invalid system id {system_id:?}"),
        })?;
        let tli = required(one_value(&rows, IDENTIFY, 1)?, IDENTIFY)?;
        let tli: u32 = tli.parse().map_err(|_| SourceError::BadAnswer {
            query: IDENTIFY,
            detail: format!("invalid timeline {tli:?}"),
        })?;
        if tli != 1 {
            return Err(SourceError::Timeline(tli));
        }
        let xlogpos = parse_lsn(
            &required(one_value(&rows, IDENTIFY, 2)?, IDENTIFY)?,
            IDENTIFY,
        )?;

        const SHOW_SEG: &str = "SHOW wal_segment_size";
        let rows = conn.simple_query(SHOW_SEG).await?;
        let seg = required(one_value(&rows, SHOW_SEG, 0)?, SHOW_SEG)?;
        let wal_seg_size = parse_wal_segment_size(&seg).ok_or(SourceError::BadAnswer {
            query: SHOW_SEG,
            detail: format!("invalid segment size {seg:?}"),
        })?;

        const SHOW_VER: &str = "SHOW server_version_num";
        let rows = conn.simple_query(SHOW_VER).await?;
        let ver = required(one_value(&rows, SHOW_VER, 0)?, SHOW_VER)?;
        let pg_version: u32 = ver.trim().parse().map_err(|_| SourceError::BadAnswer {
            query: SHOW_VER,
            detail: format!("invalid version {ver:?}"),
        })?;
        let major = pg_wal::PgMajor::from_server_version(pg_version)?;
        // PostgreSQL 14's walsender has no READ_REPLICATION_SLOT (added in 15): its slot is read
        // from pg_replication_slots over a plain connection.
        let mut slots = SlotReader::new(major, &opts).await?;

        let slot_restart_lsn = match slots.read(&mut conn, &opts.slot).await? {
            Some(lsn) => lsn,
            None => {
                let create = format!("CREATE_REPLICATION_SLOT {} PHYSICAL RESERVE_WAL", opts.slot);
                match conn.simple_query(&create).await {
                    Ok(_) => tracing::info!(slot = %opts.slot, "created physical slot"),
                    // Created meanwhile by someone else (another proposer): use it.
                    Err(PqError::Server(e)) if e.code == "42710" => {}
                    Err(e) => return Err(e.into()),
                }
                slots
                    .read(&mut conn, &opts.slot)
                    .await?
                    .ok_or(SourceError::BadAnswer {
                        query: "READ_REPLICATION_SLOT",
                        detail: format!("slot {} missing after creation", opts.slot),
                    })?
            }
        };
        let info = PrimaryInfo {
            system_id,
            xlogpos,
            wal_seg_size,
            pg_version,
            slot_restart_lsn,
        };
        tracing::info!(?info, "primary identified");
        Ok(Primary { conn, info, opts })
    }

    /// What the primary told us before streaming.
    pub fn info(&self) -> &PrimaryInfo {
        &self.info
    }

    /// Where WAL begins if every safekeeper is empty: the start of the segment holding the
    /// slot's `restart_lsn` (the oldest WAL the primary still has for us), or of the primary's
    /// current position. A segment start, because standbys and `pg_receivewal` ask for WAL from
    /// segment starts.
    pub fn empty_start_lsn(&self) -> Lsn {
        let seg = self.info.wal_seg_size as u64;
        let from = if self.info.slot_restart_lsn.is_valid() {
            self.info.slot_restart_lsn
        } else {
            self.info.xlogpos
        };
        from.segment_start(seg)
    }

    /// Fills the primary's identity into `cfg` (system id, version, segment size, start LSN).
    pub fn proposer_config(&self, mut cfg: super::ProposerConfig) -> super::ProposerConfig {
        cfg.system_id = self.info.system_id;
        cfg.pg_version = self.info.pg_version;
        cfg.wal_seg_size = self.info.wal_seg_size;
        cfg.start_lsn = self.empty_start_lsn();
        cfg
    }

    /// Streams the primary's WAL into `proposer`, from the end of the proposer's WAL (its term
    /// start on the first call; where the previous stream stopped after a reconnect), until
    /// `shutdown` resolves
    /// (then waits up to `drain` for the received WAL to commit, reports the final position to
    /// the primary, and returns) or an error. `report` is called every `report_interval`.
    /// Not cancellation-safe as a whole: use `shutdown` to stop it.
    pub async fn relay(
        self,
        proposer: &Proposer,
        shutdown: impl Future<Output = ()>,
        drain: Duration,
        mut report: impl FnMut(&RelayStats),
    ) -> Result<RelayStats, SourceError> {
        let start = proposer.progress().end_lsn;
        let query = format!(
            "START_REPLICATION SLOT {} PHYSICAL {start} TIMELINE 1",
            self.opts.slot
        );
        tracing::info!(%start, "{query}");
        let (mut rd, mut wr) = self.conn.start_copy_both(&query).await?;
        let started = Instant::now();
        let mut stats = RelayStats {
            start_lsn: start,
            received_lsn: start,
            ..RelayStats::default()
        };
        let mut progress = proposer.subscribe();
        let mut status_tick = tokio::time::interval(self.opts.status_interval);
        status_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut report_tick = tokio::time::interval(self.opts.report_interval);
        report_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        report_tick.tick().await;
        let mut reported = Lsn::INVALID;
        tokio::pin!(shutdown);

        let status = |commit: Lsn, reply_requested: bool| StandbyMessage::StatusUpdate {
            write: commit,
            flush: commit,
            apply: commit,
            send_time: pq_proto::pg_now(),
            reply_requested,
        };

        // The safekeepers' readers' oldest xmins, last sent to the primary (none yet on this
        // stream: the first is sent at once, so a slot's xmin left by an earlier stream is
        // replaced or released).
        let mut hs_sent: Option<HotStandbyFeedback> = None;
        let mut paused_since: Option<Instant> = None;

        let result: Result<(), SourceError> = loop {
            let p = *progress.borrow_and_update();
            if hs_sent != Some(p.hs_feedback) {
                wr.write_standby_message(&hs_feedback_message(&p.hs_feedback));
                if let Err(e) = wr.flush().await {
                    break Err(e.into());
                }
                tracing::debug!(
                    xmin = p.hs_feedback.xmin,
                    catalog_xmin = p.hs_feedback.catalog_xmin,
                    "hot-standby feedback to the primary"
                );
                hs_sent = Some(p.hs_feedback);
                stats.hs_feedback_sent += 1;
            }
            // Slow readers: read nothing from the primary while paused.
            let paused = matches!(p.backpressure, Backpressure::Paused { .. });
            match (paused, paused_since) {
                (true, None) => {
                    paused_since = Some(Instant::now());
                    stats.backpressure_pauses += 1;
                }
                (false, Some(t)) => {
                    stats.backpressure_paused_seconds += t.elapsed().as_secs_f64();
                    paused_since = None;
                }
                _ => {}
            }
            if let Some(seen) = p.stepped_down {
                break Err(ProposerError::SteppedDown {
                    ours: proposer.term(),
                    seen,
                }
                .into());
            }
            stats.commit_lsn = p.commit_lsn;
            // Back-pressure: read no further than `window` ahead of the commit LSN.
            let may_read = stats
                .received_lsn
                .0
                .saturating_sub(p.commit_lsn.max(start).0)
                < self.opts.window
                && !paused;
            let mut send_status = false;
            tokio::select! {
                // Cancellation-safe: a partly read message stays in the reader's buffer.
                msg = rd.read_message(), if may_read => {
                    let data = match msg {
                        Ok(BackendMessage::CopyData(d)) => d,
                        // A walsender that shuts down ends the copy with CommandComplete (no
                        // CopyDone first).
                        Ok(BackendMessage::CopyDone | BackendMessage::CommandComplete(_)) => {
                            break Err(SourceError::StreamEnded);
                        }
                        Ok(BackendMessage::NoticeResponse(_)
                            | BackendMessage::ParameterStatus { .. }) => continue,
                        Ok(BackendMessage::ErrorResponse(e)) => {
                            break Err(PqError::Server(e).into());
                        }
                        Ok(other) => {
                            break Err(PqError::Unexpected {
                                expected: "CopyData",
                                got: format!("{other:?}"),
                            }
                            .into());
                        }
                        Err(e) => break Err(e.into()),
                    };
                    match ReplicationMessage::decode(data) {
                        Ok(ReplicationMessage::XLogData { wal_start, data, .. }) => {
                            if wal_start != stats.received_lsn {
                                break Err(SourceError::Gap {
                                    expected: stats.received_lsn,
                                    got: wal_start,
                                });
                            }
                            if let Err(e) = proposer.push(wal_start, data.clone()) {
                                break Err(e.into());
                            }
                            stats.received_lsn = Lsn(wal_start.0 + data.len() as u64);
                            stats.bytes += data.len() as u64;
                            if let Backpressure::Slow { delay_ms, .. } = proposer.progress().backpressure {
                                let delay = Duration::from_millis(delay_ms);
                                tokio::time::sleep(delay).await;
                                stats.backpressure_slowed_seconds += delay.as_secs_f64();
                            }
                        }
                        Ok(ReplicationMessage::Keepalive { reply_requested, .. }) => {
                            send_status = reply_requested;
                        }
                        Err(e) => break Err(e.into()),
                    }
                }
                // Cancellation-safe.
                changed = progress.changed() => {
                    if changed.is_err() {
                        break Err(ProposerError::Recovery("proposer stopped".into()).into());
                    }
                    send_status = progress.borrow().commit_lsn > reported;
                }
                _ = status_tick.tick() => send_status = true,
                _ = report_tick.tick() => {
                    stats.seconds = started.elapsed().as_secs_f64();
                    stats.mb_per_second = stats.bytes as f64 / stats.seconds.max(1e-9) / 1e6;
                    report(&stats);
                }
                () = &mut shutdown => break Ok(()),
            }
            if send_status {
                let commit = proposer.progress().commit_lsn;
                wr.write_standby_message(&status(commit, false));
                if let Err(e) = wr.flush().await {
                    break Err(e.into());
                }
                reported = commit;
                stats.status_updates += 1;
            }
        };

        if result.is_ok() {
            // Shutting down: let what we received commit, and tell the primary, so a restarted
            // proposer and the slot agree on where WAL continues.
            match tokio::time::timeout(drain, proposer.wait_commit(stats.received_lsn)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!("final commit: {e}"),
                Err(_) => tracing::warn!(
                    received = %stats.received_lsn,
                    "received WAL not committed within {drain:?}"
                ),
            }
            let commit = proposer.progress().commit_lsn;
            wr.write_standby_message(&status(commit, false));
            stats.status_updates += 1;
            if let Err(e) = wr.send_copy_done().await {
                tracing::warn!("ending the replication stream: {e}");
            }
            let _ = wr.terminate().await;
        }
        if let Some(t) = paused_since {
            stats.backpressure_paused_seconds += t.elapsed().as_secs_f64();
        }
        stats.commit_lsn = proposer.progress().commit_lsn;
        stats.seconds = started.elapsed().as_secs_f64();
        stats.mb_per_second = stats.bytes as f64 / stats.seconds.max(1e-9) / 1e6;
        result.map(|()| stats)
    }
}

/// The standby message that tells the primary the oldest xmin and catalog xmin to keep: the
/// full 64-bit xids split into xid and epoch (PostgreSQL checks the pair against its next xid);
/// 0 releases what was kept.
pub fn hs_feedback_message(f: &HotStandbyFeedback) -> StandbyMessage {
    StandbyMessage::HotStandbyFeedback {
        send_time: pq_proto::pg_now(),
        xmin: f.xmin as u32,
        epoch: (f.xmin >> 32) as u32,
        catalog_xmin: f.catalog_xmin as u32,
        catalog_epoch: (f.catalog_xmin >> 32) as u32,
    }
}

/// Relays with [`Primary::relay`] until `shutdown` is cancelled, reconnecting (with backoff)
/// after transient failures ([`SourceError::is_transient`]: the primary restarted, the
/// connection broke); each new stream resumes at the end of the proposer's WAL. Returns stats
/// over all streams (status updates: the last stream's), or `None` if shutdown came while
/// reconnecting.
pub async fn relay_until_shutdown(
    first: Primary,
    proposer: &Proposer,
    shutdown: &CancellationToken,
    drain: Duration,
    mut report: impl FnMut(&RelayStats),
) -> Result<Option<RelayStats>, SourceError> {
    let system_id = first.info.system_id;
    let opts = first.opts.clone();
    let (first_start, started) = (proposer.progress().end_lsn, Instant::now());
    let mut primary = Some(first);
    let mut backoff = Duration::from_millis(200);
    loop {
        let p = match primary.take() {
            Some(p) => p,
            None => match Primary::connect(opts.clone()).await {
                Ok(p) if p.info.system_id != system_id => {
                    return Err(SourceError::SystemIdChanged {
                        was: system_id,
                        now: p.info.system_id,
                    });
                }
                Ok(p) => p,
                Err(e) if e.is_transient() => {
                    tracing::warn!("reconnecting to the primary: {e}; retrying in {backoff:?}");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.cancelled() => return Ok(None),
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
                Err(e) => return Err(e),
            },
        };
        match p
            .relay(proposer, shutdown.cancelled(), drain, &mut report)
            .await
        {
            Ok(mut stats) => {
                // Over all streams, not only the last one.
                stats.start_lsn = first_start;
                stats.bytes = stats.received_lsn.0.saturating_sub(first_start.0);
                stats.seconds = started.elapsed().as_secs_f64();
                stats.mb_per_second = stats.bytes as f64 / stats.seconds.max(1e-9) / 1e6;
                return Ok(Some(stats));
            }
            Err(e) if e.is_transient() && !shutdown.is_cancelled() => {
                tracing::warn!("replication from the primary stopped: {e}; reconnecting");
                backoff = Duration::from_millis(200);
            }
            Err(e) => return Err(e),
        }
    }
}

/// How the slot's `restart_lsn` is read: `READ_REPLICATION_SLOT` on the replication
/// connection (PostgreSQL 15 and later), or `pg_replication_slots` over a plain connection.
enum SlotReader {
    Replication,
    Sql(ClientConn<TcpStream>),
}

impl SlotReader {
    async fn new(major: pg_wal::PgMajor, opts: &SourceOptions) -> Result<SlotReader, SourceError> {
        if major >= pg_wal::PgMajor::V15 {
            return Ok(SlotReader::Replication);
        }
        let conn = ClientConn::connect(&opts.conninfo.sql_config()).await?;
        Ok(SlotReader::Sql(conn))
    }

    /// The slot's `restart_lsn` (`Lsn::INVALID` if it has none yet), or `None` if the slot
    /// does not exist.
    async fn read(
        &mut self,
        repl: &mut ClientConn<TcpStream>,
        slot: &str,
    ) -> Result<Option<Lsn>, SourceError> {
        match self {
            SlotReader::Replication => read_slot(repl, slot).await,
            SlotReader::Sql(conn) => read_slot_sql(conn, slot).await,
        }
    }
}

/// The slot from `pg_replication_slots`, answered as `READ_REPLICATION_SLOT` would. `slot` is
/// a valid slot name (lower-case letters, digits and `_`), so quoting it is enough.
async fn read_slot_sql(
    conn: &mut ClientConn<TcpStream>,
    slot: &str,
) -> Result<Option<Lsn>, SourceError> {
    const Q: &str = "SELECT slot_type, restart_lsn FROM pg_replication_slots";
    let rows = conn
        .simple_query(&format!("{Q} WHERE slot_name = '{slot}'"))
        .await?;
    slot_answer(&rows, Q, slot)
}

/// `READ_REPLICATION_SLOT`: the slot's `restart_lsn` (`Lsn::INVALID` if it has none yet), or
/// `None` if the slot does not exist.
async fn read_slot(
    conn: &mut ClientConn<TcpStream>,
    slot: &str,
) -> Result<Option<Lsn>, SourceError> {
    const Q: &str = "READ_REPLICATION_SLOT";
    let rows = conn.simple_query(&format!("{Q} {slot}")).await?;
    slot_answer(&rows, Q, slot)
}

/// A `(slot_type, restart_lsn)` row (none, or a NULL type, if the slot does not exist).
fn slot_answer(
    rows: &[Vec<Option<String>>],
    query: &'static str,
    slot: &str,
) -> Result<Option<Lsn>, SourceError> {
    if rows.is_empty() {
        return Ok(None);
    }
    let slot_type = one_value(rows, query, 0)?;
    match slot_type.as_deref() {
        None => Ok(None),
        Some("physical") => match one_value(rows, query, 1)? {
            Some(lsn) => Ok(Some(parse_lsn(&lsn, query)?)),
            None => Ok(Some(Lsn::INVALID)),
        },
        Some(other) => Err(SourceError::BadAnswer {
            query,
            detail: format!("slot {slot} is {other}, not physical"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conninfo_keys_quotes_and_defaults() {
        let c: ConnInfo = "host=127.0.0.1 port=5433 user=alice dbname=x password='a b\\'c'"
            .parse()
            .expect("valid");
        assert_eq!(c.host, "127.0.0.1");
        assert_eq!(c.port, 5433);
        assert_eq!(c.user, "alice");
        assert_eq!(c.password.as_deref(), Some("a b'c"));
        let d: ConnInfo = "  port = 6000 ".parse().expect("valid");
        assert_eq!(
            (d.host.as_str(), d.port, d.user.as_str()),
            ("127.0.0.1", 6000, "postgres")
        );
        assert!(
            !format!("{c:?}").contains("a b"),
            "Debug hides the password"
        );
    }

    #[test]
    fn conninfo_errors() {
        for bad in ["port=x", "host", "password='open", "host=/tmp", "=1"] {
            assert!(bad.parse::<ConnInfo>().is_err(), "{bad}");
        }
    }

    #[test]
    fn wal_segment_sizes_as_show_prints_them() {
        assert_eq!(parse_wal_segment_size("16MB"), Some(16 << 20));
        assert_eq!(parse_wal_segment_size("1MB"), Some(1 << 20));
        assert_eq!(parse_wal_segment_size("1GB"), Some(1 << 30));
        assert_eq!(parse_wal_segment_size("1024kB"), Some(1 << 20));
        assert_eq!(parse_wal_segment_size("3MB"), None);
        assert_eq!(parse_wal_segment_size("16XB"), None);
        assert_eq!(parse_wal_segment_size("99999999999GB"), None);
    }

    #[test]
    fn broken_connections_and_shutdowns_are_transient() {
        let server = |code: &str| {
            SourceError::from(PqError::Server(pq_proto::ErrorFields::error(code, "x")))
        };
        assert!(SourceError::StreamEnded.is_transient());
        assert!(SourceError::from(PqError::ConnectionClosed).is_transient());
        assert!(server("57P01").is_transient());
        assert!(server("57P03").is_transient());
        assert!(
            !server("58P01").is_transient(),
            "WAL segment already removed"
        );
        assert!(
            !SourceError::Gap {
                expected: Lsn(1),
                got: Lsn(2)
            }
            .is_transient()
        );
    }

    #[test]
    fn slot_names_as_postgres_accepts_them() {
        assert!(valid_slot_name("walproposer_1"));
        assert!(!valid_slot_name(""));
        assert!(!valid_slot_name("Bad"));
        assert!(!valid_slot_name("a;DROP"));
    }
}
