//! The pure parts of the verbs link, testable without a device: the endpoint description two
//! peers exchange (`Endpoint`, 48 bytes, validated as hostile input), the 12-byte header of
//! every message, how a frame is cut into messages and put back together (`fill`,
//! `Reassembly`), the credits that keep a sender from overrunning the peer's posted receives
//! (`Credits`), and which GID a RoCE port uses (`pick_gid`).
//! It does not touch libibverbs (`verbs` does) nor own buffers or queue pairs (`link` does).

use crate::dataplane::{Frame, MAX_FRAME_VALUES};

/// Bytes of an encoded `Endpoint`.
pub const ENDPOINT_BYTES: usize = 48;
const ENDPOINT_MAGIC: &[u8; 8] = b"shoalRD1";

/// Bytes of the header at the start of every message.
pub const CHUNK_HEADER_BYTES: usize = 12;

/// Receives each end posts for frame parts and for credit messages, their size, and the
/// sender's buffers. Credit slots exceed what the peer can need between two of our data
/// messages (`DATA_SLOTS / grant_threshold` credit messages), so grants never wait for them.
pub const DATA_SLOTS: u32 = 64;
pub const CREDIT_SLOTS: u32 = 8;
pub const SEND_SLOTS: u32 = 32;
pub const SLOT_BYTES: u32 = 64 * 1024;

/// Bounds an `Endpoint` from a peer must respect.
const MIN_SLOTS: u32 = 4;
const MAX_SLOTS: u32 = 4096;
const MIN_SLOT_BYTES: u32 = 64;
const MAX_SLOT_BYTES: u32 = 1 << 20;

/// Why a peer's bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// An endpoint description of the wrong length.
    #[error("an RDMA endpoint of {0} bytes (want {ENDPOINT_BYTES})")]
    EndpointLength(usize),
    /// An endpoint description without shoal's magic (another program or version).
    #[error("not a shoal RDMA endpoint (bad magic)")]
    Magic,
    /// A field out of its range.
    #[error("an RDMA endpoint with a bad {field}: {value}")]
    Field { field: &'static str, value: u64 },
    /// Hex that does not decode.
    #[error("an RDMA endpoint that is not hex")]
    Hex,
    /// A message shorter than its header, or of an unknown kind.
    #[error("a bad RDMA message header: {0}")]
    Header(String),
    /// Message contents that do not fit the frame being assembled.
    #[error("a bad RDMA frame: {0}")]
    Frame(String),
    /// The peer granted receives it never had.
    #[error("the peer granted {grant} {what} receives with {available} of {slots} already available")]
    Overgrant { what: &'static str, grant: u32, available: u32, slots: u32 },
}

/// The port's link layer, which decides how a queue pair addresses its peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    /// InfiniBand: the peer's LID (a GRH only across subnets).
    Infiniband,
    /// RoCE: the peer's GID, always with a GRH.
    Ethernet,
}

impl LinkLayer {
    /// From `ibv_port_attr::link_layer` (0, "unspecified", is InfiniBand by the verbs convention).
    pub fn from_verbs(v: u8) -> Option<LinkLayer> {
        match v {
            0 | 1 => Some(LinkLayer::Infiniband),
            2 => Some(LinkLayer::Ethernet),
            _ => None,
        }
    }

    fn code(self) -> u8 {
        match self {
            LinkLayer::Infiniband => 1,
            LinkLayer::Ethernet => 2,
        }
    }
}

/// What one end tells the other to connect its RC queue pair: the address (LID or GID), the
/// queue pair number, the first packet sequence number, the port's MTU and its receives (for
/// frame parts, for credit messages, and their size).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    pub link_layer: LinkLayer,
    pub lid: u16,
    /// `enum ibv_mtu`: 1 (256 bytes) to 5 (4096).
    pub mtu: u8,
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    pub data_slots: u32,
    pub credit_slots: u32,
    pub slot_bytes: u32,
}

impl Endpoint {
    /// Magic, link layer, MTU, LID, QPN, PSN, data and credit slots and their size
    /// (little-endian), GID.
    pub fn encode(&self) -> [u8; ENDPOINT_BYTES] {
        let mut b = [0u8; ENDPOINT_BYTES];
        b[0..8].copy_from_slice(ENDPOINT_MAGIC);
        b[8] = self.link_layer.code();
        b[9] = self.mtu;
        b[10..12].copy_from_slice(&self.lid.to_le_bytes());
        b[12..16].copy_from_slice(&self.qpn.to_le_bytes());
        b[16..20].copy_from_slice(&self.psn.to_le_bytes());
        b[20..24].copy_from_slice(&self.data_slots.to_le_bytes());
        b[24..28].copy_from_slice(&self.credit_slots.to_le_bytes());
        b[28..32].copy_from_slice(&self.slot_bytes.to_le_bytes());
        b[32..48].copy_from_slice(&self.gid);
        b
    }

