//! `START_WAL_PUSH`: the WAL acceptor of one proposer connection.
//!
//! A proposer's connection moves, once it has sent `START_WAL_PUSH`, to a thread of its own
//! running a single-threaded tokio runtime ([`Rebind`]: the socket and its idle timers are
//! registered with that runtime). That thread does everything for the connection: it reads and
//! decodes frames, runs `process_msg` on each, writing appends without syncing; when no further
//! message has arrived (and at least once a second under steady load) it makes the whole batch
//! durable with one `fdatasync` and writes the reply carrying the new `flush_lsn` straight to
//! the socket; it flushes once more when the connection ends. So a single commit costs one
//! read, one write, one `fdatasync` and one reply, and the kernel wakes the thread that does
//! them, with no hand-off between threads on the way; a fast proposer's messages wait in the
//! socket's buffer while an `fdatasync` runs and are taken as one batch after it (a slow disk
//! back-pressures the proposer through TCP instead of growing memory).
//!
//! The same acceptor loop ([`Link`]) also runs without a socket, behind a bounded queue
//! ([`spawn_acceptor`]: peer recovery, the benches).
//!
//! A reply only ever carries durable state: `flush_lsn` comes from the WAL store's synced
//! position (see `SafeKeeper::process_msg`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use futures::FutureExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TryRecvError;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::auth::{Claims, check_permission};
use crate::limits::Rebind;
use crate::metrics;
use crate::registry::GlobalTimelines;
use crate::timeline::Timeline;
use pq_proto::PqError;
use pq_proto::server::ServerConn;
use pq_proto::{BackendMessage, ErrorFields, FrontendMessage, sqlstate};
use sk_core::protocol::{AcceptorProposerMessage, ProposerAcceptorMessage, ProposerGreeting};
use sk_core::types::TenantTimelineId;

/// Messages queued for an acceptor without a socket ([`spawn_acceptor`]).
pub const MSG_QUEUE_SIZE: usize = 256;
/// Replies queued by an acceptor without a socket.
pub const REPLY_QUEUE_SIZE: usize = 16;
/// Under steady load, flush at least this often (each flush answers the proposer).
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

/// What the acceptor sends.
#[derive(Debug)]
pub enum Outgoing {
    /// A reply to the proposer.
    Reply(AcceptorProposerMessage),
    /// Ends the stream with an ErrorResponse.
    Error(ErrorFields),
}

/// Who feeds an acceptor.
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

/// What the acceptor reads next.
enum Input {
    /// A message to process.
    Msg(ProposerAcceptorMessage),
    /// The stream ends: cleanly, or with an error to send once written WAL is flushed.
    End(Option<ErrorFields>),
}

/// What an acceptor reads from and answers to: a proposer's socket or a queue.
trait Link {
    /// The next input if it is already here; `None` if waiting would be needed.
    fn try_next(&mut self) -> Option<Input>;
    /// Waits for the next input.
    async fn next(&mut self) -> Input;
    /// Sends a reply at once, or the error that ends the stream. False if the other side is
    /// gone.
    async fn send(&mut self, out: Outgoing) -> bool;
}

/// Starts the acceptor of `tl` on a blocking thread, behind a queue instead of a socket:
/// messages go in through the returned queue (use [`enqueue`]), replies and a fatal error come
/// out on `reply_tx`. Closing the queue makes it flush what it wrote and exit; the handle
/// completes then. Must be called inside a tokio runtime.
pub fn spawn_acceptor(
    tl: Arc<Timeline>,
    reply_tx: mpsc::Sender<Outgoing>,
    source: Source,
) -> (mpsc::Sender<QueuedMsg>, tokio::task::JoinHandle<()>) {
    let (msg_tx, msg_rx) = mpsc::channel(MSG_QUEUE_SIZE);
    let task = spawn_queue_acceptor(tl, msg_rx, reply_tx, source);
    (msg_tx, task)
}

