//! RDMA verbs (cargo feature `rdma`, off by default): detection and the verbs link. libibverbs
//! is opened at run time (dlopen through `libloading`), so a binary built with the feature
//! still runs where rdma-core is absent and has no link-time dependency on it; the inline verbs
//! go through the context's ops table, laid out by the generated `sys_*` bindings (Linux on
//! x86-64 and aarch64 only). `detect` lists devices and their ports; a host offers `rdma` when
//! one has an active port. `link` is an RC queue pair with SEND/RECV and credits, set up over
//! the invite and a bootstrap TCP connection; `wire` holds its pure, tested parts.
//! It has not run on RDMA hardware (none was reachable; see README), and it does not support
//! macOS's Thunderbolt RDMA (no layouts for it): there, setup fails and the group falls back.

pub mod wire;

#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
#[cfg_attr(target_arch = "x86_64", path = "sys_x86_64.rs")]
#[cfg_attr(target_arch = "aarch64", path = "sys_aarch64.rs")]
#[allow(non_camel_case_types, non_upper_case_globals, non_snake_case, dead_code, unsafe_op_in_unsafe_fn, clippy::all)]
mod sys;
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod link;
#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod verbs;

#[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
pub use link::{join, Offered, RdmaLink};

/// What detection found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detection {
    /// No libibverbs could be opened (or this platform has no verbs layouts).
    NoLibrary,
    /// The library opened; these devices opened (maybe none), with their ports.
    Devices(Vec<DeviceSummary>),
}

/// One device as detection reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceSummary {
    pub name: String,
    /// Port numbers in the ACTIVE state.
    pub active_ports: Vec<u8>,
}

impl Detection {
    /// Whether some device has an active port, which is when this host offers `rdma`.
    pub fn usable(&self) -> bool {
        matches!(self, Detection::Devices(d) if d.iter().any(|d| !d.active_ports.is_empty()))
    }
}

/// Looks for RDMA devices and their active ports. Never panics; a device that fails to open is
/// left out.
pub fn detect() -> Detection {
    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let Some(v) = verbs::verbs() else {
            return Detection::NoLibrary;
        };
        Detection::Devices(
            verbs::devices(v)
                .into_iter()
                .map(|d| DeviceSummary { active_ports: d.ports.iter().filter(|p| p.active && p.link_layer.is_some()).map(|p| p.num).collect(), name: d.name })
                .collect(),
        )
    }
    #[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
    Detection::NoLibrary
}

/// Stand-ins where the verbs link is not built: setup fails, and the group falls back.
#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
mod unsupported {
    use std::net::{IpAddr, SocketAddr};
    use std::time::Duration;

    use crate::dataplane::tcp::TOKEN_BYTES;
    use crate::dataplane::{LinkError, Transport};

    fn unsupported() -> LinkError {
        LinkError::Setup { transport: Transport::Rdma, message: "the verbs link is built for Linux on x86-64 and aarch64 only".into() }
    }

    /// Never made on this platform.
    pub enum RdmaLink {}

    impl crate::dataplane::Link for RdmaLink {
        fn transport(&self) -> Transport {
            match *self {}
        }
        fn send(&mut self, _: &crate::dataplane::Frame) -> Result<(), LinkError> {
            match *self {}
        }
        fn recv(&mut self, _: Duration) -> Result<Option<crate::dataplane::Frame>, LinkError> {
            match *self {}
        }
        fn is_closed(&mut self) -> bool {
            match *self {}
        }
        fn close(&mut self) {
            match *self {}
        }
        fn capacity(&self) -> usize {
            match *self {}
        }
    }

    /// Never made on this platform.
    pub struct Offered(());

    impl Offered {
        pub fn new(_ip: IpAddr) -> Result<(Offered, SocketAddr, String), LinkError> {
            Err(unsupported())
        }

        pub fn accept(self, _token: &[u8; TOKEN_BYTES], _wait: Duration) -> Result<RdmaLink, LinkError> {
            Err(unsupported())
        }
    }

