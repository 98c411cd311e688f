//! Running the daemon: lock the data directory, bind the listeners, serve until shut down.
//!
//! The binary (`src/bin/safekeeper.rs`) only parses flags, sets up tracing and the allocator,
//! and calls [`run`]. Tests call [`bind`] and [`run`] with ephemeral ports and their own shutdown
//! future.

use std::fs::{File, OpenOptions, TryLockError};
use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Conf;
use crate::registry::{GlobalTimelines, TimelineCollector};
use crate::{http, wal_service};
use pq_proto::server::ServerConfig;

/// Name of the lock file inside the data directory.
pub const LOCK_FILE: &str = "safekeeper.lock";

/// An exclusive lock on a data directory, held for the life of the process (released by the
/// kernel when the file is closed, also on a crash).
#[derive(Debug)]
pub struct DataDirLock {
    _file: File,
    path: PathBuf,
}

impl DataDirLock {
    /// Creates `datadir` if needed and locks it; fails if another process holds the lock.
    pub fn acquire(datadir: &Path) -> anyhow::Result<DataDirLock> {
        std::fs::create_dir_all(datadir)
            .with_context(|| format!("creating data directory {}", datadir.display()))?;
        let path = datadir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        // An exclusive advisory lock (flock on Unix), released by the kernel with the file.
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let owner = std::fs::read_to_string(&path).unwrap_or_default();
                bail!(
                    "data directory {} is in use by another safekeeper (pid {}); \
                     use a different --datadir",
                    datadir.display(),
                    owner.trim()
                );
            }
            Err(TryLockError::Error(err)) => {
                return Err(err).with_context(|| format!("locking {}", path.display()));
            }
        }
        file.set_len(0)?;
        writeln!(file, "{}", std::process::id())?;
        Ok(DataDirLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Listeners bound before serving, so callers can learn ephemeral ports.
pub struct Listeners {
    /// The HTTP API's listener.
    pub http: TcpListener,
    /// The PostgreSQL-protocol listener (proposers and readers).
    pub pg: TcpListener,
}

impl Listeners {
    /// Where the HTTP API listens.
    pub fn http_addr(&self) -> SocketAddr {
        self.http
            .local_addr()
            .expect("bound listener has an address")
    }

    /// Where the PostgreSQL protocol listens.
    pub fn pg_addr(&self) -> SocketAddr {
        self.pg.local_addr().expect("bound listener has an address")
    }
}

/// Binds every listener the configuration names.
pub async fn bind(conf: &Conf) -> anyhow::Result<Listeners> {
    let http = TcpListener::bind(conf.listen_http)
        .await
        .with_context(|| format!("binding the HTTP listener on {}", conf.listen_http))?;
    let pg = TcpListener::bind(conf.listen_pg)
        .await
        .with_context(|| format!("binding the PostgreSQL listener on {}", conf.listen_pg))?;
    Ok(Listeners { http, pg })
}

/// How long shutdown waits for connections to finish their in-flight work.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(4);

/// Serves until `shutdown` resolves, then stops accepting, lets in-flight work finish (queued
/// WAL is written and flushed), persists every timeline's state, and returns.
pub async fn run(
    conf: Conf,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let lock = DataDirLock::acquire(&conf.datadir)?;
    let server_config = ServerConfig {
        password: match &conf.pg_auth_token_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .with_context(|| format!("reading --pg-auth-token-file {}", path.display()))?
                    .trim_end_matches(['\n', '\r'])
                    .as_bytes()
                    .to_vec(),
            ),
            None => None,
        },
        ..ServerConfig::default()
    };
    let timelines = {
        let (datadir, node_id, no_sync) = (conf.datadir.clone(), conf.node_id(), conf.no_sync);
        tokio::task::spawn_blocking(move || GlobalTimelines::load(&datadir, node_id, no_sync))
            .await
            .context("loading timelines")??
    };
    let timelines = Arc::new(timelines);
    profiling::register_metrics();
    crate::metrics::register();
    TimelineCollector::register(&timelines);
    tracing::info!(
        id = conf.id,
        datadir = %conf.datadir.display(),
        http = %listeners.http_addr(),
        pg = %listeners.pg_addr(),
        timelines = timelines.all().len(),
        no_sync = conf.no_sync,
        "safekeeper started"
    );

    let cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    let manager = tokio::spawn(timelines.clone().run_manager(cancel.clone()));
    let pg = tokio::spawn(wal_service::run(
        listeners.pg,
        timelines.clone(),
        server_config,
        cancel.clone(),
        tasks.clone(),
    ));
    let state = Arc::new(http::AppState {
        conf,
        started: Instant::now(),
        started_at: SystemTime::now(),
        timelines: timelines.clone(),
    });
    let http_cancel = cancel.clone();
    let http = tokio::spawn(
        axum::serve(listeners.http, http::app(state))
            .with_graceful_shutdown(async move { http_cancel.cancelled().await })
            .into_future(),
    );

    shutdown.await;
    cancel.cancel();
    let _ = pg.await;
    tasks.close();
    if tokio::time::timeout(SHUTDOWN_GRACE, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections did not finish within {SHUTDOWN_GRACE:?}");
    }
    let _ = manager.await;
    tokio::task::spawn_blocking(move || timelines.persist_all())
        .await
        .context("persisting timelines")?;
    match tokio::time::timeout(SHUTDOWN_GRACE, http).await {
        Ok(Ok(Err(e))) => tracing::error!("HTTP server: {e}"),
        Err(_) => tracing::warn!("HTTP server did not stop in time"),
        _ => {}
    }
    tracing::info!(lock = %lock.path().display(), "safekeeper stopped");
    Ok(())
}

/// Resolves on the first SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    let which = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!("{which} received, shutting down");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_on_same_datadir_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let first = DataDirLock::acquire(dir.path()).unwrap();
        let err = DataDirLock::acquire(dir.path()).unwrap_err().to_string();
        assert!(err.contains("in use by another safekeeper"), "{err}");
        assert!(err.contains(&std::process::id().to_string()), "{err}");
        drop(first);
        DataDirLock::acquire(dir.path()).expect("lock is free again after release");
    }
}