/// [`spawn_acceptor`] of a recovery on a queue the caller made (a test fills it first).
#[cfg(test)]
pub(crate) fn spawn_acceptor_on(
    tl: Arc<Timeline>,
    msg_rx: mpsc::Receiver<QueuedMsg>,
    reply_tx: mpsc::Sender<Outgoing>,
) -> tokio::task::JoinHandle<()> {
    spawn_queue_acceptor(tl, msg_rx, reply_tx, Source::Recovery)
}

fn spawn_queue_acceptor(
    tl: Arc<Timeline>,
    rx: mpsc::Receiver<QueuedMsg>,
    tx: mpsc::Sender<Outgoing>,
    source: Source,
) -> tokio::task::JoinHandle<()> {
    // The acceptor logs in the caller's span (the timeline's).
    let span = tracing::Span::current();
    crate::blocking::spawn(move || {
        let mut link = QueueLink { rx, tx };
        // A queue needs no I/O driver: the plain executor parks this thread between messages.
        span.in_scope(|| futures::executor::block_on(run_acceptor(&tl, &mut link, source)));
    })
}

/// An acceptor's queues ([`spawn_acceptor`]).
struct QueueLink {
    rx: mpsc::Receiver<QueuedMsg>,
    tx: mpsc::Sender<Outgoing>,
}

impl QueueLink {
    fn taken(&self, (msg, bytes): QueuedMsg) -> Input {
        dequeued(bytes);
        Input::Msg(msg)
    }
}

/// Keeps the queue gauges right when a message of `bytes` WAL bytes leaves the queue.
fn dequeued(bytes: usize) {
    metrics::RECEIVER_QUEUE_DEPTH.dec();
    metrics::RECEIVER_QUEUE_BYTES.sub(bytes as i64);
}

impl Link for QueueLink {
    fn try_next(&mut self) -> Option<Input> {
        match self.rx.try_recv() {
            Ok(m) => Some(self.taken(m)),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(Input::End(None)),
        }
    }

    async fn next(&mut self) -> Input {
        match self.rx.recv().await {
            Some(m) => self.taken(m),
            None => Input::End(None),
        }
    }

    async fn send(&mut self, out: Outgoing) -> bool {
        self.tx.send(out).await.is_ok()
    }
}

impl Drop for QueueLink {
    /// Messages left in the queue will not be processed: keep the gauges right.
    fn drop(&mut self) {
        self.rx.close();
        while let Ok((_, bytes)) = self.rx.try_recv() {
            dequeued(bytes);
        }
    }
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
/// `shutdown` is cancelled (then what was written is still flushed). The connection moves to a
/// thread of its own for the rest of its life (see the module's documentation).
#[allow(clippy::result_large_err)] // the blocking thread's result is PqError, as every handler's
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
    S: AsyncRead + AsyncWrite + Rebind + Unpin + Send + 'static,
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
    let ctx = Session {
        timelines,
        conn_ttid,
        claims,
        allow_creation,
        shutdown,
    };
    let span = tracing::Span::current();
    let session = crate::blocking::spawn(move || {
        let _entered = span.enter();
        own_runtime_session(conn, ctx)
    });
    session
        .await
        .map_err(|e| PqError::Io(std::io::Error::other(e)))?
}

/// What a WAL push needs besides its connection.
struct Session {
    timelines: Arc<GlobalTimelines>,
    /// The timeline the connection's options name, if they do.
    conn_ttid: Option<TenantTimelineId>,
    /// The client's token, if the daemon checks tokens.
    claims: Option<Claims>,
    allow_creation: bool,
    shutdown: CancellationToken,
}

/// Runs [`push_session`] on a single-threaded runtime of this (blocking) thread, with the
/// connection moved into it.
#[allow(clippy::result_large_err)] // PqError, as every connection handler returns
fn own_runtime_session<S>(mut conn: ServerConn<S>, ctx: Session) -> Result<(), PqError>
where
    S: AsyncRead + AsyncWrite + Rebind + Unpin,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(PqError::Io)?;
    rt.block_on(async move {
        conn.get_mut().rebind()?;
        push_session(conn, ctx).await
    })
}

