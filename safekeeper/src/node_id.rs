//! The node id a data directory belongs to, kept in `<datadir>/safekeeper.id`.
//!
//! A node votes and is counted in memberships by its id, so the id must follow the data, not
//! the command line: a restart without `--id` (once the default 1) or with another node's id
//! would make this node vote as someone else (issue 26, defect 7). The rules:
//!
//! - the first start writes the id durably (`--id`, or 1 for a new, empty data directory);
//! - a later start with a different `--id` refuses, naming both ids; without `--id` it takes
//!   the stored one;
//! - a data directory that holds timelines but no id file (made before this file existed, or
//!   the file was lost) refuses to start without `--id`: no id is guessed for existing data.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use sk_core::types::NodeId;

/// The file holding the node id (decimal, one line).
pub const NODE_ID_FILE: &str = "safekeeper.id";

/// The node id for data directory `datadir` (which exists and is locked), given `--id` as
/// `flag`; writes the id file durably if it is new.
pub fn resolve(datadir: &Path, flag: Option<u64>) -> anyhow::Result<NodeId> {
    let path = datadir.join(NODE_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let stored: u64 = text.trim().parse().with_context(|| {
                format!(
                    "{} does not hold a node id: {:?}",
                    path.display(),
                    text.trim()
                )
            })?;
            if let Some(id) = flag
                && id != stored
            {
                bail!(
                    "data directory {} belongs to safekeeper id {stored} ({}); --id {id} given: \
                     refusing to start as another node (give --id {stored}, or another \
                     --datadir for node {id})",
                    datadir.display(),
                    path.display()
                );
            }
            Ok(NodeId(stored))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = match flag {
                Some(id) => id,
                None if holds_timelines(datadir)? => bail!(
                    "data directory {} holds timelines but no {NODE_ID_FILE}: give --id with \
                     the node id it was serving as (it is then stored there)",
                    datadir.display()
                ),
                None => 1,
            };
            write_durably(datadir, &path, id)?;
            tracing::info!(id, file = %path.display(), "node id stored in the data directory");
            Ok(NodeId(id))
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// Whether `datadir` has a tenant directory with a timeline in it.
fn holds_timelines(datadir: &Path) -> anyhow::Result<bool> {
    for tenant in
        std::fs::read_dir(datadir).with_context(|| format!("reading {}", datadir.display()))?
    {
        let tenant = tenant?;
        let is_tenant = tenant
            .file_name()
            .to_str()
            .is_some_and(|n| n.parse::<sk_core::types::TenantId>().is_ok());
        if !is_tenant || !tenant.path().is_dir() {
            continue;
        }
        for tl in std::fs::read_dir(tenant.path())? {
            if tl?
                .path()
                .join(crate::control_file::CONTROL_FILE_NAME)
                .exists()
            {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// Writes the id under a temporary name, fsyncs it, renames it in and fsyncs the directory.
fn write_durably(datadir: &Path, path: &PathBuf, id: u64) -> anyhow::Result<()> {
    let tmp = datadir.join(format!("{NODE_ID_FILE}.tmp"));
    std::fs::write(&tmp, format!("{id}\n"))
        .and_then(|()| std::fs::File::open(&tmp)?.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))?;
    std::fs::File::open(datadir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("fsync {}", datadir.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_id_is_stored_at_first_start_and_a_different_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(resolve(dir.path(), Some(5)).unwrap(), NodeId(5));
        assert_eq!(
            std::fs::read_to_string(dir.path().join(NODE_ID_FILE)).unwrap(),
            "5\n"
        );
        // Without --id: the stored one, not 1.
        assert_eq!(resolve(dir.path(), None).unwrap(), NodeId(5));
        assert_eq!(resolve(dir.path(), Some(5)).unwrap(), NodeId(5));
        let err = resolve(dir.path(), Some(6)).unwrap_err().to_string();
        assert!(err.contains("id 5") && err.contains("--id 6"), "{err}");
    }

    #[test]
    fn no_id_is_guessed_for_a_data_directory_with_timelines() {
        let dir = tempfile::tempdir().unwrap();
        let tl = dir
            .path()
            .join("01010101010101010101010101010101")
            .join("07070707070707070707070707070707");
        std::fs::create_dir_all(&tl).unwrap();
        std::fs::write(tl.join(crate::control_file::CONTROL_FILE_NAME), b"x").unwrap();
        let err = resolve(dir.path(), None).unwrap_err().to_string();
        assert!(err.contains("give --id"), "{err}");
        assert!(!dir.path().join(NODE_ID_FILE).exists());
        // With --id it is adopted and stored.
        assert_eq!(resolve(dir.path(), Some(3)).unwrap(), NodeId(3));
        assert_eq!(resolve(dir.path(), None).unwrap(), NodeId(3));
    }

    #[test]
    fn a_new_empty_data_directory_without_id_is_node_1() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(resolve(dir.path(), None).unwrap(), NodeId(1));
        assert_eq!(resolve(dir.path(), Some(1)).unwrap(), NodeId(1));
        assert!(resolve(dir.path(), Some(2)).is_err());
    }
}
