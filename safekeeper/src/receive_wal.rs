//! `START_WAL_PUSH`: the pipelined WAL acceptor of one proposer connection.
//!
//! Three parts run at once:
//! - the **reader** (this connection's task) decodes CopyData frames into protocol messages and
//!   pushes them into a bounded queue (256 messages: at most 32 MiB of WAL in flight, so a slow
//!   disk back-pressures the proposer instead of growing memory);
//! - the **acceptor** (a blocking thread) runs `process_msg` on each message, writing appends
//!   without syncing; when the queue is empty, and at least once a second under steady load, it
//!   makes the whole batch durable with one `fdatasync` and answers with the new `flush_lsn`; it
//!   flushes once more when the connection ends;
//! - the **writer** (a task) encodes replies and sends them, batching what is queued.
//!
//! A reply only ever carries durable state: `flush_lsn` comes from the WAL store's synced
//! position (see `SafeKeeper::process_msg`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::auth::{Claims, check_permission};
use crate::metrics;
use crate::registry::GlobalTimelines;
use crate::timeline::Timeline;
use pq_proto::PqError;
use pq_proto::server::{ServerConn, ServerReader, ServerWriter};
use pq_proto::{BackendMessage, ErrorFields, FrontendMessage, sqlstate};
use sk_core::protocol::{AcceptorProposerMessage, ProposerAcceptorMessage, ProposerGreeting};
use sk_core::types::TenantTimelineId;

/// Messages queued between the reader and the acceptor.
pub const MSG_QUEUE_SIZE: usize = 256;
/// Replies queued between the acceptor and the writer.
pub const REPLY_QUEUE_SIZE: usize = 16;
/// Under steady load, flush at least this often (each flush answers the proposer).
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// What the writer sends.
#[derive(Debug)]
pub enum Outgoing {
    /// A reply to the proposer.
    Reply(AcceptorProposerMessage),
    /// Ends the stream with an ErrorResponse.
    Error(ErrorFields),
}

/// Who feeds an acceptor pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// A proposer's `START_WAL_PUSH` connection.
    Proposer,
    /// A peer recovery ([`crate::recovery`]): its messages are refused once a proposer is
    /// connected ([`Timeline::process_recovery_msg`]).
    Recovery,
}

/// A message queued for the acceptor, with its WAL byte count (for the queue gauges).
pub type QueuedMsg = (ProposerAcceptorMessage, usize);

/// Starts the acceptor of `tl` on a blocking thread (the middle of the pipeline, without a
/// socket): messages go in through the returned queue (use [`enqueue`]), replies and a fatal
/// error come out on `reply_tx`. Closing the queue makes it flush what it wrote and exit; the
/// handle completes then. Must be called inside a tokio runtime.
pub fn spawn_acceptor(
    tl: Arc<Timeline>,
    reply_tx: mpsc::Sender<Outgoing>,
    source: Source,
) -> (mpsc::Sender<QueuedMsg>, tokio::task::JoinHandle<()>) {
    let (msg_tx, msg_rx) = mpsc::channel(MSG_QUEUE_SIZE);
    // The acceptor logs in the caller's span (the timeline's).
    let span = tracing::Span::current();
    let task = tokio::task::spawn_blocking(move || {
        span.in_scope(|| run_acceptor(&tl, msg_rx, reply_tx, source))
    });
    (msg_tx, task)
}

/// [`spawn_acceptor`] of a recovery on a queue the caller made (a test fills it first).
#[cfg(test)]
pub(crate) fn spawn_acceptor_on(
    tl: Arc<Timeline>,
    msg_rx: mpsc::Receiver<QueuedMsg>,
    reply_tx: mpsc::Sender<Outgoing>,
) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || run_acceptor(&tl, msg_rx, reply_tx, Source::Recovery))
}

/// Queues `msg` for the acceptor, waiting while the queue is full (back-pressure). False if the
/// acceptor has stopped. Cancellation-safe: a cancelled call queued nothing.
pub async fn enqueue(tx: &mpsc::Sender<QueuedMsg>, msg: ProposerAcceptorMessage) -> bool {
    let bytes = wal_len(&msg);
    let Ok(permit) = tx.reserve().await else {
        return false;
    };
    metrics::RECEIVER_QUEUE_DEPTH.inc();
    metrics::RECEIVER_QUEUE_BYTES.add(bytes as i64);
    permit.send((msg, bytes));
    true
}

