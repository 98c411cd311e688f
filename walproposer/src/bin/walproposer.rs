//! walproposer: elects itself over N safekeepers and streams WAL to them, committing on a
//! quorum. Thin: flags, tracing, then `walproposer`.
//!
//! It runs on one thread (a current-thread tokio runtime): a proposer's work is one sequence
//! (source → push → N sockets → acknowledgements → commit), and on these machines every hand-off
//! between threads costs tens of µs of a commit's latency (waking a sleeping vCPU), more than
//! the work it would spread. The kernel wakes that thread directly when a reply arrives
//! (`e2e_commit` in wal-bench measures the path with this runtime).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use sk_core::types::{Lsn, TenantId, TenantTimelineId, TimelineId};
use walproposer::conn::SafekeeperAddr;
use walproposer::postgres::{self, ConnInfo, Primary, SourceOptions};
use walproposer::synthetic::{self, AckLedger, SyntheticOptions};
use walproposer::{Proposer, ProposerConfig};

profiling::global_allocator!();

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Source {
    /// Valid logical-message WAL from the built-in generator.
    Synthetic,
    /// A real PostgreSQL primary, through a physical replication slot (`--source-conninfo`);
    /// runs until SIGINT or SIGTERM.
    Postgres,
}

/// Elects itself over N safekeepers (neon protocol v3) and streams WAL to them, committing on
/// a quorum.
#[derive(Parser, Debug)]
#[command(name = "walproposer", version, about)]
struct Args {
    /// Safekeepers' PostgreSQL-protocol addresses, comma separated.
    #[arg(
        long,
        env = "WALPROPOSER_SAFEKEEPERS",
        value_delimiter = ',',
        required = true
    )]
    safekeepers: Vec<String>,
    /// Tenant id (32 hex characters).
    #[arg(long, default_value = "de200bd42b49cc1814412c7e592dd6e9")]
    tenant_id: TenantId,
    /// Timeline id (32 hex characters).
    #[arg(long, default_value = "9e4c8f36bca74c2bc9b7b0f1bd0c6f0b")]
    timeline_id: TimelineId,
    /// PostgreSQL system identifier of the WAL.
    #[arg(long, default_value_t = 7_400_000_000_000_000_001)]
    system_id: u64,
    /// PostgreSQL version number.
    #[arg(long, default_value_t = 150018)]
    pg_version: u32,
    /// WAL segment size in bytes (power of two, 1 MiB to 1 GiB).
    #[arg(long, default_value_t = 16 << 20)]
    wal_seg_size: u32,
    /// Where WAL begins on an empty timeline.
    #[arg(long, default_value = "0/1000000")]
    start_lsn: Lsn,
    /// The safekeepers' password: a JWT (scope `safekeeperdata`, or `tenant` for this tenant)
    /// for safekeepers with --auth-public-key-path, or the shared secret of
    /// --pg-auth-token-file. Prefer the environment variable or --auth-token-file: a flag's
    /// value shows in `ps`.
    #[arg(long, env = "WALPROPOSER_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// TLS to the safekeepers, as libpq's sslmode: disable, require (encrypted, certificate not
    /// checked) or verify-full (the certificate must chain to --sslrootcert and name the host).
    #[arg(long, value_enum, default_value = "disable")]
    sslmode: walproposer::tls::SslMode,
    /// CA certificates (PEM) for --sslmode verify-full.
    #[arg(long)]
    sslrootcert: Option<std::path::PathBuf>,
    /// A file holding the token (see --auth-token); an unreadable or empty file is an error.
    #[arg(
        long,
        env = "WALPROPOSER_AUTH_TOKEN_FILE",
        conflicts_with = "auth_token"
    )]
    auth_token_file: Option<std::path::PathBuf>,
    /// Append every quorum-commit advance (an acknowledgement) to this file: `<end LSN>` per
    /// line, with the synthetic source `<end LSN> <sha256>` of the WAL from the previous line's
    /// end.
    #[arg(long)]
    ack_log: Option<std::path::PathBuf>,
    /// Elect, make the end of WAL committed on a quorum, print that LSN, exit.
    #[arg(long)]
    sync: bool,
    /// Where WAL comes from.
    #[arg(long, value_enum, default_value = "synthetic")]
    source: Source,
    /// Postgres: libpq-style `key=value` connection string of the primary (host, port, user,
    /// password; trust or cleartext password authentication).
    #[arg(long, default_value = "host=127.0.0.1 port=5432 user=postgres")]
    source_conninfo: String,
    /// Postgres: physical replication slot on the primary (created if missing).
    #[arg(long, default_value = postgres::DEFAULT_SLOT)]
    source_slot: String,
    /// Postgres: seconds between progress lines on stderr.
    #[arg(long, default_value_t = 5.0)]
    progress_interval: f64,
    /// Synthetic: payload bytes per record.
    #[arg(long, default_value = "1024", value_parser = parse_size)]
    record_size: u64,
    /// Synthetic: total WAL to generate (bytes; K, M, G suffixes are powers of 1024).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    total: u64,
    /// Pause appends while the slowest required reader (the safekeepers'
    /// `--backpressure-readers`) has flushed more than this many bytes less than our end of
    /// WAL; slow them from half of it. 0: no limit (K, M, G suffixes).
    #[arg(long, default_value = "0", value_parser = parse_size)]
    max_replication_flush_lag: u64,
    /// The same for what the slowest required reader has applied.
    #[arg(long, default_value = "0", value_parser = parse_size)]
    max_replication_apply_lag: u64,
    /// Synthetic: WAL bytes per second (default: as fast as the quorum commits).
    #[arg(long, value_parser = parse_size)]
    rate: Option<u64>,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let mult = match s[i..]
                .to_ascii_uppercase()
                .trim_end_matches("IB")
                .trim_end_matches('B')
            {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                other => return Err(format!("unknown size suffix {other:?} in {s:?}")),
            };
            (&s[..i], mult)
        }
        None => (s, 1),
    };
    num.trim()
        .parse::<u64>()
        .map(|n| n * mult)
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 1024, 64K, 16M, 1G"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour codes only for a terminal: log files stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if let Err(e) = run(Args::parse()).await {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// Appends every quorum-commit advance of `proposer` to `path`, so a test can check that
/// nothing acknowledged is ever lost. Each line is written with one `write` (a kill cannot tear
/// it): `<end LSN>`, or with a `ledger` (the synthetic source) `<end LSN> <sha256 hex>` where the
/// digest covers the WAL from the previous line's end to this one; a bare `<LSN>` line marks
/// where digests resume (a new proposer, or a commit of WAL this process did not push). Ends
/// when the proposer stops.
fn spawn_ack_log(
    proposer: &Proposer,
    path: &std::path::Path,
    ledger: Option<Arc<AckLedger>>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening --ack-log {}", path.display()))?;
    let mut rx = proposer.subscribe();
    Ok(tokio::spawn(async move {
        let mut logged = Lsn::INVALID;
        let mut last_line_end = None;
        loop {
            let commit = rx.borrow_and_update().commit_lsn;
            if commit > logged {
                let line = match ledger.as_ref().and_then(|l| l.acknowledge(commit)) {
                    Some((from, digest)) if last_line_end == Some(from) => {
                        format!("{commit} {digest}\n")
                    }
                    Some((from, digest)) => format!("{from}\n{commit} {digest}\n"),
                    None => format!("{commit}\n"),
                };
                if let Err(e) = file.write_all(line.as_bytes()) {
                    tracing::error!("writing the ack log: {e}");
                    return;
                }
                logged = commit;
                last_line_end = Some(commit);
            }
            if rx.changed().await.is_err() {
                return;
            }
        }
    }))
}

