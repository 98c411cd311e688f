//! Limits that keep a hostile or broken client from holding the daemon's resources: the number
//! of PostgreSQL-protocol connections (excess ones get PostgreSQL's "too many connections"
//! error), a separate small pool for connections still in their handshake
//! ([`HandshakePool`]: when it is full the oldest is closed, so idle sockets that never
//! authenticate cannot keep authenticated clients out), an idle timeout on every connection's reads and writes (streaming ones included),
//! and the duration syntax of the flags that set them.
//!
//! Not here: the cap on messages before authentication (`pq_proto::server::ServerConfig::
//! max_startup_message_size`), the handshake timeout (applied by [`crate::wal_service`]) and the
//! HTTP per-route-class request limits ([`crate::http`]).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{Instant, Sleep};

use pq_proto::stream::MaybeTls;

/// Connections in their startup handshake (not yet authenticated), at most `cap` at once: when
/// a new one arrives at a full pool, the oldest is closed. Authenticated clients take their
/// slot of `--max-connections` only once their handshake is done, so sockets that never finish
/// one (issue 26, defect 8: 1,000 of them kept proposers out for the whole handshake timeout)
/// only ever push each other out.
pub struct HandshakePool {
    cap: usize,
    inner: std::sync::Mutex<HandshakeInner>,
}

#[derive(Default)]
struct HandshakeInner {
    next_id: u64,
    /// Oldest first.
    queue: std::collections::VecDeque<(u64, tokio_util::sync::CancellationToken)>,
}

/// A connection's place in the [`HandshakePool`]: its token is cancelled if it is pushed out;
/// it leaves the pool on drop.
pub struct HandshakeGuard {
    pool: Arc<HandshakePool>,
    id: u64,
    evicted: tokio_util::sync::CancellationToken,
}

impl HandshakePool {
    /// A pool of at most `cap` (at least 1) handshaking connections.
    pub fn new(cap: usize) -> Arc<HandshakePool> {
        Arc::new(HandshakePool {
            cap: cap.max(1),
            inner: Default::default(),
        })
    }

    /// Enters a new connection, pushing the oldest out if the pool is full.
    pub fn enter(self: &Arc<Self>) -> HandshakeGuard {
        let evicted = tokio_util::sync::CancellationToken::new();
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        while inner.queue.len() >= self.cap {
            if let Some((_, oldest)) = inner.queue.pop_front() {
                oldest.cancel();
                crate::metrics::PG_CONNECTIONS
                    .with_label_values(&["handshake_evicted"])
                    .inc();
            }
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.queue.push_back((id, evicted.clone()));
        HandshakeGuard {
            pool: self.clone(),
            id,
            evicted,
        }
    }

    /// Connections in the pool now.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .queue
            .len()
    }

    /// Whether the pool is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl HandshakeGuard {
    /// Fires when a newer connection pushed this one out of the pool.
    pub fn evicted(&self) -> &tokio_util::sync::CancellationToken {
        &self.evicted
    }
}

impl Drop for HandshakeGuard {
    fn drop(&mut self) {
        let mut inner = self.pool.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.queue.retain(|(id, _)| *id != self.id);
    }
}

/// Parses a duration flag: `500ms`, `30s`, `10m`, `2h`, or a bare number of seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 500ms, 30s, 10m, 2h"))?;
    let d = match unit.trim() {
        "ms" => Duration::from_millis(n),
        "" | "s" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        other => {
            return Err(format!(
                "invalid duration unit {other:?} in {s:?}: use ms, s, m or h"
            ));
        }
    };
    if d.is_zero() {
        return Err(format!("invalid duration {s:?}: must be positive"));
    }
    Ok(d)
}

/// A stream whose reads fail with `TimedOut` when no byte arrives for `timeout`, and whose
/// writes (and flushes) fail the same way when the peer accepts no byte for `timeout`. The
/// clocks run only while a read or write is waiting: a connection whose task is busy elsewhere
/// (e.g. back-pressured by the disk) is not cut for it.
///
/// Wraps the raw socket, under TLS, so every byte on the wire counts as activity.
pub struct IdleTimeout<S> {
    inner: S,
    timeout: Duration,
    read: Timer,
    write: Timer,
}

/// A deadline armed when an operation first waits and disarmed when it makes progress.
struct Timer {
    sleep: Pin<Box<Sleep>>,
    armed: bool,
}

impl Timer {
    fn new() -> Timer {
        Timer {
            sleep: Box::pin(tokio::time::sleep(Duration::ZERO)),
            armed: false,
        }
    }