/// Serves one `START_WAL_PUSH` connection until the proposer disconnects, an error ends it, or
/// `shutdown` is cancelled (then queued messages are still processed and flushed).
pub async fn handle_wal_push<S>(
    mut conn: ServerConn<S>,
    timelines: Arc<GlobalTimelines>,
    conn_ttid: Option<TenantTimelineId>,
    claims: Option<Claims>,
    proto_version: u32,
    allow_creation: bool,
    shutdown: CancellationToken,
) -> Result<(), PqError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if proto_version != 3 {
        conn.send_error(ErrorFields::error(
            sqlstate::FEATURE_NOT_SUPPORTED,
            format!(
                "START_WAL_PUSH: protocol version {proto_version} is not supported; use \
                 (proto_version '3')"
            ),
        ))
        .await?;
        return Ok(());
    }
    conn.send_copy_both_response().await?;
    let (mut reader, mut writer) = conn.split();

    // The greeting picks (or creates) the timeline.
    let greeting = match read_proposer_msg(&mut reader).await {
        Ok(Some(ProposerAcceptorMessage::Greeting(g))) => g,
        Ok(Some(other)) => {
            return end_with_error(
                &mut writer,
                ErrorFields::error(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("the first message must be a greeting, got {}", kind(&other)),
                ),
            )
            .await;
        }
        Ok(None) => return Ok(()),
        Err(ConnEnd::Client(e)) => return end_with_error(&mut writer, e).await,
        Err(ConnEnd::Io(e)) => return Err(e),
    };
    // From here on every log line is about this timeline: its ids are fields of the span.
    let span = crate::timeline::span(&greeting.ttid());
    accept(
        reader,
        writer,
        timelines,
        conn_ttid,
        claims,
        greeting,
        allow_creation,
        shutdown,
    )
    .instrument(span)
    .await
}

/// The rest of a WAL push, once the greeting names the timeline.
#[allow(clippy::too_many_arguments)] // the connection's parts, handed on from the greeting
async fn accept<S>(
    mut reader: ServerReader<ReadHalf<S>>,
    mut writer: ServerWriter<WriteHalf<S>>,
    timelines: Arc<GlobalTimelines>,
    conn_ttid: Option<TenantTimelineId>,
    claims: Option<Claims>,
    greeting: ProposerGreeting,
    allow_creation: bool,
    shutdown: CancellationToken,
) -> Result<(), PqError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    if let Some(ttid) = conn_ttid
        && ttid != greeting.ttid()
    {
        return end_with_error(
            &mut writer,
            ErrorFields::error(
                sqlstate::PROTOCOL_VIOLATION,
                format!(
                    "greeting is for timeline {}, the connection options name {ttid}",
                    greeting.ttid()
                ),
            ),
        )
        .await;
    }
    // A tenant token pushes only to its tenant's timelines.
    if let Some(claims) = &claims
        && let Err(e) = check_permission(claims, Some(greeting.ttid().tenant_id))
    {
        return end_with_error(
            &mut writer,
            ErrorFields::error(sqlstate::INVALID_AUTHORIZATION_SPECIFICATION, e.to_string()),
        )
        .await;
    }
    let tl = {
        let timelines = timelines.clone();
        let greeting = greeting.clone();
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            span.in_scope(|| timelines.get_or_create(&greeting, allow_creation))
        })
        .await
        .map_err(|e| PqError::Io(std::io::Error::other(e)))?
    };
    let tl = match tl {
        Ok(tl) => tl,
        Err(e) => {
            return end_with_error(&mut writer, ErrorFields::error(e.sqlstate(), e.to_string()))
                .await;
        }
    };
    let _counted = tl.proposer_guard();
    tracing::info!("proposer connected");

    let (reply_tx, reply_rx) = mpsc::channel(REPLY_QUEUE_SIZE);
    let (msg_tx, acceptor) = spawn_acceptor(tl.clone(), reply_tx.clone(), Source::Proposer);
    let writer_task = tokio::spawn(run_writer(writer, reply_rx).in_current_span());

    // The greeting goes through the acceptor like every other message, in order.
    let mut next = Some(ProposerAcceptorMessage::Greeting(greeting));
    let result = loop {
        if let Some(msg) = next.take()
            && !enqueue(&msg_tx, msg).await
        {
            break Ok(()); // the acceptor stopped (and said why)
        }
        tokio::select! {
            msg = read_proposer_msg(&mut reader) => match msg {
                Ok(Some(m)) => next = Some(m),
                Ok(None) => break Ok(()),
                Err(ConnEnd::Client(e)) => {
                    let _ = reply_tx.send(Outgoing::Error(e)).await;
                    break Ok(());
                }
                Err(ConnEnd::Io(e)) => break Err(e),
            },
            _ = msg_tx.closed() => break Ok(()),
            _ = shutdown.cancelled() => {
                let _ = reply_tx
                    .send(Outgoing::Error(ErrorFields::fatal(
                        sqlstate::ADMIN_SHUTDOWN,
                        "the safekeeper is shutting down",
                    )))
                    .await;
                break Ok(());
            }
            _ = tl.deleted().cancelled() => {
                let _ = reply_tx
                    .send(Outgoing::Error(ErrorFields::fatal(
                        sqlstate::UNDEFINED_OBJECT,
                        format!("timeline {} was deleted on this safekeeper", tl.ttid),
                    )))
                    .await;
                break Ok(());
            }
        }
    };
    // Closing the queue makes the acceptor flush what it has and exit; then the writer drains.
    drop(msg_tx);
    drop(reply_tx);
    if let Err(e) = acceptor.await {
        tracing::error!("WAL acceptor task failed: {e}");
    }
    match writer_task.await {
        Ok(Err(e)) if result.is_ok() => {
            tracing::debug!("writing to the proposer: {e}");
        }
        Err(e) => tracing::error!("WAL writer task failed: {e}"),
        _ => {}
    }
    tracing::info!(positions = ?tl.positions(), "proposer disconnected");
    result
}

