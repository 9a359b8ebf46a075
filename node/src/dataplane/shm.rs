//! Same-host shared-memory links: a file in /dev/shm (or the temp directory where there is no
//! /dev/shm), mapped by both processes, holding one byte ring per direction with atomic read
//! and write positions, a shared `closed` flag and an `attached` flag. The creator names the
//! file to its peer over the control plane, waits until the peer has mapped it, then unlinks
//! it, so nothing is left behind when either process dies. Waiting spins briefly, then
//! yields, then sleeps in short steps (no futex: portable to macOS).
//! It does not detect a peer that died without closing: a call then ends at its deadline.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapMut;

use super::{Frame, Link, LinkError, Transport, MAX_FRAME_VALUES};

const MAGIC: u64 = u64::from_le_bytes(*b"shoalSH1");
/// Header: magic, closed, attached, then each ring's write and read positions on their own
/// cache lines.
const HEADER: usize = 64;
const RING_META: usize = 128;

/// Default bytes per direction: a prompt of a few hundred positions of a 4k-hidden model.
pub const DEFAULT_CAPACITY: usize = 4 << 20;

/// How long the rest of a started frame may take to arrive.
const FRAME_REST: Duration = Duration::from_secs(5);

fn failed(message: impl ToString) -> LinkError {
    LinkError::Failed { transport: Transport::Shm, message: message.to_string() }
}

fn setup(message: impl ToString) -> LinkError {
    LinkError::Setup { transport: Transport::Shm, message: message.to_string() }
}

/// Where shared-memory files go: /dev/shm when it is a writable directory, else the temp
/// directory on macOS (a mapped file there is shared page cache); `None` elsewhere.
pub fn shm_dir() -> Option<PathBuf> {
    let dev = Path::new("/dev/shm");
    if dev.is_dir() && !std::fs::metadata(dev).map(|m| m.permissions().readonly()).unwrap_or(true) {
        return Some(dev.to_path_buf());
    }
    if cfg!(target_os = "macos") {
        return Some(std::env::temp_dir());
    }
    None
}

/// One end of a shared-memory link.
pub struct ShmLink {
    /// Keeps the mapping alive; every pointer below points into it.
    _map: MmapMut,
    base: *mut u8,
    capacity: usize,
    /// Ring we write (0 for the creator) and ring we read.
    out_ring: usize,
    /// The file, until the peer attached and we unlinked it (creator only).
    path: Option<PathBuf>,
}

// SAFETY: `base` points into `_map`, which the link owns and which lives as long as it; the
// shared words are accessed only through atomics and the ring bytes only in the ranges the
// positions hand to this end, so moving the link to another thread is sound.
unsafe impl Send for ShmLink {}

impl ShmLink {
    /// Creates a new shared file with rings of `capacity` bytes; returns the link and the path
    /// to hand to the peer.
    pub fn create(capacity: usize) -> Result<(ShmLink, PathBuf), LinkError> {
        let dir = shm_dir().ok_or_else(|| setup("no shared-memory directory on this host"))?;
        let name = format!("shoal-dp-{}-{:016x}", std::process::id(), rand::random::<u64>());
        let path = dir.join(name);
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(setup)?;
        let len = HEADER + 2 * (RING_META + capacity);
        file.set_len(len as u64).map_err(setup)?;
        let link = ShmLink::map(&file, capacity, 0, Some(path.clone()))?;
        link.word64(0).store(MAGIC, Ordering::Release);
        Ok((link, path))
    }

    /// Maps a file a peer created (its rings swapped).
    pub fn open(path: &Path) -> Result<ShmLink, LinkError> {
        let file = OpenOptions::new().read(true).write(true).open(path).map_err(setup)?;
        let len = file.metadata().map_err(setup)?.len() as usize;
        let capacity = len.checked_sub(HEADER + 2 * RING_META).map(|c| c / 2).filter(|c| *c > 0).ok_or_else(|| setup("shared file too small"))?;
        if len != HEADER + 2 * (RING_META + capacity) {
            return Err(setup("shared file has an odd size"));
        }
        let link = ShmLink::map(&file, capacity, 1, None)?;
        if link.word64(0).load(Ordering::Acquire) != MAGIC {
            return Err(setup("not a shoal shared-memory link"));
        }
        link.word32(12).store(1, Ordering::Release);
        Ok(link)
    }

    fn map(file: &File, capacity: usize, out_ring: usize, path: Option<PathBuf>) -> Result<ShmLink, LinkError> {
        // SAFETY: the file is ours and the peer's only; both access it through this type.
        let mut map = unsafe { MmapMut::map_mut(file) }.map_err(setup)?;
        let base = map.as_mut_ptr();
        Ok(ShmLink { _map: map, base, capacity, out_ring, path })
    }