    /// Decodes and validates a peer's endpoint; every field is checked before use.
    pub fn decode(b: &[u8]) -> Result<Endpoint, WireError> {
        if b.len() != ENDPOINT_BYTES {
            return Err(WireError::EndpointLength(b.len()));
        }
        if &b[0..8] != ENDPOINT_MAGIC {
            return Err(WireError::Magic);
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let bad = |field: &'static str, value: u64| Err(WireError::Field { field, value });
        let link_layer = match b[8] {
            1 => LinkLayer::Infiniband,
            2 => LinkLayer::Ethernet,
            v => return bad("link layer", v.into()),
        };
        let mtu = b[9];
        if !(1..=5).contains(&mtu) {
            return bad("mtu", mtu.into());
        }
        let lid = u16::from_le_bytes([b[10], b[11]]);
        let (qpn, psn, data_slots, credit_slots, slot_bytes) = (u32_at(12), u32_at(16), u32_at(20), u32_at(24), u32_at(28));
        // QP 0 and 1 are the management queue pairs; numbers and PSNs are 24-bit.
        if !(2..=0xFF_FFFF).contains(&qpn) {
            return bad("queue pair number", qpn.into());
        }
        if psn > 0xFF_FFFF {
            return bad("packet sequence number", psn.into());
        }
        if !(MIN_SLOTS..=MAX_SLOTS).contains(&data_slots) {
            return bad("data slot count", data_slots.into());
        }
        if !(1..=data_slots).contains(&credit_slots) {
            return bad("credit slot count", credit_slots.into());
        }
        if !(MIN_SLOT_BYTES..=MAX_SLOT_BYTES).contains(&slot_bytes) {
            return bad("receive slot size", slot_bytes.into());
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[32..48]);
        match link_layer {
            LinkLayer::Ethernet if gid == [0; 16] => return bad("gid (zero on RoCE)", 0),
            // Unicast LIDs are 0x0001..=0xBFFF.
            LinkLayer::Infiniband if lid == 0 || lid >= 0xC000 => return bad("lid", lid.into()),
            _ => {}
        }
        Ok(Endpoint { link_layer, lid, mtu, qpn, psn, gid, data_slots, credit_slots, slot_bytes })
    }

    pub fn to_hex(&self) -> String {
        self.encode().iter().map(|b| format!("{b:02x}")).collect()
    }

    pub fn from_hex(s: &str) -> Result<Endpoint, WireError> {
        if s.len() != ENDPOINT_BYTES * 2 {
            return Err(WireError::EndpointLength(s.len() / 2));
        }
        if !s.is_ascii() {
            return Err(WireError::Hex);
        }
        let mut b = [0u8; ENDPOINT_BYTES];
        for (i, out) in b.iter_mut().enumerate() {
            *out = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| WireError::Hex)?;
        }
        Endpoint::decode(&b)
    }
}

/// What a message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// The first part of a frame: its 16-byte header, then values.
    Start,
    /// More values of the frame being assembled.
    More,
    /// Only a grant of receives.
    Credit,
}

/// What a message grants back: receives the sender re-posted since its previous message, for
/// frame parts (`data`) and for credit messages (`credit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grant {
    pub data: u32,
    pub credit: u32,
}

/// Every message's header: kind, three zero bytes, then the grant's data and credit counts
/// (little-endian u32 each).
pub fn encode_header(kind: Kind, grant: Grant) -> [u8; CHUNK_HEADER_BYTES] {
    let k = match kind {
        Kind::Start => 1,
        Kind::More => 2,
        Kind::Credit => 3,
    };
    let mut h = [0u8; CHUNK_HEADER_BYTES];
    h[0] = k;
    h[4..8].copy_from_slice(&grant.data.to_le_bytes());
    h[8..12].copy_from_slice(&grant.credit.to_le_bytes());
    h
}

