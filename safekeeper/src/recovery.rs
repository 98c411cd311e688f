//! Peer recovery: a timeline that lags behind a peer in its current term, while no proposer
//! streams to it, fetches the missing WAL from that peer.
//!
//! Every second ([`RECOVERY_TICK`]) the driver ([`run`]) looks at each timeline with no proposer
//! connected and asks its peers (`--peers`, limited to the members of the timeline's membership
//! configuration once it has one) for their status over HTTP, once this node has voted (term
//! N > 0); after a failed session the timeline waits ([`next_backoff`]: 1 s doubling up to
//! 30 s) before it is checked again. A peer is a **donor** only if
//! - its term, and the term of its newest WAL (`last_log_term`), equal this node's term N: it
//!   holds WAL of the one proposer of term N, from that proposer's `ProposerElected`, and its
//!   walsender serves it under `(term='N')`. A peer whose term is N but whose newest WAL is of an
//!   older term may hold a tail that term N's proposer truncates: it is never a donor;
//! - its term was elected in this node's membership generation (`elected_generation`), so the
//!   generation recorded with the recovered history stays true (the switch condition of a
//!   membership change reads it);
//! - its `(last_log_term, flush_lsn)` is beyond this node's.
//!
//! The most advanced donor's WAL is fetched with `START_REPLICATION PHYSICAL <lsn> (term='N')`
//! on its PostgreSQL port. That walsender checks only the donor's acceptor term (what a
//! proposer's own fetch needs), so once the stream is established, and again before the donor's
//! commit LSN is adopted, the donor's status is read again ([`recheck_donor`]): its term and
//! newest WAL's term still N, elected in the same generation, its history's entry for N the one
//! we use, and its `/v1/status` naming the donor's node id. The WAL is fed through the same
//! acceptor as a proposer's stream ([`receive_wal::spawn_acceptor`]): first a `ProposerElected` carrying the donor's term
//! history (so `process_msg` truncates a divergent tail of ours at the highest common point,
//! refuses a start below our commit LSN, and adopts the history), then an `AppendRequest` per
//! XLogData message with the donor's commit LSN. Every rule of `process_msg` holds, writes are
//! fsynced in batches as a proposer's are, and nothing is acknowledged to anyone.
//!
//! A proposer that connects stops the recovery at once (its stream wins): once it is counted
//! (before its first message is queued), the acceptor refuses, under its lock, every message
//! recovery still queued ([`Timeline::process_recovery_msg`]), so the two never interleave.
//!
//! Not here: the HTTP and PostgreSQL clients ([`crate::peer`]), the acceptor pipeline
//! ([`crate::receive_wal`]).

use std::io::Read;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pq_proto::client::CopyEvent;
use pq_proto::replication::ReplicationMessage;
use serde::Deserialize;
use sk_core::protocol::{
    AcceptorProposerMessage, AppendRequest, AppendRequestHeader, ProposerAcceptorMessage,
    ProposerElected,
};
use sk_core::types::{Generation, Lsn, NodeId, Term, TermHistory, TermLsn};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::metrics;
use crate::peer::{PeerAddr, PeerClient};
use crate::receive_wal::{Outgoing, REPLY_QUEUE_SIZE, Source, enqueue, spawn_acceptor};
use crate::registry::GlobalTimelines;
use crate::timeline::Timeline;

pub use crate::manager::recovery::{
    LocalView, MAX_RETRY_BACKOFF, NotADonor, PeerView, RECOVERY_TICK, RecoveryStatus, check_donor,
    choose_donor, next_backoff, recheck_donor, start_point,
};

