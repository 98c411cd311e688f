//! Running the daemon: lock the data directory, bind the listeners, serve until shut down.
//!
//! The binaries (`src/bin/safekeeper.rs`, and `src/bin/safekeeper-testing.rs` with the test
//! hooks on) set up the allocator and call [`main`], which parses flags, sets up tracing and the
//! runtime and calls [`run`]. Tests call [`bind`] and [`run`] with ephemeral ports and their own
//! shutdown future.

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

use crate::auth::JwtAuth;
use crate::config::Conf;
use crate::registry::{GlobalTimelines, TimelineCollector};
use crate::secrets::read_secret_file;
use crate::tls::TlsConfig;
use crate::wal_service::WalServiceConf;
use crate::wal_store::pool::SEGMENT_POOL_DIR;
use crate::wal_store::{DEFAULT_MAX_OPEN_SEGMENT_FILES, OpenFiles, SegmentPool};
use crate::{http, wal_service};
use pq_proto::server::ServerConfig;
use sk_core::storage::fs::Fs;

/// Whether a binary serves the test-only HTTP routes (failpoints, debug memory). Only the
/// `safekeeper-testing` binary, built with the `testing` feature, passes [`TestHooks::On`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TestHooks {
    /// The real daemon: test-only routes answer 404.
    Off,
    /// The test build: failpoints and debug routes are served.
    On,
}

/// The body of a safekeeper binary: flags, tracing, a multi-threaded runtime, [`bind`] and
/// [`run`] until SIGTERM or SIGINT; exits 1 with the error on failure.
pub fn main(hooks: TestHooks) {
    use clap::Parser;
    // First of all: this process may be the profiler's symbol-index builder (it exits then).
    profiling::maybe_run_helper();
    let mut conf = Conf::parse();
    conf.test_hooks = hooks == TestHooks::On;
    crate::logging::init(conf.log_format);
    raise_open_files_limit();
    if conf.test_hooks {
        tracing::warn!(
            "test build: PUT /v1/failpoints and /v1/debug/* are served; never run this binary \
             in production"
        );
    }
    // Symbol indexes for profiles live beside the data they describe (built at the first profile).
    profiling::set_symbol_index_dir(conf.datadir.join(".symcache"));
    // Before any other thread exists: see profiling::warm_up.
    profiling::warm_up();
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("safekeeper-worker")
        // Each proposer connection's WAL acceptor holds a blocking thread for its life (it
        // waits on its queue in `blocking_recv`). With tokio's default cap of 512 blocking
        // threads, the 512th connected proposer's acceptor, and every blocking task after it
        // (timeline creation for a greeting, control-file persists), waited forever.
        .max_blocking_threads(conf.max_connections + BLOCKING_THREADS_BESIDES_ACCEPTORS)
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| {
            runtime.block_on(async move {
                let listeners = bind(&conf).await?;
                run(conf, listeners, shutdown_signal()).await
            })
        });
    if let Err(e) = result {
        tracing::error!("{e:#}");
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Blocking threads for everything but the WAL acceptors (tokio's default cap in all).
const BLOCKING_THREADS_BESIDES_ACCEPTORS: usize = 512;

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
    conf.check_open_binding()?;
    let http = TcpListener::bind(conf.listen_http)
        .await
        .with_context(|| format!("binding the HTTP listener on {}", conf.listen_http))?;
    let pg = TcpListener::bind(conf.listen_pg)
        .await
        .with_context(|| format!("binding the PostgreSQL listener on {}", conf.listen_pg))?;
    let listeners = Listeners { http, pg };
    tracing::info!(http = %listeners.http_addr(), pg = %listeners.pg_addr(), "listening");
    if let Some(path) = &conf.addr_file {
        write_addr_file(path, &listeners)
            .with_context(|| format!("writing --addr-file {}", path.display()))?;
    }
    Ok(listeners)
}

/// The bound addresses as `--addr-file` has them: a temporary file beside it, renamed over it.
fn write_addr_file(path: &std::path::Path, listeners: &Listeners) -> std::io::Result<()> {
    let body = serde_json::json!({
        "pg": listeners.pg_addr().to_string(),
        "http": listeners.http_addr().to_string(),
    });
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, format!("{body}\n"))?;
    std::fs::rename(&tmp, path)
}

