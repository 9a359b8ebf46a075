//! Peer copy of model files over `net`'s `/shoal/files/1` protocol. `serve` answers peers'
//! requests from this node's store: the verified file list of a model, and byte ranges of
//! listed files only (never a path outside them). `PeerSource` is the requesting side: it asks
//! peers which of them hold a model, and copies a file from one of them in bounded chunks with
//! a window of requests in flight, resuming from a `.part` file, and checks the size and sha256
//! before the file is renamed into place; a peer that lies or vanishes is an error that the
//! caller answers by trying the next source. It decides nothing about which files a node needs.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesOrdered, StreamExt};
use libp2p::PeerId;
use sha2::{Digest, Sha256};
use shoal_proto::v1::{self, file_request, file_response, ErrorCode, FileRequest, FileResponse};
use shoal_proto::{MAX_CHUNK_BYTES, WIRE_VERSION};
use tokio::io::AsyncWriteExt;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::hub::hash_prefix;
use super::progress::Transfer;
use super::store::{hex, is_safe_relative, FileRecord, Servable, Store};
use super::ModelsError;
use crate::cluster::NodeAdvert;
use crate::net::files::error_response;
use crate::net::{InboundFile, NetError, NetHandle};

/// Requests waiting for the server before peers are told BUSY.
const SERVE_QUEUE: usize = 256;
/// Reads served at once (each holds one chunk in memory).
const SERVE_PARALLEL: usize = 8;
/// How long a model's file list is reused before the store is asked again.
const LIST_TTL: Duration = Duration::from_secs(5);

/// Serves this node's models to peers until `cancel` fires or the network stops.
pub async fn serve(net: NetHandle, store: Arc<Store>, cancel: CancellationToken) -> Result<(), NetError> {
    let mut requests = net.serve_files(SERVE_QUEUE).await?;
    let permits = Arc::new(Semaphore::new(SERVE_PARALLEL));
    // Lists by model id, so that reading chunks does not rescan the store for every chunk.
    let lists: Arc<std::sync::Mutex<HashMap<String, (Servable, Instant)>>> = Default::default();
    loop {
        let request = tokio::select! {
            biased;
            _ = cancel.cancelled() => break,
            r = requests.recv() => match r { Some(r) => r, None => break },
        };
        // The semaphore is never closed, so acquiring only waits.
        let Ok(permit) = permits.clone().acquire_owned().await else { break };
        let (store, lists) = (store.clone(), lists.clone());
        tokio::task::spawn_blocking(move || {
            let InboundFile { from, request, reply } = request;
            let response = answer(&store, &lists, request);
            if let Some(file_response::Body::Error(e)) = &response.body {
                tracing::debug!(target: "shoal::models", %from, error = %e.message, "file request refused");
            }
            let _ = reply.send(response); // the requester may have gone
            drop(permit);
        });
    }
    Ok(())
}

type Lists = std::sync::Mutex<HashMap<String, (Servable, Instant)>>;

fn servable(store: &Store, lists: &Lists, model: &str) -> Result<Servable, ModelsError> {
    if let Some((s, at)) = lists.lock().unwrap_or_else(|p| p.into_inner()).get(model) {
        if at.elapsed() < LIST_TTL {
            return Ok(s.clone());
        }
    }
    let s = store.servable(model)?;
    lists.lock().unwrap_or_else(|p| p.into_inner()).insert(model.to_string(), (s.clone(), Instant::now()));
    Ok(s)
}