/// Splits a received message into kind, grant and payload.
pub fn decode_header(msg: &[u8]) -> Result<(Kind, Grant, &[u8]), WireError> {
    if msg.len() < CHUNK_HEADER_BYTES {
        return Err(WireError::Header(format!("a message of {} bytes", msg.len())));
    }
    if msg[1..4] != [0, 0, 0] {
        return Err(WireError::Header("reserved bytes are not zero".into()));
    }
    let kind = match msg[0] {
        1 => Kind::Start,
        2 => Kind::More,
        3 => Kind::Credit,
        k => return Err(WireError::Header(format!("unknown kind {k}"))),
    };
    let grant = Grant { data: u32::from_le_bytes([msg[4], msg[5], msg[6], msg[7]]), credit: u32::from_le_bytes([msg[8], msg[9], msg[10], msg[11]]) };
    let payload = &msg[CHUNK_HEADER_BYTES..];
    match kind {
        Kind::Credit if !payload.is_empty() => Err(WireError::Header(format!("a credit message with {} payload bytes", payload.len()))),
        Kind::Start if payload.len() < Frame::HEADER_BYTES => Err(WireError::Header(format!("a frame start of {} bytes", payload.len()))),
        Kind::More if payload.is_empty() => Err(WireError::Header("an empty frame part".into())),
        _ => Ok((kind, grant, payload)),
    }
}

/// Bytes a frame takes on the wire: its 16-byte header and the values.
pub fn frame_bytes(frame: &Frame) -> usize {
    Frame::HEADER_BYTES + frame.data.len() * 4
}

/// Messages a frame needs when each carries at most `payload` bytes of it (`payload` ≥ 16, so
/// the frame header always fits in the first).
pub fn chunk_count(frame: &Frame, payload: usize) -> usize {
    frame_bytes(frame).div_ceil(payload.max(Frame::HEADER_BYTES))
}

/// Writes bytes `offset..offset + dst.len()` of the frame's wire form (seq u64, step u32,
/// length u32, values as f32, all little-endian) into `dst`; returns how many it wrote (fewer
/// at the end of the frame).
pub fn fill(frame: &Frame, offset: usize, dst: &mut [u8]) -> usize {
    let total = frame_bytes(frame);
    let n = dst.len().min(total.saturating_sub(offset));
    let mut header = [0u8; Frame::HEADER_BYTES];
    header[0..8].copy_from_slice(&frame.seq.to_le_bytes());
    header[8..12].copy_from_slice(&frame.step.to_le_bytes());
    // Frames over MAX_FRAME_VALUES are refused before they are cut, so this fits in u32.
    header[12..16].copy_from_slice(&(frame.data.len() as u32).to_le_bytes());
    let mut i = 0;
    while i < n {
        let at = offset + i;
        if at < Frame::HEADER_BYTES {
            let k = (Frame::HEADER_BYTES - at).min(n - i);
            dst[i..i + k].copy_from_slice(&header[at..at + k]);
            i += k;
        } else {
            let v = (at - Frame::HEADER_BYTES) / 4;
            let within = (at - Frame::HEADER_BYTES) % 4;
            let bytes = frame.data[v].to_le_bytes();
            let k = (4 - within).min(n - i);
            dst[i..i + k].copy_from_slice(&bytes[within..within + k]);
            i += k;
        }
    }
    n
}

/// Puts frames back together from messages, which arrive in order (RC) and never mix two
/// frames: a frame starts a new message.
#[derive(Debug, Default)]
pub struct Reassembly {
    /// The frame being assembled, its values so far, and a value split across two messages.
    current: Option<(u64, u32, usize, Vec<f32>)>,
    carry: Vec<u8>,
}

impl Reassembly {
    /// Whether part of a frame has arrived.
    pub fn in_progress(&self) -> bool {
        self.current.is_some()
    }

