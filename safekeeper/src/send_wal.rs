//! `START_REPLICATION`: the walsender that serves WAL to PostgreSQL readers (`pg_receivewal`, a
//! standby's walreceiver) and to proposers recovering WAL (`(term='N')`).
//!
//! Readers get committed WAL only: a standby cannot un-apply WAL that a later election
//! truncates. With `(term='N')` the walsender serves up to the durable `flush_lsn` instead,
//! while the local term stays N (a proposer fetching the donor's WAL).
//!
//! A `(term='N')` reader checks the term at the top of every loop *and* under the acceptor lock
//! around each read ([`Timeline::read_wal_in_term`]): a new term's truncation takes that lock, so
//! it cannot slip between the check and the read and have old-term bytes sent.
//!
//! WAL below this node's local WAL (removed after backup) is served from remote storage in
//! bounded ranges counted against the node's read budget ([`RemoteReader`]). Readers hold no
//! local WAL against removal (removal only takes what the store holds, so a reader whose
//! segment goes mid-stream carries on from the store), unless `--max-reader-hold` is set: then a
//! reader holds its local WAL while it is at most that far behind the flush LSN, and one that
//! falls further behind is cut with an error that says so.
//!
//! WAL goes out in XLogData messages of at most 128 KiB, cut at page boundaries like
//! PostgreSQL's walsender; an idle stream gets a keepalive every second; a status update that
//! asks for a reply gets one at once; CopyDone ends streaming and returns to query mode. What a
//! reader of committed WAL reports back (status updates, hot-standby feedback) is noted in the
//! timeline's [`crate::feedback`] while it streams.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite};

use crate::feedback::{ReaderHandle, ReaderInfo};
use crate::metrics;
use crate::remove_wal::ReadHold;
use crate::timeline::{Positions, TermRead, Timeline};
use crate::wal_backup::RemoteReader;
use pg_wal::format::xlog_file_name;
use pq_proto::replication::StandbyMessage;
use pq_proto::server::{ServerConn, ServerReader, ServerWriter};
use pq_proto::{BackendMessage, ErrorFields, FrontendMessage, sqlstate};
use pq_proto::{PqError, pg_now};
use sk_core::protocol::MAX_SEND_SIZE;
use sk_core::types::{Lsn, Term};

/// Keepalive period of an idle stream.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);

/// How a walsender stream ended.
pub enum StreamEnd<S> {
    /// The client sent CopyDone: the connection is back in query mode.
    CopyDone(ServerConn<S>),
    /// The client went away (EOF or Terminate).
    Closed,
}

/// Checks the request and streams WAL from `start` until the client ends the stream.
pub async fn handle_start_replication<S>(
    mut conn: ServerConn<S>,
    tl: Arc<Timeline>,
    start: Lsn,
    term: Option<Term>,
    reader: ReaderInfo,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<StreamEnd<S>, PqError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let pos = tl.positions();
    if let Some(t) = term
        && pos.term != t
    {
        conn.send_error(ErrorFields::error(
            sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!(
                "requested term {t} differs from the current term {}",
                pos.term
            ),
        ))
        .await?;
        return Ok(StreamEnd::CopyDone(conn));
    }
    let end = end_of(&pos, term);
    if start > end {
        conn.send_error(ErrorFields::error(
            sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
            format!(
                "requested starting point {start} is ahead of the WAL flush position of this \
                 server {end}"
            ),
        ))
        .await?;
        return Ok(StreamEnd::CopyDone(conn));
    }
    // Below the local WAL (removed after backup), the segment comes from remote storage: a
    // HEAD request says whether it is there; nothing is downloaded before the stream starts.
    let local = start >= tl.oldest_available_lsn() && tl.has_segment_at(start);
    if !local {
        let stored = RemoteReader::probe(&tl, start).await;
        if !matches!(stored, Ok(true)) {
            if let Err(e) = stored {
                tracing::warn!("looking for WAL at {start} in remote storage: {e:#}");
            }
            conn.send_error(removed_error(&tl, start)).await?;
            return Ok(StreamEnd::CopyDone(conn));
        }
    }

    let _counted = tl.reader_guard();
    // A proposer fetching its term's WAL is not a reader of committed WAL: it reports nothing.
    let feedback = term.is_none().then(|| tl.register_reader(reader, start));
    conn.send_copy_both_response().await?;
    let (mut reader, mut writer) = conn.split();
    tracing::info!(%start, ?term, "streaming WAL");
    let result = stream(
        &mut reader,
        &mut writer,
        &tl,
        (start, feedback.as_ref()),
        term,
        shutdown,
    )
    .await;
    match result {
        Ok(true) => {
            // CopyDone from the client: answer it and go back to query mode.
            writer.write_message(&BackendMessage::CopyDone);
            writer.write_message(&BackendMessage::CommandComplete("START_STREAMING".into()));
            writer.write_message(&BackendMessage::ReadyForQuery(
                pq_proto::backend::TransactionStatus::Idle,
            ));
            writer.flush().await?;
            Ok(StreamEnd::CopyDone(reader.unsplit(writer)))
        }
        Ok(false) => Ok(StreamEnd::Closed),
        Err(Ending::Error(e)) => {
            writer.write_message(&BackendMessage::ErrorResponse(e));
            writer.flush().await?;
            writer.shutdown().await?;
            Ok(StreamEnd::Closed)
        }
        Err(Ending::Io(e)) => Err(e),
    }
}

