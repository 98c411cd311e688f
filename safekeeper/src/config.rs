//! The daemon's configuration: command-line flags, each with an environment-variable override.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;
use clap::Parser;

use crate::limits::parse_duration;

/// mini-safekeeper: accepts PostgreSQL WAL from a proposer (neon's safekeeper protocol v3),
/// keeps it durably in WAL segments, and serves committed WAL to PostgreSQL readers.
#[derive(Parser, Debug, Clone)]
#[command(name = "safekeeper", version, about, long_about = None)]
pub struct Conf {
    /// This safekeeper's node id (unique within a safekeeper set). Stored in the data
    /// directory (`safekeeper.id`) at first start; later starts take it from there and refuse
    /// a different one. Default for a new, empty data directory: 1.
    #[arg(long, env = "SAFEKEEPER_ID")]
    pub id: Option<u64>,

    /// Data directory: one sub-directory per tenant and timeline. Created if missing.
    #[arg(long, env = "SAFEKEEPER_DATADIR", default_value = "safekeeper_data")]
    pub datadir: PathBuf,

    /// Address of the PostgreSQL-protocol listener (proposers and WAL readers).
    #[arg(long, env = "SAFEKEEPER_LISTEN_PG", default_value = "127.0.0.1:5454")]
    pub listen_pg: SocketAddr,

    /// Address of the HTTP listener (status, metrics, profiles).
    #[arg(long, env = "SAFEKEEPER_LISTEN_HTTP", default_value = "127.0.0.1:7676")]
    pub listen_http: SocketAddr,

    /// After binding, write the listeners' addresses to this file, as JSON
    /// `{"pg": "127.0.0.1:5454", "http": "127.0.0.1:7676"}` (written to a temporary file and
    /// renamed, so a reader sees all of it or nothing). With port 0 in --listen-pg or
    /// --listen-http the kernel picks a free port, and this file says which.
    #[arg(long, env = "SAFEKEEPER_ADDR_FILE")]
    pub addr_file: Option<PathBuf>,

    /// File holding a shared secret that clients of the PostgreSQL port must send as their
    /// password (cleartext). Without it, connections are trusted (loopback use).
    #[arg(long, env = "SAFEKEEPER_PG_AUTH_TOKEN_FILE")]
    pub pg_auth_token_file: Option<PathBuf>,

    /// Ed25519 public keys that tokens are checked against (neon's JWT auth): a PEM file, or a
    /// directory of them; reloaded on SIGHUP. With keys, the PostgreSQL port takes a token as
    /// the password and HTTP as `Authorization: Bearer`. Without, the daemon is open and may
    /// listen on loopback addresses only (unless --allow-no-auth).
    #[arg(long, env = "SAFEKEEPER_AUTH_PUBLIC_KEY_PATH")]
    pub auth_public_key_path: Option<PathBuf>,

    /// Allow listening on a non-loopback address without --auth-public-key-path: anyone who can
    /// reach the ports can read and write every timeline.
    #[arg(long, env = "SAFEKEEPER_ALLOW_NO_AUTH")]
    pub allow_no_auth: bool,

    /// With --auth-public-key-path, require a token (scope safekeeperdata) on /v1/status,
    /// /metrics and /profile/* too. By default they stay open, as in neon, for scrapers and
    /// profilers.
    #[arg(long, env = "SAFEKEEPER_AUTH_OPS_ROUTES")]
    pub auth_ops_routes: bool,

    /// TLS certificate chain (PEM). With --tls-key, both ports require TLS: the PostgreSQL
    /// port answers SSLRequest `S` (and refuses clients that do not ask), HTTP becomes HTTPS.
    /// Reloaded on SIGHUP.
    #[arg(long, env = "SAFEKEEPER_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,

    /// TLS private key (PEM) of --tls-cert.
    #[arg(long, env = "SAFEKEEPER_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,

    /// Most PostgreSQL-protocol connections served at once; more are refused with
    /// PostgreSQL's "too many connections" error (SQLSTATE 53300).
    #[arg(long, env = "SAFEKEEPER_MAX_CONNECTIONS", default_value_t = 256,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_connections: usize,

    /// Most PostgreSQL-protocol connections in their startup handshake (not yet authenticated)
    /// at once, apart from --max-connections: when a new one arrives at a full pool the oldest
    /// handshaking one is closed, so sockets that never authenticate cannot keep clients out.
    #[arg(long, env = "SAFEKEEPER_MAX_HANDSHAKING_CONNECTIONS", default_value_t = 64,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_handshaking_connections: usize,