    /// Called when the operation is pending: `Ready(Err)` once `timeout` has passed since it
    /// started waiting.
    fn poll_expired(
        &mut self,
        cx: &mut Context<'_>,
        timeout: Duration,
        what: &str,
    ) -> Poll<io::Result<()>> {
        if !self.armed {
            self.sleep.as_mut().reset(Instant::now() + timeout);
            self.armed = true;
        }
        match self.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("{what} for {timeout:?} (--pg-idle-timeout)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S> IdleTimeout<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, timeout: Duration) -> IdleTimeout<S> {
        IdleTimeout {
            inner,
            timeout,
            read: Timer::new(),
            write: Timer::new(),
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

/// A stream that can move to the tokio runtime of the calling thread: its socket is
/// registered with that runtime's I/O driver, its timers with that runtime's clock. A proposer's
/// connection moves to a runtime of its own ([`crate::receive_wal`]), so the kernel wakes the
/// thread that processes its messages directly, with no hand-off between threads.
pub trait Rebind {
    /// Re-registers with the current runtime. Call it inside that runtime, while nothing is
    /// waiting on the stream.
    fn rebind(&mut self) -> io::Result<()>;
}

impl<S: Rebind> Rebind for IdleTimeout<S> {
    fn rebind(&mut self) -> io::Result<()> {
        self.inner.rebind()?;
        self.read = Timer::new();
        self.write = Timer::new();
        Ok(())
    }
}

impl<P: Rebind, T: Rebind> Rebind for MaybeTls<P, T> {
    fn rebind(&mut self) -> io::Result<()> {
        match self {
            MaybeTls::Plain(s) => s.rebind(),
            MaybeTls::Tls(s) => s.rebind(),
        }
    }
}

impl<T: Rebind> Rebind for Box<T> {
    fn rebind(&mut self) -> io::Result<()> {
        (**self).rebind()
    }
}

impl<S: Rebind> Rebind for tokio_rustls::server::TlsStream<S> {
    fn rebind(&mut self) -> io::Result<()> {
        // The TLS session state stays; only the transport under it moves.
        self.get_mut().0.rebind()
    }
}

/// What is buffered stays; only the stream under it moves.
impl<S: Rebind + AsyncRead> Rebind for tokio::io::BufReader<S> {
    fn rebind(&mut self) -> io::Result<()> {
        self.get_mut().rebind()
    }
}

/// In-memory streams (tests) belong to no runtime.
impl Rebind for tokio::io::DuplexStream {
    fn rebind(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// A TCP socket that can move between runtimes ([`Rebind`]).
pub struct Socket(Option<TcpStream>);

impl Socket {
    /// Wraps a socket registered with the current runtime.
    pub fn new(s: TcpStream) -> Socket {
        Socket(Some(s))
    }

    /// Runs `op` on the socket; only a failed move ([`Rebind::rebind`]) leaves none.
    fn poll_with<T>(
        self: Pin<&mut Self>,
        op: impl FnOnce(Pin<&mut TcpStream>) -> Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        match self.get_mut().0.as_mut() {
            Some(s) => op(Pin::new(s)),
            None => Poll::Ready(Err(lost_in_a_move())),
        }
    }
}

fn lost_in_a_move() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "socket lost in a move")
}

impl Rebind for Socket {
    fn rebind(&mut self) -> io::Result<()> {
        let s = self.0.take().ok_or_else(lost_in_a_move)?;
        // Deregisters from the old runtime's driver; the std socket stays non-blocking.
        let std = s.into_std()?;
        self.0 = Some(TcpStream::from_std(std)?);
        Ok(())
    }
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.poll_with(|s| s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_with(|s| s.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_with(|s| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.poll_with(|s| s.poll_shutdown(cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_with(|s| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for IdleTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.read.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => this
                .read
                .poll_expired(cx, this.timeout, "no data from the client"),
        }
    }
}

impl<S: AsyncWrite + Unpin> IdleTimeout<S> {
    fn progress<T>(&mut self, cx: &mut Context<'_>, p: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match p {
            Poll::Ready(r) => {
                self.write.armed = false;
                Poll::Ready(r)
            }
            Poll::Pending => {
                match self
                    .write
                    .poll_expired(cx, self.timeout, "the client accepted no data")
                {
                    Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                    _ => Poll::Pending,
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for IdleTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_write(cx, buf);
        this.progress(cx, p)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_flush(cx);
        this.progress(cx, p)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_shutdown(cx);
        this.progress(cx, p)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let p = Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        this.progress(cx, p)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The PostgreSQL-protocol connection limit: a slot per served (authenticated) connection.
#[derive(Clone)]
pub struct ConnectionLimit {
    slots: Arc<Semaphore>,
}

impl ConnectionLimit {
    /// A limit of `max` connections served at once.
    pub fn new(max: usize) -> ConnectionLimit {
        ConnectionLimit {
            slots: Arc::new(Semaphore::new(max)),
        }
    }

    /// A slot for a connection, held for its life; `None` when all are taken.
    pub fn try_acquire(&self) -> Option<OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_owned().ok()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn a_full_handshake_pool_closes_its_oldest_connection() {
        let pool = HandshakePool::new(2);
        let a = pool.enter();
        let b = pool.enter();
        assert!(!a.evicted().is_cancelled() && !b.evicted().is_cancelled());
        let c = pool.enter();
        assert!(a.evicted().is_cancelled(), "the oldest goes");
        assert!(!b.evicted().is_cancelled() && !c.evicted().is_cancelled());
        assert_eq!(pool.len(), 2);
        // A connection that finished its handshake leaves: no one is pushed out for the next.
        drop(b);
        let d = pool.enter();
        assert!(!c.evicted().is_cancelled() && !d.evicted().is_cancelled());
        drop((a, c, d));
        assert!(pool.is_empty());
    }

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_duration("2h"), Ok(Duration::from_secs(7200)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("").is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_peer_is_cut_after_the_idle_timeout_and_an_active_one_is_not() {
        let (client, server) = tokio::io::duplex(64);
        let mut server = IdleTimeout::new(server, Duration::from_secs(10));
        let mut client = client;
        // Activity every 6 s keeps the connection: each byte restarts the clock.
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_secs(6)).await;
            client.write_all(b"x").await.unwrap();
            let mut b = [0u8; 1];
            server.read_exact(&mut b).await.unwrap();
        }
        let started = Instant::now();
        let mut b = [0u8; 1];
        let err = server.read_exact(&mut b).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_that_reads_nothing_is_cut_after_the_idle_timeout() {
        let (_client, server) = tokio::io::duplex(64);
        let mut server = IdleTimeout::new(server, Duration::from_secs(10));
        let started = Instant::now();
        let err = server.write_all(&[0u8; 1024]).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
    }
}
