//! Moving a timeline to another safekeeper: the snapshot a peer serves
//! (`GET /v1/tenant/{t}/timeline/{tl}/snapshot`) and the pull that installs it
//! (`POST /v1/pull_timeline`).
//!
//! The snapshot is a stream of frames (`u8 kind`, `u64 length`, payload), after the 8-byte magic
//! `SKSNAP1\n`:
//! 1. `CONTROL`: `u64 start`, `u64 flush`, then the control-file image of the durable state
//!    (its own CRC-32C), all read under the acceptor lock at one moment;
//! 2. `WAL` frames: `u64 lsn`, then up to 1 MiB of WAL from `start` on, in order, each read
//!    under the acceptor lock in the snapshot's term and with its newest WAL's term (a new term,
//!    or a new history in the same term, aborts the stream: no mix of two histories' WAL can be
//!    served);
//! 3. `END`: `u64 flush`, `u32` CRC-32C of all the WAL bytes.
//!
//! The producer runs on a blocking thread and hands frames to the response through a bounded
//! channel (4 frames): the snapshot is never held whole in memory, and a slow puller slows the
//! reads. The timeline's WAL is held from removal until the stream ends
//! ([`Timeline::snapshot_point`]).
//!
//! Where the snapshot starts ([`crate::manager::snapshot_start`]): when the puller says it has
//! remote storage (`?remote=true`) and the donor has it too, at the donor's backed-up point, so
//! a timeline whose early WAL was removed after backup can be pulled (issue 26); the puller
//! serves the WAL below from the store. Otherwise at the donor's first WAL, all of which must
//! still be local.
//!
//! The puller asks every peer for its status, needs a majority of the timeline's members (of
//! the hosts asked, without a membership configuration) to answer, so the most advanced one
//! among them holds every committed byte ([`crate::manager::pull_quorum`]), streams the
//! snapshot of the most advanced one into a directory of its own under `<datadir>/tmp/` (one
//! pull of a timeline at a time), refuses it if it is older than that peer's status said, checks
//! the frames (sizes, order, the WAL checksum, the control file's CRC), fsyncs every file,
//! decodes the WAL records up to the snapshot's flush LSN, and only then installs it
//! ([`GlobalTimelines::install_pulled`]: renamed into place under a tombstone, opened and
//! verified, and only then made live). A crash before the tombstone is cleared leaves nothing
//! that is served; after it, a complete verified timeline.
//!
//! Peers are reached through [`PeerClient`]: `host:port` over HTTP, `https://host:port` over
//! HTTPS checked against `--peer-ca`, with `--peer-auth-token-path`'s token when given.

use std::io::{BufReader, Read};
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use serde::Deserialize;
use sk_core::storage::durable::fsync_dir;
use sk_core::storage::fs::{FileHandle, Fs, OpenMode, SyncKind};
use sk_core::types::{Lsn, TenantTimelineId, Term};
use tokio::sync::mpsc;

use crate::control_file;
use crate::peer::PeerClient;
use crate::registry::GlobalTimelines;
use crate::timeline::{SnapshotPoint, TermRead, Timeline, TimelineError};
use crate::wal_store::segment::segment_path;
use crate::wal_store::verify_committed_wal;

/// First bytes of a snapshot stream.
pub const SNAPSHOT_MAGIC: &[u8; 8] = b"SKSNAP1\n";
const FRAME_CONTROL: u8 = 1;
const FRAME_WAL: u8 = 2;
const FRAME_END: u8 = 3;
/// WAL bytes per frame.
const CHUNK: u64 = 1 << 20;
/// Largest frame a puller accepts.
const MAX_FRAME: u64 = CHUNK + 64;

fn frame(kind: u8, payload: &[&[u8]]) -> Bytes {
    let len: usize = payload.iter().map(|p| p.len()).sum();
    let mut b = Vec::with_capacity(9 + len);
    b.push(kind);
    b.extend_from_slice(&(len as u64).to_le_bytes());
    for p in payload {
        b.extend_from_slice(p);
    }
    Bytes::from(b)
}