    /// A PostgreSQL-protocol connection on which no byte arrives, or none is accepted, for this
    /// long is closed, streaming ones included (proposers send a heartbeat every second,
    /// readers feedback every 10 s). `500ms`, `30s`, `10m`, `2h`.
    #[arg(long, env = "SAFEKEEPER_PG_IDLE_TIMEOUT", default_value = "10m", value_parser = parse_duration)]
    pub pg_idle_timeout: Duration,

    /// Time a client of the PostgreSQL port has to finish the startup handshake (encryption,
    /// startup packet, password).
    #[arg(long, env = "SAFEKEEPER_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = parse_duration)]
    pub handshake_timeout: Duration,

    /// Most HTTP requests in progress at once in each route class (data routes; status,
    /// metrics and profiles); more get 503.
    #[arg(long, env = "SAFEKEEPER_HTTP_MAX_CONCURRENT_REQUESTS", default_value_t = 128,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub http_max_concurrent_requests: usize,

    /// Most WAL segment files held open for writing, over all timelines: the least recently
    /// written ones are closed (fsynced first if they hold unsynced WAL) and opened again on
    /// their next write. Default: 512, or half the open-files limit (`ulimit -n`, raised to its
    /// hard limit at start) if that is lower.
    #[arg(long, env = "SAFEKEEPER_MAX_OPEN_SEGMENT_FILES",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_open_segment_files: Option<usize>,

    /// Zero-filled WAL segments the node keeps ready in `<datadir>/segment_pool` (of the size
    /// the timelines ask for, 16 MiB until one asks for another),
    /// written only while no WAL was flushed for a second and the file system stays under 90 %
    /// used (or `--max-disk-usage-ratio`, if lower). A timeline takes one for each new segment instead of zero-filling its own under
    /// its commits: a burst of this many segments of WAL writes no zeros. `0`: no pool. Not
    /// kept under `--no-sync`, nor with a `--max-timeline-disk-usage` under 64 MiB (a pooled
    /// segment counts whole against it).
    #[arg(long, env = "SAFEKEEPER_PREPARED_SEGMENTS", default_value_t = 4)]
    pub prepared_segments: usize,

    /// Skip every fsync. Only for tests and benchmarks: a crash can lose acknowledged WAL.
    #[arg(long, env = "SAFEKEEPER_NO_SYNC")]
    pub no_sync: bool,

    /// Log format on stderr: `text` (colours only when stderr is a terminal) or `json` (one
    /// object per line; a timeline's lines carry its ids under `span`).
    #[arg(long, env = "SAFEKEEPER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Remote storage that complete, committed WAL segments are backed up to: `file:///path`
    /// (local files) or `s3://bucket/prefix` (AWS environment: `AWS_ENDPOINT_URL`,
    /// `AWS_REGION`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`). Only with it are local
    /// segments removed (below the backed-up, committed, peer-needed and reader-held WAL, keeping
    /// --wal-keep-size) and readers below the local WAL served from it. Without it, no WAL is
    /// ever removed: every segment a reader may need stays on local disk.
    #[arg(long, env = "SAFEKEEPER_REMOTE_STORAGE")]
    pub remote_storage: Option<String>,

    /// WAL kept locally below the end of WAL even when it is backed up (like PostgreSQL's
    /// wal_keep_size): bytes, or with a unit `kB`, `MB`, `GB` (powers of 1024).
    #[arg(long, env = "SAFEKEEPER_WAL_KEEP_SIZE", default_value = "128MB", value_parser = parse_size)]
    pub wal_keep_size: u64,

    /// Most disk space one timeline's directory may use (`0`: no limit). Past it, the
    /// timeline's appends are refused with an error naming this limit, while reads, backup and
    /// removal go on; appends resume once usage is back under it.
    #[arg(long, env = "SAFEKEEPER_MAX_TIMELINE_DISK_USAGE", default_value = "0", value_parser = parse_size)]
    pub max_timeline_disk_usage: u64,

    /// Most used fraction (0 to 1) of the data directory's file system (`0`: no limit). Past
    /// it, every timeline's appends are refused with an error naming this limit; they resume
    /// once usage is back under it.
    #[arg(long, env = "SAFEKEEPER_MAX_DISK_USAGE_RATIO", default_value_t = 0.0, value_parser = parse_ratio)]
    pub max_disk_usage_ratio: f64,