/// The WAL push on its own thread: the greeting picks (or creates) the timeline, then the
/// acceptor serves the socket.
async fn push_session<S>(mut conn: ServerConn<S>, ctx: Session) -> Result<(), PqError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let read = tokio::select! {
        r = read_proposer_msg(&mut conn) => r,
        _ = ctx.shutdown.cancelled() => return Ok(()),
    };
    let greeting = match read {
        Ok(Some(ProposerAcceptorMessage::Greeting(g))) => g,
        Ok(Some(other)) => {
            return end_with_error(
                &mut conn,
                ErrorFields::error(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("the first message must be a greeting, got {}", kind(&other)),
                ),
            )
            .await;
        }
        Ok(None) => return Ok(()),
        Err(ConnEnd::Client(e)) => return end_with_error(&mut conn, e).await,
        Err(ConnEnd::Io(e)) => return Err(e),
    };
    // From here on every log line is about this timeline: its ids are fields of the span.
    let span = crate::timeline::span(&greeting.ttid());
    accept(conn, ctx, greeting).instrument(span).await
}

/// The rest of a WAL push, once the greeting names the timeline.
async fn accept<S>(
    mut conn: ServerConn<S>,
    ctx: Session,
    greeting: ProposerGreeting,
) -> Result<(), PqError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    if let Some(ttid) = ctx.conn_ttid
        && ttid != greeting.ttid()
    {
        return end_with_error(
            &mut conn,
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
    if let Some(claims) = &ctx.claims
        && let Err(e) = check_permission(claims, Some(greeting.ttid().tenant_id))
    {
        return end_with_error(
            &mut conn,
            ErrorFields::error(sqlstate::INVALID_AUTHORIZATION_SPECIFICATION, e.to_string()),
        )
        .await;
    }
    // Blocking (it may create and fsync the timeline), which this thread may do.
    let tl = match crate::evict::get_or_create(&ctx.timelines, &greeting, ctx.allow_creation).await
    {
        Ok(tl) => tl,
        Err(e) => {
            return end_with_error(&mut conn, ErrorFields::error(e.sqlstate(), e.to_string()))
                .await;
        }
    };
    let _counted = tl.proposer_guard();
    tracing::info!("proposer connected");

    let mut link = SocketLink {
        conn,
        // The greeting goes through the acceptor like every other message, in order.
        first: Some(ProposerAcceptorMessage::Greeting(greeting)),
        shutdown: ctx.shutdown,
        deleted: tl.deleted().clone(),
        ttid: tl.ttid,
        buf: BytesMut::with_capacity(256),
        read_failed: None,
    };
    run_acceptor(&tl, &mut link, Source::Proposer).await;
    tracing::info!(positions = ?tl.positions(), "proposer disconnected");
    match link.read_failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A proposer's socket as the acceptor's [`Link`].
struct SocketLink<S> {
    conn: ServerConn<S>,
    /// The greeting, read before the timeline was known.
    first: Option<ProposerAcceptorMessage>,
    shutdown: CancellationToken,
    deleted: CancellationToken,
    ttid: TenantTimelineId,
    buf: BytesMut,
    /// The socket failed while reading (the session's result).
    read_failed: Option<PqError>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> SocketLink<S> {
    fn input(&mut self, r: Result<Option<ProposerAcceptorMessage>, ConnEnd>) -> Input {
        match r {
            Ok(Some(m)) => Input::Msg(m),
            Ok(None) => Input::End(None),
            Err(ConnEnd::Client(e)) => Input::End(Some(e)),
            Err(ConnEnd::Io(e)) => {
                self.read_failed = Some(e);
                Input::End(None)
            }
        }
    }

    /// Why the stream must end now, if it must: shutdown or deletion.
    fn stopped(&self) -> Option<Input> {
        if self.shutdown.is_cancelled() {
            return Some(shutting_down());
        }
        if self.deleted.is_cancelled() {
            return Some(deleted(&self.ttid));
        }
        None
    }
}

fn shutting_down() -> Input {
    Input::End(Some(ErrorFields::fatal(
        sqlstate::ADMIN_SHUTDOWN,
        "the safekeeper is shutting down",
    )))
}

fn deleted(ttid: &TenantTimelineId) -> Input {
    Input::End(Some(ErrorFields::fatal(
        sqlstate::UNDEFINED_OBJECT,
        format!("timeline {ttid} was deleted on this safekeeper"),
    )))
}

impl<S: AsyncRead + AsyncWrite + Unpin> Link for SocketLink<S> {
    fn try_next(&mut self) -> Option<Input> {
        if let Some(m) = self.first.take() {
            return Some(Input::Msg(m));
        }
        if let Some(end) = self.stopped() {
            return Some(end);
        }
        // One poll: a frame already buffered, or bytes the socket has now. Unconstrained, so
        // tokio's cooperative budget never makes a ready socket look empty (which would cost
        // an extra fdatasync). Cancellation-safe: a partial frame stays buffered.
        let r = tokio::task::unconstrained(read_proposer_msg(&mut self.conn)).now_or_never()?;
        Some(self.input(r))
    }

    async fn next(&mut self) -> Input {
        if let Some(m) = self.first.take() {
            return Input::Msg(m);
        }
        tokio::select! {
            r = read_proposer_msg(&mut self.conn) => self.input(r),
            _ = self.shutdown.cancelled() => shutting_down(),
            _ = self.deleted.cancelled() => deleted(&self.ttid),
        }
    }

    async fn send(&mut self, out: Outgoing) -> bool {
        let sent = match out {
            Outgoing::Reply(reply) => {
                self.buf.clear();
                if let Err(e) = reply.encode(&mut self.buf) {
                    tracing::error!("encoding a reply: {e}");
                    return false;
                }
                self.conn.write_copy_data(&[&self.buf]);
                self.conn.flush().await
            }
            Outgoing::Error(e) => end_with_error(&mut self.conn, e).await,
        };
        match sent {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!("writing to the proposer: {e}");
                false
            }
        }
    }
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
async fn read_proposer_msg<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut ServerConn<S>,
) -> Result<Option<ProposerAcceptorMessage>, ConnEnd> {
    match conn.read_message().await {
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

/// The acceptor loop. Returns when the input ends or an error ends the connection; flushes
/// written WAL before returning (and before sending the error that ends a stream).
async fn run_acceptor<L: Link>(tl: &Timeline, link: &mut L, source: Source) {
    let mut link = Acks { link, last: None };
    let link = &mut link;
    let mut dirty = false;
    let mut last_flush = Instant::now();
    // The error that answers a refused message: it goes out first, before the final flush.
    let mut refusal = None;
    // The error that ends the stream for another reason: after the final flush's reply.
    let mut ending = None;
    loop {
        let input = match link.try_next() {
            Some(input) => input,
            None => {
                // Nothing more has arrived: one fdatasync covers the whole batch.
                if dirty && !flush(tl, link, &mut dirty, &mut last_flush).await {
                    break;
                }
                link.next().await
            }
        };
        let msg = match input {
            Input::Msg(m) => m,
            Input::End(e) => {
                ending = e;
                break;
            }
        };
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
                    && !link.send(Outgoing::Reply(reply)).await
                {
                    break;
                }
            }
            Err(e) => {
                metrics::count_proposer_message(label, false);
                tracing::warn!("{label} refused: {e}");
                refusal = Some(ErrorFields::error(sqlstate::INTERNAL_ERROR, e.to_string()));
                break;
            }
        }
        if dirty
            && last_flush.elapsed() >= FLUSH_INTERVAL
            && !flush(tl, link, &mut dirty, &mut last_flush).await
        {
            break;
        }
    }
    if let Some(e) = refusal {
        link.send(Outgoing::Error(e)).await;
    }
    // Whatever was written is made durable before the connection is gone (neon #9259); a
    // proposer told to go (shutdown, deletion, a bad frame) gets that flush's reply first.
    if dirty {
        flush(tl, link, &mut dirty, &mut last_flush).await;
    }
    if let Some(e) = ending {
        link.send(Outgoing::Error(e)).await;
    }
}

/// A link that leaves out an `AppendResponse` identical to the last one sent: it tells the
/// proposer nothing new. That is the answer to a commit-only append (the proposer sends one
/// to every member after each commit) or to a heartbeat when nothing moved; leaving it out
/// spares the proposer a wake-up per member and commit. The first acknowledgement on a
/// connection always goes out (a proposer counts a member's start point in its term from
/// it), and any change (flush or persisted commit LSN, term, feedback) does.
struct Acks<'a, L> {
    link: &'a mut L,
    last: Option<sk_core::protocol::AppendResponse>,
}

impl<L: Link> Link for Acks<'_, L> {
    fn try_next(&mut self) -> Option<Input> {
        self.link.try_next()
    }

    async fn next(&mut self) -> Input {
        self.link.next().await
    }

    async fn send(&mut self, out: Outgoing) -> bool {
        if let Outgoing::Reply(AcceptorProposerMessage::AppendResponse(r)) = &out {
            if self.last.as_ref() == Some(r) {
                return true;
            }
            self.last = Some(r.clone());
        }
        self.link.send(out).await
    }
}