/// The response body of `GET …/snapshot`: frames produced on a blocking thread.
/// `remote`: the puller has remote storage (see the module docs).
pub fn snapshot_body(tl: Arc<Timeline>, remote: bool) -> Body {
    let (tx, rx) = mpsc::channel(4);
    let span = crate::timeline::span(&tl.ttid);
    crate::blocking::spawn(move || {
        let _span = span.entered();
        match produce(tl, remote, &tx) {
            Ok(bytes) => tracing::info!(bytes, "snapshot served"),
            Err(e) => {
                tracing::warn!("snapshot aborted: {e}");
                // The stream ends without its END frame: the puller refuses it.
                let _ = tx.blocking_send(Err(std::io::Error::other(e)));
            }
        }
    });
    Body::new(ChannelBody(rx))
}

/// Sends the snapshot's frames; returns the WAL bytes sent.
fn produce(
    tl: Arc<Timeline>,
    remote: bool,
    tx: &mpsc::Sender<Result<Bytes, std::io::Error>>,
) -> Result<u64, String> {
    let mut snap = Snapshot::begin(tl, remote)?;
    while let Some(f) = snap.next_frame()? {
        tx.blocking_send(Ok(f))
            .map_err(|_| "the puller went away".to_string())?;
    }
    Ok(snap.wal_bytes())
}

/// A snapshot being produced, one frame at a time ([`Snapshot::next_frame`]): its starting
/// point is read at [`Snapshot::begin`] and its WAL held from removal until it is dropped; each
/// WAL frame is read under the acceptor lock in the snapshot's term and newest WAL's term.
pub struct Snapshot {
    _counted: crate::timeline::ConnectionGuard,
    tl: Arc<Timeline>,
    p: SnapshotPoint,
    next: Next,
    /// The next WAL frame's start.
    pos: Lsn,
    /// CRC-32C of the WAL sent so far.
    crc: u32,
    buf: Vec<u8>,
}

/// The frame a [`Snapshot`] produces next.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Next {
    Magic,
    Control,
    /// WAL frames from `pos`, then END.
    Wal,
    Done,
}

impl Snapshot {
    /// Chooses the snapshot's point ([`Timeline::snapshot_point`]). Blocking.
    pub fn begin(tl: Arc<Timeline>, remote: bool) -> Result<Snapshot, String> {
        // Counted as a reader while it streams: the timeline is not evicted under it.
        let counted = tl.reader_guard();
        let p = tl.snapshot_point(remote)?;
        Ok(Snapshot {
            _counted: counted,
            tl,
            pos: p.start,
            p,
            next: Next::Magic,
            crc: 0,
            buf: Vec::new(),
        })
    }

    /// The WAL it sends: `[start, flush)`.
    pub fn range(&self) -> (Lsn, Lsn) {
        (self.p.start, self.p.flush)
    }

    /// Whether the END frame was produced.
    pub fn ended(&self) -> bool {
        self.next == Next::Done
    }

    /// WAL bytes the snapshot holds.
    pub fn wal_bytes(&self) -> u64 {
        self.p.flush.0 - self.p.start.0
    }