    /// Most bytes of WAL read from remote storage for readers (below the local WAL) in
    /// progress or buffered at once on the node: each reader reads ranges of at most 1 MiB,
    /// taken from this budget before they are requested (readers wait for it beyond).
    #[arg(long, env = "SAFEKEEPER_REMOTE_READ_BUDGET", default_value = "64MB", value_parser = parse_size)]
    pub remote_read_budget: u64,

    /// With remote storage, how far behind the end of WAL a reader may hold local WAL from
    /// removal (like PostgreSQL's max_slot_wal_keep_size); a reader that falls further behind
    /// is cut with an error saying so. 0 (the default): readers hold nothing, and WAL removed
    /// under a reader is served to it from the store.
    #[arg(long, env = "SAFEKEEPER_MAX_READER_HOLD", default_value = "0", value_parser = parse_size)]
    pub max_reader_hold: u64,

    /// Readers whose lag the proposer feels (its `--max-replication-flush-lag` and
    /// `--max-replication-apply-lag`): their least positions are reported in every
    /// acknowledgement.
    /// `*` (any reader of committed WAL), `none`, or comma-separated `application_name`s.
    #[arg(long, env = "SAFEKEEPER_BACKPRESSURE_READERS", default_value = "*")]
    pub backpressure_readers: crate::feedback::RequiredReaders,

    /// With remote storage: committed WAL that no stored segment holds yet is uploaded as a
    /// partial segment (its committed part, an object of its own) once it has waited this long
    /// with no new complete segment backed up, so a timeline that goes quiet mid-segment has
    /// its committed WAL in the store within this time (neon: 15 min). `0`: never.
    #[arg(long, env = "SAFEKEEPER_PARTIAL_BACKUP_TIMEOUT", default_value = "5m", value_parser = parse_duration)]
    pub partial_backup_timeout: Duration,

    /// A timeline idle this long (no connection, no new WAL) whose WAL is wholly in remote
    /// storage (complete segments and a partial segment) is evicted: only its control file is
    /// kept locally, and it is restored on demand (a proposer, a reader, a pull). `0`: never.
    /// Only with `--remote-storage`.
    #[arg(long, env = "SAFEKEEPER_EVICTION_MIN_IDLE", default_value = "15m", value_parser = parse_duration)]
    pub eviction_min_idle: Duration,

    /// Most restores of evicted timelines running at once on the node.
    #[arg(long, env = "SAFEKEEPER_MAX_CONCURRENT_RESTORES", default_value_t = crate::registry::DEFAULT_RESTORES,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1024))]
    pub max_concurrent_restores: usize,

    /// Most segment uploads (or verifications) in progress at once on the node.
    #[arg(long, env = "SAFEKEEPER_BACKUP_PARALLELISM", default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    pub backup_parallelism: usize,

    /// The peers this safekeeper recovers WAL from, by node id: `ID=HOST:HTTP_PORT` (or
    /// `ID=https://HOST:HTTP_PORT`), comma-separated; this node's own id may be listed (it is
    /// skipped). A timeline that lags behind a peer in its current term while no proposer is
    /// connected fetches the missing WAL from it (README, "Peer recovery"). Empty: no recovery.
    #[arg(long, env = "SAFEKEEPER_PEERS", value_delimiter = ',', value_parser = parse_peer)]
    pub peers: Vec<(u64, String)>,

    /// File holding the token sent to peers (pull_timeline, peer recovery): HTTP
    /// `Authorization: Bearer` and the PostgreSQL password. For peers with
    /// --auth-public-key-path, a JWT of scope safekeeperdata.
    #[arg(long, env = "SAFEKEEPER_PEER_AUTH_TOKEN_PATH")]
    pub peer_auth_token_path: Option<PathBuf>,

    /// CA certificates (PEM) that `https://` peers' certificates are checked against (their
    /// PostgreSQL port is then reached over TLS too).
    #[arg(long, env = "SAFEKEEPER_PEER_CA")]
    pub peer_ca: Option<PathBuf>,

    /// Serve the test-only HTTP routes (failpoints, debug memory). Not a flag: only the
    /// `safekeeper-testing` binary (built with the `testing` feature) sets it; without that
    /// feature the routes are not compiled at all.
    #[arg(skip)]
    pub test_hooks: bool,
}

/// How log lines are written (`--log-format`).
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines; ANSI colours only when stderr is a terminal.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `message` and the event's
    /// fields at the top level, the current span's fields under `span`.
    Json,
}

