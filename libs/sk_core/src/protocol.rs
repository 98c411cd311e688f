//! Neon's proposer ↔ acceptor protocol, version 3: message types and a byte-exact codec.
//!
//! Every message is the payload of one PostgreSQL `CopyData` frame; this module neither frames
//! nor reads sockets (the network layer does). Encoding is big-endian with a one-byte ASCII tag;
//! layouts are in `shared/reference/neon-safekeeper.md` §2.2.
//!
//! Decoding is total and bounded: every read is checked, counts are checked against both a
//! constant cap and the bytes that remain before anything is allocated, unknown tags and trailing
//! bytes are errors (stricter than neon, which ignores bytes after an append's WAL), and an
//! `AppendRequest`'s WAL is a zero-copy slice of the input frame.
//! Semantic rules (terms, generations, continuity) are the consensus core's job
//! ([`crate::safekeeper`]), except for the structural ones the layout implies: `end_lsn >=
//! begin_lsn`, a WAL payload of at most [`MAX_SEND_SIZE`], a non-empty member list for a non-zero
//! generation, unique member ids, and an ordered term history.

use bytes::{BufMut, Bytes, BytesMut};
use pq_proto::reader::{ReadError, Reader};

use crate::state::{Configuration, SafekeeperId};
use crate::types::{
    Generation, Lsn, NodeId, TenantId, TenantTimelineId, Term, TermHistory, TermHistoryError,
    TermLsn, TimelineId,
};

/// Largest WAL payload of one `AppendRequest` (neon's `MAX_SEND_SIZE`, 16 pages). The one
/// definition: the proposer cuts its appends and the walsender its XLogData messages at it.
pub const MAX_SEND_SIZE: usize = 8192 * 16;
/// Largest term history we accept (one entry per elected term that wrote WAL).
pub const MAX_TERM_HISTORY_ENTRIES: usize = 1024;
/// Largest member list of a membership configuration.
pub const MAX_MEMBERS: usize = 1024;
/// Largest NUL-terminated string, excluding the NUL (host names, ids, feedback keys).
pub const MAX_CSTR_LEN: usize = 1024;

/// Smallest encoding of one member: `u64 id`, empty `cstr host`, `u16 port`.
const MIN_MEMBER_BYTES: usize = 8 + 1 + 2;
/// Encoding of one term history entry.
const TERM_HISTORY_ENTRY_BYTES: usize = 16;

/// Why a frame could not be decoded. Any of these closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// A frame with no bytes.
    #[error("empty message")]
    Empty,
    /// A tag no message of this direction has.
    #[error("unknown message tag {0:#04x}")]
    UnknownTag(u8),
    /// A field could not be read: truncated, too long, too many, trailing bytes.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// A tenant or timeline id that is not 32 hex characters.
    #[error("{field}: invalid id {value:?}")]
    InvalidId {
        /// Which id.
        field: &'static str,
        /// What was sent.
        value: String,
    },
    /// An append whose range is reversed.
    #[error("append end_lsn {end} is below begin_lsn {begin}")]
    EndBeforeBegin {
        /// `begin_lsn` sent.
        begin: Lsn,
        /// `end_lsn` sent.
        end: Lsn,
    },
    /// An append of more than [`MAX_SEND_SIZE`] bytes (refused before reading them).
    #[error("append carries {len} bytes of WAL, more than MAX_SEND_SIZE ({max})")]
    AppendTooLarge {
        /// `end_lsn - begin_lsn` sent.
        len: u64,
        /// [`MAX_SEND_SIZE`].
        max: usize,
    },
    /// A non-zero generation with an empty member list.
    #[error("membership generation {0} with no members")]
    EmptyMembership(Generation),
    /// Two members with one id.
    #[error("duplicate member id {0}")]
    DuplicateMember(NodeId),
    /// A term history out of order.
    #[error(transparent)]
    TermHistory(#[from] TermHistoryError),
    /// A known pageserver feedback key with a value of the wrong length.
    #[error("pageserver feedback key {key:?} has length {len}, expected {expected}")]
    FeedbackLength {
        /// The key.
        key: String,
        /// The length sent.
        len: i32,
        /// The key's length.
        expected: i32,
    },
    /// An unknown pageserver feedback key with a negative length (which cannot be skipped).
    #[error("pageserver feedback key {key:?} has invalid length {len}")]
    FeedbackBadLength {
        /// The key.
        key: String,
        /// The length sent.
        len: i32,
    },
}

