//! A short measurement of this machine as the engine sees it: f32 matrix-multiply FLOP/s
//! through candle and memory read bandwidth over all cores, each for a fixed time budget
//! (well under a second in total). The figures feed the cluster view and, later, placement.
//! It does not benchmark quantized kernels or the network, and keeps no state.

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::Result;

/// What the probe measured.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MachineProfile {
    /// f32 matrix-multiply throughput, floating-point operations per second.
    pub flops: f64,
    /// Memory read bandwidth over all cores, bytes per second.
    pub mem_bandwidth: f64,
}

/// How long each half of the probe runs, and the sizes it uses.
#[derive(Debug, Clone, Copy)]
pub struct ProbeBudget {
    pub matmul_time: Duration,
    pub matmul_size: usize,
    pub memory_time: Duration,
    pub memory_bytes: usize,
}

impl Default for ProbeBudget {
    /// About 0.4 s in all: a 768² matmul repeated for 200 ms, and a 64 MiB buffer read for 150 ms.
    fn default() -> Self {
        ProbeBudget { matmul_time: Duration::from_millis(200), matmul_size: 768, memory_time: Duration::from_millis(150), memory_bytes: 64 << 20 }
    }
}

/// Measures this machine with the default budget.
pub fn measure() -> Result<MachineProfile> {
    measure_with(&ProbeBudget::default())
}

pub fn measure_with(budget: &ProbeBudget) -> Result<MachineProfile> {
    Ok(MachineProfile { flops: matmul_flops(budget.matmul_size, budget.matmul_time)?, mem_bandwidth: read_bandwidth(budget.memory_bytes, budget.memory_time) })
}

/// Repeats an n×n f32 matmul (after one warm-up) until `budget` has passed.
fn matmul_flops(n: usize, budget: Duration) -> Result<f64> {
    let device = Device::Cpu;
    let a = Tensor::arange(0u32, (n * n) as u32, &device)?.to_dtype(DType::F32)?.affine(1e-6, -0.5)?.reshape((n, n))?;
    let b = a.t()?.contiguous()?;
    black_box(a.matmul(&b)?);
    let started = Instant::now();
    let mut runs = 0u32;
    while runs < 2 || started.elapsed() < budget {
        black_box(a.matmul(&b)?);
        runs += 1;
    }
    let flop = 2.0 * (n as f64).powi(3) * runs as f64;
    Ok(flop / started.elapsed().as_secs_f64().max(1e-9))
}

/// Sums a buffer of `bytes` in parallel chunks, pass after pass, until `budget` has passed.
fn read_bandwidth(bytes: usize, budget: Duration) -> f64 {
    let words = (bytes / 8).max(1024);
    // Writing every element commits the pages, so the passes below read real memory.
    let buffer: Vec<u64> = (0..words as u64).collect();
    let chunk = (words / rayon::current_num_threads().max(1)).max(1024);
    let pass = || buffer.par_chunks(chunk).map(|c| c.iter().fold(0u64, |acc, x| acc.wrapping_add(*x))).reduce(|| 0, u64::wrapping_add);
    black_box(pass());
    let started = Instant::now();
    let mut passes = 0u32;
    while passes < 2 || started.elapsed() < budget {
        black_box(pass());
        passes += 1;
    }
    (words * 8) as f64 * passes as f64 / started.elapsed().as_secs_f64().max(1e-9)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_is_short_and_plausible() {
        let started = Instant::now();
        let p = measure().unwrap();
        assert!(started.elapsed() < Duration::from_secs(1), "the probe took {:?}", started.elapsed());
        // Bounds any machine clears by far, even in a debug build: 10 MFLOP/s, 100 MB/s.
        assert!(p.flops > 1e7 && p.flops.is_finite(), "{p:?}");
        assert!(p.mem_bandwidth > 1e8 && p.mem_bandwidth.is_finite(), "{p:?}");
    }
}
