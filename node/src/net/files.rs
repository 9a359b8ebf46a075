//! The peer-copy protocol `/shoal/files/1`: one `FileRequest` (list a model's files, or read
//! a byte range of one) answered by one `FileResponse` per stream, with the codec, the shape
//! checks of both directions, and `FileRpcs`, the event loop's book of pending file calls
//! (each ends by response, failure, closed connection or deadline, like control RPCs).
//! Inbound requests go to the sink registered with `NetHandle::serve_files`, never to the
//! node's event channel; with no sink they are refused as NOT_SERVING. What a model or a file
//! is belongs to `models::peer`: this file checks sizes and versions only.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::time::Duration;

use libp2p::futures::future::BoxFuture;
use libp2p::futures::stream::FuturesUnordered;
use libp2p::futures::{AsyncRead, AsyncWrite};
use libp2p::request_response::{self as rr, InboundRequestId, OutboundFailure, OutboundRequestId, ResponseChannel};
use libp2p::{PeerId, StreamProtocol};
use prost::Message;
use shoal_proto::v1::{self, file_request, file_response, ErrorCode, FileRequest, FileResponse};
use shoal_proto::{MAX_CHUNK_BYTES, WIRE_VERSION};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::codec::{read_frame, write_frame};
use super::handle::NetCounters;
use super::wire::{check_len, WireError, MAX_ERROR_BYTES, MAX_STRING_BYTES};
use super::NetError;

pub const FILES_PROTOCOL: StreamProtocol = StreamProtocol::new("/shoal/files/1");

/// The most files one list may carry.
pub const MAX_LISTED_FILES: usize = 4096;
/// Longest file path in a list or a read.
pub const MAX_PATH_BYTES: usize = 1024;
/// Largest frame of this protocol: a full chunk plus its envelope, or a full list.
const MAX_FRAME: usize = MAX_CHUNK_BYTES + (2 << 20);

/// An inbound file request for the registered server. Send exactly one response on `reply`;
/// dropping it (or taking longer than `NetTimers::rpc_max`) fails the call at the requester.
#[derive(Debug)]
pub struct InboundFile {
    pub from: PeerId,
    pub request: FileRequest,
    pub reply: oneshot::Sender<FileResponse>,
}

/// Length-prefixed prost frames of this protocol.
#[derive(Debug, Clone, Copy, Default)]
pub struct FileCodec;