/// The token of `--auth-token-file` (trailing whitespace trimmed) or `--auth-token`.
fn auth_token(args: &Args) -> anyhow::Result<Option<String>> {
    let Some(path) = &args.auth_token_file else {
        return Ok(args.auth_token.clone());
    };
    let token = std::fs::read_to_string(path)
        .with_context(|| format!("--auth-token-file {}: cannot read the file", path.display()))?;
    let token = token.trim();
    if token.is_empty() {
        anyhow::bail!("--auth-token-file {}: the file is empty", path.display());
    }
    Ok(Some(token.to_string()))
}

async fn run(args: Args) -> anyhow::Result<()> {
    // The relay takes the version from the primary (and checks it there).
    if !matches!(args.source, Source::Postgres) {
        pg_wal::PgMajor::from_server_version(args.pg_version).context("--pg-version")?;
    }
    let token = auth_token(&args)?;
    let tls = walproposer::tls::ClientTls::new(args.sslmode, args.sslrootcert.as_deref())?;
    let safekeepers = args
        .safekeepers
        .iter()
        .map(|s| {
            SafekeeperAddr::parse(s).map(|mut a| {
                a.password = token.clone();
                a.tls = tls.clone();
                a
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(anyhow::Error::msg)?;
    let cfg = ProposerConfig {
        safekeepers,
        ttid: TenantTimelineId {
            tenant_id: args.tenant_id,
            timeline_id: args.timeline_id,
        },
        system_id: args.system_id,
        pg_version: args.pg_version,
        wal_seg_size: args.wal_seg_size,
        start_lsn: args.start_lsn,
        allow_timeline_creation: true,
        max_replication_flush_lag: args.max_replication_flush_lag,
        max_replication_apply_lag: args.max_replication_apply_lag,
    };
    if matches!(args.source, Source::Postgres) {
        return relay_postgres(&args, cfg).await;
    }
    let ledger = Arc::new(AckLedger::new());
    let Some((proposer, ack_log)) = elect(&args, cfg, Some(ledger.clone())).await? else {
        return Ok(()); // --sync: done
    };
    match args.source {
        Source::Synthetic => {
            let opts = SyntheticOptions {
                record_size: args.record_size as usize,
                total_bytes: args.total,
                rate: args.rate,
                ..SyntheticOptions::default()
            };
            let stats = synthetic::run_with_ledger(&proposer, &opts, Some(&ledger)).await?;
            proposer.finish(Duration::from_secs(10)).await;
            if let Some(task) = ack_log {
                let _ = task.await;
            }
            println!("{}", serde_json::to_string(&stats)?);
        }
        Source::Postgres => unreachable!("handled by relay_postgres"),
    }
    Ok(())
}

/// Elects; with `--sync` also commits the end of WAL, prints it and returns `None`. Otherwise
/// returns the proposer and the `--ack-log` writer, if any.
async fn elect(
    args: &Args,
    cfg: ProposerConfig,
    ledger: Option<Arc<AckLedger>>,
) -> anyhow::Result<Option<(Proposer, Option<tokio::task::JoinHandle<()>>)>> {
    let proposer = Proposer::elect(cfg).await.context("election")?;
    tracing::info!(term = %proposer.term(), start = %proposer.term_start_lsn(), "elected");
    let ack_log = match &args.ack_log {
        Some(path) => Some(spawn_ack_log(&proposer, path, ledger)?),
        None => None,
    };
    if args.sync {
        let lsn = proposer.sync().await?;
        proposer.finish(Duration::from_secs(10)).await;
        println!("{lsn}");
        return Ok(None);
    }
    Ok(Some((proposer, ack_log)))
}

/// `--source postgres`: identify the primary, elect with its system id, version and segment
/// size, relay until SIGINT/SIGTERM, then finish gracefully and print the final stats as JSON.
async fn relay_postgres(args: &Args, cfg: ProposerConfig) -> anyhow::Result<()> {
    let conninfo: ConnInfo = args.source_conninfo.parse()?;
    let mut opts = SourceOptions::new(conninfo);
    opts.slot = args.source_slot.clone();
    opts.report_interval = Duration::from_secs_f64(args.progress_interval.max(0.1));
    let primary = Primary::connect(opts.clone())
        .await
        .context("connecting to the primary")?;
    let cfg = primary.proposer_config(cfg);
    let Some((proposer, ack_log)) = elect(args, cfg, None).await? else {
        return Ok(()); // --sync: done
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        on_signal.cancel();
    });
    let result = postgres::relay_until_shutdown(
        primary,
        &proposer,
        &shutdown,
        Duration::from_secs(10),
        |s| {
            eprintln!(
                "relayed {} bytes ({:.2} MB/s), received {}, committed {}",
                s.bytes, s.mb_per_second, s.received_lsn, s.commit_lsn
            )
        },
    )
    .await;
    proposer.finish(Duration::from_secs(10)).await;
    if let Some(task) = ack_log {
        let _ = task.await;
    }
    let Some(stats) = result.context("relaying")? else {
        eprintln!("stopped while reconnecting to the primary");
        return Ok(());
    };
    eprintln!(
        "relayed {} bytes in {:.1} s ({:.2} MB/s), committed {}",
        stats.bytes, stats.seconds, stats.mb_per_second, stats.commit_lsn
    );
    println!("{}", serde_json::to_string(&stats)?);
    Ok(())
}
