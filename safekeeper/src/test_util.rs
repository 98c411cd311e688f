//! Helpers shared by the crate's unit tests: drive a [`Timeline`] as a proposer would.
//!
//! Not here: the integration tests' proposer over TCP (`tests/common`).

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use sk_core::protocol::{
    AcceptorProposerMessage, AppendRequest, AppendRequestHeader, MAX_SEND_SIZE,
    ProposerAcceptorMessage, ProposerElected, ProposerGreeting, VoteRequest, VoteResponse,
};
use sk_core::state::Configuration;
use sk_core::storage::fs::{Fs, SimFs};
use sk_core::types::{Generation, Lsn, NodeId, TenantId, Term, TermHistory, TermLsn, TimelineId};

use crate::registry::GlobalTimelines;
use crate::timeline::Timeline;

/// The data directory of simulated nodes.
pub const DATADIR: &str = "/data";

/// A greeting for timeline `tl` of tenant 1 with segments of `seg_size` bytes.
pub fn greeting(tl: u8, seg_size: u64) -> ProposerGreeting {
    ProposerGreeting {
        tenant_id: TenantId([1; 16]),
        timeline_id: TimelineId([tl; 16]),
        mconf: Configuration::default(),
        pg_version: 150000,
        system_id: 42,
        wal_seg_size: seg_size as u32,
    }
}

/// An empty node on a simulated file system.
pub fn sim_node() -> (Arc<SimFs>, Fs, GlobalTimelines) {
    let (sim, fs) = SimFs::with_dir(Path::new(DATADIR));
    let timelines = load(&fs);
    (sim, fs, timelines)
}

/// Loads the node in [`DATADIR`] of `fs`.
pub fn load(fs: &Fs) -> GlobalTimelines {
    GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(1), false)
        .expect("the node loads")
}

/// Runs `msg` through the timeline's acceptor, which must take it.
/// A blocking section ([`crate::blocking`]): tests drive the acceptor from their own thread,
/// which may be a tokio test's.
pub fn run(tl: &Timeline, msg: ProposerAcceptorMessage) -> Option<AcceptorProposerMessage> {
    crate::blocking::section(|| tl.process_msg(&msg)).expect("the acceptor takes the message")
}

/// Asks for a vote in `term`.
pub fn vote(tl: &Timeline, term: u64) -> VoteResponse {
    match run(
        tl,
        ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation(0),
            term: Term(term),
        }),
    ) {
        Some(AcceptorProposerMessage::VoteResponse(v)) => v,
        other => panic!("expected a vote response, got {other:?}"),
    }
}

/// Votes for `term` and is elected with `history` (whose last entry is `term`'s start).
pub fn elect(tl: &Timeline, term: u64, history: &[(u64, Lsn)]) {
    assert!(vote(tl, term).vote_given);
    let start = history.last().expect("a history").1;
    run(
        tl,
        ProposerAcceptorMessage::Elected(ProposerElected {
            generation: Generation(0),
            term: Term(term),
            start_streaming_at: start,
            term_history: TermHistory(
                history
                    .iter()
                    .map(|&(t, lsn)| TermLsn { term: Term(t), lsn })
                    .collect(),
            ),
        }),
    );
}

/// Creates timeline `tl` (segments of `seg_size` bytes) on `timelines` as a proposer's greeting
/// does, and elects term 1 starting at `start`.
pub fn elected_timeline(
    timelines: &GlobalTimelines,
    tl: u8,
    seg_size: u64,
    start: Lsn,
) -> Arc<Timeline> {
    let g = greeting(tl, seg_size);
    let timeline = timelines.get_or_create(&g, true).expect("timeline created");
    run(&timeline, ProposerAcceptorMessage::Greeting(g));
    elect(&timeline, 1, &[(1, start)]);
    timeline
}

/// Appends `wal` from `start` in `term`, in pieces of at most `MAX_SEND_SIZE`, each made durable
/// (`flush`) or only written (the WAL acceptor's `NoFlushAppendRequest`).
pub fn append(tl: &Timeline, term: u64, start: Lsn, wal: &[u8], commit: Lsn, flush: bool) {
    for (i, piece) in wal.chunks(MAX_SEND_SIZE).enumerate() {
        let begin = Lsn(start.0 + (i * MAX_SEND_SIZE) as u64);
        let m = AppendRequest {
            h: AppendRequestHeader {
                generation: Generation(0),
                term: Term(term),
                begin_lsn: begin,
                end_lsn: Lsn(begin.0 + piece.len() as u64),
                commit_lsn: commit,
                truncate_lsn: Lsn::INVALID,
            },
            wal_data: Bytes::copy_from_slice(piece),
        };
        run(
            tl,
            if flush {
                ProposerAcceptorMessage::AppendRequest(m)
            } else {
                ProposerAcceptorMessage::NoFlushAppendRequest(m)
            },
        );
    }
}

/// One durable append of `wal` (at most `MAX_SEND_SIZE` bytes) from `begin` in `term`.
pub fn append_msg(term: u64, begin: Lsn, wal: &[u8], commit: Lsn) -> ProposerAcceptorMessage {
    assert!(wal.len() <= MAX_SEND_SIZE);
    ProposerAcceptorMessage::AppendRequest(AppendRequest {
        h: AppendRequestHeader {
            generation: Generation(0),
            term: Term(term),
            begin_lsn: begin,
            end_lsn: Lsn(begin.0 + wal.len() as u64),
            commit_lsn: commit,
            truncate_lsn: Lsn::INVALID,
        },
        wal_data: Bytes::copy_from_slice(wal),
    })
}

/// Votes for `term`, is elected with `history`, and appends `wal` durably from the start of
/// `term`'s entry.
pub fn elect_and_append(tl: &Timeline, term: u64, history: &[(u64, Lsn)], wal: &[u8]) {
    elect(tl, term, history);
    let start = history.last().expect("a history").1;
    append(tl, term, start, wal, Lsn::INVALID, true);
}