/// How a connection's input ended, other than cleanly.
enum ConnEnd {
    /// The client sent something invalid: tell it why, then close.
    Client(ErrorFields),
    /// The socket failed.
    Io(PqError),
}

/// Reads the next protocol message. `Ok(None)` on a clean end (EOF, Terminate, CopyDone).
/// Cancellation-safe: the underlying read is.
async fn read_proposer_msg<R: AsyncRead + Unpin>(
    reader: &mut ServerReader<R>,
) -> Result<Option<ProposerAcceptorMessage>, ConnEnd> {
    match reader.read_message().await {
        Ok(Some(FrontendMessage::CopyData(frame))) => {
            match ProposerAcceptorMessage::decode(&frame) {
                Ok(
                    ProposerAcceptorMessage::NoFlushAppendRequest(_)
                    | ProposerAcceptorMessage::FlushWAL,
                ) => Err(ConnEnd::Client(ErrorFields::error(
                    sqlstate::PROTOCOL_VIOLATION,
                    "internal-only message received from the network",
                ))),
                Ok(m) => Ok(Some(m)),
                Err(e) => Err(ConnEnd::Client(ErrorFields::error(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("invalid proposer message: {e}"),
                ))),
            }
        }
        Ok(Some(FrontendMessage::CopyDone | FrontendMessage::Terminate)) | Ok(None) => Ok(None),
        Ok(Some(FrontendMessage::CopyFail(reason))) => {
            tracing::info!("proposer aborted the stream: {reason}");
            Ok(None)
        }
        Ok(Some(other)) => Err(ConnEnd::Client(ErrorFields::error(
            sqlstate::PROTOCOL_VIOLATION,
            format!("unexpected message during START_WAL_PUSH: {other:?}"),
        ))),
        Err(PqError::Protocol(e)) => Err(ConnEnd::Client(e.to_error_fields())),
        Err(e) => Err(ConnEnd::Io(e)),
    }
}

fn kind(m: &ProposerAcceptorMessage) -> &'static str {
    match m {
        ProposerAcceptorMessage::Greeting(_) => "greeting",
        ProposerAcceptorMessage::VoteRequest(_) => "vote_request",
        ProposerAcceptorMessage::Elected(_) => "elected",
        ProposerAcceptorMessage::AppendRequest(_) => "append",
        ProposerAcceptorMessage::NoFlushAppendRequest(_) => "append_noflush",
        ProposerAcceptorMessage::FlushWAL => "flush",
    }
}

fn wal_len(m: &ProposerAcceptorMessage) -> usize {
    match m {
        ProposerAcceptorMessage::AppendRequest(a) => a.wal_data.len(),
        _ => 0,
    }
}