/// PostgreSQL's error for WAL that is neither local nor in remote storage.
fn removed_error(tl: &Timeline, lsn: Lsn) -> ErrorFields {
    ErrorFields::error(
        sqlstate::UNDEFINED_OBJECT,
        format!(
            "requested WAL segment {} has already been removed",
            xlog_file_name(1, lsn.segment_number(tl.seg_size), tl.seg_size)
        ),
    )
}

fn end_of(pos: &Positions, term: Option<Term>) -> Lsn {
    if term.is_some() {
        pos.flush_lsn
    } else {
        pos.commit_lsn
    }
}

/// The error that ends a `(term='N')` stream once the acceptor's term is `now`.
fn term_changed(was: Term, now: Term) -> Ending {
    Ending::Error(ErrorFields::error(
        sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!("term changed from {was} to {now}: ending WAL recovery stream"),
    ))
}

enum Ending {
    /// End the stream with this error.
    Error(ErrorFields),
    Io(PqError),
}

impl From<PqError> for Ending {
    fn from(e: PqError) -> Self {
        Ending::Io(e)
    }
}

/// Flushes what `writer` buffered for a reader at `pos`. A reader that stopped reading blocks
/// the flush: if it holds local WAL (`hold`), the hold is released once the end of WAL is more
/// than `max_hold` bytes past `pos` (removal would otherwise wait for it without bound); the
/// flush goes on (the reader carries on from the store when it reads again).
async fn flush_holding<W: AsyncWrite + Unpin>(
    writer: &mut ServerWriter<W>,
    watch: &mut tokio::sync::watch::Receiver<Positions>,
    pos: Lsn,
    max_hold: u64,
    hold: &mut Option<ReadHold>,
) -> Result<(), PqError> {
    if hold.is_none() {
        return writer.flush().await;
    }
    let past_limit = async {
        while watch.changed().await.is_ok() {
            if watch.borrow().flush_lsn.0.saturating_sub(pos.0) > max_hold {
                return;
            }
        }
        std::future::pending::<()>().await
    };
    tokio::select! {
        r = writer.flush() => return r,
        () = past_limit => {}
    }
    *hold = None;
    tracing::warn!(
        %pos,
        "a reader that stopped reading is more than --max-reader-hold {max_hold} bytes behind \
         the end of WAL: its hold on local WAL is released"
    );
    // Cancellation-safe: the unsent bytes stayed buffered.
    writer.flush().await
}

