//! The node's persistent identity: an ed25519 keypair kept in `<data dir>/node.key`
//! (libp2p's protobuf key encoding, mode 0600), whose PeerId is the node id everywhere
//! (API, cluster view and swarm). A restart is the same node.
//! It does not sign or verify anything itself, and never prints or logs the key.

use std::io::Write;
use std::path::{Path, PathBuf};

pub use libp2p::identity::{Keypair, PeerId};

/// The key file's name inside the data directory.
pub const KEY_FILE: &str = "node.key";

/// Why the identity could not be loaded or created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// Reading, writing or creating the key file or its directory failed.
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The key file exists but does not hold a valid protobuf-encoded keypair.
    #[error("{path}: not a valid node key ({reason}); move it away to create a new identity")]
    Corrupt { path: PathBuf, reason: String },
    /// The key file is readable by other users.
    #[error("{path}: the node key is readable by others (mode {mode:o}); run `chmod 600` on it")]
    Exposed { path: PathBuf, mode: u32 },
}

/// Loads the node's keypair from `data_dir/node.key`, creating the directory and a fresh
/// ed25519 key (written atomically, mode 0600) when there is none.
pub fn load_or_create(data_dir: &Path) -> Result<Keypair, IdentityError> {
    let path = data_dir.join(KEY_FILE);
    let io = |source| IdentityError::Io { path: path.clone(), source };
    match std::fs::read(&path) {
        Ok(bytes) => {
            check_private(&path)?;
            Keypair::from_protobuf_encoding(&bytes).map_err(|e| IdentityError::Corrupt { path: path.clone(), reason: e.to_string() })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(data_dir).map_err(|source| IdentityError::Io { path: data_dir.to_path_buf(), source })?;
            let key = Keypair::generate_ed25519();
            // Encoding only fails for key types compiled out; ed25519 is compiled in.
            let bytes = key.to_protobuf_encoding().expect("ed25519 keys always encode");
            let tmp = data_dir.join(format!(".{KEY_FILE}.{}.tmp", std::process::id()));
            write_private(&tmp, &bytes).map_err(|source| IdentityError::Io { path: tmp.clone(), source })?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            Ok(key)
        }
        Err(e) => Err(io(e)),
    }
}

/// The node id: the PeerId of the key, as a string.
pub fn node_id(key: &Keypair) -> String {
    key.public().to_peer_id().to_string()
}

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path)?;
    file.write_all(bytes)?;
    file.sync_all()
}

#[cfg(unix)]
fn check_private(path: &Path) -> Result<(), IdentityError> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(path).map_err(|source| IdentityError::Io { path: path.to_path_buf(), source })?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(IdentityError::Exposed { path: path.to_path_buf(), mode });
    }
    Ok(())
}

#[cfg(not(unix))]
fn check_private(_path: &Path) -> Result<(), IdentityError> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restart_is_the_same_node() {
        let dir = tempfile::tempdir().unwrap();
        let first = node_id(&load_or_create(&dir.path().join("nested")).unwrap());
        let again = node_id(&load_or_create(&dir.path().join("nested")).unwrap());
        assert_eq!(first, again);
        assert!(first.starts_with("12D3KooW"), "an ed25519 PeerId: {first}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(dir.path().join("nested").join(KEY_FILE)).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn a_corrupt_key_is_an_error_not_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        write_private(&dir.path().join(KEY_FILE), b"not a key").unwrap();
        assert!(matches!(load_or_create(dir.path()), Err(IdentityError::Corrupt { .. })));
    }
}