/// Why a message could not be encoded (a local bug, never a peer's fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EncodeError {
    /// A message that only exists inside the safekeeper (`NoFlushAppendRequest`, `FlushWAL`).
    #[error("{0} is internal to the safekeeper and never sent")]
    InternalOnly(&'static str),
    /// A string field with a NUL byte, which its C-string encoding cannot carry.
    #[error("{field} contains a NUL byte")]
    NulInString {
        /// Which field.
        field: &'static str,
    },
    /// More entries than the decoder would accept.
    #[error("{field}: {count} entries exceed the limit of {max}")]
    TooMany {
        /// Which list.
        field: &'static str,
        /// Its length.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// An append whose WAL length is not `end_lsn - begin_lsn`.
    #[error("append WAL payload is {len} bytes but end_lsn - begin_lsn is {expected}")]
    WalLengthMismatch {
        /// Bytes of WAL.
        len: usize,
        /// `end_lsn - begin_lsn`.
        expected: u64,
    },
    /// An append of more than [`MAX_SEND_SIZE`] bytes.
    #[error("append WAL payload is {0} bytes, more than MAX_SEND_SIZE")]
    AppendTooLarge(usize),
}

// ---------------------------------------------------------------------------------------------
// Messages

/// `g`: the proposer introduces itself and the timeline it writes.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ProposerGreeting {
    /// The tenant of the timeline.
    pub tenant_id: TenantId,
    /// The timeline the proposer writes.
    pub timeline_id: TimelineId,
    /// The proposer's view of the membership configuration.
    pub mconf: Configuration,
    /// Full PostgreSQL version, e.g. 150018; 0 = unknown.
    pub pg_version: u32,
    /// PostgreSQL system identifier; 0 = unknown (sync-safekeepers).
    pub system_id: u64,
    /// WAL segment size in bytes.
    pub wal_seg_size: u32,
}

impl ProposerGreeting {
    /// The timeline the greeting is for.
    pub fn ttid(&self) -> TenantTimelineId {
        TenantTimelineId {
            tenant_id: self.tenant_id,
            timeline_id: self.timeline_id,
        }
    }
}

/// `v`: asks for a vote in `term`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct VoteRequest {
    /// Membership generation the sender acts in (0: no membership configuration).
    pub generation: Generation,
    /// The term the proposer wants to lead.
    pub term: Term,
}

/// `e`: the proposer won `term`; the acceptor must truncate its WAL at `start_streaming_at` and
/// adopt `term_history`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct ProposerElected {
    /// Membership generation the sender acts in (0: no membership configuration).
    pub generation: Generation,
    /// The term the proposer won.
    pub term: Term,
    /// Where this acceptor's WAL must end before the new term's WAL arrives: the highest
    /// point its history has in common with the proposer's.
    pub start_streaming_at: Lsn,
    /// The proposer's history; its last entry is `(term, term_start_lsn)`.
    pub term_history: TermHistory,
}

/// The fixed part of an `AppendRequest`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct AppendRequestHeader {
    /// Membership generation the sender acts in (0: no membership configuration).
    pub generation: Generation,
    /// The proposer's term.
    pub term: Term,
    /// LSN of the first WAL byte carried.
    pub begin_lsn: Lsn,
    /// Invariant: `end_lsn >= begin_lsn`, `end_lsn - begin_lsn <= MAX_SEND_SIZE`.
    pub end_lsn: Lsn,
    /// The proposer's commit LSN (0 = none yet).
    pub commit_lsn: Lsn,
    /// Oldest WAL any peer may still need (becomes the acceptor's peer horizon).
    pub truncate_lsn: Lsn,
}

/// `a`: WAL bytes `[begin_lsn, end_lsn)`.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AppendRequest {
    /// The fixed fields.
    pub h: AppendRequestHeader,
    /// Invariant: `wal_data.len() == end_lsn - begin_lsn`. A slice of the received frame.
    pub wal_data: Bytes,
}