/// The streaming loop from `pos`, noting what is sent and what the reader reports in
/// `feedback`. `Ok(true)`: the client sent CopyDone; `Ok(false)`: it went away.
async fn stream<R, W>(
    reader: &mut ServerReader<R>,
    writer: &mut ServerWriter<W>,
    tl: &Arc<Timeline>,
    (mut pos, feedback): (Lsn, Option<&ReaderHandle>),
    term: Option<Term>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<bool, Ending>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut remote = RemoteReader::default();
    // The local WAL this reader holds against removal: only with --max-reader-hold, and only
    // while it is within it of the flush LSN.
    let max_hold = tl.remote().map_or(0, |r| r.max_reader_hold());
    let mut hold = None;
    let mut watch = tl.subscribe();
    let mut buf = Vec::with_capacity(MAX_SEND_SIZE);
    let mut keepalive = tokio::time::interval(KEEPALIVE_INTERVAL);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    keepalive.reset();
    loop {
        let now = *watch.borrow_and_update();
        if let Some(t) = term
            && now.term != t
        {
            return Err(term_changed(t, now.term));
        }
        let end = end_of(&now, term);
        let have_wal = pos < end;
        tokio::select! {
            biased;
            msg = reader.read_message() => {
                match msg? {
                    Some(FrontendMessage::CopyData(d)) => match StandbyMessage::decode(d) {
                        Ok(StandbyMessage::StatusUpdate {
                            write,
                            flush,
                            apply,
                            send_time,
                            reply_requested,
                        }) => {
                            if let Some(f) = feedback {
                                f.status_update([write, flush, apply], send_time, Instant::now());
                            }
                            if reply_requested {
                                writer.write_keepalive(end, pg_now(), false);
                                writer.flush().await?;
                            }
                        }
                        Ok(StandbyMessage::HotStandbyFeedback {
                            send_time,
                            xmin,
                            epoch,
                            catalog_xmin,
                            catalog_epoch,
                        }) => {
                            if let Some(f) = feedback {
                                f.hs_feedback(send_time, (xmin, epoch), (catalog_xmin, catalog_epoch));
                            }
                        }
                        Ok(StandbyMessage::NeonFeedback(_)) => {} // a pageserver's: not used
                        Err(e) => {
                            return Err(Ending::Error(ErrorFields::error(
                                sqlstate::PROTOCOL_VIOLATION,
                                format!("invalid standby message: {e}"),
                            )));
                        }
                    },
                    Some(FrontendMessage::CopyDone) => return Ok(true),
                    // A walreceiver that gives up sends Terminate inside the copy.
                    Some(FrontendMessage::Terminate) | None => return Ok(false),
                    Some(other) => {
                        return Err(Ending::Error(ErrorFields::error(
                            sqlstate::PROTOCOL_VIOLATION,
                            format!("unexpected message while streaming: {other:?}"),
                        )));
                    }
                }
            }
            _ = std::future::ready(()), if have_wal => {
                let mut chunk_end = Lsn(pos.0.saturating_add(MAX_SEND_SIZE as u64).min(end.0));
                if chunk_end < end {
                    // Like PostgreSQL's walsender: cut at a page boundary when more follows.
                    let page_end = chunk_end.page_start();
                    if page_end > pos {
                        chunk_end = page_end;
                    }
                }
                buf.clear();
                if max_hold > 0 {
                    let behind = now.flush_lsn.0.saturating_sub(pos.0);
                    if behind > max_hold && hold.is_some() {
                        return Err(Ending::Error(ErrorFields::error(
                            sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                            format!(
                                "this reader is {behind} bytes behind the end of WAL, more than \
                                 --max-reader-hold {max_hold}: its hold on local WAL is released \
                                 and the stream ended (reconnect to be served from remote storage)"
                            ),
                        )));
                    }
                    if hold.is_none() && behind <= max_hold {
                        hold = tl.hold_wal(pos);
                    }
                }
                let removed = pos.segment_number(tl.seg_size) < tl.removed_below();
                if removed {
                    // Removed here after backup: served from remote storage.
                    match remote.read(tl, pos, chunk_end, &mut buf).await {
                        Ok(Some(e)) => chunk_end = e,
                        other => {
                            if let Err(e) = other {
                                tracing::error!("reading WAL at {pos} from remote storage: {e:#}");
                            }
                            return Err(Ending::Error(removed_error(tl, pos)));
                        }
                    }
                } else {
                    remote.release();
                    let read = {
                        let tl = tl.clone();
                        let mut b = std::mem::take(&mut buf);
                        crate::blocking::spawn(move || {
                            #[cfg(test)]
                            tl.run_before_wal_read_hook();
                            // A (term='N') reader's term check covers its read: both happen under
                            // the acceptor lock, so a new term cannot truncate the range between.
                            let r = match term {
                                Some(t) => tl.read_wal_in_term(t, None, pos, chunk_end, &mut b),
                                None => tl.read_wal(pos, chunk_end, &mut b).map(|()| TermRead::Read),
                            };
                            (r, b)
                        })
                        .await
                        .map_err(|e| Ending::Io(PqError::Io(std::io::Error::other(e))))?
                    };
                    buf = read.1;
                    match read.0 {
                        Ok(TermRead::Read) => {}
                        Ok(TermRead::TermChanged(now)) => {
                            return Err(term_changed(term.unwrap_or(now), now));
                        }
                        // Truncated in the same term (a new history in it): look at the
                        // positions again.
                        Ok(TermRead::Truncated(_) | TermRead::LogTermChanged(_)) => continue,
                        // Removed while it was read (no hold keeps it): from the store next.
                        Err(_) if pos.segment_number(tl.seg_size) < tl.removed_below() => continue,
                        Err(e) => {
                            tracing::error!("reading WAL at {pos}: {e}");
                            return Err(Ending::Error(ErrorFields::error(
                                sqlstate::INTERNAL_ERROR,
                                format!("could not read WAL at {pos}"),
                            )));
                        }
                    }
                }
                writer.write_xlog_data(pos, end, pg_now(), &buf);
                flush_holding(writer, &mut watch, pos, max_hold, &mut hold).await?;
                metrics::WAL_SENT_BYTES.inc_by(buf.len() as u64);
                pos = chunk_end;
                if let Some(f) = feedback {
                    f.sent(pos, Instant::now());
                }
                if let Some(h) = &hold {
                    h.advance(pos);
                }
                keepalive.reset();
            }
            changed = watch.changed(), if !have_wal => {
                if changed.is_err() {
                    return Err(Ending::Error(ErrorFields::fatal(
                        sqlstate::ADMIN_SHUTDOWN,
                        "timeline is shutting down",
                    )));
                }
            }
            _ = keepalive.tick() => {
                writer.write_keepalive(end, pg_now(), true);
                flush_holding(writer, &mut watch, pos, max_hold, &mut hold).await?;
            }
            _ = shutdown.cancelled() => {
                return Err(Ending::Error(ErrorFields::fatal(
                    sqlstate::ADMIN_SHUTDOWN,
                    "the safekeeper is shutting down",
                )));
            }
            _ = tl.deleted().cancelled() => {
                return Err(Ending::Error(ErrorFields::fatal(
                    sqlstate::UNDEFINED_OBJECT,
                    format!("timeline {} was deleted on this safekeeper", tl.ttid),
                )));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::BytesMut;
    use pg_wal::generator::WalGenerator;
    use pq_proto::backend::decode_backend;
    use pq_proto::replication::ReplicationMessage;
    use pq_proto::server::ServerConfig;
    use sk_core::protocol::ProposerAcceptorMessage;
    use tokio::io::AsyncReadExt;

    use super::*;
    use crate::test_util::{elect_and_append, greeting, run, sim_node};

    const SEG: u64 = 1 << 20;

    /// A new term truncates and rewrites the WAL while a `(term='1')` walsender is between its
    /// term check and its read (a test hook runs there). The reader must get only term 1's
    /// bytes, and the stream must end with an error naming the term change.
    #[tokio::test]
    async fn a_term_reader_never_gets_wal_a_new_term_wrote_after_its_check() {
        let (_sim, _fs, timelines) = sim_node();
        let greeting = greeting(2, SEG);
        let tl = timelines.get_or_create(&greeting, true).unwrap();
        run(&tl, ProposerAcceptorMessage::Greeting(greeting));

        // Term 1: 200 kB of WAL from the start of segment 1.
        let start = Lsn(SEG);
        let mut g1 = WalGenerator::new(42, SEG, start).unwrap();
        let mut term1 = Vec::new();
        let mut ends = Vec::new();
        while term1.len() < 200_000 {
            ends.push(g1.append_logical_message(&mut term1, &[1; 300]));
        }
        elect_and_append(&tl, 1, &[(1, start)], &term1);
        assert_eq!(tl.positions().flush_lsn, g1.lsn());

        // Term 2 keeps term 1's WAL up to a record boundary 20 kB in, then writes its own.
        let cut = ends.iter().find(|p| p.end.0 >= start.0 + 20_000).unwrap();
        let mut g2 = WalGenerator::new(42, SEG, cut.end)
            .unwrap()
            .with_prev(cut.start);
        let mut term2 = Vec::new();
        while term2.len() < 200_000 {
            g2.append_logical_message(&mut term2, &[2; 300]);
        }
        let hook_tl = Arc::downgrade(&tl);
        let cut_end = cut.end;
        *tl.before_wal_read.lock().unwrap() = Some(Box::new(move || {
            let tl = hook_tl.upgrade().expect("the timeline is alive");
            elect_and_append(&tl, 2, &[(1, start), (2, cut_end)], &term2);
        }));

        let (mut client, server) = tokio::io::duplex(1 << 20);
        let conn = ServerConn::new(server, ServerConfig::default());
        let walsender = tokio::spawn(handle_start_replication(
            conn,
            tl.clone(),
            start,
            Some(Term(1)),
            ReaderInfo::default(),
            tokio_util::sync::CancellationToken::new(),
        ));
        let mut buf = BytesMut::new();
        let mut error = None;
        let mut served = start;
        tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                let msg = match decode_backend(&mut buf, 1 << 20).unwrap() {
                    Some(m) => m,
                    None => {
                        let n = client.read_buf(&mut buf).await.unwrap();
                        if n == 0 {
                            return;
                        }
                        continue;
                    }
                };
                match msg {
                    BackendMessage::CopyData(d) => {
                        if let Ok(ReplicationMessage::XLogData {
                            wal_start, data, ..
                        }) = ReplicationMessage::decode(d)
                        {
                            let off = (wal_start.0 - start.0) as usize;
                            assert!(
                                data[..] == term1[off..off + data.len()],
                                "the term 1 reader got bytes [{wal_start}, +{}) that are not \
                                 term 1's WAL",
                                data.len()
                            );
                            served = Lsn(wal_start.0 + data.len() as u64);
                        }
                    }
                    BackendMessage::ErrorResponse(e) => {
                        error = Some(e.message);
                        return;
                    }
                    _ => {}
                }
            }
        })
        .await
        .expect("the stream ends");
        let error = error.expect("the stream ends with an error");
        assert!(error.contains("term changed"), "{error}");
        assert!(served <= cut_end, "served up to {served}");
        walsender.await.unwrap().unwrap();
    }
}