impl Conf {
    /// Refuses to listen beyond loopback without authentication, unless --allow-no-auth.
    pub fn check_open_binding(&self) -> anyhow::Result<()> {
        if self.auth_public_key_path.is_some() || self.allow_no_auth {
            return Ok(());
        }
        for (flag, addr) in [
            ("--listen-pg", self.listen_pg),
            ("--listen-http", self.listen_http),
        ] {
            if !addr.ip().is_loopback() {
                bail!(
                    "{flag} {addr} is not a loopback address and authentication is off: give \
                     --auth-public-key-path, or --allow-no-auth to serve it open"
                );
            }
        }
        Ok(())
    }

    /// A configuration with defaults for `datadir`, listening on ephemeral loopback ports (for
    /// tests).
    pub fn for_tests(datadir: PathBuf) -> Conf {
        Conf {
            id: Some(1),
            datadir,
            listen_pg: "127.0.0.1:0".parse().expect("valid address"),
            listen_http: "127.0.0.1:0".parse().expect("valid address"),
            addr_file: None,
            no_sync: false,
            pg_auth_token_file: None,
            auth_public_key_path: None,
            tls_cert: None,
            tls_key: None,
            allow_no_auth: false,
            auth_ops_routes: false,
            max_connections: 256,
            max_handshaking_connections: 64,
            max_open_segment_files: None,
            // Every test daemon would otherwise write 64 MiB of zeros; the pool's own tests
            // turn it on.
            prepared_segments: 0,
            pg_idle_timeout: Duration::from_secs(600),
            handshake_timeout: Duration::from_secs(10),
            http_max_concurrent_requests: 128,
            test_hooks: false,
            remote_storage: None,
            wal_keep_size: 128 << 20,
            backup_parallelism: 4,
            partial_backup_timeout: Duration::from_secs(300),
            eviction_min_idle: Duration::from_secs(900),
            max_concurrent_restores: crate::registry::DEFAULT_RESTORES,
            remote_read_budget: 64 << 20,
            max_reader_hold: 0,
            backpressure_readers: Default::default(),
            max_timeline_disk_usage: 0,
            max_disk_usage_ratio: 0.0,
            log_format: LogFormat::Text,
            peers: Vec::new(),
            peer_auth_token_path: None,
            peer_ca: None,
        }
    }
}

/// Parses a size: bytes, or a number with `kB`, `MB`, `GB` (powers of 1024; `KiB`, `MiB`,
/// `GiB` too).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: expected e.g. 0, 16MB, 1GB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "k" | "K" | "kB" | "KB" | "KiB" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        "G" | "GB" | "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "invalid size unit {other:?} in {s:?}: use kB, MB or GB"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Parses one `--peers` entry, `ID=ADDRESS`.
pub fn parse_peer(s: &str) -> Result<(u64, String), String> {
    let bad = || format!("invalid peer {s:?}: expected ID=HOST:HTTP_PORT, e.g. 2=10.0.0.2:7676");
    let (id, addr) = s.trim().split_once('=').ok_or_else(bad)?;
    let id: u64 = id.parse().map_err(|_| bad())?;
    crate::peer::PeerAddr::parse(addr).map_err(|e| format!("peer {id}: {e}"))?;
    Ok((id, addr.to_string()))
}

/// Parses a fraction in `[0, 1)`.
pub fn parse_ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..1.0).contains(&r) => Ok(r),
        _ => Err(format!(
            "invalid ratio {s:?}: expected a number from 0 to below 1, e.g. 0.95"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("0"), Ok(0));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("16MB"), Ok(16 << 20));
        assert_eq!(parse_size("2kB"), Ok(2048));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert!(parse_size("1TB").is_err());
        assert!(parse_size("MB").is_err());
        assert!(parse_size("99999999999999GB").is_err());
    }

    #[test]
    fn peers_parse_as_id_and_address() {
        assert_eq!(
            parse_peer("2=127.0.0.1:7677"),
            Ok((2, "127.0.0.1:7677".into()))
        );
        assert_eq!(
            parse_peer("3=https://sk3:7676"),
            Ok((3, "https://sk3:7676".into()))
        );
        for bad in ["127.0.0.1:7677", "x=127.0.0.1:1", "2=nohost", "2="] {
            assert!(parse_peer(bad).is_err(), "{bad}");
        }
    }
}