/// How often the timeline managers' supervisor looks for new timelines and pending remote
/// deletions (it is also woken by every create and delete), and the disk-usage loop measures.
const LIFECYCLE_TICK: Duration = Duration::from_secs(1);
/// How long shutdown waits for connections to finish their in-flight work.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(4);

/// Serves until `shutdown` resolves, then stops accepting, lets in-flight work finish (queued
/// WAL is written and flushed), persists every timeline's state, and returns.
pub async fn run(
    conf: Conf,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // Secrets first: an unreadable or empty file stops start-up, naming the file.
    let password = match &conf.pg_auth_token_file {
        Some(path) => {
            let mut secret = read_secret_file("--pg-auth-token-file", path)?;
            secret.truncate(secret.trim_ascii_end().len());
            Some(secret)
        }
        None => None,
    };
    let auth = match &conf.auth_public_key_path {
        Some(path) => Some(Arc::new(JwtAuth::load(path)?)),
        None => None,
    };
    let tls = match (&conf.tls_cert, &conf.tls_key) {
        (Some(cert), Some(key)) => Some(Arc::new(TlsConfig::load(cert, key)?)),
        (None, None) => None,
        _ => bail!("--tls-cert and --tls-key go together"),
    };
    conf.check_open_binding()?;
    let peer = crate::peer::PeerClient::from_files(
        conf.peer_auth_token_path.as_deref(),
        conf.peer_ca.as_deref(),
    )?;
    let pg_port = listeners.pg_addr().port();
    // Remote storage: a bad URL or configuration stops start-up, naming the flag.
    let remote = match &conf.remote_storage {
        Some(url) => Some(
            crate::wal_backup::RemoteStorage::from_url(url)?
                .with_reader_limits(conf.remote_read_budget, conf.max_reader_hold),
        ),
        None => None,
    };
    let lock = DataDirLock::acquire(&conf.datadir)?;
    let node_id = crate::node_id::resolve(&conf.datadir, conf.id)?;
    let pg_conf = WalServiceConf {
        server: ServerConfig {
            password,
            ..ServerConfig::default()
        },
        max_connections: conf.max_connections,
        max_handshaking: conf.max_handshaking_connections,
        idle_timeout: conf.pg_idle_timeout,
        handshake_timeout: conf.handshake_timeout,
        auth: auth.clone(),
        tls: tls.clone(),
        backpressure_readers: conf.backpressure_readers.clone(),
    };
    let open_files = OpenFiles::new(
        conf.max_open_segment_files
            .unwrap_or_else(|| default_max_open_segment_files(conf.max_connections)),
    );
    // A pooled segment counts whole against a timeline's disk limit from its first append.
    let seg = pg_wal::format::DEFAULT_WAL_SEG_SIZE;
    let limit_allows = conf.max_timeline_disk_usage == 0 || conf.max_timeline_disk_usage >= 4 * seg;
    let pool_dir = conf.datadir.join(SEGMENT_POOL_DIR);
    let pool = if conf.prepared_segments > 0 && !conf.no_sync && limit_allows {
        Some(
            SegmentPool::start(
                Fs::real(),
                &pool_dir,
                seg,
                conf.prepared_segments,
                conf.max_disk_usage_ratio,
            )
            .context("opening the segment pool")?,
        )
    } else {
        // What a pool of an earlier run left is disk space no one will use.
        crate::wal_store::pool::remove(&Fs::real(), &pool_dir)
            .context("removing the segment pool")?;
        None
    };
    let started = Instant::now();
    let timelines = {
        let (datadir, no_sync) = (conf.datadir.clone(), conf.no_sync);
        let open_files = open_files.clone();
        crate::blocking::spawn(move || {
            GlobalTimelines::load_in_with(Fs::real(), &datadir, node_id, no_sync, open_files, pool)
        })
        .await
        .context("loading timelines")??
    };
    let load_time = started.elapsed();
    // The loader threads' allocations are freed: their pages go back to the kernel now, not
    // after jemalloc's decay time (an idle node's RSS is what it keeps).
    profiling::purge_unused_memory();
    let mut timelines = timelines;
    timelines.set_max_restores(conf.max_concurrent_restores);
    let timelines = Arc::new(timelines);
    let (resident, evicted) = timelines.counts();
    profiling::register_metrics();
    crate::metrics::register();
    TimelineCollector::register(&timelines);
    tracing::info!(
        id = node_id.0,
        datadir = %conf.datadir.display(),
        http = %listeners.http_addr(),
        pg = %listeners.pg_addr(),
        timelines = resident,
        evicted,
        load_seconds = load_time.as_secs_f64(),
        max_open_segment_files = open_files.cap(),
        no_sync = conf.no_sync,
        "safekeeper started"
    );
    match &auth {
        Some(a) => tracing::info!(
            keys = %a.path().display(),
            ops_routes_open = !conf.auth_ops_routes,
            "JWT authentication on both ports"
        ),
        None if conf.allow_no_auth => tracing::warn!(
            "authentication is OFF (--allow-no-auth): anyone who reaches the ports can read and \
             write every timeline"
        ),
        None => tracing::warn!(
            "authentication is off: serving loopback only (give --auth-public-key-path to \
             require tokens)"
        ),
    }

    let cancel = CancellationToken::new();
    let tasks = TaskTracker::new();
    // The timeline managers (issue 26): control-file saves for every timeline, and with
    // remote storage (issue 19) backup, removal and the remote side of deletions.
    let backup = remote.map(|storage| {
        tracing::info!(
            remote = storage.url(),
            wal_keep_size = conf.wal_keep_size,
            "WAL backup on"
        );
        crate::wal_backup::Backup::new(storage, conf.backup_parallelism)
    });
    let manager = tokio::spawn(crate::lifecycle::run(
        timelines.clone(),
        crate::lifecycle::Settings {
            backup,
            wal_keep_size: conf.wal_keep_size,
            supervise_every: LIFECYCLE_TICK,
            partial_timeout: (!conf.partial_backup_timeout.is_zero())
                .then_some(conf.partial_backup_timeout),
            evict_after: (!conf.eviction_min_idle.is_zero()).then_some(conf.eviction_min_idle),
        },
        cancel.clone(),
    ));
    let limits = crate::disk_usage::DiskLimits {
        max_timeline_bytes: conf.max_timeline_disk_usage,
        max_fs_ratio: conf.max_disk_usage_ratio,
        datadir: conf.datadir.clone(),
    };
    if limits.any() {
        timelines.set_disk_limits(limits.clone());
    }
    let disk = limits.any().then(|| {
        tokio::spawn(crate::lifecycle::run_disk_limits(
            timelines.clone(),
            limits,
            LIFECYCLE_TICK,
            cancel.clone(),
        ))
    });
    let recovery = tokio::spawn(crate::recovery::run(
        timelines.clone(),
        conf.peers.clone(),
        peer.clone(),
        cancel.clone(),
    ));
    let reloader = tokio::spawn(reload_on_sighup(auth.clone(), tls.clone(), cancel.clone()));
    let pg = tokio::spawn(wal_service::run(
        listeners.pg,
        timelines.clone(),
        pg_conf,
        cancel.clone(),
        tasks.clone(),
    ));
    let handshake_timeout = conf.handshake_timeout;
    let state = Arc::new(http::AppState {
        conf,
        started: Instant::now(),
        started_at: SystemTime::now(),
        timelines: timelines.clone(),
        auth,
        peer,
        pg_port,
    });
    let http_cancel = cancel.clone();
    let http = tokio::spawn(http::serve(
        listeners.http,
        http::app(state),
        tls.clone(),
        handshake_timeout,
        http_cancel,
    ));

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
    let _ = recovery.await;
    if let Some(task) = disk {
        let _ = task.await;
    }
    let _ = reloader.await;
    crate::blocking::spawn(move || timelines.persist_all())
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

/// The soft and hard `RLIMIT_NOFILE`, or `None` if they cannot be read.
fn open_files_limit() -> Option<(u64, u64)> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through a valid pointer to a local.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    (rc == 0).then_some((lim.rlim_cur, lim.rlim_max))
}

