//! Where a prompt's time goes on a device: with `SHOAL_PROMPT_TIMING=1`, each marked section of
//! a layer's forward pass synchronizes the device and adds its wall time to a per-name total,
//! which `report` prints (a diagnostic: synchronizing slows the pass; off by default, no cost then).

use std::collections::BTreeMap;
use std::sync::{LazyLock, Mutex};
use std::time::Instant;

use candle_core::Device;

static ON: LazyLock<bool> = LazyLock::new(|| std::env::var("SHOAL_PROMPT_TIMING").is_ok_and(|v| v == "1"));
static TOTALS: Mutex<BTreeMap<&'static str, (f64, u64)>> = Mutex::new(BTreeMap::new());

/// A running section clock (`None` when timing is off).
pub struct Clock(Option<Instant>);

pub fn start(device: &Device) -> Clock {
    if !*ON {
        return Clock(None);
    }
    let _ = device.synchronize();
    Clock(Some(Instant::now()))
}

impl Clock {
    /// Ends section `name` (after the device has finished it) and starts the next.
    pub fn mark(&mut self, device: &Device, name: &'static str) {
        let Some(t) = self.0 else { return };
        let _ = device.synchronize();
        let mut totals = TOTALS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let e = totals.entry(name).or_default();
        e.0 += t.elapsed().as_secs_f64();
        e.1 += 1;
        self.0 = Some(Instant::now());
    }
}

/// The totals so far, largest first, and clears them; `None` when timing is off.
pub fn report() -> Option<String> {
    if !*ON {
        return None;
    }
    let mut totals = TOTALS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut rows: Vec<_> = totals.iter().map(|(k, v)| (*k, *v)).collect();
    rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let all: f64 = rows.iter().map(|r| r.1 .0).sum();
    let text = rows.iter().map(|(k, (s, n))| format!("  {k:12} {:9.2} ms {:5.1}% ({n} times)", s * 1e3, 100.0 * s / all.max(1e-12))).collect::<Vec<_>>().join("\n");
    totals.clear();
    Some(text)
}