    /// Waits until the peer mapped the file, then unlinks it (creator only).
    pub fn wait_attached(&mut self, wait: Duration) -> Result<(), LinkError> {
        let until = Instant::now() + wait;
        while self.word32(12).load(Ordering::Acquire) == 0 {
            if Instant::now() >= until {
                return Err(setup("the peer did not map the shared file in time"));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
        Ok(())
    }

    fn word64(&self, off: usize) -> &AtomicU64 {
        // SAFETY: `off` is one of the 8-aligned header/ring-meta offsets inside the mapping
        // (page-aligned base), and the word is only ever accessed atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        // SAFETY: as `word64`, for the 4-aligned flag words of the header.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn ring_meta(&self, ring: usize) -> usize {
        HEADER + ring * (RING_META + self.capacity)
    }

    fn closed(&self) -> bool {
        self.word32(8).load(Ordering::Acquire) != 0
    }

    /// Writes all of `bytes` into our ring, waiting for room while the peer reads.
    fn write(&mut self, bytes: &[u8]) -> Result<(), LinkError> {
        let meta = self.ring_meta(self.out_ring);
        let (w_pos, r_pos) = (self.word64(meta), self.word64(meta + 64));
        let data = unsafe { self.base.add(meta + RING_META) };
        let mut done = 0;
        let mut waiter = Waiter::new(FRAME_REST);
        while done < bytes.len() {
            if self.closed() {
                return Err(LinkError::Closed(Transport::Shm));
            }
            let w = w_pos.load(Ordering::Relaxed);
            let free = self.capacity - (w - r_pos.load(Ordering::Acquire)) as usize;
            if free == 0 {
                if !waiter.wait() {
                    return Err(failed("the peer stopped reading"));
                }
                continue;
            }
            let n = free.min(bytes.len() - done);
            let at = (w % self.capacity as u64) as usize;
            let first = n.min(self.capacity - at);
            // SAFETY: [at, at+first) and [0, n-first) lie inside our ring and are free: the
            // reader is behind `w - capacity + free` and never touches them until we publish.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr().add(done), data.add(at), first);
                std::ptr::copy_nonoverlapping(bytes.as_ptr().add(done + first), data, n - first);
            }
            w_pos.store(w + n as u64, Ordering::Release);
            done += n;
            waiter = Waiter::new(FRAME_REST);
        }
        Ok(())
    }

    /// Bytes readable now in the peer's ring.
    fn available(&self) -> usize {
        let meta = self.ring_meta(1 - self.out_ring);
        (self.word64(meta).load(Ordering::Acquire) - self.word64(meta + 64).load(Ordering::Relaxed)) as usize
    }

    /// Reads exactly `out.len()` bytes, waiting at most `FRAME_REST` without progress.
    fn read(&mut self, out: &mut [u8]) -> Result<(), LinkError> {
        let meta = self.ring_meta(1 - self.out_ring);
        let (w_pos, r_pos) = (self.word64(meta), self.word64(meta + 64));
        let data = unsafe { self.base.add(meta + RING_META) } as *const u8;
        let mut done = 0;
        let mut waiter = Waiter::new(FRAME_REST);
        while done < out.len() {
            let r = r_pos.load(Ordering::Relaxed);
            let avail = (w_pos.load(Ordering::Acquire) - r) as usize;
            if avail == 0 {
                if self.closed() {
                    return Err(LinkError::Closed(Transport::Shm));
                }
                if !waiter.wait() {
                    return Err(failed("a frame stopped part way"));
                }
                continue;
            }
            let n = avail.min(out.len() - done);
            let at = (r % self.capacity as u64) as usize;
            let first = n.min(self.capacity - at);
            // SAFETY: the writer published these bytes (Acquire above) and does not reuse them
            // until we advance the read position.
            unsafe {
                std::ptr::copy_nonoverlapping(data.add(at), out.as_mut_ptr().add(done), first);
                std::ptr::copy_nonoverlapping(data, out.as_mut_ptr().add(done + first), n - first);
            }
            r_pos.store(r + n as u64, Ordering::Release);
            done += n;
            waiter = Waiter::new(FRAME_REST);
        }
        Ok(())
    }
}

impl Drop for ShmLink {
    fn drop(&mut self) {
        self.close();
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Link for ShmLink {
    fn transport(&self) -> Transport {
        Transport::Shm
    }

    fn send(&mut self, frame: &Frame) -> Result<(), LinkError> {
        self.write(&frame.to_bytes()).inspect_err(|_| self.close())
    }

    fn recv(&mut self, wait: Duration) -> Result<Option<Frame>, LinkError> {
        let mut waiter = Waiter::new(wait);
        while self.available() < Frame::HEADER_BYTES {
            if self.closed() {
                return Err(LinkError::Closed(Transport::Shm));
            }
            if !waiter.wait() {
                return Ok(None);
            }
        }
        let mut header = [0u8; Frame::HEADER_BYTES];
        self.read(&mut header).inspect_err(|_| self.close())?;
        let Some((seq, step, len)) = Frame::parse_header(&header) else {
            self.close();
            return Err(failed(format!("frame of more than {MAX_FRAME_VALUES} values")));
        };
        let mut raw = vec![0u8; len * 4];
        self.read(&mut raw).inspect_err(|_| self.close())?;
        Ok(Some(Frame { seq, step, data: Frame::values(&raw) }))
    }

    fn is_closed(&mut self) -> bool {
        self.closed()
    }

    fn close(&mut self) {
        self.word32(8).store(1, Ordering::Release);
    }

    fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Spins for 50 µs, then yields until 2 ms, then sleeps in 20 µs steps, until `limit` has passed.
pub(super) struct Waiter {
    started: Instant,
    limit: Duration,
}

impl Waiter {
    pub(super) fn new(limit: Duration) -> Waiter {
        Waiter { started: Instant::now(), limit }
    }

    /// Waits a little; false once the limit has passed.
    pub(super) fn wait(&mut self) -> bool {
        let elapsed = self.started.elapsed();
        if elapsed < Duration::from_micros(50) {
            for _ in 0..64 {
                std::hint::spin_loop();
            }
        } else if elapsed < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
        elapsed < self.limit
    }
}
