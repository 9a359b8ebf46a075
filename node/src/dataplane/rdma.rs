//! RDMA verbs detection (cargo feature `rdma`, off by default): libibverbs is opened at run
//! time (dlopen through `libloading`), so a binary built with the feature still runs where
//! rdma-core is absent; a device counts when it opens and gives a protection domain. Only
//! exported entry points are called, never the inline verbs that depend on struct layouts.
//! It does not move data: no queue pairs are made and `Transport::Rdma` is not offered, because
//! this build has no verbs link (see README); detection only tells the operator what is there.

use std::ffi::{c_char, c_int, c_void, CStr};

/// The libraries tried, in order: rdma-core's soname on Linux, then the unversioned names.
const LIBRARIES: [&str; 3] = ["libibverbs.so.1", "libibverbs.so", "libibverbs.dylib"];

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type GetDeviceName = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type OpenDevice = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type CloseDevice = unsafe extern "C" fn(*mut c_void) -> c_int;
type AllocPd = unsafe extern "C" fn(*mut c_void) -> *mut c_void;
type DeallocPd = unsafe extern "C" fn(*mut c_void) -> c_int;

/// What detection found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Detection {
    /// No libibverbs could be opened.
    NoLibrary,
    /// The library opened; these devices opened and gave a protection domain (maybe none).
    Devices(Vec<String>),
}

/// Looks for usable RDMA devices. Never panics; a library or device that fails is skipped.
pub fn detect() -> Detection {
    // SAFETY: loading libibverbs runs its constructors, which only register providers.
    let Some(lib) = LIBRARIES.iter().find_map(|name| unsafe { libloading::Library::new(*name) }.ok()) else {
        return Detection::NoLibrary;
    };
    // SAFETY: the symbol types match rdma-core's exported prototypes (verbs.h).
    let found = unsafe { devices(&lib) };
    Detection::Devices(found.unwrap_or_default())
}

/// # Safety
/// `lib` must be libibverbs.
unsafe fn devices(lib: &libloading::Library) -> Result<Vec<String>, libloading::Error> {
    let get_list: libloading::Symbol<GetDeviceList> = lib.get(b"ibv_get_device_list\0")?;
    let free_list: libloading::Symbol<FreeDeviceList> = lib.get(b"ibv_free_device_list\0")?;
    let get_name: libloading::Symbol<GetDeviceName> = lib.get(b"ibv_get_device_name\0")?;
    let open: libloading::Symbol<OpenDevice> = lib.get(b"ibv_open_device\0")?;
    let close: libloading::Symbol<CloseDevice> = lib.get(b"ibv_close_device\0")?;
    let alloc_pd: libloading::Symbol<AllocPd> = lib.get(b"ibv_alloc_pd\0")?;
    let dealloc_pd: libloading::Symbol<DeallocPd> = lib.get(b"ibv_dealloc_pd\0")?;
    let mut n: c_int = 0;
    let list = get_list(&mut n);
    if list.is_null() {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    for i in 0..n.max(0) as usize {
        let dev = *list.add(i);
        if dev.is_null() {
            break;
        }
        let name = get_name(dev);
        let name = if name.is_null() { format!("device {i}") } else { CStr::from_ptr(name).to_string_lossy().into_owned() };
        let ctx = open(dev);
        if ctx.is_null() {
            continue;
        }
        let pd = alloc_pd(ctx);
        if !pd.is_null() {
            dealloc_pd(pd);
            out.push(name);
        }
        close(ctx);
    }
    free_list(list);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_follows_what_the_host_has() {
        let has_library = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib"].iter().any(|d| std::path::Path::new(d).join("libibverbs.so.1").exists());
        match detect() {
            Detection::NoLibrary => assert!(!has_library, "libibverbs is installed but did not open"),
            Detection::Devices(d) => {
                assert!(has_library || cfg!(target_os = "macos"), "found a libibverbs this host does not have");
                assert!(d.iter().all(|n| !n.is_empty()), "{d:?}");
            }
        }
    }
}
