//! libibverbs through dlopen: the exported entry points resolved once per process (`Verbs`),
//! the device list with each port's state, and `Channel`, one RC queue pair with everything it
//! needs (context, protection domain, one registered buffer of receive and send slots, a
//! completion queue each way), moved RESET→INIT→RTR→RTS against a peer's `Endpoint`. The
//! inline verbs (post send/receive, poll) go through the context's ops table, whose layout comes
//! from the generated `sys` bindings. Every unsafe call is here; errors come back as strings
//! for the link to wrap. It does not decide what the messages mean (`link` and `wire` do).

use std::alloc::Layout;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::null_mut;
use std::sync::OnceLock;

use super::sys::*;
use super::wire::{Endpoint, GidEntry, LinkLayer};

/// The libraries tried, in order: rdma-core's soname, then the unversioned name.
const LIBRARIES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut ibv_device);
type GetDeviceName = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;
type OpenDevice = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;
type CloseDevice = unsafe extern "C" fn(*mut ibv_context) -> c_int;
type QueryDevice = unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
/// The exported (compat) `ibv_query_port`: it fills the fields of the 1.1 struct, a prefix of
/// `ibv_port_attr` holding every field read here; a zeroed whole struct is passed.
type QueryPort = unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
type QueryGid = unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
type QueryGidEx = unsafe extern "C" fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;
type DeallocPd = unsafe extern "C" fn(*mut ibv_pd) -> c_int;
type RegMr = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
type DeregMr = unsafe extern "C" fn(*mut ibv_mr) -> c_int;
type CreateCq = unsafe extern "C" fn(*mut ibv_context, c_int, *mut c_void, *mut c_void, c_int) -> *mut ibv_cq;
type DestroyCq = unsafe extern "C" fn(*mut ibv_cq) -> c_int;
type CreateQp = unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
type DestroyQp = unsafe extern "C" fn(*mut ibv_qp) -> c_int;
type ModifyQp = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
type WcStatusStr = unsafe extern "C" fn(ibv_wc_status) -> *const c_char;

/// The entry points of one loaded libibverbs (kept loaded for the life of the process).
pub struct Verbs {
    _lib: libloading::Library,
    get_device_list: GetDeviceList,
    free_device_list: FreeDeviceList,
    get_device_name: GetDeviceName,
    open_device: OpenDevice,
    close_device: CloseDevice,
    query_device: QueryDevice,
    query_port: QueryPort,
    query_gid: QueryGid,
    /// rdma-core 32 and later: the GID's type (RoCE v1 or v2) without reading sysfs.
    query_gid_ex: Option<QueryGidEx>,
    alloc_pd: AllocPd,
    dealloc_pd: DeallocPd,
    reg_mr: RegMr,
    dereg_mr: DeregMr,
    create_cq: CreateCq,
    destroy_cq: DestroyCq,
    create_qp: CreateQp,
    destroy_qp: DestroyQp,
    modify_qp: ModifyQp,
    wc_status_str: WcStatusStr,
}

static VERBS: OnceLock<Option<Verbs>> = OnceLock::new();

/// libibverbs, loaded on first use; `None` when no library opens or one lacks a symbol.
pub fn verbs() -> Option<&'static Verbs> {
    VERBS.get_or_init(load).as_ref()
}

