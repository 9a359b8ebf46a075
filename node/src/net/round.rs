//! The cluster's highest epoch round, kept in `<data dir>/cluster.round` so that a restarted
//! leader never reuses an epoch (see `cluster::ClusterState::new`). It lives beside the swarm
//! because `cluster` does no I/O; it knows nothing of epochs beyond the number.
//! The file is one decimal number and a newline, replaced atomically (write, fsync, rename).

use std::io::Write;
use std::path::{Path, PathBuf};

/// The file's name inside the data directory.
pub const ROUND_FILE: &str = "cluster.round";

/// Why the round could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RoundFileError {
    /// Reading, writing or renaming the file failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The file holds something other than a number.
    #[error("{path}: not a round number ({text:?}); move it away to start from round 0")]
    Corrupt { path: PathBuf, text: String },
}

/// The stored round, or 0 when the node has never stored one.
pub fn load_highest_round(data_dir: &Path) -> Result<u64, RoundFileError> {
    let path = data_dir.join(ROUND_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse().map_err(|_| RoundFileError::Corrupt { path, text: text.chars().take(40).collect() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(source) => Err(RoundFileError::Io { path, source }),
    }
}

/// Stores `round` (call it whenever `ClusterState::highest_round` grows).
pub fn store_highest_round(data_dir: &Path, round: u64) -> Result<(), RoundFileError> {
    let path = data_dir.join(ROUND_FILE);
    let tmp = data_dir.join(format!(".{ROUND_FILE}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(data_dir)?;
        let mut file = std::fs::File::create(&tmp)?;
        writeln!(file, "{round}")?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path)
    };
    write().map_err(|source| RoundFileError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_round_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        assert_eq!(load_highest_round(&data).unwrap(), 0);
        store_highest_round(&data, 41).unwrap();
        store_highest_round(&data, 42).unwrap();
        assert_eq!(load_highest_round(&data).unwrap(), 42);
        std::fs::write(data.join(ROUND_FILE), "forty-two").unwrap();
        assert!(matches!(load_highest_round(&data), Err(RoundFileError::Corrupt { .. })));
    }
}