/// Makes written WAL durable and sends the reply that says so. False if the connection must
/// end.
async fn flush<L: Link>(tl: &Timeline, link: &mut L, dirty: &mut bool, last: &mut Instant) -> bool {
    let started = Instant::now();
    let result = tl.process_msg(&ProposerAcceptorMessage::FlushWAL);
    metrics::WAL_FLUSH_SECONDS.observe(started.elapsed().as_secs_f64());
    metrics::WAL_FLUSHES.inc();
    *dirty = false;
    *last = Instant::now();
    match result {
        Ok(Some(reply)) => {
            // A reply that cannot be sent is fine here: the WAL is durable either way, and
            // the input says soon whether the proposer is gone.
            link.send(Outgoing::Reply(reply)).await;
            true
        }
        Ok(None) => true,
        Err(e) => {
            tracing::error!("flushing WAL: {e}");
            link.send(Outgoing::Error(ErrorFields::error(
                sqlstate::INTERNAL_ERROR,
                format!("flushing WAL: {e}"),
            )))
            .await;
            false
        }
    }
}

/// Ends the stream with an error the client can read.
async fn end_with_error<S: AsyncRead + AsyncWrite + Unpin>(
    conn: &mut ServerConn<S>,
    e: ErrorFields,
) -> Result<(), PqError> {
    tracing::warn!("ending WAL push: {}", e.message);
    conn.write_message(&BackendMessage::ErrorResponse(e));
    conn.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;
    use sk_core::protocol::AppendResponse;
    use sk_core::types::{Generation, Lsn, Term};

    /// A link that records what is sent.
    #[derive(Default)]
    struct Recorder(Vec<Outgoing>);

    impl Link for Recorder {
        fn try_next(&mut self) -> Option<Input> {
            None
        }

        async fn next(&mut self) -> Input {
            Input::End(None)
        }

        async fn send(&mut self, out: Outgoing) -> bool {
            self.0.push(out);
            true
        }
    }

    fn ack(flush: u64) -> Outgoing {
        let mut r = AppendResponse::term_only(Generation(0), Term(2));
        r.flush_lsn = Lsn(flush);
        Outgoing::Reply(AcceptorProposerMessage::AppendResponse(r))
    }

    #[test]
    fn identical_acknowledgements_are_sent_once_and_every_change_is_sent() {
        let mut rec = Recorder::default();
        let mut acks = Acks {
            link: &mut rec,
            last: None,
        };
        futures::executor::block_on(async {
            // The first one always goes out (a start point's acknowledgement).
            assert!(acks.send(ack(100)).await);
            // A commit-only append's answer: nothing moved.
            assert!(acks.send(ack(100)).await);
            assert!(acks.send(ack(200)).await);
            assert!(acks.send(ack(200)).await);
            // Errors always go out.
            acks.send(Outgoing::Error(ErrorFields::error(
                sqlstate::INTERNAL_ERROR,
                "x",
            )))
            .await;
        });
        let flushes: Vec<_> = rec
            .0
            .iter()
            .map(|o| match o {
                Outgoing::Reply(AcceptorProposerMessage::AppendResponse(r)) => r.flush_lsn.0,
                Outgoing::Error(_) => 0,
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(flushes, vec![100, 200, 0]);
    }
}