/// Messages an acceptor processes.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum ProposerAcceptorMessage {
    /// `g`: the first message of a connection.
    Greeting(ProposerGreeting),
    /// `v`: a vote request.
    VoteRequest(VoteRequest),
    /// `e`: the proposer was elected.
    Elected(ProposerElected),
    /// Write and make durable before answering.
    AppendRequest(AppendRequest),
    /// Internal only (never on the wire): write without syncing; answer only if `flush_lsn`
    /// moved. The WAL receiver turns every `AppendRequest` into this and batches the sync.
    NoFlushAppendRequest(AppendRequest),
    /// Internal only: sync what was written and always answer with an `AppendResponse`.
    FlushWAL,
}

/// `g` reply: who the acceptor is and the highest term it has seen.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AcceptorGreeting {
    /// The acceptor's node id.
    pub node_id: NodeId,
    /// The acceptor's membership configuration.
    pub mconf: Configuration,
    /// The highest term the acceptor has seen.
    pub term: Term,
}

/// `v` reply.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct VoteResponse {
    /// Membership generation the sender acts in (0: no membership configuration).
    pub generation: Generation,
    /// The acceptor's term after processing the request.
    pub term: Term,
    /// Whether the vote was given (durably: it is persisted before this reply exists).
    pub vote_given: bool,
    /// Durable end of the acceptor's WAL.
    pub flush_lsn: Lsn,
    /// The acceptor's peer horizon.
    pub truncate_lsn: Lsn,
    /// The acceptor's history up to `flush_lsn`.
    pub term_history: TermHistory,
}

/// Hot-standby feedback aggregated from readers (zero = none).
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct HotStandbyFeedback {
    /// When it was produced (µs since 2000-01-01 UTC).
    pub ts: i64,
    /// Oldest xmin any reader still needs (full 64-bit transaction id).
    pub xmin: u64,
    /// Oldest catalog xmin any reader still needs.
    pub catalog_xmin: u64,
}

/// Pageserver progress, forwarded to the compute for backpressure.
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct PageserverFeedback {
    /// Logical size of the timeline on the pageserver, in bytes.
    pub current_timeline_size: u64,
    /// WAL the pageserver has received (`ps_writelsn`).
    pub last_received_lsn: Lsn,
    /// WAL the pageserver has made durable locally (`ps_flushlsn`).
    pub disk_consistent_lsn: Lsn,
    /// WAL the pageserver has uploaded to remote storage (`ps_applylsn`).
    pub remote_consistent_lsn: Lsn,
    /// Microseconds since 2000-01-01 (PostgreSQL epoch).
    pub replytime: i64,
    /// Sent only when non-zero.
    pub shard_number: u32,
    /// Sent only when true.
    pub corruption_detected: bool,
}

impl HotStandbyFeedback {
    /// Whether it asks to keep anything.
    pub fn is_empty(&self) -> bool {
        self.xmin == 0 && self.catalog_xmin == 0
    }

    /// The oldest of several feedbacks: per field the smallest non-zero xid (0 if none), `ts`
    /// the newest among those that ask for something. Full 64-bit xids compare right across a
    /// 32-bit wraparound. neon's walproposer combines its safekeepers' feedback by this rule
    /// (`CombineHotStanbyFeedbacks`), and a safekeeper its readers'.
    pub fn oldest(feedbacks: impl IntoIterator<Item = HotStandbyFeedback>) -> HotStandbyFeedback {
        let min_nonzero = |a: u64, b: u64| match (a, b) {
            (0, b) => b,
            (a, 0) => a,
            (a, b) => a.min(b),
        };
        let mut out = HotStandbyFeedback::default();
        for f in feedbacks.into_iter().filter(|f| !f.is_empty()) {
            out.xmin = min_nonzero(out.xmin, f.xmin);
            out.catalog_xmin = min_nonzero(out.catalog_xmin, f.catalog_xmin);
            out.ts = out.ts.max(f.ts);
        }
        out
    }
}

/// `a` reply.
#[derive(Clone, PartialEq, Eq, Debug)]
pub struct AppendResponse {
    /// Membership generation the sender acts in (0: no membership configuration).
    pub generation: Generation,
    /// The acceptor's term.
    pub term: Term,
    /// Durable end of the acceptor's WAL (0 in a term-only refusal).
    pub flush_lsn: Lsn,
    /// The acceptor's *persisted* commit LSN (0 in a term-only refusal).
    pub commit_lsn: Lsn,
    /// What the acceptor's readers still need.
    pub hs_feedback: HotStandbyFeedback,
    /// The pageserver's progress, when the acceptor has it.
    pub pageserver_feedback: Option<PageserverFeedback>,
}

