//! The request-response codec of protocol `/shoal/rpc/1`: one prost message per stream,
//! preceded by its length as a big-endian u32. The length is checked against the cap before
//! anything is allocated, and the body buffer grows only as bytes actually arrive, so a peer
//! that announces 64 MiB and sends nothing costs nothing. It does not check versions or
//! contents (`wire` does); a frame that does not decode is an `InvalidData` I/O error.

use std::io;

use libp2p::futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::request_response;
use libp2p::StreamProtocol;
use prost::Message;
use shoal_proto::v1::{ControlRequest, ControlResponse};

/// The protocol name of control RPCs and data-plane forwards.
pub const RPC_PROTOCOL: StreamProtocol = StreamProtocol::new("/shoal/rpc/1");

/// Length-prefixed prost frames, at most `max_frame` bytes each.
#[derive(Debug, Clone, Copy)]
pub struct ProstCodec {
    pub max_frame: usize,
}

impl Default for ProstCodec {
    fn default() -> Self {
        ProstCodec { max_frame: shoal_proto::MAX_MESSAGE_BYTES }
    }
}

/// Reads one frame: the length, checked against `max`, then exactly that many bytes.
pub async fn read_frame<T: AsyncRead + Unpin + Send>(io: &mut T, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes exceeds the {max}-byte cap")));
    }
    // Grow with the data rather than reserving `len` up front: the length is the peer's claim.
    let mut body = Vec::with_capacity(len.min(64 << 10));
    io.take(len as u64).read_to_end(&mut body).await?;
    if body.len() != len {
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("frame ended after {} of {len} bytes", body.len())));
    }
    Ok(body)
}

/// Writes one frame; refuses (rather than truncates) a message over `max`.
pub async fn write_frame<T: AsyncWrite + Unpin + Send>(io: &mut T, body: &[u8], max: usize) -> io::Result<()> {
    if body.len() > max {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("message of {} bytes exceeds the {max}-byte cap", body.len())));
    }
    io.write_all(&(body.len() as u32).to_be_bytes()).await?;
    io.write_all(body).await?;
    io.flush().await
}

fn decode<M: Message + Default>(body: &[u8]) -> io::Result<M> {
    M::decode(body).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

impl request_response::Codec for ProstCodec {
    type Protocol = StreamProtocol;
    type Request = ControlRequest;
    type Response = ControlResponse;

    async fn read_request<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<ControlRequest>
    where
        T: AsyncRead + Unpin + Send,
    {
        decode(&read_frame(io, self.max_frame).await?)
    }

    async fn read_response<T>(&mut self, _: &StreamProtocol, io: &mut T) -> io::Result<ControlResponse>
    where
        T: AsyncRead + Unpin + Send,
    {
        decode(&read_frame(io, self.max_frame).await?)
    }

    async fn write_request<T>(&mut self, _: &StreamProtocol, io: &mut T, req: ControlRequest) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, &req.encode_to_vec(), self.max_frame).await
    }

    async fn write_response<T>(&mut self, _: &StreamProtocol, io: &mut T, res: ControlResponse) -> io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, &res.encode_to_vec(), self.max_frame).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use libp2p::futures::io::Cursor;

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    #[test]
    fn a_frame_round_trips_and_the_cap_is_checked_before_reading_the_body() {
        block_on(async {
            let mut out = Cursor::new(Vec::new());
            write_frame(&mut out, b"hello", 16).await.unwrap();
            let bytes = out.into_inner();
            assert_eq!(read_frame(&mut Cursor::new(bytes.clone()), 16).await.unwrap(), b"hello");
            // A claimed 4 GiB frame with no body is refused at the length, not after reading.
            let mut huge = Cursor::new(u32::MAX.to_be_bytes().to_vec());
            assert_eq!(read_frame(&mut huge, 1 << 20).await.unwrap_err().kind(), io::ErrorKind::InvalidData);
            // A frame cut short is an error, not a shorter message.
            let mut short = Cursor::new(bytes[..7].to_vec());
            assert_eq!(read_frame(&mut short, 16).await.unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
            let mut out = Cursor::new(Vec::new());
            assert_eq!(write_frame(&mut out, &[0; 17], 16).await.unwrap_err().kind(), io::ErrorKind::InvalidInput);
        });
    }

    #[test]
    fn garbage_is_invalid_data() {
        block_on(async {
            let mut out = Cursor::new(Vec::new());
            write_frame(&mut out, &[0xff; 9], 64).await.unwrap();
            let mut codec = ProstCodec::default();
            let err = request_response::Codec::read_request(&mut codec, &RPC_PROTOCOL, &mut Cursor::new(out.into_inner())).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        });
    }
}