    /// The next frame (the magic counts as one), `None` after the END frame; an error if the
    /// timeline's history changed since [`Snapshot::begin`] (the stream must then end without
    /// its END frame). Blocking (file reads under the acceptor lock).
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, String> {
        match self.next {
            Next::Magic => {
                self.next = Next::Control;
                return Ok(Some(Bytes::from_static(SNAPSHOT_MAGIC)));
            }
            Next::Control => {
                self.next = Next::Wal;
                return Ok(Some(frame(
                    FRAME_CONTROL,
                    &[
                        &self.p.start.0.to_le_bytes(),
                        &self.p.flush.0.to_le_bytes(),
                        &control_file::encode(&self.p.state),
                    ],
                )));
            }
            Next::Wal => {}
            Next::Done => return Ok(None),
        }
        let (p, pos) = (&self.p, self.pos);
        if pos >= p.flush {
            self.next = Next::Done;
            return Ok(Some(frame(
                FRAME_END,
                &[&p.flush.0.to_le_bytes(), &self.crc.to_le_bytes()],
            )));
        }
        let end = Lsn((pos.0 + CHUNK).min(p.flush.0));
        self.buf.clear();
        match self
            .tl
            .read_wal_in_term(p.term, Some(p.last_log_term), pos, end, &mut self.buf)
        {
            Ok(TermRead::Read) => {}
            Ok(TermRead::TermChanged(t)) => {
                return Err(format!(
                    "term changed from {} to {t} during the snapshot; pull again",
                    p.term
                ));
            }
            Ok(TermRead::LogTermChanged(t)) => {
                return Err(format!(
                    "the newest WAL's term changed from {} to {t} during the snapshot (a new \
                     history in term {}); pull again",
                    p.last_log_term, p.term
                ));
            }
            Ok(TermRead::Truncated(l)) => {
                return Err(format!(
                    "WAL truncated to {l} during the snapshot; pull again"
                ));
            }
            Err(e) => return Err(format!("reading WAL at {pos}: {e}")),
        }
        self.crc = crc32c::crc32c_append(self.crc, &self.buf);
        self.pos = end;
        Ok(Some(frame(FRAME_WAL, &[&pos.0.to_le_bytes(), &self.buf])))
    }
}

/// A response body fed by a bounded channel.
struct ChannelBody(mpsc::Receiver<Result<Bytes, std::io::Error>>);

impl http_body::Body for ChannelBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|o| o.map(|r| r.map(http_body::Frame::data)))
    }
}

/// Why a pull failed: the HTTP status class and the reason.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// The timeline exists here already.
    #[error("timeline {0} exists on this safekeeper already")]
    Exists(TenantTimelineId),
    /// The request cannot be served as given (no peers, bad address).
    #[error("{0}")]
    BadRequest(String),
    /// Peers did not answer, or what they sent is not a valid, current copy.
    #[error("{0}")]
    Peer(String),
    /// Installing it here failed.
    #[error(transparent)]
    Local(#[from] TimelineError),
}

/// What a pull did.
#[derive(Debug, serde::Serialize)]
pub struct Pulled {
    /// The peer it copied from.
    pub source: String,
    /// The WAL it copied: `[start, flush)`.
    pub start_lsn: Lsn,
    /// The end of the copied WAL.
    pub flush_lsn: Lsn,
    /// WAL bytes received.
    pub wal_bytes: u64,
}

/// The part of a peer's timeline status the puller compares.
#[derive(Debug, Deserialize)]
struct PeerStatus {
    node_id: sk_core::types::NodeId,
    last_log_term: Term,
    flush_lsn: String,
    mconf: sk_core::state::Configuration,
    /// Where the peer backs the timeline up (absent: it has no remote storage).
    #[serde(default)]
    remote_location: Option<String>,
}

