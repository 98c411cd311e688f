//! Key, token and certificate files given on the command line (a leaf: it imports nothing of
//! this crate, so configuration, authentication, TLS and the peer client all use it).

use std::path::Path;

use anyhow::{Context, bail};

/// Reads a key, token or certificate file given with `flag`. An unreadable file, or one that is
/// empty or only whitespace, is an error naming the flag and the file: a daemon never starts
/// with an empty secret (an empty shared secret would make the empty password valid).
pub fn read_secret_file(flag: &str, path: &Path) -> anyhow::Result<Vec<u8>> {
    let bytes = std::fs::read(path)
        .with_context(|| format!("{flag} {}: cannot read the file", path.display()))?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        bail!("{flag} {}: the file is empty", path.display());
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_or_unreadable_secret_files_are_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty");
        std::fs::write(&empty, " \n").unwrap();
        let err = format!("{:#}", read_secret_file("--x", &empty).unwrap_err());
        assert!(
            err.contains("--x") && err.contains(&*empty.to_string_lossy()),
            "{err}"
        );
        assert!(err.contains("empty"), "{err}");
        let missing = dir.path().join("missing");
        let err = format!("{:#}", read_secret_file("--x", &missing).unwrap_err());
        assert!(
            err.contains(&*missing.to_string_lossy()) && err.contains("cannot read"),
            "{err}"
        );
        // A directory is not a readable file either.
        let err = format!("{:#}", read_secret_file("--x", dir.path()).unwrap_err());
        assert!(err.contains("cannot read"), "{err}");
        std::fs::write(&empty, "s3cret\n").unwrap();
        assert_eq!(read_secret_file("--x", &empty).unwrap(), b"s3cret\n");
    }
}
