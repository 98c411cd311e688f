//! `START_REPLICATION`: the walsender that serves WAL to PostgreSQL readers (`pg_receivewal`, a
//! standby's walreceiver) and to proposers recovering WAL (`(term='N')`).
//!
//! Readers get committed WAL only: a standby cannot un-apply WAL that a later election
//! truncates. With `(term='N')` the walsender serves up to the durable `flush_lsn` instead,
//! while the local term stays N (a proposer fetching the donor's WAL).
//!
//! WAL goes out in XLogData messages of at most 128 KiB, cut at page boundaries like
//! PostgreSQL's walsender; an idle stream gets a keepalive every second; a status update that
//! asks for a reply gets one at once; CopyDone ends streaming and returns to query mode.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

use crate::metrics;
use crate::timeline::{Positions, Timeline};
use crate::wal_store::segment_path;
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
    let oldest = tl.oldest_available_lsn();
    if start < oldest || !segment_exists(&tl, start) {
        conn.send_error(ErrorFields::error(
            sqlstate::UNDEFINED_OBJECT,
            format!(
                "requested WAL segment {} has already been removed",
                xlog_file_name(1, start.segment_number(tl.seg_size), tl.seg_size)
            ),
        ))
        .await?;
        return Ok(StreamEnd::CopyDone(conn));
    }

    let _counted = tl.reader_guard();
    conn.send_copy_both_response().await?;
    let (mut reader, mut writer) = conn.split();
    tracing::info!(ttid = %tl.ttid, %start, ?term, "streaming WAL");
    let result = stream(&mut reader, &mut writer, &tl, start, term, shutdown).await;
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

fn end_of(pos: &Positions, term: Option<Term>) -> Lsn {
    if term.is_some() {
        pos.flush_lsn
    } else {
        pos.commit_lsn
    }
}

fn segment_exists(tl: &Timeline, lsn: Lsn) -> bool {
    let segno = lsn.segment_number(tl.seg_size);
    [false, true]
        .into_iter()
        .any(|partial| segment_path(&tl.dir, segno, tl.seg_size, partial).exists())
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

/// The streaming loop. `Ok(true)`: the client sent CopyDone; `Ok(false)`: it went away.
async fn stream<R, W>(
    reader: &mut ServerReader<R>,
    writer: &mut ServerWriter<W>,
    tl: &Arc<Timeline>,
    mut pos: Lsn,
    term: Option<Term>,
    shutdown: tokio_util::sync::CancellationToken,
) -> Result<bool, Ending>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
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
            return Err(Ending::Error(ErrorFields::error(
                sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                format!(
                    "term changed from {t} to {}: ending WAL recovery stream",
                    now.term
                ),
            )));
        }
        let end = end_of(&now, term);
        let have_wal = pos < end;
        tokio::select! {
            biased;
            msg = reader.read_message() => {
                match msg? {
                    Some(FrontendMessage::CopyData(d)) => match StandbyMessage::decode(d) {
                        Ok(StandbyMessage::StatusUpdate { reply_requested, .. }) => {
                            if reply_requested {
                                writer.write_keepalive(end, pg_now(), false);
                                writer.flush().await?;
                            }
                        }
                        Ok(_) => {} // hot-standby and pageserver feedback: not used yet
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
                let read = {
                    let tl = tl.clone();
                    let mut b = std::mem::take(&mut buf);
                    tokio::task::spawn_blocking(move || {
                        let r = tl.read_wal(pos, chunk_end, &mut b);
                        (r, b)
                    })
                    .await
                    .map_err(|e| Ending::Io(PqError::Io(std::io::Error::other(e))))?
                };
                buf = read.1;
                if let Err(e) = read.0 {
                    tracing::error!(ttid = %tl.ttid, "reading WAL at {pos}: {e}");
                    return Err(Ending::Error(ErrorFields::error(
                        sqlstate::INTERNAL_ERROR,
                        format!("could not read WAL at {pos}"),
                    )));
                }
                writer.write_xlog_data(pos, end, pg_now(), &buf);
                writer.flush().await?;
                metrics::WAL_SENT_BYTES.inc_by(buf.len() as u64);
                pos = chunk_end;
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
                writer.flush().await?;
            }
            _ = shutdown.cancelled() => {
                return Err(Ending::Error(ErrorFields::fatal(
                    sqlstate::ADMIN_SHUTDOWN,
                    "the safekeeper is shutting down",
                )));
            }
        }
    }
}
