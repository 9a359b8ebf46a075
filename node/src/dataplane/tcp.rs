//! Direct TCP links with TCP_NODELAY: one side listens (`TcpAcceptor`), the other connects
//! and proves it was invited by sending the token both learnt through the control plane.
//! Frames are a 16-byte header (seq u64, step u32, length u32, little-endian) and the values
//! as little-endian f32. Closing shuts the socket down, which the peer reads as end of stream.
//! It does not encrypt: it carries only activations of a group whose members the
//! authenticated control plane introduced, over a token it handed out.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use super::{Frame, Link, LinkError, Transport, MAX_FRAME_VALUES};

/// Invitation tokens are this long.
pub const TOKEN_BYTES: usize = 16;

/// How long a connect, a token exchange or the rest of a started frame may take.
const SETUP: Duration = Duration::from_secs(5);

fn failed(message: impl ToString) -> LinkError {
    LinkError::Failed { transport: Transport::Tcp, message: message.to_string() }
}

fn setup(message: impl ToString) -> LinkError {
    LinkError::Setup { transport: Transport::Tcp, message: message.to_string() }
}

/// A random invitation token.
pub fn new_token() -> [u8; TOKEN_BYTES] {
    rand::random()
}

/// A listening socket waiting for one invited peer.
pub struct TcpAcceptor {
    listener: TcpListener,
}

impl TcpAcceptor {
    /// Listens on `ip` (port chosen by the system).
    pub fn bind(ip: std::net::IpAddr) -> Result<TcpAcceptor, LinkError> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0)).map_err(setup)?;
        Ok(TcpAcceptor { listener })
    }

    pub fn addr(&self) -> Result<SocketAddr, LinkError> {
        self.listener.local_addr().map_err(setup)
    }

    /// Accepts the first connection that presents `token` within `wait`; others are dropped.
    pub fn accept(&self, token: &[u8; TOKEN_BYTES], wait: Duration) -> Result<TcpLink, LinkError> {
        TcpLink::new(self.accept_stream(token, wait)?)
    }

    /// The socket of the first connection that presents `token` within `wait` (blocking, no
    /// timeouts set); others are dropped. Also the RDMA link's bootstrap.
    pub fn accept_stream(&self, token: &[u8; TOKEN_BYTES], wait: Duration) -> Result<TcpStream, LinkError> {
        let until = Instant::now() + wait;
        self.listener.set_nonblocking(true).map_err(setup)?;
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(setup)?;
                    stream.set_read_timeout(Some(SETUP)).map_err(setup)?;
                    let mut got = [0u8; TOKEN_BYTES];
                    if stream.try_clone().map_err(setup)?.read_exact(&mut got).is_ok() && &got == token {
                        stream.set_read_timeout(None).map_err(setup)?;
                        return Ok(stream);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= until {
                        return Err(setup("no invited peer connected in time"));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(setup(e)),
            }
        }
    }
}

/// Connects to `addr` and presents `token`.
pub fn connect(addr: SocketAddr, token: &[u8; TOKEN_BYTES]) -> Result<TcpLink, LinkError> {
    let mut stream = TcpStream::connect_timeout(&addr, SETUP).map_err(setup)?;
    stream.write_all(token).map_err(setup)?;
    TcpLink::new(stream)
}

/// One end of a TCP link.
pub struct TcpLink {
    stream: TcpStream,
    closed: bool,
    /// The header being read when a `recv` timed out part way (kept for the next call).
    partial: Vec<u8>,
}

impl TcpLink {
    fn new(stream: TcpStream) -> Result<TcpLink, LinkError> {
        stream.set_nodelay(true).map_err(setup)?;
        stream.set_read_timeout(None).map_err(setup)?;
        Ok(TcpLink { stream, closed: false, partial: Vec::new() })
    }

    fn fail(&mut self, e: LinkError) -> LinkError {
        self.close();
        e
    }

    /// Reads exactly `buf.len()` bytes within `SETUP` (the rest of a frame already started).
    fn read_rest(&mut self, buf: &mut [u8]) -> Result<(), LinkError> {
        self.stream.set_read_timeout(Some(SETUP)).map_err(failed)?;
        self.stream.read_exact(buf).map_err(|e| if e.kind() == ErrorKind::UnexpectedEof { LinkError::Closed(Transport::Tcp) } else { failed(e) })
    }
}

impl Link for TcpLink {
    fn transport(&self) -> Transport {
        Transport::Tcp
    }

    fn send(&mut self, frame: &Frame) -> Result<(), LinkError> {
        if self.closed {
            return Err(LinkError::Closed(Transport::Tcp));
        }
        self.stream.write_all(&frame.to_bytes()).map_err(|e| failed(e)).map_err(|e| self.fail(e))
    }

    fn recv(&mut self, wait: Duration) -> Result<Option<Frame>, LinkError> {
        if self.closed {
            return Err(LinkError::Closed(Transport::Tcp));
        }
        // Wait for the first bytes of a header for at most `wait`; a zero timeout means poll.
        self.stream.set_read_timeout(Some(wait.max(Duration::from_micros(1)))).map_err(failed)?;
        let mut header = [0u8; Frame::HEADER_BYTES];
        let have = self.partial.len();
        header[..have].copy_from_slice(&self.partial);
        match self.stream.read(&mut header[have..]) {
            Ok(0) => return Err(self.fail(LinkError::Closed(Transport::Tcp))),
            Ok(n) if have + n < Frame::HEADER_BYTES => {
                self.partial = header[..have + n].to_vec();
                return Ok(None);
            }
            Ok(_) => self.partial.clear(),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => return Ok(None),
            Err(e) => return Err(self.fail(failed(e))),
        }
        let Some((seq, step, len)) = Frame::parse_header(&header) else {
            return Err(self.fail(failed(format!("frame of more than {MAX_FRAME_VALUES} values"))));
        };
        let mut raw = vec![0u8; len * 4];
        if let Err(e) = self.read_rest(&mut raw) {
            return Err(self.fail(e));
        }
        Ok(Some(Frame { seq, step, data: Frame::values(&raw) }))
    }

    fn is_closed(&mut self) -> bool {
        if self.closed {
            return true;
        }
        // End of stream (the peer closed) shows as a zero-byte peek without blocking.
        if self.stream.set_nonblocking(true).is_err() {
            return false;
        }
        let mut b = [0u8; 1];
        let eof = matches!(self.stream.peek(&mut b), Ok(0));
        let _ = self.stream.set_nonblocking(false);
        if eof {
            self.closed = true;
        }
        eof
    }

    fn close(&mut self) {
        self.closed = true;
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn capacity(&self) -> usize {
        // What the kernel's socket buffers surely hold on every platform we run on.
        64 * 1024
    }
}