    pub fn join(_addr: SocketAddr, _token: &[u8; TOKEN_BYTES], _endpoint: &str) -> Result<RdmaLink, LinkError> {
        Err(unsupported())
    }
}
#[cfg(not(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64"))))]
pub use unsupported::{join, Offered, RdmaLink};

#[cfg(test)]
mod tests {
    use super::*;

    fn has_library() -> bool {
        ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"].iter().any(|d| std::path::Path::new(d).join("libibverbs.so.1").exists())
    }

    #[test]
    fn detection_follows_what_the_host_has() {
        let d = detect();
        match &d {
            Detection::NoLibrary => assert!(!has_library(), "libibverbs is installed but did not open"),
            Detection::Devices(devices) => {
                assert!(has_library(), "found a libibverbs this host does not have");
                assert!(devices.iter().all(|d| !d.name.is_empty()), "{devices:?}");
            }
        }
        // Hosts without /sys/class/infiniband (this CI machine, containers) have no usable device.
        if !std::path::Path::new("/sys/class/infiniband").exists() {
            assert!(!d.usable(), "{d:?}");
        }
        assert!(!Detection::NoLibrary.usable());
        assert!(!Detection::Devices(vec![DeviceSummary { name: "mlx5_0".into(), active_ports: vec![] }]).usable());
        assert!(Detection::Devices(vec![DeviceSummary { name: "mlx5_0".into(), active_ports: vec![1] }]).usable());
    }

    /// Without a device both ends of the setup fail with a setup error that says why, and the
    /// joiner checks the peer's endpoint before it touches a device.
    #[test]
    fn setup_without_a_device_fails_with_a_clear_error() {
        if detect().usable() {
            eprintln!("skipped: this host has an RDMA device");
            return;
        }
        let err = Offered::new("127.0.0.1".parse().unwrap()).err().expect("no device: no offer");
        let msg = err.to_string();
        assert!(matches!(err, crate::dataplane::LinkError::Setup { transport: crate::dataplane::Transport::Rdma, .. }), "{msg}");
        assert!(msg.contains("libibverbs") || msg.contains("no RDMA device") || msg.contains("Linux"), "{msg}");
        let token = [7u8; 16];
        let addr = "127.0.0.1:9".parse().unwrap();
        let hostile = join(addr, &token, "00ff").err().expect("a bad endpoint");
        assert!(hostile.to_string().contains("RDMA endpoint"), "{hostile}");
        let good = wire::Endpoint { link_layer: wire::LinkLayer::Ethernet, lid: 0, mtu: 5, qpn: 99, psn: 1, gid: [1; 16], data_slots: 64, credit_slots: 8, slot_bytes: 65536 };
        let err = join(addr, &token, &good.to_hex()).err().expect("no device");
        assert!(err.to_string().contains("libibverbs") || err.to_string().contains("no RDMA device") || err.to_string().contains("Linux"), "{err}");
    }

    #[cfg(all(target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
    #[test]
    fn the_fields_read_through_raw_pointers_sit_where_libibverbs_puts_them() {
        // bindgen's own layout checks (the `const _` blocks in sys_*.rs) run at compile time;
        // these pin the few fields the link reads from library-owned structs.
        use std::mem::offset_of;
        assert_eq!(offset_of!(sys::ibv_context, ops), 8);
        assert_eq!(offset_of!(sys::ibv_qp, context), 0);
        assert_eq!(offset_of!(sys::ibv_qp, qp_num), 52);
        assert_eq!(offset_of!(sys::ibv_cq, context), 0);
        assert_eq!(offset_of!(sys::ibv_mr, lkey), 36);
        assert_eq!(std::mem::size_of::<sys::ibv_wc>(), 48);
        assert_eq!(std::mem::size_of::<sys::ibv_send_wr>(), 128);
        assert_eq!(std::mem::size_of::<sys::ibv_qp_attr>(), 144);
        let post_send = offset_of!(sys::ibv_context_ops, post_send);
        assert_eq!(post_send % 8, 0);
        assert!(post_send > offset_of!(sys::ibv_context_ops, poll_cq));
    }
}