/// One answer, from the store. Blocking file I/O.
fn answer(store: &Store, lists: &Lists, request: FileRequest) -> FileResponse {
    let body = match request.body {
        Some(file_request::Body::List(l)) => match servable(store, lists, &l.model) {
            Ok(s) => file_response::Body::List(v1::FileList {
                model: s.manifest.id,
                repo: s.manifest.repo.unwrap_or_default(),
                revision: s.manifest.revision.unwrap_or_default(),
                files: s.manifest.files.into_iter().map(|f| v1::FileEntry { path: f.path, size: f.size, sha256: f.sha256 }).collect(),
            }),
            Err(e) => return error_response(ErrorCode::NotServing, e.to_string()),
        },
        Some(file_request::Body::Read(r)) => {
            let s = match servable(store, lists, &r.model) {
                Ok(s) => s,
                Err(e) => return error_response(ErrorCode::NotServing, e.to_string()),
            };
            let Some(record) = s.manifest.file(&r.path) else { return error_response(ErrorCode::NotServing, format!("{} is not a file of {}", r.path, r.model)) };
            if r.offset >= record.size {
                return error_response(ErrorCode::BadRequest, format!("offset {} is past the end of {} ({} bytes)", r.offset, r.path, record.size));
            }
            let len = (record.size - r.offset).min(u64::from(r.length)).min(MAX_CHUNK_BYTES as u64) as usize;
            match read_at(&s.base.join(&record.path), r.offset, len) {
                Ok(data) => file_response::Body::Chunk(v1::FileChunk { offset: r.offset, data }),
                Err(e) => return error_response(ErrorCode::Internal, format!("{}: {e}", r.path)),
            }
        }
        // `net` checks that a request has a body before it reaches us.
        None => return error_response(ErrorCode::BadRequest, "no body"),
    };
    FileResponse { version: WIRE_VERSION, body: Some(body) }
}

fn read_at(path: &Path, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(path)?;
    f.seek(SeekFrom::Start(offset))?;
    let mut data = Vec::with_capacity(len);
    f.take(len as u64).read_to_end(&mut data)?;
    if data.len() != len {
        return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the file is shorter than its manifest says"));
    }
    Ok(data)
}

/// The peers whose latest adverts say they hold model `id` (`NodeAdvert::models`), for
/// `PeerSource::peers`; the list of files itself is asked for over the wire.
pub fn peers_holding<'a>(adverts: impl IntoIterator<Item = (&'a PeerId, &'a NodeAdvert)>, id: &str) -> Vec<PeerId> {
    adverts.into_iter().filter(|(_, a)| a.models.iter().any(|h| h == id)).map(|(p, _)| *p).collect()
}

/// A peer's list of a model's files.
#[derive(Debug, Clone)]
pub struct PeerList {
    pub peer: PeerId,
    pub repo: Option<String>,
    pub revision: Option<String>,
    pub files: Vec<FileRecord>,
}

/// The peers to copy from, through this node's network.
#[derive(Debug, Clone)]
pub struct PeerSource {
    pub net: NetHandle,
    pub peers: Vec<PeerId>,
    /// Deadline of one list or chunk request.
    pub deadline: Duration,
    /// Bytes per chunk request (at most `MAX_CHUNK_BYTES`).
    pub chunk: u32,
    /// Chunk requests in flight per file.
    pub window: usize,
}

impl PeerSource {
    pub fn new(net: NetHandle, peers: Vec<PeerId>) -> Self {
        PeerSource { net, peers, deadline: Duration::from_secs(10), chunk: 1 << 20, window: 8 }
    }

    /// The peers that hold model `id`, with their lists (asked all at once; a peer that does
    /// not answer within the deadline, or does not hold it, is left out).
    pub async fn holders(&self, id: &str) -> Vec<PeerList> {
        let asks = self.peers.iter().map(|peer| async move {
            let request = FileRequest { version: WIRE_VERSION, body: Some(file_request::Body::List(v1::ListFiles { model: id.to_string() })) };
            match self.net.file_request(*peer, request, self.deadline).await {
                Ok(FileResponse { body: Some(file_response::Body::List(l)), .. }) if l.model == id && l.files.iter().all(|f| is_safe_relative(&f.path)) => Some(PeerList {
                    peer: *peer,
                    repo: Some(l.repo).filter(|r| !r.is_empty()),
                    revision: Some(l.revision).filter(|r| !r.is_empty()),
                    files: l.files.into_iter().map(|f| FileRecord { path: f.path, size: f.size, sha256: f.sha256.to_ascii_lowercase() }).collect(),
                }),
                Ok(other) => {
                    tracing::debug!(target: "shoal::models", %peer, ?other, "peer does not hold the model");
                    None
                }
                Err(e) => {
                    tracing::debug!(target: "shoal::models", %peer, error = %e, "peer did not list the model");
                    None
                }
            }
        });
        futures_util::future::join_all(asks).await.into_iter().flatten().collect()
    }

