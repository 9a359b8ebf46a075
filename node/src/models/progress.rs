//! Progress of this node's downloads, peer copies and loads, for the terminal bar and for
//! `/v1/cluster`. `Progress` is a cloneable registry (an `Arc<Mutex<..>>` of transfers);
//! each transfer is owned by a `Transfer` guard that its worker updates and that removes
//! (or marks failed) its entry when dropped, so a crashed or cancelled worker never leaves a
//! transfer that looks alive. Readers take a `snapshot`. It does no I/O and never blocks on
//! anything but its own short lock.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

/// What a transfer is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Downloading,
    Copying,
    Verifying,
    Loading,
    Done,
    Failed,
}

/// One transfer as readers see it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TransferView {
    pub model: String,
    pub phase: Phase,
    /// `hub`, `peer <id>`, or `disk`.
    pub source: String,
    /// The file being worked on, if any.
    pub file: Option<String>,
    pub bytes_done: u64,
    /// `None` while the size is unknown.
    pub bytes_total: Option<u64>,
    /// `bytes_done / bytes_total`, when the total is known.
    pub fraction: Option<f64>,
    /// Bytes per second since the transfer started.
    pub bytes_per_s: f64,
    pub error: Option<String>,
}

struct Entry {
    id: u64,
    model: String,
    phase: Phase,
    source: String,
    file: Option<String>,
    done: Arc<AtomicU64>,
    total: Option<u64>,
    started: Instant,
    /// When a finished or failed entry stops being shown.
    expires: Option<Instant>,
    error: Option<String>,
}

/// How long a finished or failed transfer stays visible.
const LINGER: Duration = Duration::from_secs(30);

/// The registry. Clones share it.
#[derive(Clone, Default)]
pub struct Progress {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    entries: Vec<Entry>,
}

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Progress").field("transfers", &self.snapshot().len()).finish()
    }
}

impl Progress {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Only plain field updates happen under the lock: a poisoned one is still consistent.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a transfer; it lives until the returned guard is finished or dropped.
    pub fn start(&self, model: &str, phase: Phase, source: &str, total: Option<u64>) -> Transfer {
        let done = Arc::new(AtomicU64::new(0));
        let mut inner = self.lock();
        inner.next += 1;
        let id = inner.next;
        inner.entries.push(Entry { id, model: model.into(), phase, source: source.into(), file: None, done: done.clone(), total, started: Instant::now(), expires: None, error: None });
        Transfer { progress: self.clone(), id, done, ended: false }
    }

    /// Every transfer now (running, and finished or failed within the last 30 s).
    pub fn snapshot(&self) -> Vec<TransferView> {
        let now = Instant::now();
        let mut inner = self.lock();
        inner.entries.retain(|e| e.expires.is_none_or(|t| t > now));
        inner
            .entries
            .iter()
            .map(|e| {
                let done = e.done.load(Ordering::Relaxed);
                let secs = e.started.elapsed().as_secs_f64().max(1e-3);
                TransferView {
                    model: e.model.clone(),
                    phase: e.phase,
                    source: e.source.clone(),
                    file: e.file.clone(),
                    bytes_done: done,
                    bytes_total: e.total,
                    fraction: e.total.filter(|t| *t > 0).map(|t| (done as f64 / t as f64).min(1.0)),
                    bytes_per_s: done as f64 / secs,
                    error: e.error.clone(),
                }
            })
            .collect()
    }

    fn update(&self, id: u64, f: impl FnOnce(&mut Entry)) {
        if let Some(e) = self.lock().entries.iter_mut().find(|e| e.id == id) {
            f(e);
        }
    }
}

/// The worker's end of one transfer. Dropping it unfinished marks the transfer failed.
pub struct Transfer {
    progress: Progress,
    id: u64,
    /// Shared with the registry entry: bytes done, bumped without taking the lock.
    done: Arc<AtomicU64>,
    ended: bool,
}

impl Transfer {
    pub fn add(&self, bytes: u64) {
        self.done.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Takes back bytes counted for data that was thrown away (a restarted file).
    pub fn sub(&self, bytes: u64) {
        // fetch_update cannot fail with a closure that always returns Some.
        let _ = self.done.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |d| Some(d.saturating_sub(bytes)));
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    pub fn set_total(&self, total: Option<u64>) {
        self.progress.update(self.id, |e| e.total = total);
    }

    pub fn set_phase(&self, phase: Phase, source: &str) {
        self.progress.update(self.id, |e| {
            e.phase = phase;
            e.source = source.into();
        });
    }

    pub fn set_file(&self, file: Option<&str>) {
        self.progress.update(self.id, |e| e.file = file.map(str::to_string));
    }

    /// Ends the transfer successfully; it stays visible as done for a while.
    pub fn finish(mut self) {
        self.end(Phase::Done, None);
    }

    /// Ends the transfer with an error that stays visible for a while.
    pub fn fail(mut self, error: &str) {
        self.end(Phase::Failed, Some(error.to_string()));
    }

    fn end(&mut self, phase: Phase, error: Option<String>) {
        self.ended = true;
        self.progress.update(self.id, |e| {
            e.phase = phase;
            e.error = error;
            e.expires = Some(Instant::now() + LINGER);
        });
    }
}

impl Drop for Transfer {
    fn drop(&mut self) {
        if !self.ended {
            self.end(Phase::Failed, Some("interrupted".into()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transfer_reports_bytes_and_ends_done_or_failed() {
        let progress = Progress::default();
        let t = progress.start("m", Phase::Downloading, "hub", Some(200));
        t.add(50);
        let view = &progress.snapshot()[0];
        assert_eq!((view.bytes_done, view.fraction, view.phase), (50, Some(0.25), Phase::Downloading));
        t.finish();
        assert_eq!(progress.snapshot()[0].phase, Phase::Done);
        let dropped = progress.start("n", Phase::Copying, "peer x", None);
        drop(dropped);
        let failed = progress.snapshot().into_iter().find(|v| v.model == "n").unwrap();
        assert_eq!((failed.phase, failed.error.as_deref(), failed.fraction), (Phase::Failed, Some("interrupted"), None));
    }
}