fn load() -> Option<Verbs> {
    // SAFETY: loading libibverbs runs its constructors, which only register providers.
    let lib = LIBRARIES.iter().find_map(|name| unsafe { libloading::Library::new(*name) }.ok())?;
    // SAFETY: each symbol's type is its prototype in rdma-core's verbs.h (or, for the compat
    // ibv_query_port, the ABI noted on `QueryPort`); the fn pointers are copied out and stay
    // valid because the library is kept in the struct, never unloaded.
    unsafe {
        Some(Verbs {
            get_device_list: *lib.get(b"ibv_get_device_list\0").ok()?,
            free_device_list: *lib.get(b"ibv_free_device_list\0").ok()?,
            get_device_name: *lib.get(b"ibv_get_device_name\0").ok()?,
            open_device: *lib.get(b"ibv_open_device\0").ok()?,
            close_device: *lib.get(b"ibv_close_device\0").ok()?,
            query_device: *lib.get(b"ibv_query_device\0").ok()?,
            query_port: *lib.get(b"ibv_query_port\0").ok()?,
            query_gid: *lib.get(b"ibv_query_gid\0").ok()?,
            query_gid_ex: lib.get(b"_ibv_query_gid_ex\0").ok().map(|s| *s),
            alloc_pd: *lib.get(b"ibv_alloc_pd\0").ok()?,
            dealloc_pd: *lib.get(b"ibv_dealloc_pd\0").ok()?,
            reg_mr: *lib.get(b"ibv_reg_mr\0").ok()?,
            dereg_mr: *lib.get(b"ibv_dereg_mr\0").ok()?,
            create_cq: *lib.get(b"ibv_create_cq\0").ok()?,
            destroy_cq: *lib.get(b"ibv_destroy_cq\0").ok()?,
            create_qp: *lib.get(b"ibv_create_qp\0").ok()?,
            destroy_qp: *lib.get(b"ibv_destroy_qp\0").ok()?,
            modify_qp: *lib.get(b"ibv_modify_qp\0").ok()?,
            wc_status_str: *lib.get(b"ibv_wc_status_str\0").ok()?,
            _lib: lib,
        })
    }
}

/// One port of a device, as `ibv_query_port` saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Port {
    pub num: u8,
    pub active: bool,
    /// `None` for a link layer this build does not know (never used).
    pub link_layer: Option<LinkLayer>,
    pub lid: u16,
    pub active_mtu: u8,
    pub gid_table_len: u32,
}

/// One device and its ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub ports: Vec<Port>,
}

impl Device {
    /// The first active port with a link layer this build speaks.
    pub fn active_port(&self) -> Option<&Port> {
        self.ports.iter().find(|p| p.active && p.link_layer.is_some())
    }
}

/// The device list (pointers valid until dropped).
struct DeviceList<'a> {
    verbs: &'a Verbs,
    list: *mut *mut ibv_device,
    len: usize,
}

impl<'a> DeviceList<'a> {
    fn get(verbs: &'a Verbs) -> DeviceList<'a> {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid out-pointer; a null list means none (or an error).
        let list = unsafe { (verbs.get_device_list)(&mut n) };
        DeviceList { verbs, list, len: if list.is_null() { 0 } else { n.max(0) as usize } }
    }

    /// The devices with their names.
    fn iter(&self) -> impl Iterator<Item = (String, *mut ibv_device)> + '_ {
        (0..self.len).map_while(move |i| {
            // SAFETY: the list holds `len` entries (and a null after them).
            let dev = unsafe { *self.list.add(i) };
            if dev.is_null() {
                return None;
            }
            // SAFETY: `dev` is a live entry of the list; the name is a C string it owns.
            let name = unsafe { (self.verbs.get_device_name)(dev) };
            // SAFETY: non-null names are NUL-terminated strings of the device.
            let name = if name.is_null() { format!("device {i}") } else { unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned() };
            Some((name, dev))
        })
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: the list came from ibv_get_device_list and is freed once.
            unsafe { (self.verbs.free_device_list)(self.list) };
        }
    }
}

/// An open device context, closed on drop.
struct Context {
    verbs: &'static Verbs,
    ctx: *mut ibv_context,
    name: String,
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by ibv_open_device, closed once, after everything made on it.
        unsafe { (self.verbs.close_device)(self.ctx) };
    }
}