/// Raises the soft limit on open files to the hard one, as PostgreSQL and most daemons do
/// (connections and segment files need descriptors; the soft default is often 1024), and logs
/// both. A failure only leaves the limit as it was.
fn raise_open_files_limit() {
    let Some((soft, hard)) = open_files_limit() else {
        tracing::warn!("could not read the open files limit (RLIMIT_NOFILE)");
        return;
    };
    if soft >= hard {
        tracing::info!(soft, hard, "open files limit (RLIMIT_NOFILE)");
        return;
    }
    let lim = libc::rlimit {
        rlim_cur: hard,
        rlim_max: hard,
    };
    // SAFETY: setrlimit reads one `rlimit` through a valid pointer to a local.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } == 0 {
        tracing::info!(
            from = soft,
            to = hard,
            "open files limit (RLIMIT_NOFILE) raised to the hard limit"
        );
    } else {
        let e = std::io::Error::last_os_error();
        tracing::warn!(soft, hard, "raising the open files limit failed: {e}");
    }
}

/// Descriptors one proposer connection holds: its socket, and its own runtime's epoll and
/// eventfd ([`crate::receive_wal`]).
const FDS_PER_CONNECTION: u64 = 3;
/// Descriptors kept for everything else: listeners, logs, start-up, short-lived files.
const FDS_RESERVED: u64 = 64;

