//! The kernels' worker pool: `threads - 1` long-lived workers plus the calling thread run the
//! tasks of one job, each task claimed from a shared epoch-tagged counter. The caller waits only
//! for claimed tasks to finish, never for a worker to wake up, so a descheduled worker costs
//! nothing unless it holds a task. Between jobs a worker spins briefly (decode issues a job every
//! few tens of microseconds) and then sleeps on a condvar, so an idle engine costs no CPU.
//! One job runs at a time (callers queue on a mutex); the pool does not nest jobs.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a worker spins for the next job before it sleeps.
const SPIN: Duration = Duration::from_micros(500);
/// `next` value meaning "the job is being replaced: claim nothing".
const CLOSED: u64 = u32::MAX as u64;

type Task<'a> = &'a (dyn Fn(usize) + Sync);

/// A job on the caller's stack; reached by workers only through a claimed task.
struct Job<'a> {
    f: Task<'a>,
}

struct Shared {
    /// `(epoch << 32) | next task`; a task is claimed by a compare-exchange that keeps the epoch.
    state: AtomicU64,
    /// Task count and job of the current epoch, written while `state` is `(epoch, CLOSED)`.
    tasks: AtomicUsize,
    job: AtomicPtr<Job<'static>>,
    /// Tasks of the current job that have finished (run or panicked).
    done: AtomicUsize,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    /// Sleeping workers wait on `wake`; the caller notifies when `sleepers` is non-zero.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises jobs from different callers (several engines in one process); holds the epoch.
    running: Mutex<u64>,
    threads: usize,
}

impl Pool {
    /// A pool that runs jobs on `threads` threads in all (the caller included).
    pub fn new(threads: usize) -> Pool {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: AtomicU64::new(CLOSED),
            tasks: AtomicUsize::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("shoal-kernel-{i}")).spawn(move || worker(&s)).expect("spawning a kernel worker thread")
            })
            .collect();
        Pool { shared, workers, running: Mutex::new(0), threads }
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(0..tasks)` across the pool and returns when every task has finished.
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.workers.is_empty() || tasks == 1 {
            (0..tasks).for_each(f);
            return;
        }
        assert!((tasks as u64) < CLOSED, "too many tasks in one job");
        let mut epoch = self.running.lock().unwrap_or_else(|e| e.into_inner());
        *epoch = (*epoch + 1) & 0xFFFF_FFFF;
        let s = &*self.shared;
        let job = Job { f };
        s.state.store((*epoch << 32) | CLOSED, SeqCst);
        s.done.store(0, SeqCst);
        s.panicked.store(false, SeqCst);
        s.tasks.store(tasks, SeqCst);
        // SAFETY (lifetime erasure): workers dereference `job` only while holding a claimed task of
        // this epoch, and this function returns only after every task has finished.
        s.job.store(&job as *const Job<'_> as *mut Job<'static>, SeqCst);
        s.state.store(*epoch << 32, SeqCst);
        if s.sleepers.load(SeqCst) > 0 {
            let _l = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| claim_tasks(s, *epoch)));
        let mut spins = 0u32;
        while s.done.load(SeqCst) < tasks {
            spins += 1;
            if spins % 4096 == 0 {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        s.job.store(std::ptr::null_mut(), SeqCst);
        if let Err(p) = mine {
            std::panic::resume_unwind(p);
        }
        assert!(!s.panicked.load(SeqCst), "a kernel task panicked on a worker thread");
    }
}

/// Claims and runs tasks of `epoch` until none is left (or the job changed); returns how many ran.
fn claim_tasks(s: &Shared, epoch: u64) {
    loop {
        let st = s.state.load(SeqCst);
        if st >> 32 != epoch {
            return;
        }
        let next = st & 0xFFFF_FFFF;
        let tasks = s.tasks.load(SeqCst) as u64;
        let job = s.job.load(SeqCst);
        if next >= tasks || next == CLOSED {
            return;
        }
        if s.state.compare_exchange(st, st + 1, SeqCst, SeqCst).is_ok() {
            // SAFETY: the claim succeeded while the state still carried this epoch, so `tasks` and
            // `job` were read after this epoch published them and before any later one; the job
            // stays alive until its `done` count reaches `tasks`, which needs this task.
            let f = unsafe { (*job).f };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(next as usize))).is_err() {
                s.panicked.store(true, SeqCst);
            }
            s.done.fetch_add(1, SeqCst);
        }
    }
}

fn worker(s: &Shared) {
    let mut seen = CLOSED >> 32;
    loop {
        let started = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = s.state.load(SeqCst) >> 32;
            if s.shutdown.load(SeqCst) {
                return;
            }
            if e != seen && s.state.load(SeqCst) & 0xFFFF_FFFF != CLOSED {
                break e;
            }
            spins = spins.wrapping_add(1);
            if spins % 256 == 0 && started.elapsed() > SPIN {
                let mut l = s.sleep.lock().unwrap_or_else(|e| e.into_inner());
                s.sleepers.fetch_add(1, SeqCst);
                while s.state.load(SeqCst) >> 32 == seen && !s.shutdown.load(SeqCst) {
                    l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
                }
                s.sleepers.fetch_sub(1, SeqCst);
                continue;
            }
            std::hint::spin_loop();
        };
        seen = epoch;
        claim_tasks(s, epoch);
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, SeqCst);
        {
            let _l = self.shared.sleep.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

static GLOBAL: OnceLock<Pool> = OnceLock::new();

/// Sets the number of kernel threads for this process; only the first call (or first use) counts.
/// Returns the number in force.
pub fn init(threads: usize) -> usize {
    GLOBAL.get_or_init(|| Pool::new(threads)).threads()
}

/// The process's kernel pool: as many threads as `init` asked for, else `SHOAL_THREADS`, else
/// the machine's available parallelism.
pub fn global() -> &'static Pool {
    GLOBAL.get_or_init(|| {
        let threads = std::env::var("SHOAL_THREADS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
        Pool::new(threads)
    })
}