impl Context {
    fn ports(&self) -> Vec<Port> {
        // SAFETY: zeroed is a valid ibv_device_attr (integers and arrays only).
        let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `attr` a whole struct of the queried layout.
        if unsafe { (self.verbs.query_device)(self.ctx, &mut attr) } != 0 {
            return Vec::new();
        }
        (1..=attr.phys_port_cnt).filter_map(|num| self.port(num).ok()).collect()
    }

    fn port(&self, num: u8) -> Result<Port, String> {
        // SAFETY: zeroed is a valid ibv_port_attr (integers only).
        let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; the compat entry point writes at most the whole struct.
        let rc = unsafe { (self.verbs.query_port)(self.ctx, num, &mut attr) };
        if rc != 0 {
            return Err(format!("querying port {num} of {}: error {rc}", self.name));
        }
        Ok(Port {
            num,
            active: attr.state == IBV_PORT_ACTIVE,
            link_layer: LinkLayer::from_verbs(attr.link_layer),
            lid: attr.lid,
            active_mtu: u8::try_from(attr.active_mtu).unwrap_or(1).clamp(1, 5),
            gid_table_len: u32::try_from(attr.gid_tbl_len).unwrap_or(0),
        })
    }

    fn gid(&self, port: u8, index: u8) -> Result<[u8; 16], String> {
        // SAFETY: zeroed is a valid ibv_gid (bytes).
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open and `gid` a whole union.
        let rc = unsafe { (self.verbs.query_gid)(self.ctx, port, c_int::from(index), &mut gid) };
        if rc != 0 {
            return Err(format!("GID index {index} of {} port {port} cannot be read (error {rc})", self.name));
        }
        // SAFETY: every bit pattern is a valid `raw` view of the union.
        Ok(unsafe { gid.raw })
    }

    /// The port's GID table with each entry's type (from libibverbs, else from sysfs).
    fn gid_entries(&self, port: &Port) -> Vec<GidEntry> {
        let len = port.gid_table_len.min(256);
        (0..len)
            .filter_map(|index| {
                let index8 = u8::try_from(index).ok()?;
                if let Some(query_ex) = self.verbs.query_gid_ex {
                    // SAFETY: zeroed is a valid ibv_gid_entry (integers and bytes).
                    let mut e: ibv_gid_entry = unsafe { std::mem::zeroed() };
                    // SAFETY: `ctx` is open; `e` is a whole entry of the size passed.
                    let rc = unsafe { query_ex(self.ctx, u32::from(port.num), index, &mut e, 0, std::mem::size_of::<ibv_gid_entry>()) };
                    // SAFETY: every bit pattern is a valid `raw` view of the union.
                    return (rc == 0).then_some(GidEntry { index, gid: unsafe { e.gid.raw }, gid_type: e.gid_type });
                }
                let gid = self.gid(port.num, index8).ok()?;
                let path = format!("/sys/class/infiniband/{}/ports/{}/gid_attrs/types/{index}", self.name, port.num);
                let gid_type = match std::fs::read_to_string(path).unwrap_or_default().trim() {
                    "RoCE v2" => 2,
                    "IB/RoCE v1" => 1,
                    _ => 0,
                };
                Some(GidEntry { index, gid, gid_type })
            })
            .collect()
    }
}

/// Every device libibverbs lists, with its ports (a device that does not open is left out).
pub fn devices(verbs: &'static Verbs) -> Vec<Device> {
    let list = DeviceList::get(verbs);
    list.iter()
        .filter_map(|(name, dev)| {
            // SAFETY: `dev` is a live entry of the list.
            let ctx = unsafe { (verbs.open_device)(dev) };
            if ctx.is_null() {
                return None;
            }
            let ctx = Context { verbs, ctx, name: name.clone() };
            Some(Device { name, ports: ctx.ports() })
        })
        .collect()
}

/// One completion: which slot (`wr_id`), whether it worked, how many bytes arrived.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    pub wr_id: u64,
    pub ok: bool,
    pub status: u32,
    pub byte_len: u32,
}

