//! The daemon's configuration: command-line flags, each with an environment-variable override.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;

use sk_core::types::NodeId;

/// mini-safekeeper: accepts PostgreSQL WAL from a proposer (neon's safekeeper protocol v3),
/// keeps it durably in WAL segments, and serves committed WAL to PostgreSQL readers.
#[derive(Parser, Debug, Clone)]
#[command(name = "safekeeper", version, about, long_about = None)]
pub struct Conf {
    /// This safekeeper's node id (unique within a safekeeper set).
    #[arg(long, env = "SAFEKEEPER_ID", default_value_t = 1)]
    pub id: u64,

    /// Data directory: one sub-directory per tenant and timeline. Created if missing.
    #[arg(long, env = "SAFEKEEPER_DATADIR", default_value = "safekeeper_data")]
    pub datadir: PathBuf,

    /// Address of the PostgreSQL-protocol listener (proposers and WAL readers).
    #[arg(long, env = "SAFEKEEPER_LISTEN_PG", default_value = "127.0.0.1:5454")]
    pub listen_pg: SocketAddr,

    /// Address of the HTTP listener (status, metrics, profiles).
    #[arg(long, env = "SAFEKEEPER_LISTEN_HTTP", default_value = "127.0.0.1:7676")]
    pub listen_http: SocketAddr,

    /// File holding a shared secret that clients of the PostgreSQL port must send as their
    /// password (cleartext). Without it, connections are trusted (loopback use).
    #[arg(long, env = "SAFEKEEPER_PG_AUTH_TOKEN_FILE")]
    pub pg_auth_token_file: Option<PathBuf>,

    /// Skip every fsync. Only for tests and benchmarks: a crash can lose acknowledged WAL.
    #[arg(long, env = "SAFEKEEPER_NO_SYNC")]
    pub no_sync: bool,

    /// Log format on stderr: `text` (colours only when stderr is a terminal) or `json` (one
    /// object per line; a timeline's lines carry its ids under `span`).
    #[arg(long, env = "SAFEKEEPER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
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
    /// `--id` as a node id.
    pub fn node_id(&self) -> NodeId {
        NodeId(self.id)
    }

    /// A configuration with defaults for `datadir`, listening on ephemeral loopback ports (for
    /// tests).
    pub fn for_tests(datadir: PathBuf) -> Conf {
        Conf {
            id: 1,
            datadir,
            listen_pg: "127.0.0.1:0".parse().expect("valid address"),
            listen_http: "127.0.0.1:0".parse().expect("valid address"),
            no_sync: false,
            pg_auth_token_file: None,
            log_format: LogFormat::Text,
        }
    }
}