/// `--max-open-segment-files` when not given: [`DEFAULT_MAX_OPEN_SEGMENT_FILES`], or what the
/// open files limit leaves after `max_connections` proposer connections and a reserve, if
/// that is lower (but at least a quarter of the limit).
fn default_max_open_segment_files(max_connections: usize) -> usize {
    let budget = open_files_limit().map_or(u64::MAX, |(soft, _)| {
        soft.saturating_sub(FDS_RESERVED + FDS_PER_CONNECTION * max_connections as u64)
            .max(soft / 4)
    });
    (DEFAULT_MAX_OPEN_SEGMENT_FILES as u64).min(budget).max(1) as usize
}

/// Reloads the JWT keys on every SIGHUP until `cancel` (a failed reload keeps the old keys).
async fn reload_on_sighup(
    auth: Option<Arc<JwtAuth>>,
    tls: Option<Arc<TlsConfig>>,
    cancel: CancellationToken,
) {
    use tokio::signal::unix::{SignalKind, signal};
    let mut hup = match signal(SignalKind::hangup()) {
        Ok(h) => h,
        Err(e) => {
            tracing::error!("installing the SIGHUP handler: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = hup.recv() => {}
            _ = cancel.cancelled() => return,
        }
        tracing::info!("SIGHUP received, reloading keys and certificates");
        if let Some(tls) = &tls {
            match tls.reload() {
                Ok(()) => {
                    tracing::info!(cert = %tls.cert_path().display(), "TLS certificate reloaded")
                }
                Err(e) => tracing::error!(
                    "reloading the TLS certificate (the old one stays in force): {e:#}"
                ),
            }
        }
        if let Some(auth) = &auth {
            match auth.reload() {
                Ok(n) => {
                    tracing::info!(keys = n, path = %auth.path().display(), "JWT keys reloaded")
                }
                Err(e) => tracing::error!("reloading JWT keys (the old ones stay in force): {e:#}"),
            }
        }
    }
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