/// One RC queue pair and its resources; everything is released on drop, in reverse order.
pub struct Channel {
    verbs: &'static Verbs,
    /// Declared first among the owned pointers so that everything below is released before it.
    ctx: Option<Context>,
    pd: *mut ibv_pd,
    mr: *mut ibv_mr,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    buf: *mut u8,
    layout: Layout,
    port: Port,
    gid_index: u8,
    gid: [u8; 16],
    psn: u32,
    /// Receives posted: for frame parts and for credit messages (`recv_slots` is their sum).
    data_slots: u32,
    credit_slots: u32,
    pub recv_slots: u32,
    pub send_slots: u32,
    pub slot_bytes: u32,
    /// Completions read by `poll`, reused between calls.
    wcs: Vec<ibv_wc>,
}

// SAFETY: the channel owns its verbs objects and buffer exclusively (no aliases escape it);
// libibverbs objects may be used from any thread, one at a time, which `&mut self` ensures.
unsafe impl Send for Channel {}

impl Channel {
    /// Opens the device (`want`: by name, else the first with an active port), makes the queue
    /// pair with `slots` (data, credit) receive and `send_slots` send buffers of `slot_bytes`,
    /// moves it to INIT and posts every receive. `gid_index`: the operator's choice, else
    /// picked from the table.
    pub fn open(want: Option<&str>, gid_index: Option<u8>, slots: (u32, u32), send_slots: u32, slot_bytes: u32) -> Result<Channel, String> {
        let (data_slots, credit_slots) = slots;
        let recv_slots = data_slots + credit_slots;
        let verbs = verbs().ok_or("libibverbs (rdma-core) is not installed")?;
        let (ctx, port) = open_device(verbs, want)?;
        let link_layer = port.link_layer.ok_or_else(|| format!("{} port {} has an unknown link layer", ctx.name, port.num))?;
        let gid_index = match gid_index {
            Some(i) => i,
            None => match link_layer {
                LinkLayer::Ethernet => super::wire::pick_gid(&ctx.gid_entries(&port))
                    .and_then(|i| u8::try_from(i).ok())
                    .ok_or_else(|| format!("{} port {} has no usable RoCE GID (set SHOAL_RDMA_GID_INDEX)", ctx.name, port.num))?,
                LinkLayer::Infiniband => 0,
            },
        };
        let gid = match (link_layer, ctx.gid(port.num, gid_index)) {
            (_, Ok(g)) => g,
            (LinkLayer::Infiniband, Err(_)) => [0; 16],
            (LinkLayer::Ethernet, Err(e)) => return Err(e),
        };
        if link_layer == LinkLayer::Ethernet && gid == [0; 16] {
            return Err(format!("GID index {gid_index} of {} port {} is empty", ctx.name, port.num));
        }
        let total = (recv_slots as usize + send_slots as usize) * slot_bytes as usize;
        let layout = Layout::from_size_align(total, 4096).map_err(|e| e.to_string())?;
        let mut ch = Channel {
            verbs,
            ctx: Some(ctx),
            pd: null_mut(),
            mr: null_mut(),
            send_cq: null_mut(),
            recv_cq: null_mut(),
            qp: null_mut(),
            buf: null_mut(),
            layout,
            port,
            gid_index,
            gid,
            psn: rand::random::<u32>() & 0xFF_FFFF,
            data_slots,
            credit_slots,
            recv_slots,
            send_slots,
            slot_bytes,
            wcs: Vec::new(),
        };
        ch.build()?;
        Ok(ch)
    }

    fn ctx(&self) -> Result<*mut ibv_context, String> {
        self.ctx.as_ref().map(|c| c.ctx).ok_or_else(|| "the device is closed".to_string())
    }