fn decode<M: Message + Default>(body: &[u8]) -> io::Result<M> {
    M::decode(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

impl rr::Codec for FileCodec {
    type Protocol = StreamProtocol;
    type Request = FileRequest;
    type Response = FileResponse;

    async fn read_request<T: AsyncRead + Unpin + Send>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<FileRequest> {
        decode(&read_frame(io, MAX_FRAME).await?)
    }
    async fn read_response<T: AsyncRead + Unpin + Send>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<FileResponse> {
        decode(&read_frame(io, MAX_FRAME).await?)
    }
    async fn write_request<T: AsyncWrite + Unpin + Send>(&mut self, _: &StreamProtocol, io: &mut T, req: FileRequest) -> io::Result<()> {
        write_frame(io, &req.encode_to_vec(), MAX_FRAME).await
    }
    async fn write_response<T: AsyncWrite + Unpin + Send>(&mut self, _: &StreamProtocol, io: &mut T, res: FileResponse) -> io::Result<()> {
        write_frame(io, &res.encode_to_vec(), MAX_FRAME).await
    }
}

/// Checks a file request, inbound or about to be sent.
pub fn check_request(request: &FileRequest) -> Result<(), WireError> {
    if request.version != WIRE_VERSION {
        return Err(WireError::Version { got: request.version });
    }
    match request.body.as_ref().ok_or(WireError::Missing("file_request.body"))? {
        file_request::Body::List(l) => check_len("list.model", &l.model, MAX_STRING_BYTES),
        file_request::Body::Read(r) => {
            check_len("read.model", &r.model, MAX_STRING_BYTES)?;
            check_len("read.path", &r.path, MAX_PATH_BYTES)?;
            if r.length == 0 || r.length as usize > MAX_CHUNK_BYTES {
                return Err(WireError::OutOfRange { field: "read.length" });
            }
            r.offset.checked_add(u64::from(r.length)).map(|_| ()).ok_or(WireError::OutOfRange { field: "read.offset" })
        }
    }
}

/// Checks a file response before the caller sees it.
pub fn check_response(response: &FileResponse) -> Result<(), WireError> {
    if response.version != WIRE_VERSION {
        return Err(WireError::Version { got: response.version });
    }
    match response.body.as_ref().ok_or(WireError::Missing("file_response.body"))? {
        file_response::Body::List(list) => {
            check_len("list.model", &list.model, MAX_STRING_BYTES)?;
            check_len("list.repo", &list.repo, MAX_STRING_BYTES)?;
            check_len("list.revision", &list.revision, MAX_STRING_BYTES)?;
            if list.files.len() > MAX_LISTED_FILES {
                return Err(WireError::TooMany { field: "list.files", len: list.files.len(), max: MAX_LISTED_FILES });
            }
            for f in &list.files {
                check_len("list.files.path", &f.path, MAX_PATH_BYTES)?;
                if f.sha256.len() != 64 || !f.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                    return Err(WireError::Decode(format!("{}: sha256 is not 64 hex digits", f.path)));
                }
            }
            Ok(())
        }
        file_response::Body::Chunk(c) if c.data.len() > MAX_CHUNK_BYTES => Err(WireError::TooLong { field: "chunk.data", len: c.data.len(), max: MAX_CHUNK_BYTES }),
        file_response::Body::Chunk(_) => Ok(()),
        file_response::Body::Error(e) => check_len("file_response.error.message", &e.message, MAX_ERROR_BYTES),
    }
}

/// The reply to a file request that could not be served.
pub fn error_response(code: ErrorCode, message: impl Into<String>) -> FileResponse {
    let mut message: String = message.into();
    message.truncate(MAX_ERROR_BYTES);
    FileResponse { version: WIRE_VERSION, body: Some(file_response::Body::Error(v1::RpcError { code: code as i32, message })) }
}

struct Outbound {
    peer: PeerId,
    deadline: Duration,
    /// To the caller of `NetHandle::file_request`, who awaits it.
    reply: oneshot::Sender<Result<FileResponse, NetError>>,
}

/// The event loop's pending file calls, both ways, and the registered server.
#[derive(Default)]
pub(super) struct FileRpcs {
    outbound: HashMap<OutboundRequestId, Outbound>,
    /// When each outbound call gives up, soonest first; entries already ended are skipped.
    deadlines: BinaryHeap<Reverse<(Instant, OutboundRequestId)>>,
    /// Inbound calls awaiting the server's answer: libp2p's channel back to the caller.
    inbound: HashMap<InboundRequestId, ResponseChannel<FileResponse>>,
    /// The server's answers; `None` when it dropped its sender or exceeded `rpc_max`.
    pub(super) answers: FuturesUnordered<BoxFuture<'static, (InboundRequestId, Option<FileResponse>)>>,
    /// Where inbound requests go (`NetHandle::serve_files`); its receiver is the file server.
    /// Closed or absent: requests are refused as NOT_SERVING.
    sink: Option<mpsc::Sender<InboundFile>>,
}

impl FileRpcs {
    pub(super) fn set_sink(&mut self, sink: mpsc::Sender<InboundFile>) {
        self.sink = Some(sink);
    }

    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.peek().map(|Reverse((at, _))| *at)
    }

    pub(super) fn send(&mut self, behaviour: &mut rr::Behaviour<FileCodec>, peer: PeerId, request: FileRequest, deadline: Duration, reply: oneshot::Sender<Result<FileResponse, NetError>>) {
        let id = behaviour.send_request(&peer, request);
        self.outbound.insert(id, Outbound { peer, deadline, reply });
        self.deadlines.push(Reverse((Instant::now() + deadline, id)));
    }

    fn finish(&mut self, id: OutboundRequestId, result: impl FnOnce(&Outbound) -> Result<FileResponse, NetError>) {
        if let Some(pending) = self.outbound.remove(&id) {
            let result = result(&pending);
            let _ = pending.reply.send(result); // the caller may have given up
        }
    }

    pub(super) fn expire(&mut self) {
        let now = Instant::now();
        while let Some(Reverse((at, id))) = self.deadlines.peek().copied() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            self.finish(id, |p| Err(NetError::Timeout { peer: p.peer, deadline: p.deadline }));
        }
    }

    pub(super) fn on_answer(&mut self, behaviour: &mut rr::Behaviour<FileCodec>, id: InboundRequestId, answer: Option<FileResponse>) {
        let Some(channel) = self.inbound.remove(&id) else { return }; // the caller is gone
        let response = answer.unwrap_or_else(|| error_response(ErrorCode::Internal, "the node did not answer"));
        // Err: the connection closed meanwhile; libp2p reports it as an inbound failure.
        let _ = behaviour.send_response(channel, response);
    }

    pub(super) fn on_event(&mut self, behaviour: &mut rr::Behaviour<FileCodec>, event: rr::Event<FileRequest, FileResponse>, counters: &NetCounters, rpc_max: Duration) {
        match event {
            rr::Event::Message { peer, message: rr::Message::Request { request_id, request, channel }, .. } => {
                if let Err(e) = check_request(&request) {
                    NetCounters::bump(&counters.bad_frames);
                    let code = if matches!(e, WireError::Version { .. }) { ErrorCode::UnsupportedVersion } else { ErrorCode::BadRequest };
                    let _ = behaviour.send_response(channel, error_response(code, e.to_string()));
                    return;
                }
                let (reply, answer) = oneshot::channel();
                let refused = match &self.sink {
                    None => Some((ErrorCode::NotServing, "this node does not serve files")),
                    Some(sink) => match sink.try_send(InboundFile { from: peer, request, reply }) {
                        Ok(()) => None,
                        Err(mpsc::error::TrySendError::Full(_)) => Some((ErrorCode::Busy, "busy")),
                        Err(mpsc::error::TrySendError::Closed(_)) => Some((ErrorCode::NotServing, "this node does not serve files")),
                    },
                };
                if let Some((code, reason)) = refused {
                    let _ = behaviour.send_response(channel, error_response(code, reason));
                    return;
                }
                self.inbound.insert(request_id, channel);
                self.answers.push(Box::pin(async move { (request_id, tokio::time::timeout(rpc_max, answer).await.ok().and_then(Result::ok)) }));
            }
            rr::Event::Message { message: rr::Message::Response { request_id, response }, .. } => {
                let checked = check_response(&response);
                if checked.is_err() {
                    NetCounters::bump(&counters.bad_frames);
                }
                self.finish(request_id, |_| checked.map(|()| response).map_err(NetError::Invalid));
            }
            rr::Event::OutboundFailure { peer, request_id, error, .. } => {
                if matches!(&error, OutboundFailure::Io(e) if e.kind() == io::ErrorKind::InvalidData) {
                    NetCounters::bump(&counters.bad_frames);
                }
                self.finish(request_id, |p| Err(NetError::from_outbound(peer, error, p.deadline)));
            }
            rr::Event::InboundFailure { peer, request_id, error, .. } => {
                if matches!(&error, rr::InboundFailure::Io(e) if e.kind() == io::ErrorKind::InvalidData) {
                    NetCounters::bump(&counters.bad_frames);
                }
                tracing::debug!(target: "shoal::net", %peer, %error, "inbound file request failed");
                self.inbound.remove(&request_id);
            }
            rr::Event::ResponseSent { .. } => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(length: u32, offset: u64) -> FileRequest {
        FileRequest { version: WIRE_VERSION, body: Some(file_request::Body::Read(v1::ReadRange { model: "m".into(), path: "f".into(), offset, length })) }
    }

    #[test]
    fn ranges_and_lists_are_checked_before_use() {
        assert!(check_request(&read(1 << 20, 0)).is_ok());
        assert!(check_request(&read(0, 0)).is_err());
        assert!(check_request(&read(MAX_CHUNK_BYTES as u32 + 1, 0)).is_err());
        assert!(check_request(&read(10, u64::MAX - 2)).is_err());
        assert!(check_request(&FileRequest { version: 9, body: None }).is_err());
        let entry = |sha: &str| v1::FileEntry { path: "a".into(), size: 1, sha256: sha.into() };
        let list = |sha: &str| FileResponse { version: WIRE_VERSION, body: Some(file_response::Body::List(v1::FileList { model: "m".into(), repo: String::new(), revision: String::new(), files: vec![entry(sha)] })) };
        assert!(check_response(&list(&"ab".repeat(32))).is_ok());
        assert!(check_response(&list("not-a-hash")).is_err());
        let chunk = FileResponse { version: WIRE_VERSION, body: Some(file_response::Body::Chunk(v1::FileChunk { offset: 0, data: vec![0; MAX_CHUNK_BYTES + 1] })) };
        assert!(check_response(&chunk).is_err());
    }
}