/// The driver: checks every timeline each [`RECOVERY_TICK`] and runs recoveries, at most one per
/// timeline at a time, until `cancel`. Returns at once without peers.
pub async fn run(
    timelines: Arc<GlobalTimelines>,
    peers: Vec<(u64, String)>,
    client: PeerClient,
    cancel: CancellationToken,
) {
    let me = timelines.node_id();
    let peers: Arc<Vec<(NodeId, String)>> = Arc::new(
        peers
            .into_iter()
            .map(|(id, a)| (NodeId(id), a))
            .filter(|(id, _)| *id != me)
            .collect(),
    );
    if peers.is_empty() {
        return;
    }
    tracing::info!(peers = ?peers, "peer recovery on");
    let tasks = TaskTracker::new();
    let mut ticker = crate::ticker::Ticker::new(RECOVERY_TICK);
    while ticker.tick(&cancel).await {
        for tl in timelines.all() {
            if tl.deleted().is_cancelled() || tl.proposer_count() > 0 {
                continue;
            }
            let Some(busy) = tl.recovery_slot() else {
                continue; // a check or a recovery of this timeline is under way
            };
            let (peers, client, cancel) = (peers.clone(), client.clone(), cancel.clone());
            let span = crate::timeline::span(&tl.ttid);
            tasks.spawn(
                async move {
                    let _busy = busy;
                    check_and_recover(&tl, &peers, &client, &cancel).await;
                }
                .instrument(span),
            );
        }
    }
    tasks.close();
    tasks.wait().await;
}