impl AppendResponse {
    /// The refusal sent when the acceptor's term is above the request's.
    pub fn term_only(generation: Generation, term: Term) -> AppendResponse {
        AppendResponse {
            generation,
            term,
            flush_lsn: Lsn::INVALID,
            commit_lsn: Lsn::INVALID,
            hs_feedback: HotStandbyFeedback::default(),
            pageserver_feedback: None,
        }
    }
}

/// Messages an acceptor sends.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum AcceptorProposerMessage {
    /// `g`: the answer to a greeting.
    Greeting(AcceptorGreeting),
    /// `v`: the answer to a vote request.
    VoteResponse(VoteResponse),
    /// `a`: the answer to appends (and to an election).
    AppendResponse(AppendResponse),
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// Protocol v3's composite fields, read with the shared bounded [`Reader`].
trait ReadProtocol {
    fn term(&mut self, field: &'static str) -> Result<Term, DecodeError>;
    fn generation(&mut self) -> Result<Generation, DecodeError>;
    fn string(&mut self, field: &'static str) -> Result<String, DecodeError>;
    fn id<T: std::str::FromStr>(&mut self, field: &'static str) -> Result<T, DecodeError>;
    fn term_history(&mut self) -> Result<TermHistory, DecodeError>;
    fn members(&mut self, field: &'static str) -> Result<Vec<SafekeeperId>, DecodeError>;
    fn mconf(&mut self) -> Result<Configuration, DecodeError>;
    fn pageserver_feedback(&mut self) -> Result<PageserverFeedback, DecodeError>;
}

impl ReadProtocol for Reader {
    fn term(&mut self, field: &'static str) -> Result<Term, DecodeError> {
        Ok(self.u64(field).map(Term)?)
    }

    fn generation(&mut self) -> Result<Generation, DecodeError> {
        Ok(self.u32("generation").map(Generation)?)
    }

    /// A NUL-terminated UTF-8 string of at most [`MAX_CSTR_LEN`] bytes.
    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        Ok(self.cstr(field, MAX_CSTR_LEN)?)
    }

    fn id<T: std::str::FromStr>(&mut self, field: &'static str) -> Result<T, DecodeError> {
        let s = self.string(field)?;
        s.parse()
            .map_err(|_| DecodeError::InvalidId { field, value: s })
    }

    fn term_history(&mut self) -> Result<TermHistory, DecodeError> {
        let n = self.count(
            "term history",
            MAX_TERM_HISTORY_ENTRIES,
            TERM_HISTORY_ENTRY_BYTES,
        )?;
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            let term = self.term("term history term")?;
            let lsn = self.lsn("term history lsn")?;
            entries.push(TermLsn { term, lsn });
        }
        let history = TermHistory(entries);
        history.validate()?;
        Ok(history)
    }

    fn members(&mut self, field: &'static str) -> Result<Vec<SafekeeperId>, DecodeError> {
        let n = self.count(field, MAX_MEMBERS, MIN_MEMBER_BYTES)?;
        let mut members: Vec<SafekeeperId> = Vec::with_capacity(n);
        for _ in 0..n {
            let id = NodeId(self.u64("member id")?);
            let host = self.string("member host")?;
            let pg_port = self.u16("member pg_port")?;
            if members.iter().any(|m| m.id == id) {
                return Err(DecodeError::DuplicateMember(id));
            }
            members.push(SafekeeperId { id, host, pg_port });
        }
        Ok(members)
    }

    fn mconf(&mut self) -> Result<Configuration, DecodeError> {
        let generation = self.generation()?;
        let members = self.members("members")?;
        let new_members = self.members("new members")?;
        if generation != Generation::INVALID && members.is_empty() {
            return Err(DecodeError::EmptyMembership(generation));
        }
        Ok(Configuration {
            generation,
            members,
            new_members: (!new_members.is_empty()).then_some(new_members),
        })
    }

    fn pageserver_feedback(&mut self) -> Result<PageserverFeedback, DecodeError> {
        let mut f = PageserverFeedback::default();
        let nkeys = self.u8("feedback key count")?;
        for _ in 0..nkeys {
            let key = self.string("feedback key")?;
            let len = self.i32("feedback value length")?;
            let expect = |expected: i32| {
                if len == expected {
                    Ok(())
                } else {
                    Err(DecodeError::FeedbackLength {
                        key: key.clone(),
                        len,
                        expected,
                    })
                }
            };
            match key.as_str() {
                "current_timeline_size" => {
                    expect(8)?;
                    f.current_timeline_size = self.u64("current_timeline_size")?;
                }
                "ps_writelsn" => {
                    expect(8)?;
                    f.last_received_lsn = self.lsn("ps_writelsn")?;
                }
                "ps_flushlsn" => {
                    expect(8)?;
                    f.disk_consistent_lsn = self.lsn("ps_flushlsn")?;
                }
                "ps_applylsn" => {
                    expect(8)?;
                    f.remote_consistent_lsn = self.lsn("ps_applylsn")?;
                }
                "ps_replytime" => {
                    expect(8)?;
                    f.replytime = self.i64("ps_replytime")?;
                }
                "shard_number" => {
                    expect(4)?;
                    f.shard_number = self.u32("shard_number")?;
                }
                "corruption_detected" => {
                    expect(1)?;
                    f.corruption_detected = self.u8("corruption_detected")? != 0;
                }
                _ => {
                    // Unknown keys are skipped using their length.
                    let Ok(len) = usize::try_from(len) else {
                        return Err(DecodeError::FeedbackBadLength { key, len });
                    };
                    self.skip("unknown feedback value", len)?;
                }
            }
        }
        Ok(f)
    }
}

fn read_tag(buf: &Bytes) -> Result<(u8, Reader), DecodeError> {
    let Some(&tag) = buf.first() else {
        return Err(DecodeError::Empty);
    };
    Ok((tag, Reader::new(buf.slice(1..))))
}

impl ProposerAcceptorMessage {
    /// Decodes one frame. The WAL of an append is a zero-copy slice of `frame`.
    pub fn decode(frame: &Bytes) -> Result<ProposerAcceptorMessage, DecodeError> {
        let (tag, mut r) = read_tag(frame)?;
        let msg = match tag {
            b'g' => {
                let tenant_id = r.id("tenant_id")?;
                let timeline_id = r.id("timeline_id")?;
                let mconf = r.mconf()?;
                let pg_version = r.u32("pg_version")?;
                let system_id = r.u64("system_id")?;
                let wal_seg_size = r.u32("wal_seg_size")?;
                ProposerAcceptorMessage::Greeting(ProposerGreeting {
                    tenant_id,
                    timeline_id,
                    mconf,
                    pg_version,
                    system_id,
                    wal_seg_size,
                })
            }
            b'v' => ProposerAcceptorMessage::VoteRequest(VoteRequest {
                generation: r.generation()?,
                term: r.term("term")?,
            }),
            b'e' => ProposerAcceptorMessage::Elected(ProposerElected {
                generation: r.generation()?,
                term: r.term("term")?,
                start_streaming_at: r.lsn("start_streaming_at")?,
                term_history: r.term_history()?,
            }),
            b'a' => {
                let h = AppendRequestHeader {
                    generation: r.generation()?,
                    term: r.term("term")?,
                    begin_lsn: r.lsn("begin_lsn")?,
                    end_lsn: r.lsn("end_lsn")?,
                    commit_lsn: r.lsn("commit_lsn")?,
                    truncate_lsn: r.lsn("truncate_lsn")?,
                };
                let Some(len) = h.end_lsn.checked_sub(h.begin_lsn) else {
                    return Err(DecodeError::EndBeforeBegin {
                        begin: h.begin_lsn,
                        end: h.end_lsn,
                    });
                };
                if len > MAX_SEND_SIZE as u64 {
                    return Err(DecodeError::AppendTooLarge {
                        len,
                        max: MAX_SEND_SIZE,
                    });
                }
                let wal_data = r.bytes("wal data", len as usize)?;
                ProposerAcceptorMessage::AppendRequest(AppendRequest { h, wal_data })
            }
            other => return Err(DecodeError::UnknownTag(other)),
        };
        r.finish()?;
        Ok(msg)
    }

    /// Appends the wire form to `buf`. Internal-only variants are refused.
    pub fn encode(&self, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            ProposerAcceptorMessage::Greeting(g) => {
                buf.put_u8(b'g');
                put_cstr(buf, "tenant_id", &g.tenant_id.to_string())?;
                put_cstr(buf, "timeline_id", &g.timeline_id.to_string())?;
                put_mconf(buf, &g.mconf)?;
                buf.put_u32(g.pg_version);
                buf.put_u64(g.system_id);
                buf.put_u32(g.wal_seg_size);
            }
            ProposerAcceptorMessage::VoteRequest(v) => {
                buf.put_u8(b'v');
                buf.put_u32(v.generation.0);
                buf.put_u64(v.term.0);
            }
            ProposerAcceptorMessage::Elected(e) => {
                buf.put_u8(b'e');
                buf.put_u32(e.generation.0);
                buf.put_u64(e.term.0);
                buf.put_u64(e.start_streaming_at.0);
                put_term_history(buf, &e.term_history)?;
            }
            ProposerAcceptorMessage::AppendRequest(a) => {
                let expected = a.h.end_lsn.checked_sub(a.h.begin_lsn);
                if expected != Some(a.wal_data.len() as u64) {
                    return Err(EncodeError::WalLengthMismatch {
                        len: a.wal_data.len(),
                        expected: expected.unwrap_or(0),
                    });
                }
                if a.wal_data.len() > MAX_SEND_SIZE {
                    return Err(EncodeError::AppendTooLarge(a.wal_data.len()));
                }
                buf.reserve(1 + 4 + 5 * 8 + a.wal_data.len());
                buf.put_u8(b'a');
                buf.put_u32(a.h.generation.0);
                buf.put_u64(a.h.term.0);
                buf.put_u64(a.h.begin_lsn.0);
                buf.put_u64(a.h.end_lsn.0);
                buf.put_u64(a.h.commit_lsn.0);
                buf.put_u64(a.h.truncate_lsn.0);
                buf.put_slice(&a.wal_data);
            }
            ProposerAcceptorMessage::NoFlushAppendRequest(_) => {
                return Err(EncodeError::InternalOnly("NoFlushAppendRequest"));
            }
            ProposerAcceptorMessage::FlushWAL => return Err(EncodeError::InternalOnly("FlushWAL")),
        }
        Ok(())
    }
}

impl AcceptorProposerMessage {
    /// Decodes one frame sent by an acceptor.
    pub fn decode(frame: &Bytes) -> Result<AcceptorProposerMessage, DecodeError> {
        let (tag, mut r) = read_tag(frame)?;
        let msg = match tag {
            b'g' => AcceptorProposerMessage::Greeting(AcceptorGreeting {
                node_id: NodeId(r.u64("node_id")?),
                mconf: r.mconf()?,
                term: r.term("term")?,
            }),
            b'v' => AcceptorProposerMessage::VoteResponse(VoteResponse {
                generation: r.generation()?,
                term: r.term("term")?,
                vote_given: r.u8("vote_given")? != 0,
                flush_lsn: r.lsn("flush_lsn")?,
                truncate_lsn: r.lsn("truncate_lsn")?,
                term_history: r.term_history()?,
            }),
            b'a' => {
                let generation = r.generation()?;
                let term = r.term("term")?;
                let flush_lsn = r.lsn("flush_lsn")?;
                let commit_lsn = r.lsn("commit_lsn")?;
                let hs_feedback = HotStandbyFeedback {
                    ts: r.i64("hs_feedback ts")?,
                    xmin: r.u64("hs_feedback xmin")?,
                    catalog_xmin: r.u64("hs_feedback catalog_xmin")?,
                };
                // The feedback block is present iff bytes remain (as walproposer parses it).
                let pageserver_feedback = if r.has_remaining() {
                    Some(r.pageserver_feedback()?)
                } else {
                    None
                };
                AcceptorProposerMessage::AppendResponse(AppendResponse {
                    generation,
                    term,
                    flush_lsn,
                    commit_lsn,
                    hs_feedback,
                    pageserver_feedback,
                })
            }
            other => return Err(DecodeError::UnknownTag(other)),
        };
        r.finish()?;
        Ok(msg)
    }