    fn build(&mut self) -> Result<(), String> {
        let ctx = self.ctx()?;
        let name = self.ctx.as_ref().map(|c| c.name.clone()).unwrap_or_default();
        // SAFETY: `ctx` is open.
        self.pd = unsafe { (self.verbs.alloc_pd)(ctx) };
        if self.pd.is_null() {
            return Err(format!("{name}: no protection domain"));
        }
        // SAFETY: the layout has a non-zero size (slot counts and sizes are at least 1).
        self.buf = unsafe { std::alloc::alloc_zeroed(self.layout) };
        if self.buf.is_null() {
            return Err(format!("no memory for {} bytes of RDMA buffers", self.layout.size()));
        }
        // SAFETY: `buf` is ours for `layout.size()` bytes until drop, which deregisters first.
        self.mr = unsafe { (self.verbs.reg_mr)(self.pd, self.buf.cast(), self.layout.size(), IBV_ACCESS_LOCAL_WRITE as c_int) };
        if self.mr.is_null() {
            return Err(format!("{name}: registering {} bytes failed (locked-memory limit? see ulimit -l)", self.layout.size()));
        }
        // SAFETY: `ctx` is open; no completion channel, vector 0.
        self.send_cq = unsafe { (self.verbs.create_cq)(ctx, self.send_slots as c_int, null_mut(), null_mut(), 0) };
        // SAFETY: as above.
        self.recv_cq = unsafe { (self.verbs.create_cq)(ctx, self.recv_slots as c_int, null_mut(), null_mut(), 0) };
        if self.send_cq.is_null() || self.recv_cq.is_null() {
            return Err(format!("{name}: no completion queue"));
        }
        // SAFETY: zeroed is a valid ibv_qp_init_attr (null pointers and integers).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = self.send_cq;
        init.recv_cq = self.recv_cq;
        init.qp_type = IBV_QPT_RC;
        init.cap.max_send_wr = self.send_slots;
        init.cap.max_recv_wr = self.recv_slots;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: `pd` and both CQs are live; `init` is a whole struct.
        self.qp = unsafe { (self.verbs.create_qp)(self.pd, &mut init) };
        if self.qp.is_null() {
            return Err(format!("{name}: no RC queue pair"));
        }
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = self.port.num;
        attr.qp_access_flags = 0;
        self.modify(&mut attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT")?;
        for slot in 0..self.recv_slots {
            self.post_recv(slot)?;
        }
        Ok(())
    }

    fn modify(&mut self, attr: &mut ibv_qp_attr, mask: ibv_qp_attr_mask, state: &str) -> Result<(), String> {
        // SAFETY: `qp` is live and `attr` a whole struct holding the fields the mask names.
        let rc = unsafe { (self.verbs.modify_qp)(self.qp, attr, mask as c_int) };
        if rc != 0 {
            return Err(format!("moving the queue pair to {state} failed: {}", std::io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// What the peer needs to connect to this queue pair.
    pub fn local(&self) -> Endpoint {
        // SAFETY: `qp` is live; `qp_num` precedes the pthread fields, at the same offset on
        // every target the bindings cover.
        let qpn = unsafe { (*self.qp).qp_num };
        Endpoint {
            link_layer: self.port.link_layer.unwrap_or(LinkLayer::Infiniband),
            lid: self.port.lid,
            mtu: self.port.active_mtu,
            qpn,
            psn: self.psn,
            gid: self.gid,
            data_slots: self.data_slots,
            credit_slots: self.credit_slots,
            slot_bytes: self.slot_bytes,
        }
    }

    /// RTR then RTS against the peer's (already validated) endpoint.
    pub fn connect(&mut self, remote: &Endpoint) -> Result<(), String> {
        let local = self.local();
        if remote.link_layer != local.link_layer {
            return Err(format!("the peer's port is {:?}, ours {:?}", remote.link_layer, local.link_layer));
        }
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = IBV_QPS_RTR;
        attr.path_mtu = ibv_mtu::from(remote.mtu.min(local.mtu));
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = self.port.num;
        // RoCE always routes by GID; InfiniBand by LID unless the peer has no LID.
        if local.link_layer == LinkLayer::Ethernet || remote.lid == 0 {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid;
            attr.ah_attr.grh.sgid_index = self.gid_index;
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = 0;
            attr.ah_attr.grh.flow_label = 0;
        }
        self.modify(&mut attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, "RTR")?;
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = 1;
        self.modify(&mut attr, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC, "RTS")
    }

    /// Moves the queue pair to ERR: posted work completes as flushed, nothing more is sent.
    pub fn set_error(&mut self) {
        if self.qp.is_null() {
            return;
        }
        // SAFETY: zeroed is a valid ibv_qp_attr.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = IBV_QPS_ERR;
        let _ = self.modify(&mut attr, IBV_QP_STATE, "ERR");
    }

    fn slot_ptr(&self, index: usize) -> *mut u8 {
        // SAFETY (of the callers' use): `index` < recv_slots + send_slots, so the slot lies in
        // the buffer; `add` stays inside the allocation.
        unsafe { self.buf.add(index * self.slot_bytes as usize) }
    }

    fn lkey(&self) -> u32 {
        // SAFETY: `mr` is live while the channel is.
        unsafe { (*self.mr).lkey }
    }

    /// Posts receive slot `slot` (< recv_slots); its `wr_id` is the slot.
    pub fn post_recv(&mut self, slot: u32) -> Result<(), String> {
        if slot >= self.recv_slots {
            return Err(format!("receive slot {slot} does not exist"));
        }
        let mut sge = ibv_sge { addr: self.slot_ptr(slot as usize) as u64, length: self.slot_bytes, lkey: self.lkey() };
        // SAFETY: zeroed is a valid ibv_recv_wr.
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = u64::from(slot);
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad: *mut ibv_recv_wr = null_mut();
        // SAFETY: `qp` and its context are live; the ops table was filled by the provider
        // (it is how verbs.h's inline ibv_post_recv calls it); `wr` and `sge` outlive the call,
        // which copies them; the slot is registered memory not otherwise in use.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_recv.ok_or("the provider has no post_recv")?;
            post(self.qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(format!("posting a receive failed: {}", std::io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// The bytes of receive slot `slot` (its first `len`, clamped to the slot).
    pub fn recv_slot(&self, slot: u32, len: u32) -> &[u8] {
        let slot = slot.min(self.recv_slots.saturating_sub(1));
        // SAFETY: the slot lies in the buffer (clamped above) and is not posted while read:
        // the link reads a slot only between its completion and its re-post.
        unsafe { std::slice::from_raw_parts(self.slot_ptr(slot as usize), len.min(self.slot_bytes) as usize) }
    }

    /// Send slot `slot` (< send_slots) to fill before `post_send`.
    pub fn send_slot(&mut self, slot: u32) -> &mut [u8] {
        let slot = slot.min(self.send_slots.saturating_sub(1));
        // SAFETY: send slots follow the receive slots inside the buffer; the link fills a
        // slot only while no send of it is outstanding, and `&mut self` excludes other views.
        unsafe { std::slice::from_raw_parts_mut(self.slot_ptr((self.recv_slots + slot) as usize), self.slot_bytes as usize) }
    }

    /// Sends the first `len` bytes of send slot `slot` (signalled; `wr_id` is the slot).
    pub fn post_send(&mut self, slot: u32, len: u32) -> Result<(), String> {
        if slot >= self.send_slots || len > self.slot_bytes {
            return Err(format!("send slot {slot} of {len} bytes does not exist"));
        }
        let mut sge = ibv_sge { addr: self.slot_ptr((self.recv_slots + slot) as usize) as u64, length: len, lkey: self.lkey() };
        // SAFETY: zeroed is a valid ibv_send_wr (its unions hold integers and null pointers).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = u64::from(slot);
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = IBV_SEND_SIGNALED;
        let mut bad: *mut ibv_send_wr = null_mut();
        // SAFETY: as in `post_recv`; the slot stays untouched until its completion.
        let rc = unsafe {
            let post = (*(*self.qp).context).ops.post_send.ok_or("the provider has no post_send")?;
            post(self.qp, &mut wr, &mut bad)
        };
        if rc != 0 {
            return Err(format!("posting a send failed: {}", std::io::Error::from_raw_os_error(rc)));
        }
        Ok(())
    }

    /// Appends the completions waiting on the send (`send`) or receive queue to `out`.
    pub fn poll(&mut self, send: bool, out: &mut Vec<Completion>) -> Result<(), String> {
        let cq = if send { self.send_cq } else { self.recv_cq };
        const BATCH: usize = 16;
        if self.wcs.len() < BATCH {
            // SAFETY: zeroed is a valid ibv_wc.
            self.wcs.resize(BATCH, unsafe { std::mem::zeroed() });
        }
        // SAFETY: `cq` and its context are live; `wcs` has room for BATCH entries.
        let n = unsafe {
            let poll = (*(*cq).context).ops.poll_cq.ok_or("the provider has no poll_cq")?;
            poll(cq, BATCH as c_int, self.wcs.as_mut_ptr())
        };
        if n < 0 {
            return Err(format!("polling a completion queue failed ({n})"));
        }
        out.extend(self.wcs[..n as usize].iter().map(|wc| Completion { wr_id: wc.wr_id, ok: wc.status == IBV_WC_SUCCESS, status: wc.status, byte_len: wc.byte_len }));
        Ok(())
    }

    /// libibverbs' name for a completion status.
    pub fn status_name(&self, status: u32) -> String {
        // SAFETY: the function returns a static string for any value ("unknown" otherwise).
        let s = unsafe { (self.verbs.wc_status_str)(status) };
        if s.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null results are static NUL-terminated strings.
        format!("{} ({status})", unsafe { CStr::from_ptr(s) }.to_string_lossy())
    }
}

impl Drop for Channel {
    fn drop(&mut self) {
        // SAFETY: each object was made once by this channel and is destroyed once, queue pair
        // before its CQs, the MR before its buffer and PD; the context closes last (`ctx`).
        unsafe {
            if !self.qp.is_null() {
                (self.verbs.destroy_qp)(self.qp);
            }
            for cq in [self.send_cq, self.recv_cq] {
                if !cq.is_null() {
                    (self.verbs.destroy_cq)(cq);
                }
            }
            if !self.mr.is_null() {
                (self.verbs.dereg_mr)(self.mr);
            }
            if !self.buf.is_null() {
                std::alloc::dealloc(self.buf, self.layout);
            }
            if !self.pd.is_null() {
                (self.verbs.dealloc_pd)(self.pd);
            }
        }
        self.ctx.take();
    }
}

/// Opens `want` (or the first device with an active port) and returns it with that port.
fn open_device(verbs: &'static Verbs, want: Option<&str>) -> Result<(Context, Port), String> {
    let list = DeviceList::get(verbs);
    let mut seen = Vec::new();
    for (name, dev) in list.iter() {
        if want.is_some_and(|w| w != name) {
            continue;
        }
        // SAFETY: `dev` is a live entry of the list.
        let ctx = unsafe { (verbs.open_device)(dev) };
        if ctx.is_null() {
            seen.push(format!("{name} (does not open)"));
            continue;
        }
        let ctx = Context { verbs, ctx, name: name.clone() };
        let device = Device { name: name.clone(), ports: ctx.ports() };
        match device.active_port() {
            Some(p) => return Ok((ctx, p.clone())),
            None => seen.push(format!("{name} (no active port)")),
        }
    }
    Err(match (want, seen.is_empty()) {
        (Some(w), true) => format!("no RDMA device named {w} (SHOAL_RDMA_DEVICE)"),
        (_, true) => "no RDMA device on this host".to_string(),
        (_, false) => format!("no RDMA device with an active port: {}", seen.join(", ")),
    })
}