    /// Copies `expected.path` of model `id` from `peer` through `part` into `dest`, checking its
    /// size and sha256 against `expected`. Returns the bytes that came over the network.
    #[allow(clippy::too_many_arguments)]
    pub async fn copy_file(&self, peer: PeerId, id: &str, expected: &FileRecord, part: &Path, dest: &Path, transfer: &Transfer, cancel: &CancellationToken) -> Result<u64, ModelsError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| ModelsError::Io { path, source }
        };
        let lie = |reason: String| ModelsError::Peer { peer: peer.to_string(), reason };
        if let Some(dir) = part.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
        }
        let (mut hasher, mut have) = hash_prefix(part).await?;
        if have > expected.size {
            tokio::fs::remove_file(part).await.map_err(io(part))?;
            (hasher, have) = (Sha256::new(), 0);
        }
        transfer.add(have);
        let resumed = have;
        let mut counted = have;
        let result: Result<(), ModelsError> = async {
            let mut out = tokio::fs::OpenOptions::new().create(true).append(true).open(part).await.map_err(io(part))?;
            let chunk = u64::from(self.chunk.clamp(1, MAX_CHUNK_BYTES as u32));
            let mut next = have;
            let mut in_flight = FuturesOrdered::new();
            let read = |offset: u64| {
                let length = (expected.size - offset).min(chunk) as u32;
                let request = FileRequest { version: WIRE_VERSION, body: Some(file_request::Body::Read(v1::ReadRange { model: id.to_string(), path: expected.path.clone(), offset, length })) };
                let net = self.net.clone();
                let deadline = self.deadline;
                async move { (offset, length, net.file_request(peer, request, deadline).await) }
            };
            while have < expected.size {
                while in_flight.len() < self.window.max(1) && next < expected.size {
                    in_flight.push_back(read(next));
                    next += chunk.min(expected.size - next);
                }
                let (offset, length, response) = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => return Err(ModelsError::Cancelled),
                    r = in_flight.next() => r.expect("the window is refilled before every wait"),
                };
                let data = match response.map_err(|e| lie(e.to_string()))?.body {
                    Some(file_response::Body::Chunk(c)) if c.offset == offset && c.data.len() == length as usize => c.data,
                    Some(file_response::Body::Chunk(c)) => return Err(lie(format!("asked for {length} bytes at {offset}, got {} at {}", c.data.len(), c.offset))),
                    Some(file_response::Body::Error(e)) => return Err(lie(e.message)),
                    other => return Err(lie(format!("unexpected answer {other:?}"))),
                };
                out.write_all(&data).await.map_err(io(part))?;
                hasher.update(&data);
                have += data.len() as u64;
                transfer.add(data.len() as u64);
                counted += data.len() as u64;
            }
            out.flush().await.map_err(io(part))
        }
        .await;
        if let Err(e) = result {
            // The part file stays for the next source to resume; a final hash check catches
            // bad bytes in it. The transfer forgets this attempt's bytes: the next one recounts.
            transfer.sub(counted);
            return Err(e);
        }
        let got = hex(&hasher.finalize());
        if got != expected.sha256 {
            let _ = tokio::fs::remove_file(part).await;
            transfer.sub(counted);
            return Err(ModelsError::HashMismatch { file: format!("{} from peer {peer}", expected.path), expected: expected.sha256.clone(), got });
        }
        if let Some(dir) = dest.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(io(dir))?;
        }
        tokio::fs::rename(part, dest).await.map_err(io(dest))?;
        Ok(expected.size - resumed)
    }
}