    /// Appends the wire form to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            AcceptorProposerMessage::Greeting(g) => {
                buf.put_u8(b'g');
                buf.put_u64(g.node_id.0);
                put_mconf(buf, &g.mconf)?;
                buf.put_u64(g.term.0);
            }
            AcceptorProposerMessage::VoteResponse(v) => {
                buf.put_u8(b'v');
                buf.put_u32(v.generation.0);
                buf.put_u64(v.term.0);
                buf.put_u8(v.vote_given as u8);
                buf.put_u64(v.flush_lsn.0);
                buf.put_u64(v.truncate_lsn.0);
                put_term_history(buf, &v.term_history)?;
            }
            AcceptorProposerMessage::AppendResponse(a) => {
                buf.put_u8(b'a');
                buf.put_u32(a.generation.0);
                buf.put_u64(a.term.0);
                buf.put_u64(a.flush_lsn.0);
                buf.put_u64(a.commit_lsn.0);
                buf.put_i64(a.hs_feedback.ts);
                buf.put_u64(a.hs_feedback.xmin);
                buf.put_u64(a.hs_feedback.catalog_xmin);
                if let Some(f) = &a.pageserver_feedback {
                    put_pageserver_feedback(buf, f);
                }
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Encoding helpers

fn put_cstr(buf: &mut BytesMut, field: &'static str, s: &str) -> Result<(), EncodeError> {
    if s.as_bytes().contains(&0) {
        return Err(EncodeError::NulInString { field });
    }
    buf.put_slice(s.as_bytes());
    buf.put_u8(0);
    Ok(())
}

fn put_members(
    buf: &mut BytesMut,
    field: &'static str,
    members: &[SafekeeperId],
) -> Result<(), EncodeError> {
    if members.len() > MAX_MEMBERS {
        return Err(EncodeError::TooMany {
            field,
            count: members.len(),
            max: MAX_MEMBERS,
        });
    }
    buf.put_u32(members.len() as u32);
    for m in members {
        buf.put_u64(m.id.0);
        put_cstr(buf, "member host", &m.host)?;
        buf.put_u16(m.pg_port);
    }
    Ok(())
}

fn put_mconf(buf: &mut BytesMut, mconf: &Configuration) -> Result<(), EncodeError> {
    buf.put_u32(mconf.generation.0);
    put_members(buf, "members", &mconf.members)?;
    // `None` and `Some(empty)` are both "not joint": 0 new members.
    put_members(
        buf,
        "new members",
        mconf.new_members.as_deref().unwrap_or(&[]),
    )
}

fn put_term_history(buf: &mut BytesMut, history: &TermHistory) -> Result<(), EncodeError> {
    if history.0.len() > MAX_TERM_HISTORY_ENTRIES {
        return Err(EncodeError::TooMany {
            field: "term history",
            count: history.0.len(),
            max: MAX_TERM_HISTORY_ENTRIES,
        });
    }
    buf.put_u32(history.0.len() as u32);
    for e in &history.0 {
        buf.put_u64(e.term.0);
        buf.put_u64(e.lsn.0);
    }
    Ok(())
}

/// Neon's `PageserverFeedback::serialize`: always the five core keys, then the optional ones.
fn put_pageserver_feedback(buf: &mut BytesMut, f: &PageserverFeedback) {
    let count_at = buf.len();
    buf.put_u8(0);
    let mut nkeys = 0u8;
    let mut put_u64 = |buf: &mut BytesMut, key: &[u8], v: u64| {
        buf.put_slice(key);
        buf.put_i32(8);
        buf.put_u64(v);
        nkeys += 1;
    };
    put_u64(buf, b"current_timeline_size\0", f.current_timeline_size);
    put_u64(buf, b"ps_writelsn\0", f.last_received_lsn.0);
    put_u64(buf, b"ps_flushlsn\0", f.disk_consistent_lsn.0);
    put_u64(buf, b"ps_applylsn\0", f.remote_consistent_lsn.0);
    put_u64(buf, b"ps_replytime\0", f.replytime as u64);
    if f.shard_number > 0 {
        buf.put_slice(b"shard_number\0");
        buf.put_i32(4);
        buf.put_u32(f.shard_number);
        nkeys += 1;
    }
    if f.corruption_detected {
        buf.put_slice(b"corruption_detected\0");
        buf.put_i32(1);
        buf.put_u8(1);
        nkeys += 1;
    }
    buf[count_at] = nkeys;
}

#[cfg(test)]
mod tests;