/// One check of `tl`: poll the peers, and if one is a donor, recover from it.
async fn check_and_recover(
    tl: &Arc<Timeline>,
    peers: &[(NodeId, String)],
    client: &PeerClient,
    cancel: &CancellationToken,
) {
    let mut retry_at = None;
    tl.update_recovery(|r| retry_at = r.retry_at);
    if retry_at.is_some_and(|t| Instant::now() < t) {
        return; // backing off after a failed session
    }
    let mconf = tl.status().mconf;
    if mconf.generation.0 > 0 && !mconf.contains(tl.node_id()) {
        return; // not a member: takes no part
    }
    let asked: Vec<(NodeId, String)> = peers
        .iter()
        .filter(|(id, _)| mconf.generation.0 == 0 || mconf.contains(*id))
        .cloned()
        .collect();
    let me = tl.recovery_view();
    if asked.is_empty() || me.term == Term(0) {
        return; // no peer to ask, or no term N to recover WAL of
    }
    let views = {
        let (client, ttid) = (client.clone(), tl.ttid);
        crate::blocking::spawn(move || {
            asked
                .iter()
                .filter_map(|(id, http)| match peer_view(&client, ttid, *id, http) {
                    Ok(v) => Some(v),
                    Err(e) => {
                        tracing::debug!(peer = %id, "peer status: {e}");
                        None
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default()
    };
    let Some(donor) = choose_donor(&me, &views) else {
        return;
    };
    if tl.proposer_count() > 0 {
        return;
    }
    let started = Instant::now();
    tracing::info!(
        donor = %donor.id,
        term = %me.term,
        from = %me.flush_lsn,
        to = %donor.flush_lsn,
        "recovering WAL from a peer"
    );
    tl.update_recovery(|r| {
        r.active = true;
        r.donor = Some(donor.id);
    });
    metrics::RECOVERY_ACTIVE.inc();
    let result = recover(tl, client, donor, cancel).await;
    metrics::RECOVERY_ACTIVE.dec();
    let secs = started.elapsed().as_secs_f64();
    match &result {
        Ok(bytes) => tracing::info!(
            donor = %donor.id,
            bytes,
            seconds = secs,
            positions = ?tl.positions(),
            "recovery from a peer done"
        ),
        Err(e) => tracing::warn!(donor = %donor.id, "recovery from a peer failed: {e}"),
    }
    tl.update_recovery(|r| {
        r.active = false;
        r.sessions += 1;
        if result.is_ok() {
            r.backoff = Duration::ZERO;
            r.retry_at = None;
        } else {
            r.backoff = next_backoff(r.backoff);
            r.retry_at = Some(Instant::now() + r.backoff);
        }
        r.last_error = result.err();
    });
}

/// Reads the acceptor's replies to a recovery session of term `term` until the acceptor exits;
/// returns why the session failed, if it did, and cancels `stop` then. An error ends the session,
/// and so does a reply in another term than `term` (our term moved on: the acceptor refuses the
/// appends with a term-only reply, which is no error to a proposer but is to recovery).
async fn watch_replies(
    mut reply_rx: mpsc::Receiver<Outgoing>,
    term: Term,
    stop: CancellationToken,
) -> Option<String> {
    let mut error = None;
    while let Some(out) = reply_rx.recv().await {
        let failed = match out {
            Outgoing::Error(e) => Some(e.message),
            Outgoing::Reply(AcceptorProposerMessage::AppendResponse(r)) if r.term != term => {
                Some(format!("our term moved on to {}", r.term))
            }
            Outgoing::Reply(_) => None,
        };
        if let Some(why) = failed {
            error.get_or_insert(why);
            stop.cancel();
        }
    }
    error
}

/// The part of a peer's timeline status recovery reads.
#[derive(Deserialize)]
struct StatusJson {
    term: Term,
    term_history: Vec<EntryJson>,
    flush_lsn: String,
    commit_lsn: String,
    elected_generation: u32,
}

#[derive(Deserialize)]
struct EntryJson {
    term: Term,
    lsn: String,
}

/// The highest LSN a peer may report (an exbibyte of WAL): beyond it, its status is bogus,
/// and LSN arithmetic on it could overflow.
pub const MAX_PEER_LSN: Lsn = Lsn(1 << 60);

/// An LSN of a peer's status: valid syntax, at most [`MAX_PEER_LSN`].
fn peer_lsn(v: &str) -> Result<Lsn, String> {
    let lsn: Lsn = v.parse().map_err(|e| format!("invalid LSN {v:?}: {e}"))?;
    if lsn > MAX_PEER_LSN {
        return Err(format!("LSN {lsn} is beyond {MAX_PEER_LSN}"));
    }
    Ok(lsn)
}

/// Asks peer `id` at `http` for its status of `ttid`. Blocking.
fn peer_view(
    client: &PeerClient,
    ttid: sk_core::types::TenantTimelineId,
    id: NodeId,
    http: &str,
) -> Result<PeerView, String> {
    let path = format!(
        "/v1/tenant/{}/timeline/{}",
        ttid.tenant_id, ttid.timeline_id
    );
    let mut body = String::new();
    client
        .get(http, &path)?
        .take(1 << 20)
        .read_to_string(&mut body)
        .map_err(|e| format!("{http}: {e}"))?;
    let s: StatusJson = serde_json::from_str(&body).map_err(|e| format!("{http}: {e}"))?;
    let lsn = |v: &str| -> Result<Lsn, String> { peer_lsn(v).map_err(|e| format!("{http}: {e}")) };
    let term_history = TermHistory(
        s.term_history
            .iter()
            .map(|e| {
                Ok(TermLsn {
                    term: e.term,
                    lsn: lsn(&e.lsn)?,
                })
            })
            .collect::<Result<_, String>>()?,
    );
    term_history
        .validate()
        .map_err(|e| format!("{http}: {e}"))?;
    Ok(PeerView {
        id,
        http: http.to_string(),
        term: s.term,
        term_history,
        flush_lsn: lsn(&s.flush_lsn)?,
        commit_lsn: lsn(&s.commit_lsn)?,
        elected_generation: Generation(s.elected_generation),
    })
}

/// What recovery reads of a peer's `/v1/status`.
#[derive(Deserialize)]
struct NodeStatus {
    id: u64,
    pg_port: u16,
}

/// The donor's `/v1/status`, which must name the donor's node id (the HTTP address is that
/// node). Blocking.
fn donor_node_status(client: &PeerClient, donor: &PeerView) -> Result<NodeStatus, String> {
    let mut body = String::new();
    client
        .get(&donor.http, "/v1/status")?
        .take(1 << 16)
        .read_to_string(&mut body)
        .map_err(|e| format!("{}: {e}", donor.http))?;
    let s: NodeStatus =
        serde_json::from_str(&body).map_err(|e| format!("{}: /v1/status: {e}", donor.http))?;
    if s.id != donor.id.0 {
        return Err(format!(
            "{} is node {}, not the donor {}",
            donor.http, s.id, donor.id
        ));
    }
    Ok(s)
}

/// The donor's PostgreSQL address: its entry in our membership configuration, else the host of
/// its HTTP address and the port its `/v1/status` names. The HTTP address must be the donor's
/// node (its `/v1/status` id), so both addresses name the same node. Blocking.
fn donor_pg_addr(
    tl: &Timeline,
    client: &PeerClient,
    donor: &PeerView,
) -> Result<(String, u16, bool), String> {
    let http = PeerAddr::parse(&donor.http)?;
    let status = donor_node_status(client, donor)?;
    let mconf = tl.status().mconf;
    let member = mconf
        .members
        .iter()
        .chain(mconf.new_members.iter().flatten())
        .find(|m| m.id == donor.id);
    if let Some(m) = member {
        return Ok((m.host.clone(), m.pg_port, http.tls));
    }
    Ok((http.host, status.pg_port, http.tls))
}

/// Reads the donor's status again (blocking calls on a blocking thread) and checks it with
/// [`recheck_donor`] and its node id.
async fn verify_donor(
    client: &PeerClient,
    ttid: sk_core::types::TenantTimelineId,
    donor: &PeerView,
    term: Term,
) -> Result<(), String> {
    let (client, donor) = (client.clone(), donor.clone());
    crate::blocking::spawn(move || {
        donor_node_status(&client, &donor)?;
        let fresh = peer_view(&client, ttid, donor.id, &donor.http)?;
        recheck_donor(&donor, &fresh, term)
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Streams the donor's WAL from our start point up to the donor's flush LSN (as its status
/// said) through the timeline's acceptor. Returns the WAL bytes applied.
async fn recover(
    tl: &Arc<Timeline>,
    client: &PeerClient,
    donor: &PeerView,
    cancel: &CancellationToken,
) -> Result<u64, String> {
    // Registered before the check below: a proposer that arrives after it wakes us.
    let proposer = tl.proposer_arrived();
    tokio::pin!(proposer);
    proposer.as_mut().enable();
    if tl.proposer_count() > 0 {
        return Err("a proposer connected".into());
    }
    // Our state as it is now (the peers' answers took a while): still behind this donor?
    let me = &tl.recovery_view();
    check_donor(me, donor).map_err(|why| format!("no longer a donor: {why:?}"))?;
    let start = start_point(me, donor)?;
    if start < me.commit_lsn {
        return Err(format!(
            "the donor's history diverges from ours at {start}, below our commit LSN {}",
            me.commit_lsn
        ));
    }
    let (host, port, tls) = {
        let (tl, client, donor) = (tl.clone(), client.clone(), donor.clone());
        crate::blocking::spawn(move || donor_pg_addr(&tl, &client, &donor))
            .await
            .map_err(|e| e.to_string())??
    };
    let app = format!("safekeeper_{}_recovery", tl.node_id().0);
    let conn = client
        .connect_pg(&host, port, tls, tl.ttid, &app)
        .await
        .map_err(|e| format!("connecting to {host}:{port}: {e}"))?;
    let term = me.term;
    let (mut reader, mut writer) = conn
        .start_copy_both(&format!(
            "START_REPLICATION PHYSICAL {start} (term='{}')",
            term.0
        ))
        .await
        .map_err(|e| format!("{host}:{port}: START_REPLICATION: {e}"))?;

    // The stream is served under `(term='N')`, which checks only the donor's acceptor term:
    // the donor must still hold WAL of term N from its `ProposerElected(N)` on, as when it was
    // chosen (only that WAL may be recovered).
    verify_donor(client, tl.ttid, donor, term).await?;

    let (reply_tx, reply_rx) = mpsc::channel(REPLY_QUEUE_SIZE);
    let (msg_tx, acceptor) = spawn_acceptor(tl.clone(), reply_tx, Source::Recovery);
    let stop = CancellationToken::new();
    let replies = tokio::spawn(watch_replies(reply_rx, term, stop.clone()));
    let generation = donor.elected_generation;
    let elected = ProposerAcceptorMessage::Elected(ProposerElected {
        generation,
        term,
        start_streaming_at: start,
        term_history: donor.term_history.clone(),
    });
    let mut applied = 0u64;
    let mut pos = start;
    let outcome: Result<(), String> = async {
        if !enqueue(&msg_tx, elected).await {
            return Err("the acceptor refused the donor's history".into());
        }
        while pos < donor.flush_lsn {
            // Biased: a proposer that connected wins over WAL that is ready to read.
            let event = tokio::select! {
                biased;
                _ = &mut proposer => return Err("a proposer connected".into()),
                _ = cancel.cancelled() => return Err("shutting down".into()),
                _ = tl.deleted().cancelled() => return Err("the timeline was deleted".into()),
                _ = msg_tx.closed() => return Err("the acceptor stopped".into()),
                _ = stop.cancelled() => return Err("the acceptor refused the session".into()),
                e = reader.read() => e.map_err(|e| format!("{host}:{port}: {e}"))?,
            };
            let frame = match event {
                CopyEvent::Data(d) => d,
                CopyEvent::Done => return Err(format!("{host}:{port} ended the stream")),
            };
            let (wal_start, data): (Lsn, Bytes) = match ReplicationMessage::decode(frame) {
                Ok(ReplicationMessage::XLogData {
                    wal_start, data, ..
                }) => (wal_start, data),
                Ok(ReplicationMessage::Keepalive { .. }) => continue,
                Err(e) => return Err(format!("{host}:{port}: invalid walsender message: {e}")),
            };
            if wal_start != pos {
                return Err(format!(
                    "{host}:{port} sent WAL at {wal_start}, {pos} was expected"
                ));
            }
            let len = data.len() as u64;
            let end = pos
                .0
                .checked_add(len)
                .map(Lsn)
                .filter(|end| *end <= MAX_PEER_LSN)
                .ok_or_else(|| format!("{host}:{port} sent WAL past {MAX_PEER_LSN} at {pos}"))?;
            let append = ProposerAcceptorMessage::AppendRequest(AppendRequest {
                h: AppendRequestHeader {
                    generation,
                    term,
                    begin_lsn: pos,
                    end_lsn: end,
                    commit_lsn: donor.commit_lsn,
                    truncate_lsn: Lsn::INVALID,
                },
                wal_data: data,
            });
            if !enqueue(&msg_tx, append).await {
                return Err("the acceptor stopped".into());
            }
            applied += len;
            metrics::RECOVERY_BYTES.inc_by(len);
            tl.update_recovery(|r| r.bytes += len);
            pos = end;
            if sk_core::failpoint::active("recovery-slow") {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // The commit LSN is capped by the durable end of WAL: make the WAL durable, then move
        // the commit LSN with an empty append.
        let commit = ProposerAcceptorMessage::AppendRequest(AppendRequest {
            h: AppendRequestHeader {
                generation,
                term,
                begin_lsn: pos,
                end_lsn: pos,
                commit_lsn: donor.commit_lsn,
                truncate_lsn: Lsn::INVALID,
            },
            wal_data: Bytes::new(),
        });
        if !enqueue(&msg_tx, ProposerAcceptorMessage::FlushWAL).await {
            return Err("the acceptor stopped".into());
        }
        // The donor's commit LSN is adopted only if the donor is still what it was.
        verify_donor(client, tl.ttid, donor, term).await?;
        if stop.is_cancelled() || !enqueue(&msg_tx, commit).await {
            return Err("the acceptor stopped".into());
        }
        Ok(())
    }
    .await;
    let _ = writer.send_copy_done().await;
    // Closing the queue makes the acceptor flush what it wrote and exit.
    drop(msg_tx);
    if let Err(e) = acceptor.await {
        return Err(format!("the WAL acceptor task failed: {e}"));
    }
    let refused = replies.await.ok().flatten();
    match (outcome, refused) {
        (_, Some(e)) => Err(format!("the acceptor refused the donor's WAL: {e}")),
        (Err(e), None) => Err(e),
        (Ok(()), None) => Ok(applied),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sk_core::protocol::AppendResponse;

    fn hist(entries: &[(u64, u64)]) -> TermHistory {
        TermHistory::from_pairs(entries)
    }

    fn me(term: u64, h: &[(u64, u64)], flush: u64) -> LocalView {
        LocalView {
            term: Term(term),
            term_history: hist(h),
            flush_lsn: Lsn(flush),
            commit_lsn: Lsn(0),
            generation: Generation(0),
        }
    }

    fn peer(id: u64, term: u64, h: &[(u64, u64)], flush: u64) -> PeerView {
        PeerView {
            id: NodeId(id),
            http: format!("127.0.0.1:{id}"),
            term: Term(term),
            term_history: hist(h),
            flush_lsn: Lsn(flush),
            commit_lsn: Lsn(0),
            elected_generation: Generation(0),
        }
    }

    #[test]
    fn only_a_peer_ahead_in_our_term_with_wal_of_that_term_is_a_donor() {
        let m = me(3, &[(1, 100), (3, 500)], 900);
        // Ahead in term 3: the most advanced one is chosen.
        let a = peer(1, 3, &[(1, 100), (3, 500)], 1500);
        let b = peer(2, 3, &[(1, 100), (3, 500)], 2000);
        assert_eq!(
            choose_donor(&m, &[a.clone(), b.clone()]).unwrap().id,
            NodeId(2)
        );
        // Voted for term 3 but holds only older WAL: a tail term 3 may truncate.
        let voted_only = peer(4, 3, &[(1, 100), (2, 400)], 5000);
        assert!(matches!(
            check_donor(&m, &voted_only),
            Err(NotADonor::NotAhead | NotADonor::OtherTerm { .. })
        ));
        // The hazard of `(term='N')` streams: we voted for term 2 and so did the peer, which is
        // ahead in term-1 WAL only (it never got term 2's `ProposerElected`): its tail may be
        // truncated by term 2's proposer, so it is no donor.
        let voted = me(2, &[(1, 100)], 900);
        let ahead_in_older_wal = peer(7, 2, &[(1, 100)], 5000);
        assert!(matches!(
            check_donor(&voted, &ahead_in_older_wal),
            Err(NotADonor::OtherTerm {
                last_log_term: Term(1),
                ..
            })
        ));
        // A newer term than ours: never (we would have to vote first).
        let newer = peer(5, 4, &[(1, 100), (3, 500), (4, 2000)], 2500);
        assert!(matches!(
            check_donor(&m, &newer),
            Err(NotADonor::OtherTerm { .. })
        ));
        // Behind or equal: nothing to fetch.
        assert_eq!(
            check_donor(&m, &peer(6, 3, &[(1, 100), (3, 500)], 900)),
            Err(NotADonor::NotAhead)
        );
        // Elected in another generation than ours.
        let mut other_gen = a.clone();
        other_gen.elected_generation = Generation(2);
        assert!(matches!(
            check_donor(&m, &other_gen),
            Err(NotADonor::OtherGeneration { .. })
        ));
        assert!(choose_donor(&m, &[voted_only, newer, other_gen]).is_none());
    }

    /// Recovery messages queued when a proposer connects are refused under the acceptor lock:
    /// none is applied once the proposer is counted (its stream and recovery's never interleave).
    #[tokio::test]
    async fn recovery_messages_are_refused_once_a_proposer_is_counted() {
        use crate::test_util::{elected_timeline, sim_node};
        const SEG: u64 = 1 << 20;
        let (_sim, _fs, timelines) = sim_node();
        let start = Lsn(SEG);
        let tl = elected_timeline(&timelines, 3, SEG, start);
        let mut g = pg_wal::generator::WalGenerator::new(42, SEG, start).unwrap();
        let mut wal = Vec::new();
        while wal.len() < 20_000 {
            g.append_logical_message(&mut wal, &[7; 300]);
        }
        let before = tl.positions().flush_lsn;
        // Recovery's messages are queued, then the proposer connects before they are processed.
        let (reply_tx, mut reply_rx) = mpsc::channel(REPLY_QUEUE_SIZE);
        let (msg_tx, msg_rx) = mpsc::channel(16);
        let append = |begin: Lsn, piece: &[u8]| {
            ProposerAcceptorMessage::AppendRequest(AppendRequest {
                h: AppendRequestHeader {
                    generation: Generation(0),
                    term: Term(1),
                    begin_lsn: begin,
                    end_lsn: Lsn(begin.0 + piece.len() as u64),
                    commit_lsn: Lsn::INVALID,
                    truncate_lsn: Lsn::INVALID,
                },
                wal_data: Bytes::copy_from_slice(piece),
            })
        };
        for (i, piece) in wal.chunks(4096).enumerate() {
            let begin = Lsn(start.0 + (i * 4096) as u64);
            assert!(enqueue(&msg_tx, append(begin, piece)).await);
        }
        drop(msg_tx);
        let proposer = tl.proposer_guard();
        let acceptor = crate::receive_wal::spawn_acceptor_on(tl.clone(), msg_rx, reply_tx);
        acceptor.await.unwrap();
        let mut refused = None;
        while let Some(out) = reply_rx.recv().await {
            if let Outgoing::Error(e) = out {
                refused.get_or_insert(e.message);
            }
        }
        let refused = refused.expect("recovery's WAL refused");
        assert!(refused.contains("a proposer is connected"), "{refused}");
        assert_eq!(tl.positions().flush_lsn, before, "no recovery WAL applied");
        // Without a proposer, the same message is taken.
        drop(proposer);
        crate::blocking::section(|| tl.process_recovery_msg(&append(start, &wal)))
            .expect("taken with no proposer");
    }

    #[test]
    fn a_donor_is_rechecked_against_what_the_session_began_with() {
        let d = peer(1, 3, &[(1, 100), (3, 500)], 2000);
        let mut fresh = d.clone();
        fresh.flush_lsn = Lsn(3000);
        assert_eq!(recheck_donor(&d, &fresh, Term(3)), Ok(()));
        // It voted for term 4 since: its term moved on.
        let mut voted = fresh.clone();
        voted.term = Term(4);
        assert!(recheck_donor(&d, &voted, Term(3)).is_err());
        // Its history's entry for term 3 is not the one our `ProposerElected` carries.
        let mut moved = fresh.clone();
        moved.term_history = hist(&[(1, 100), (3, 400)]);
        assert!(recheck_donor(&d, &moved, Term(3)).is_err());
        // Newest WAL of an older term (a vote without WAL).
        let mut older = fresh.clone();
        older.term_history = hist(&[(1, 100)]);
        assert!(recheck_donor(&d, &older, Term(3)).is_err());
        // Elected in another generation.
        let mut other_gen = fresh;
        other_gen.elected_generation = Generation(5);
        assert!(recheck_donor(&d, &other_gen, Term(3)).is_err());
    }

    /// A reply in another term than the session's (our term moved on: appends get a term-only
    /// answer) fails the session and stops it, as an error does; replies in its term do not.
    #[tokio::test]
    async fn a_reply_in_another_term_fails_the_session() {
        let reply = |t: u64| {
            Outgoing::Reply(AcceptorProposerMessage::AppendResponse(
                AppendResponse::term_only(Generation(0), Term(t)),
            ))
        };
        let (tx, rx) = mpsc::channel(8);
        let stop = CancellationToken::new();
        tx.send(reply(3)).await.unwrap();
        drop(tx);
        assert_eq!(watch_replies(rx, Term(3), stop.clone()).await, None);
        assert!(!stop.is_cancelled());

        let (tx, rx) = mpsc::channel(8);
        tx.send(reply(3)).await.unwrap();
        tx.send(reply(4)).await.unwrap();
        drop(tx);
        let why = watch_replies(rx, Term(3), stop.clone()).await;
        assert_eq!(why.as_deref(), Some("our term moved on to 4"));
        assert!(stop.is_cancelled());
    }

    #[test]
    fn a_peer_lsn_beyond_sane_bounds_is_refused() {
        assert_eq!(peer_lsn("0/1000000"), Ok(Lsn(1 << 24)));
        assert!(peer_lsn("FFFFFFFF/FFFFFFFF").is_err());
        assert!(peer_lsn("10000000/1").is_err());
        assert!(peer_lsn("not an LSN").is_err());
    }

    #[test]
    fn no_donor_before_we_voted_and_failed_sessions_back_off() {
        // Term 0: no term N, whatever a peer holds.
        let m = me(0, &[], 0);
        assert_eq!(
            check_donor(&m, &peer(1, 0, &[(0, 100)], 2000)),
            Err(NotADonor::NoTerm)
        );
        assert_eq!(
            check_donor(&m, &peer(1, 1, &[(1, 100)], 2000)),
            Err(NotADonor::NoTerm)
        );
        // 1 s, 2 s, 4 s, ... up to 30 s.
        let mut b = Duration::ZERO;
        let mut waits = Vec::new();
        for _ in 0..7 {
            b = next_backoff(b);
            waits.push(b.as_secs());
        }
        assert_eq!(waits, [1, 2, 4, 8, 16, 30, 30]);
    }

    #[test]
    fn the_start_point_cuts_our_divergent_tail() {
        // We hold term 2's WAL, which term 3 never had: it goes, from where term 2 began.
        let m = me(3, &[(1, 100), (2, 400)], 900);
        let d = peer(1, 3, &[(1, 100), (3, 600)], 2000);
        assert_eq!(start_point(&m, &d), Ok(Lsn(400)));
        // Same history: from our end.
        let m = me(3, &[(1, 100), (3, 600)], 900);
        assert_eq!(start_point(&m, &d), Ok(Lsn(900)));
        // Nothing in common (our WAL is empty): the donor's start.
        let m = me(3, &[], 0);
        assert_eq!(start_point(&m, &d), Ok(Lsn(100)));
    }
}
