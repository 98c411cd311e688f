//! `wal-verify <timeline dir>`: decodes a timeline's WAL on disk record by record, as the
//! daemon's recovery does, with the page magic and resource managers of the timeline's
//! PostgreSQL version (from its control file) and every record's CRC-32C checked, and prints
//! what it found as one JSON line. Exits 1 if the WAL does not decode up to the end asked for
//! (by default the control file's commit LSN).
//!
//! Offline and read-only: run it on a stopped node's directory or a copy (a running daemon may
//! be writing the last segment). It does not need the daemon to start, so it also inspects a
//! directory the daemon refuses.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use pg_wal::{Lsn, PgMajor};
use safekeeper::control_file::{self, CONTROL_FILE_NAME};
use safekeeper::wal_store::first_local_segment;
use safekeeper::wal_store::recovery::verify_committed_wal;
use sk_core::storage::fs::Fs;

/// Decode a timeline directory's WAL record by record and check every record's CRC.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The timeline directory (holding `safekeeper.control` and the segment files).
    dir: PathBuf,
    /// First byte to decode (a record boundary or a segment start); default: the start of the
    /// first local segment, or the timeline's `local_start_lsn` if that is later.
    #[arg(long)]
    from: Option<Lsn>,
    /// Decode up to here; default: the control file's commit LSN.
    #[arg(long)]
    to: Option<Lsn>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match verify(&args) {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("wal-verify: {}: {e}", args.dir.display());
            ExitCode::FAILURE
        }
    }
}

fn verify(args: &Args) -> Result<serde_json::Value, String> {
    let dir: &Path = &args.dir;
    let path = dir.join(CONTROL_FILE_NAME);
    let bytes = std::fs::read(&path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let state = control_file::decode(&bytes, &path).map_err(|e| e.to_string())?;
    let major = PgMajor::from_server_version(state.server.pg_version).map_err(|e| e.to_string())?;
    let seg_size = u64::from(state.server.wal_seg_size);
    if !pg_wal::format::is_valid_seg_size(seg_size) {
        return Err(format!(
            "the control file gives an invalid WAL segment size {seg_size}"
        ));
    }
    let fs = Fs::real();
    let first = first_local_segment(&fs, dir, seg_size)
        .map_err(|e| e.to_string())?
        .ok_or("no WAL segments")?;
    let from = args
        .from
        .unwrap_or_else(|| Lsn(first * seg_size).max(state.local_start_lsn));
    let to = args.to.unwrap_or(state.commit_lsn);
    if to < from {
        return Err(format!("nothing to decode: end {to} is below start {from}"));
    }
    let records =
        verify_committed_wal(&fs, dir, seg_size, major, from, to).map_err(|e| e.to_string())?;
    Ok(serde_json::json!({
        "pg_version": state.server.pg_version,
        "major": major.number(),
        "page_magic": format!("{:#06X}", major.page_magic()),
        "from": from.to_string(),
        "to": to.to_string(),
        "records": records,
        "commit_lsn": state.commit_lsn.to_string(),
    }))
}