/// The acceptor loop (blocking thread). Returns when the queue closes or an error ends the
/// connection; flushes written WAL before returning.
fn run_acceptor(
    tl: &Timeline,
    mut rx: mpsc::Receiver<QueuedMsg>,
    tx: mpsc::Sender<Outgoing>,
    source: Source,
) {
    let mut dirty = false;
    let mut last_flush = Instant::now();
    loop {
        let (msg, bytes) = match rx.try_recv() {
            Ok(m) => m,
            Err(TryRecvError::Empty) => {
                // The queue drained: one fdatasync covers the whole batch.
                if dirty && !flush(tl, &tx, &mut dirty, &mut last_flush) {
                    break;
                }
                match rx.blocking_recv() {
                    Some(m) => m,
                    None => break,
                }
            }
            Err(TryRecvError::Disconnected) => break,
        };
        metrics::RECEIVER_QUEUE_DEPTH.dec();
        metrics::RECEIVER_QUEUE_BYTES.sub(bytes as i64);
        let label = kind(&msg);
        let msg = match msg {
            ProposerAcceptorMessage::AppendRequest(a) => {
                dirty = true;
                metrics::WAL_WRITTEN_BYTES.inc_by(a.wal_data.len() as u64);
                ProposerAcceptorMessage::NoFlushAppendRequest(a)
            }
            other => other,
        };
        let result = match source {
            Source::Proposer => tl.process_msg(&msg),
            Source::Recovery => tl.process_recovery_msg(&msg),
        };
        match result {
            Ok(reply) => {
                metrics::count_proposer_message(label, true);
                if let Some(reply) = reply
                    && tx.blocking_send(Outgoing::Reply(reply)).is_err()
                {
                    break;
                }
            }
            Err(e) => {
                metrics::count_proposer_message(label, false);
                tracing::warn!("{label} refused: {e}");
                let _ = tx.blocking_send(Outgoing::Error(ErrorFields::error(
                    sqlstate::INTERNAL_ERROR,
                    e.to_string(),
                )));
                break;
            }
        }
        if dirty
            && last_flush.elapsed() >= FLUSH_INTERVAL
            && !flush(tl, &tx, &mut dirty, &mut last_flush)
        {
            break;
        }
    }
    // Whatever was written is made durable before the connection is gone (neon #9259).
    if dirty {
        flush(tl, &tx, &mut dirty, &mut last_flush);
    }
    // Messages left in the queue will not be processed: keep the gauges right.
    rx.close();
    while let Ok((_, bytes)) = rx.try_recv() {
        metrics::RECEIVER_QUEUE_DEPTH.dec();
        metrics::RECEIVER_QUEUE_BYTES.sub(bytes as i64);
    }
}

/// Makes written WAL durable and queues the reply that says so. False if the connection must
/// end.
fn flush(tl: &Timeline, tx: &mpsc::Sender<Outgoing>, dirty: &mut bool, last: &mut Instant) -> bool {
    let started = Instant::now();
    let result = tl.process_msg(&ProposerAcceptorMessage::FlushWAL);
    metrics::WAL_FLUSH_SECONDS.observe(started.elapsed().as_secs_f64());
    metrics::WAL_FLUSHES.inc();
    *dirty = false;
    *last = Instant::now();
    match result {
        Ok(Some(reply)) => {
            // A closed reply queue is fine here: the WAL is durable either way.
            let _ = tx.blocking_send(Outgoing::Reply(reply));
            true
        }
        Ok(None) => true,
        Err(e) => {
            tracing::error!("flushing WAL: {e}");
            let _ = tx.blocking_send(Outgoing::Error(ErrorFields::error(
                sqlstate::INTERNAL_ERROR,
                format!("flushing WAL: {e}"),
            )));
            false
        }
    }
}

/// Sends replies until the queue closes or an error reply ends the stream.
async fn run_writer<W: AsyncWrite + Unpin>(
    mut writer: ServerWriter<W>,
    mut rx: mpsc::Receiver<Outgoing>,
) -> Result<(), PqError> {
    let mut buf = BytesMut::with_capacity(256);
    while let Some(out) = rx.recv().await {
        let mut next = Some(out);
        // Batch whatever is queued into one socket write.
        while let Some(out) = next.take() {
            match out {
                Outgoing::Reply(reply) => {
                    buf.clear();
                    if let Err(e) = reply.encode(&mut buf) {
                        tracing::error!("encoding a reply: {e}");
                        return Ok(());
                    }
                    writer.write_copy_data(&[&buf]);
                }
                Outgoing::Error(e) => {
                    writer.write_message(&BackendMessage::ErrorResponse(e));
                    writer.flush().await?;
                    writer.shutdown().await?;
                    return Ok(());
                }
            }
            next = rx.try_recv().ok();
        }
        writer.flush().await?;
    }
    Ok(())
}

/// Ends the stream with an error the client can read.
async fn end_with_error<W: AsyncWrite + Unpin>(
    writer: &mut ServerWriter<W>,
    e: ErrorFields,
) -> Result<(), PqError> {
    tracing::warn!("ending WAL push: {}", e.message);
    writer.write_message(&BackendMessage::ErrorResponse(e));
    writer.flush().await?;
    writer.shutdown().await
}