/// `POST /v1/pull_timeline`: copies `ttid` from the most advanced of `hosts` (a majority must
/// answer) and registers it. Blocking (network and file I/O); run it on a blocking thread.
pub fn pull_timeline(
    timelines: &GlobalTimelines,
    client: &PeerClient,
    ttid: TenantTimelineId,
    hosts: &[String],
) -> Result<Pulled, PullError> {
    if hosts.is_empty() {
        return Err(PullError::BadRequest("http_hosts is empty".into()));
    }
    if timelines.contains(&ttid) {
        return Err(PullError::Exists(ttid));
    }
    // One pull of a timeline at a time; its directory is its own (issue 26).
    let (tmp, _pulling) = timelines.begin_pull(&ttid)?;
    let path = format!(
        "/v1/tenant/{}/timeline/{}",
        ttid.tenant_id, ttid.timeline_id
    );
    let mut answers = Vec::new();
    let mut locations = std::collections::HashMap::new();
    let mut failures = Vec::new();
    for host in hosts {
        match client.get(host, &path).and_then(|mut r| {
            let mut body = String::new();
            r.read_to_string(&mut body)
                .map_err(|e| format!("{host}: reading status: {e}"))?;
            let s: PeerStatus =
                serde_json::from_str(&body).map_err(|e| format!("{host}: status: {e}"))?;
            let flush: Lsn = s
                .flush_lsn
                .parse()
                .map_err(|e| format!("{host}: flush_lsn: {e}"))?;
            Ok((
                (s.last_log_term, flush),
                s.node_id,
                s.mconf,
                s.remote_location,
            ))
        }) {
            Ok((pos, id, mconf, location)) => {
                locations.insert(host.clone(), location);
                answers.push(PeerAnswer {
                    pos,
                    host: host.clone(),
                    id,
                    mconf,
                })
            }
            Err(e) => failures.push(e),
        }
    }
    let (source, best) = choose_source(answers, &failures, hosts.len())?;
    // From the backed-up point, the WAL below the snapshot is served from this node's store:
    // it must be the store the donor backed it up to.
    if let (Some(ours), Some(Some(theirs))) =
        (timelines.remote_location(&ttid), locations.get(&source))
        && ours != *theirs
    {
        return Err(PullError::Peer(format!(
            "{source} backs the timeline up to {theirs}, this node to {ours}: a pull needs both \
             on the same remote storage (the WAL below the snapshot is read from it)"
        )));
    }
    tracing::info!(%source, best_term = %best.0, best_flush = %best.1, "pulling from the most advanced peer");
    let path = format!(
        "/v1/tenant/{}/timeline/{}/snapshot?remote={}",
        ttid.tenant_id,
        ttid.timeline_id,
        timelines.remote_storage_on()
    );
    let stream = client.get(&source, &path).map_err(PullError::Peer)?;
    let mut r = BufReader::with_capacity(1 << 20, stream);
    pull_from(timelines, ttid, &tmp, &mut r, &source, best)
}

/// One peer's answer to the pull's status request.
#[derive(Clone, Debug)]
pub struct PeerAnswer {
    /// Its newest WAL's term and its durable end of WAL.
    pub pos: (Term, Lsn),
    /// The address it was asked at.
    pub host: String,
    /// Its node id.
    pub id: sk_core::types::NodeId,
    /// The membership configuration it knows.
    pub mconf: sk_core::state::Configuration,
}

/// Which peer to copy from: the most advanced by (newest WAL's term, flush LSN) among those
/// that answered, once they are a quorum ([`crate::manager::pull_quorum`], of the newest
/// configuration any of them knows) — a majority holds every committed byte, so the most
/// advanced of it does too. Returns its host and position.
pub fn choose_source(
    mut answers: Vec<PeerAnswer>,
    failures: &[String],
    hosts: usize,
) -> Result<(String, (Term, Lsn)), PullError> {
    let mconf = answers
        .iter()
        .map(|a| &a.mconf)
        .max_by_key(|m| m.generation)
        .cloned()
        .unwrap_or_default();
    let ids: Vec<_> = answers.iter().map(|a| a.id).collect();
    if let Err(why) = crate::manager::pull_quorum(&ids, &mconf, hosts) {
        let failed = if failures.is_empty() {
            String::new()
        } else {
            format!(": {}", failures.join("; "))
        };
        return Err(PullError::Peer(format!("{why}{failed}")));
    }
    answers.sort_by_key(|a| a.pos);
    let best = answers.pop().expect("a quorum answered");
    Ok((best.host, best.pos))
}

/// Receives a snapshot of `ttid` from `source` (read from `r`) into `tmp` (the pull's own
/// directory, [`GlobalTimelines::begin_pull`]), verifies it, and installs it
/// ([`GlobalTimelines::install_pulled`]). `best` is the source's status: an older snapshot is
/// refused. On any error nothing is installed and `tmp` is removed. Blocking.
pub fn pull_from(
    timelines: &GlobalTimelines,
    ttid: TenantTimelineId,
    tmp: &Path,
    r: &mut impl Read,
    source: &str,
    best: (Term, Lsn),
) -> Result<Pulled, PullError> {
    let fs = timelines.fs().clone();
    fs.create_dir_all(tmp)
        .map_err(|e| TimelineError::io(format!("creating {}", tmp.display()), e))?;
    let (start, flush) = match receive(timelines, &fs, tmp, r, source, ttid, best) {
        Ok(r) => r,
        Err(e) => {
            let _ = fs.remove_dir_all(tmp);
            return Err(e);
        }
    };
    timelines.install_pulled(ttid, tmp, flush)?;
    Ok(Pulled {
        source: source.to_string(),
        start_lsn: start,
        flush_lsn: flush,
        wal_bytes: flush.0 - start.0,
    })
}