    /// Takes one message's payload; returns the frame it completes, if any.
    pub fn push(&mut self, kind: Kind, payload: &[u8]) -> Result<Option<Frame>, WireError> {
        let values = match (kind, self.current.is_some()) {
            (Kind::Start, false) => {
                let h = &payload[..Frame::HEADER_BYTES.min(payload.len())];
                if h.len() < Frame::HEADER_BYTES {
                    return Err(WireError::Frame("a frame start without its header".into()));
                }
                let seq = u64::from_le_bytes(h[0..8].try_into().map_err(|_| WireError::Frame("header".into()))?);
                let step = u32::from_le_bytes(h[8..12].try_into().map_err(|_| WireError::Frame("header".into()))?);
                let len = u32::from_le_bytes(h[12..16].try_into().map_err(|_| WireError::Frame("header".into()))?) as usize;
                if len > MAX_FRAME_VALUES {
                    return Err(WireError::Frame(format!("a frame of {len} values is over the limit")));
                }
                self.current = Some((seq, step, len, Vec::with_capacity(len)));
                self.carry.clear();
                &payload[Frame::HEADER_BYTES..]
            }
            (Kind::More, true) => payload,
            (Kind::Start, true) => return Err(WireError::Frame("a frame started inside another".into())),
            (Kind::More, false) => return Err(WireError::Frame("a frame part without a start".into())),
            (Kind::Credit, _) => return Ok(None),
        };
        let Some((_, _, len, data)) = self.current.as_mut() else {
            return Err(WireError::Frame("no frame in progress".into()));
        };
        let missing = (*len - data.len()) * 4 - self.carry.len();
        if values.len() > missing {
            return Err(WireError::Frame(format!("{} bytes where {missing} were left", values.len())));
        }
        let mut rest = values;
        if !self.carry.is_empty() {
            let k = (4 - self.carry.len()).min(rest.len());
            self.carry.extend_from_slice(&rest[..k]);
            rest = &rest[k..];
            if self.carry.len() == 4 {
                data.push(f32::from_le_bytes([self.carry[0], self.carry[1], self.carry[2], self.carry[3]]));
                self.carry.clear();
            }
        }
        let whole = rest.len() / 4 * 4;
        data.extend(rest[..whole].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        self.carry.extend_from_slice(&rest[whole..]);
        if data.len() == *len {
            let (seq, step, _, data) = self.current.take().ok_or_else(|| WireError::Frame("no frame in progress".into()))?;
            return Ok(Some(Frame { seq, step, data }));
        }
        Ok(None)
    }
}

/// Receives to grant before a message of credits alone goes out (with no data to carry them).
pub fn grant_threshold(data_slots: u32) -> u32 {
    (data_slots / 4).max(1)
}

/// Send credits, two kinds: frame parts may fill the peer's data receives, credit messages its
/// credit receives. Every message carries back what this end re-posted of each kind since its
/// previous message. Credit messages carry grants only when there are data receives to grant:
/// at the threshold, or at once while this end's own send waits for credits; credit receives
/// alone are acknowledged by a credit message only when a waiting sender holds all of the
/// peer's (its budget is spent). So grants always flow, credit messages never answer each
/// other, and no message arrives without a posted receive.
#[derive(Debug, Clone)]
pub struct Credits {
    peer_data: u32,
    peer_credit: u32,
    own_credit: u32,
    /// Frame parts we may still send, and credit messages.
    data: u32,
    credit: u32,
    /// What we re-posted and not yet granted back.
    pending: Grant,
    threshold: u32,
}

impl Credits {
    /// `peer`: the receives the peer posted (data, credit); `own`: ours.
    pub fn new(peer: (u32, u32), own: (u32, u32)) -> Credits {
        Credits { peer_data: peer.0, peer_credit: peer.1, own_credit: own.1, data: peer.0, credit: peer.1, pending: Grant::default(), threshold: grant_threshold(own.0) }
    }

    pub fn available(&self) -> (u32, u32) {
        (self.data, self.credit)
    }

    pub fn pending(&self) -> Grant {
        self.pending
    }

    pub fn can_send_data(&self) -> bool {
        self.data >= 1
    }

    /// Whether a credit message should go out now (`blocked`: our send waits for credits).
    pub fn credit_due(&self, blocked: bool) -> bool {
        let p = self.pending;
        self.credit >= 1 && (p.data >= self.threshold || (blocked && (p.data >= 1 || p.credit >= self.own_credit)))
    }

    /// Spends a credit on a frame part; returns the grant it carries.
    pub fn spend_data(&mut self) -> Grant {
        debug_assert!(self.data > 0, "a frame part sent without credit");
        self.data = self.data.saturating_sub(1);
        std::mem::take(&mut self.pending)
    }

    /// Spends a credit on a credit message; returns the grant it carries.
    pub fn spend_credit(&mut self) -> Grant {
        debug_assert!(self.credit > 0, "a credit message sent without credit");
        self.credit = self.credit.saturating_sub(1);
        std::mem::take(&mut self.pending)
    }

    /// The peer granted receives back.
    pub fn granted(&mut self, g: Grant) -> Result<(), WireError> {
        let data = self.data.checked_add(g.data).filter(|d| *d <= self.peer_data);
        let credit = self.credit.checked_add(g.credit).filter(|c| *c <= self.peer_credit);
        match (data, credit) {
            (Some(d), Some(c)) => {
                (self.data, self.credit) = (d, c);
                Ok(())
            }
            (None, _) => Err(WireError::Overgrant { what: "data", grant: g.data, available: self.data, slots: self.peer_data }),
            (_, None) => Err(WireError::Overgrant { what: "credit", grant: g.credit, available: self.credit, slots: self.peer_credit }),
        }
    }