/// Reads the snapshot of `source` from `r` into `tmp`, verifies it and makes every file durable.
/// Returns the WAL range received.
fn receive(
    timelines: &GlobalTimelines,
    fs: &Fs,
    tmp: &Path,
    r: &mut impl Read,
    source: &str,
    ttid: TenantTimelineId,
    (best_term, best_flush): (Term, Lsn),
) -> Result<(Lsn, Lsn), PullError> {
    let no_sync = timelines.no_sync();
    let peer = |m: String| PullError::Peer(format!("{source}: {m}"));
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)
        .map_err(|e| peer(format!("reading the snapshot: {e}")))?;
    if &magic != SNAPSHOT_MAGIC {
        return Err(peer("not a snapshot stream".into()));
    }
    let (kind, control) = read_frame(r).map_err(peer)?;
    if kind != FRAME_CONTROL || control.len() < 16 {
        return Err(peer(
            "the snapshot does not start with its control frame".into(),
        ));
    }
    let start = Lsn(u64::from_le_bytes(
        control[..8].try_into().expect("8 bytes"),
    ));
    let flush = Lsn(u64::from_le_bytes(
        control[8..16].try_into().expect("8 bytes"),
    ));
    let mut state = control_file::decode(&control[16..], Path::new("snapshot control file"))
        .map_err(|e| peer(e.to_string()))?;
    if state.tenant_id != ttid.tenant_id || state.timeline_id != ttid.timeline_id {
        return Err(peer(format!(
            "the snapshot is of timeline {}/{}",
            state.tenant_id, state.timeline_id
        )));
    }
    // The donor's eviction is the donor's: this copy is resident (a flag carried over would
    // have its next start-up remove WAL it took since).
    state.evicted = false;
    let last_term = state
        .acceptor_state
        .term_history
        .0
        .last()
        .map(|e| e.term)
        .unwrap_or(Term::INITIAL);
    if (last_term, flush) < (best_term, best_flush) {
        return Err(peer(format!(
            "stale snapshot: it ends at {flush} in term {last_term}, the peer's status said \
             {best_flush} in term {best_term}"
        )));
    }
    if start > flush || state.commit_lsn > flush {
        return Err(peer(format!(
            "inconsistent snapshot: WAL [{start}, {flush}), commit_lsn {}",
            state.commit_lsn
        )));
    }
    let seg_size = state.server.wal_seg_size as u64;
    if !pg_wal::format::is_valid_seg_size(seg_size) {
        return Err(peer(format!("invalid segment size {seg_size}")));
    }
    let major = pg_wal::PgMajor::from_server_version(state.server.pg_version)
        .map_err(|e| peer(format!("the snapshot's timeline: {e}")))?;

    let mut seg: Option<(u64, Box<dyn FileHandle>)> = None;
    let mut pos = start;
    let mut crc = 0u32;
    let slow = sk_core::failpoint::active("pull-slow");
    loop {
        let (kind, payload) = read_frame(r).map_err(peer)?;
        match kind {
            FRAME_WAL => {
                if payload.len() < 8 {
                    return Err(peer("short WAL frame".into()));
                }
                let lsn = Lsn(u64::from_le_bytes(
                    payload[..8].try_into().expect("8 bytes"),
                ));
                let data = &payload[8..];
                if lsn != pos || pos.0 + data.len() as u64 > flush.0 {
                    return Err(peer(format!(
                        "WAL frame at {lsn} (+{}) where {pos} was expected, below {flush}",
                        data.len()
                    )));
                }
                crc = crc32c::crc32c_append(crc, data);
                let mut off = 0usize;
                while off < data.len() {
                    let at = Lsn(pos.0 + off as u64);
                    let segno = at.segment_number(seg_size);
                    let in_seg = at.segment_offset(seg_size);
                    let n = ((seg_size - in_seg) as usize).min(data.len() - off);
                    if seg.as_ref().is_none_or(|(s, _)| *s != segno) {
                        if let Some((_, f)) = seg.take() {
                            sync(f.as_ref(), no_sync)?;
                        }
                        let partial = segno == flush.segment_number(seg_size);
                        let p = segment_path(tmp, segno, seg_size, partial);
                        let f = fs
                            .open(&p, OpenMode::CreateTruncate)
                            .and_then(|f| f.set_len(seg_size).map(|()| f))
                            .map_err(|e| {
                                TimelineError::io(format!("creating {}", p.display()), e)
                            })?;
                        seg = Some((segno, f));
                    }
                    let (_, f) = seg.as_ref().expect("opened above");
                    f.write_all_at(&data[off..off + n], in_seg)
                        .map_err(|e| TimelineError::io("writing a pulled segment", e))?;
                    off += n;
                }
                pos = Lsn(pos.0 + data.len() as u64);
                if slow {
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
            FRAME_END => {
                if payload.len() != 12 {
                    return Err(peer("bad END frame".into()));
                }
                let end = Lsn(u64::from_le_bytes(
                    payload[..8].try_into().expect("8 bytes"),
                ));
                let sent_crc = u32::from_le_bytes(payload[8..].try_into().expect("4 bytes"));
                if end != flush || pos != flush {
                    return Err(peer(format!(
                        "snapshot ended at {pos}, announced {flush}, END says {end}"
                    )));
                }
                if sent_crc != crc {
                    return Err(peer(format!(
                        "WAL checksum mismatch: sent {sent_crc:#010x}, received {crc:#010x}"
                    )));
                }
                break;
            }
            other => return Err(peer(format!("unexpected frame kind {other}"))),
        }
    }
    if let Some((_, f)) = seg.take() {
        sync(f.as_ref(), no_sync)?;
    }
    // The WAL decodes, record by record, up to the snapshot's end.
    verify_committed_wal(fs, tmp, seg_size, major, start, flush)
        .map_err(|e| peer(format!("the pulled WAL does not verify: {e}")))?;
    if start > state.local_start_lsn.max(state.timeline_start_lsn) {
        // The snapshot starts at the donor's backed-up point: the WAL below is committed (the
        // point is at or below the donor's commit LSN) and stored. The copy's LSNs say so; its
        // control file is the donor's *persisted* state, whose commit LSN may lag below `start`,
        // and start-up would search the end of WAL from there, below the copy's first segment
        // (found by the manager's simulation: the copy opened with its WAL ending at the old
        // commit LSN).
        state.commit_lsn = state.commit_lsn.max(start);
        state.backup_lsn = state.backup_lsn.max(start);
    }
    state.local_start_lsn = start;
    control_file::FileControlStore::create_new_in(fs.clone(), tmp, state, no_sync)
        .map_err(TimelineError::from)?;
    if !no_sync {
        fsync_dir(fs, tmp).map_err(TimelineError::from)?;
    }
    Ok((start, flush))
}

fn sync(f: &dyn FileHandle, no_sync: bool) -> Result<(), PullError> {
    if no_sync {
        return Ok(());
    }
    f.sync(SyncKind::Data)
        .map_err(|e| TimelineError::io("fsyncing a pulled segment", e).into())
}

/// Reads one frame: its kind and payload.
fn read_frame(r: &mut impl Read) -> Result<(u8, Vec<u8>), String> {
    let mut head = [0u8; 9];
    r.read_exact(&mut head)
        .map_err(|e| format!("the snapshot ended early: {e}"))?;
    let len = u64::from_le_bytes(head[1..].try_into().expect("8 bytes"));
    if len > MAX_FRAME {
        return Err(format!("frame of {len} bytes is too large"));
    }
    let mut payload = vec![0u8; len as usize];
    r.read_exact(&mut payload)
        .map_err(|e| format!("the snapshot ended early: {e}"))?;
    Ok((head[0], payload))
}

#[cfg(test)]
mod tests;