    /// We re-posted the receive of one message of `kind`.
    pub fn reposted(&mut self, kind: Kind) {
        match kind {
            Kind::Credit => self.pending.credit += 1,
            Kind::Start | Kind::More => self.pending.data += 1,
        }
    }
}

/// Bytes a send can leave in flight without the peer reading: the peer's data receives less
/// the grants it may hold back below its threshold, each message less its header.
pub fn capacity(peer_data_slots: u32, payload: usize) -> usize {
    (peer_data_slots.saturating_sub(grant_threshold(peer_data_slots)) as usize) * payload
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    pub index: u32,
    pub gid: [u8; 16],
    /// `enum ibv_gid_type`: 0 IB, 1 RoCE v1, 2 RoCE v2.
    pub gid_type: u32,
}

/// The GID index a RoCE port uses when none is configured: the first RoCE v2 entry holding an
/// IPv4-mapped address (routable, what most fabrics use), else the first RoCE v2 entry, else
/// the first non-zero entry.
pub fn pick_gid(entries: &[GidEntry]) -> Option<u32> {
    let v4_mapped = |g: &[u8; 16]| g[..10] == [0; 10] && g[10..12] == [0xff, 0xff];
    let nonzero = |e: &&GidEntry| e.gid != [0; 16];
    entries
        .iter()
        .filter(nonzero)
        .find(|e| e.gid_type == 2 && v4_mapped(&e.gid))
        .or_else(|| entries.iter().filter(nonzero).find(|e| e.gid_type == 2))
        .or_else(|| entries.iter().find(nonzero))
        .map(|e| e.index)
}

/// `SHOAL_RDMA_GID_INDEX`: a GID index chosen by the operator (`None` when unset; an error
/// naming the value when it is not a number below 256).
pub fn gid_index_override(value: Option<&str>) -> Result<Option<u8>, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => v.parse::<u8>().map(Some).map_err(|_| format!("SHOAL_RDMA_GID_INDEX=`{v}` is not a GID index (0-255)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint() -> Endpoint {
        Endpoint { link_layer: LinkLayer::Ethernet, lid: 0, mtu: 3, qpn: 0x1234, psn: 0xabcdef, gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 7], data_slots: DATA_SLOTS, credit_slots: CREDIT_SLOTS, slot_bytes: SLOT_BYTES }
    }

    #[test]
    fn endpoints_round_trip_through_bytes_and_hex() {
        let e = endpoint();
        assert_eq!(Endpoint::decode(&e.encode()), Ok(e));
        assert_eq!(Endpoint::from_hex(&e.to_hex()), Ok(e));
        let ib = Endpoint { link_layer: LinkLayer::Infiniband, lid: 7, gid: [0; 16], ..e };
        assert_eq!(Endpoint::decode(&ib.encode()), Ok(ib));
    }

    #[test]
    fn hostile_endpoints_are_refused_not_trusted() {
        let good = endpoint().encode();
        assert_eq!(Endpoint::decode(&good[..47]), Err(WireError::EndpointLength(47)));
        assert_eq!(Endpoint::decode(&[]), Err(WireError::EndpointLength(0)));
        let mut long = good.to_vec();
        long.push(0);
        assert!(Endpoint::decode(&long).is_err());
        let set = |i: usize, bytes: &[u8]| {
            let mut b = good;
            b[i..i + bytes.len()].copy_from_slice(bytes);
            Endpoint::decode(&b)
        };
        assert_eq!(set(0, b"shoalRD2"), Err(WireError::Magic));
        for (i, bytes, field) in [
            (8, &[0u8][..], "link layer"),
            (8, &[9], "link layer"),
            (9, &[0], "mtu"),
            (9, &[6], "mtu"),
            (12, &0u32.to_le_bytes()[..], "queue pair number"),
            (12, &1u32.to_le_bytes(), "queue pair number"),
            (12, &0x100_0000u32.to_le_bytes(), "queue pair number"),
            (16, &0x100_0000u32.to_le_bytes(), "packet sequence number"),
            (20, &0u32.to_le_bytes(), "data slot count"),
            (20, &u32::MAX.to_le_bytes(), "data slot count"),
            (24, &0u32.to_le_bytes(), "credit slot count"),
            (24, &(DATA_SLOTS + 1).to_le_bytes(), "credit slot count"),
            (28, &0u32.to_le_bytes(), "receive slot size"),
            (28, &u32::MAX.to_le_bytes(), "receive slot size"),
            (32, &[0u8; 16], "gid (zero on RoCE)"),
        ] {
            match set(i, bytes) {
                Err(WireError::Field { field: f, .. }) => assert_eq!(f, field),
                other => panic!("byte {i} = {bytes:?}: {other:?}"),
            }
        }
        let mut ib = good;
        ib[8] = 1;
        ib[10..12].copy_from_slice(&0u16.to_le_bytes());
        assert!(matches!(Endpoint::decode(&ib), Err(WireError::Field { field: "lid", .. })));
        ib[10..12].copy_from_slice(&0xC000u16.to_le_bytes());
        assert!(matches!(Endpoint::decode(&ib), Err(WireError::Field { field: "lid", .. })), "multicast LIDs are not peers");
        assert_eq!(Endpoint::from_hex("zz"), Err(WireError::EndpointLength(1)));
        assert_eq!(Endpoint::from_hex(&"g".repeat(ENDPOINT_BYTES * 2)), Err(WireError::Hex));
        assert_eq!(Endpoint::from_hex(&"é".repeat(ENDPOINT_BYTES)), Err(WireError::Hex), "88 bytes, not ASCII");
        // Random bytes never panic.
        for seed in 0..2000u64 {
            let mut b = [0u8; ENDPOINT_BYTES];
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for v in b.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *v = x as u8;
            }
            if seed % 2 == 0 {
                b[0..8].copy_from_slice(ENDPOINT_MAGIC);
            }
            let _ = Endpoint::decode(&b);
        }
    }

    #[test]
    fn message_headers_are_checked() {
        let g = Grant { data: 77, credit: 3 };
        let h = encode_header(Kind::More, g);
        let mut msg = h.to_vec();
        msg.push(1);
        assert_eq!(decode_header(&msg), Ok((Kind::More, g, &[1u8][..])));
        assert_eq!(decode_header(&encode_header(Kind::Credit, g)), Ok((Kind::Credit, g, &[][..])));
        assert!(decode_header(&h[..11]).is_err(), "short");
        assert!(decode_header(&h).is_err(), "an empty frame part");
        let with = |first: [u8; 4], extra: usize| {
            let mut m = first.to_vec();
            m.extend_from_slice(&[0; 8]);
            m.extend(std::iter::repeat_n(1u8, extra));
            decode_header(&m).map(|(k, g, _)| (k, g))
        };
        assert!(with([9, 0, 0, 0], 1).is_err(), "unknown kind");
        assert!(with([2, 1, 0, 0], 1).is_err(), "reserved bytes");
        assert!(with([3, 0, 0, 0], 1).is_err(), "a credit with payload");
        assert!(with([1, 0, 0, 0], 15).is_err(), "a start without a whole frame header");
        assert!(with([1, 0, 0, 0], 16).is_ok());
    }

    fn cut(frame: &Frame, payload: usize) -> Vec<(Kind, Vec<u8>)> {
        let n = chunk_count(frame, payload);
        (0..n)
            .map(|i| {
                let mut buf = vec![0u8; payload];
                let k = fill(frame, i * payload, &mut buf);
                buf.truncate(k);
                (if i == 0 { Kind::Start } else { Kind::More }, buf)
            })
            .collect()
    }

    #[test]
    fn frames_cut_into_messages_come_back_whole() {
        let mut r = Reassembly::default();
        for (values, payload) in [(0usize, 16usize), (0, 100), (1, 16), (3, 17), (1000, 16), (1000, 21), (1000, 4096), (100_003, SLOT_BYTES as usize - CHUNK_HEADER_BYTES)] {
            let frame = Frame { seq: values as u64 * 3 + 1, step: 7, data: (0..values).map(|i| i as f32 * 0.25 - 3.0).collect() };
            let parts = cut(&frame, payload);
            assert_eq!(parts.len(), chunk_count(&frame, payload));
            assert_eq!(parts.iter().map(|p| p.1.len()).sum::<usize>(), frame_bytes(&frame));
            for (i, (kind, bytes)) in parts.iter().enumerate() {
                let got = r.push(*kind, bytes).expect("valid parts");
                assert_eq!(got.is_some(), i + 1 == parts.len(), "{values} values, {payload}-byte parts: part {i}");
                if let Some(f) = got {
                    assert_eq!(f, frame);
                }
            }
            assert!(!r.in_progress());
        }
    }

    #[test]
    fn hostile_frames_are_refused() {
        let frame = Frame { seq: 1, step: 0, data: vec![1.0; 10] };
        let parts = cut(&frame, 24);
        let mut r = Reassembly::default();
        assert!(r.push(Kind::More, &parts[1].1).is_err(), "a part without a start");
        let mut r = Reassembly::default();
        r.push(Kind::Start, &parts[0].1).unwrap();
        assert!(r.push(Kind::Start, &parts[0].1).is_err(), "a start inside a frame");
        let mut r = Reassembly::default();
        r.push(Kind::Start, &parts[0].1).unwrap();
        assert!(r.push(Kind::More, &[0u8; 41]).is_err(), "more bytes than the frame has left");
        let mut huge = parts[0].1.clone();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Reassembly::default().push(Kind::Start, &huge).is_err(), "a length over the limit allocates nothing");
        let mut r = Reassembly::default();
        assert_eq!(r.push(Kind::Credit, &[]), Ok(None));
    }

    /// One end of a simulated link: the peer's messages in flight, arrived ones not yet
    /// consumed, and what is posted.
    struct End {
        credits: Credits,
        posted: u32,
        in_flight: std::collections::VecDeque<(Kind, Grant)>,
        held: std::collections::VecDeque<Kind>,
        received: u32,
    }

    impl End {
        fn new(data: u32, credit: u32) -> End {
            End { credits: Credits::new((data, credit), (data, credit)), posted: data + credit, in_flight: Default::default(), held: Default::default(), received: 0 }
        }

        /// Completions: grants apply at once, credit messages are re-posted at once, frame
        /// parts wait for `consume`.
        fn poll(&mut self) {
            while let Some((kind, grant)) = self.in_flight.pop_front() {
                self.credits.granted(grant).expect("never over-granted");
                if kind == Kind::Credit {
                    self.credits.reposted(kind);
                    self.posted += 1;
                } else {
                    self.held.push_back(kind);
                }
            }
        }

        fn consume(&mut self) -> bool {
            let Some(kind) = self.held.pop_front() else { return false };
            self.received += 1;
            self.posted += 1;
            self.credits.reposted(kind);
            true
        }
    }

    /// Sends from `ends[me]` to the other: asserts that a receive was posted for it.
    fn deliver(ends: &mut [End], me: usize, kind: Kind) {
        let grant = if kind == Kind::Credit { ends[me].credits.spend_credit() } else { ends[me].credits.spend_data() };
        let peer = &mut ends[1 - me];
        assert!(peer.posted > 0, "a message with no posted receive");
        peer.posted -= 1;
        peer.in_flight.push_back((kind, grant));
    }

    /// Random interleavings of two ends that each stream frame parts to the other while reading
    /// at random times: no message ever lacks a posted receive, grants never exceed what was
    /// posted, and everything gets through (no deadlock, no credit messages answering each
    /// other forever).
    #[test]
    fn credits_never_overrun_the_peer_and_always_flow() {
        for seed in 0..300u64 {
            let (data, credit) = [(DATA_SLOTS, CREDIT_SLOTS), (4, 1), (8, 2), (5, 3)][(seed % 4) as usize];
            let mut ends = [End::new(data, credit), End::new(data, credit)];
            let mut to_send = [500u32, (seed % 3) as u32 * 70];
            let mut x = seed + 1;
            let mut rand = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let mut credit_messages = 0u64;
            for _ in 0..400_000 {
                let me = (rand() % 2) as usize;
                match rand() % 4 {
                    0 => ends[me].poll(),
                    1 => {
                        ends[me].consume();
                    }
                    _ => {
                        ends[me].poll();
                        let blocked = to_send[me] > 0 && !ends[me].credits.can_send_data();
                        if to_send[me] > 0 && ends[me].credits.can_send_data() {
                            to_send[me] -= 1;
                            deliver(&mut ends, me, Kind::More);
                        } else if ends[me].credits.credit_due(blocked) {
                            credit_messages += 1;
                            deliver(&mut ends, me, Kind::Credit);
                        }
                    }
                }
                if to_send == [0, 0] && ends[0].received == (seed % 3) as u32 * 70 && ends[1].received == 500 {
                    break;
                }
            }
            assert_eq!([ends[0].received, ends[1].received], [(seed % 3) as u32 * 70, 500], "seed {seed} ({data}, {credit}): frames stuck");
            assert!(credit_messages < 2000, "seed {seed}: {credit_messages} credit messages for 640 parts at most");
        }
    }

    /// The group's pattern: both ends send a frame that fits `capacity` without the other
    /// reading (only polling), then both read. Neither send ever waits for credits, whatever
    /// grants were left over from earlier exchanges.
    #[test]
    fn frames_within_capacity_never_wait_for_the_peer() {
        let payload = 1000;
        // Credit slots at least data slots / threshold, as `CREDIT_SLOTS` is.
        for (data, credit) in [(DATA_SLOTS, CREDIT_SLOTS), (8, 4), (4, 4), (5, 5)] {
            let fits = capacity(data, payload) / payload;
            assert!(fits >= 1);
            let mut ends = [End::new(data, credit), End::new(data, credit)];
            let mut x = 7u64 + u64::from(data);
            for exchange in 0..5000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let parts = [1 + (x % fits as u64) as u32, 1 + ((x >> 20) % fits as u64) as u32];
                let mut left = parts;
                while left != [0, 0] {
                    let me = ((x >> (left[0] % 7)) % 2) as usize;
                    let me = if left[me] == 0 { 1 - me } else { me };
                    ends[me].poll();
                    assert!(ends[me].credits.can_send_data(), "exchange {exchange}: a send within capacity waited ({data} slots, {parts:?})");
                    deliver(&mut ends, me, Kind::More);
                    left[me] -= 1;
                }
                // Both read the whole frame, granting as they go.
                for me in [0, 1] {
                    for _ in 0..parts[1 - me] {
                        ends[me].poll();
                        assert!(ends[me].consume(), "exchange {exchange}: a part went missing");
                        if ends[me].credits.credit_due(false) {
                            deliver(&mut ends, me, Kind::Credit);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn credits_refuse_overgrants() {
        let mut c = Credits::new((4, 2), (4, 2));
        assert!(c.granted(Grant { data: 1, credit: 0 }).is_err(), "all four are already available");
        assert!(c.granted(Grant { data: 0, credit: 1 }).is_err(), "both credit slots too");
        assert_eq!(c.spend_data(), Grant::default());
        c.reposted(Kind::More);
        assert!(c.credit_due(false), "the threshold of 4 slots is 1");
        assert_eq!(c.spend_credit(), Grant { data: 1, credit: 0 });
        assert_eq!(c.available(), (3, 1));
        assert!(c.granted(Grant { data: 1, credit: 1 }).is_ok());
        assert!(c.granted(Grant { data: u32::MAX, credit: 0 }).is_err());
        let mut c = Credits::new((64, 8), (64, 8));
        c.reposted(Kind::More);
        assert!(!c.credit_due(false), "below the threshold of 64 slots");
        assert!(c.credit_due(true), "at once while our send waits");
        let mut c = Credits::new((64, 8), (64, 8));
        for _ in 0..7 {
            c.reposted(Kind::Credit);
        }
        assert!(!c.credit_due(true), "credit messages alone are not answered while the peer has budget");
        c.reposted(Kind::Credit);
        assert!(c.credit_due(true), "but are once its budget is spent and we wait");
        assert_eq!(capacity(64, 1000), 48 * 1000);
        assert_eq!(capacity(4, 1000), 3 * 1000);
    }

    #[test]
    fn roce_prefers_v2_ipv4_mapped_gids() {
        let e = |index, gid_type, last: u8, mapped: bool| {
            let mut gid = [0u8; 16];
            if mapped {
                gid[10] = 0xff;
                gid[11] = 0xff;
            } else {
                gid[0] = 0xfe;
                gid[1] = 0x80;
            }
            gid[15] = last;
            GidEntry { index, gid, gid_type }
        };
        let zero = GidEntry { index: 9, gid: [0; 16], gid_type: 2 };
        assert_eq!(pick_gid(&[e(0, 1, 1, false), e(1, 2, 1, false), e(2, 1, 2, true), e(3, 2, 2, true)]), Some(3));
        assert_eq!(pick_gid(&[zero, e(0, 1, 1, false), e(1, 2, 1, false)]), Some(1));
        assert_eq!(pick_gid(&[zero, e(4, 0, 1, false)]), Some(4), "InfiniBand: the first non-zero");
        assert_eq!(pick_gid(&[zero]), None);
        assert_eq!(pick_gid(&[]), None);
        assert_eq!(gid_index_override(None), Ok(None));
        assert_eq!(gid_index_override(Some(" 3 ")), Ok(Some(3)));
        assert!(gid_index_override(Some("-1")).unwrap_err().contains("SHOAL_RDMA_GID_INDEX"));
        assert!(gid_index_override(Some("256")).is_err());
    }
}
