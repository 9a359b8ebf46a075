//! A short measurement of this machine as the engine sees it: on the CPU, f32 matrix-multiply
//! FLOP/s through candle, memory read bandwidth over all cores, and the weight bytes per second
//! shoal's own Q4_K decode kernel streams (what decode really runs at: on few cores it is bound by
//! the kernel, not by memory); on a GPU, f16 matrix-multiply FLOP/s and device-memory copy
//! bandwidth. Each part runs for a fixed time budget (well under a second in total). The figures
//! feed adverts, placement, the cost model and the cluster view.
//! It does not measure the network, and keeps no state.

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};

use super::device::ComputeDevice;
use super::Result;

/// What the probe measured.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct MachineProfile {
    /// f32 matrix-multiply throughput, floating-point operations per second.
    pub flops: f64,
    /// Memory read bandwidth over all cores, bytes per second.
    pub mem_bandwidth: f64,
    /// Weight bytes per second of a Q4_K matrix-vector product on the kernel pool (decode's
    /// inner loop); on a GPU, the copy bandwidth.
    pub decode_bandwidth: f64,
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
    /// About 0.5 s in all: a 768² matmul repeated for 200 ms, a 64 MiB buffer read for 150 ms, and
    /// a 32 MiB Q4_K matrix-vector product for 100 ms.
    fn default() -> Self {
        ProbeBudget { matmul_time: Duration::from_millis(200), matmul_size: 768, memory_time: Duration::from_millis(150), memory_bytes: 64 << 20 }
    }
}

/// Measures this machine's CPU with the default budget.
pub fn measure() -> Result<MachineProfile> {
    measure_with(&ProbeBudget::default())
}

/// Measures the device shards will compute on: the CPU, or a GPU (f16 GEMM, device copy).
pub fn measure_device(device: &ComputeDevice) -> Result<MachineProfile> {
    if !device.is_gpu() {
        return measure();
    }
    let budget = Duration::from_millis(200);
    let mem_bandwidth = gpu_copy_bandwidth(device, 512 << 20, budget)?;
    Ok(MachineProfile { flops: gpu_matmul_flops(device, 4096, budget)?, mem_bandwidth, decode_bandwidth: mem_bandwidth })
}

/// Repeats an n×n f16 matmul on the GPU until `budget` has passed (synchronizing to time it).
fn gpu_matmul_flops(device: &ComputeDevice, n: usize, budget: Duration) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (n, n), device.candle())?.to_dtype(DType::F16)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), device.candle())?.to_dtype(DType::F16)?;
    black_box(a.matmul(&b)?);
    device.synchronize()?;
    let started = Instant::now();
    let mut runs = 0u32;
    while runs < 4 || started.elapsed() < budget {
        for _ in 0..8 {
            black_box(a.matmul(&b)?);
        }
        device.synchronize()?;
        runs += 8;
    }
    Ok(2.0 * (n as f64).powi(3) * runs as f64 / started.elapsed().as_secs_f64().max(1e-9))
}

/// Device-to-device copy bandwidth of a `bytes` buffer (`cuMemcpyDtoD`, the copy engine's best),
/// counting bytes read plus bytes written, as GPU datasheets and PyTorch copy benchmarks do;
/// the best of the passes counts. The CPU has no such figure: 0.
pub fn gpu_copy_bandwidth(device: &ComputeDevice, bytes: usize, budget: Duration) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if let Ok(cuda) = device.candle().as_cuda_device() {
        let fail = |e: candle_core::cuda_backend::cudarc::driver::DriverError| super::EngineError::Device(e.to_string());
        let stream = cuda.cuda_stream();
        let src = stream.alloc_zeros::<u8>(bytes).map_err(fail)?;
        let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(fail)?;
        stream.memcpy_dtod(&src, &mut dst).map_err(fail)?;
        stream.synchronize().map_err(fail)?;
        let started = Instant::now();
        let mut best = 0f64;
        while started.elapsed() < budget || best == 0.0 {
            let t0 = Instant::now();
            for _ in 0..4 {
                stream.memcpy_dtod(&src, &mut dst).map_err(fail)?;
            }
            stream.synchronize().map_err(fail)?;
            best = best.max(8.0 * bytes as f64 / t0.elapsed().as_secs_f64().max(1e-9));
        }
        return Ok(best);
    }
    let _ = (device, bytes, budget);
    Ok(0.0)
}

pub fn measure_with(budget: &ProbeBudget) -> Result<MachineProfile> {
    Ok(MachineProfile {
        flops: matmul_flops(budget.matmul_size, budget.matmul_time)?,
        mem_bandwidth: super::bench::read_bandwidth(rayon::current_num_threads(), budget.memory_bytes, budget.memory_time),
        decode_bandwidth: q4k_decode_bandwidth(budget.memory_bytes / 2, budget.memory_time * 2 / 3)?,
    })
}

/// Repeats a Q4_K matrix-vector product over about `bytes` of blocks (random scales and quants:
/// speed does not depend on values) on the kernel pool until `budget` has passed.
pub fn q4k_decode_bandwidth(bytes: usize, budget: Duration) -> Result<f64> {
    use super::kernels::{matmul_many, pool, Isa, QMatrix, QType};
    let cols = 4096;
    let row_bytes = cols / QType::Q4K.block_len() * QType::Q4K.block_bytes();
    let rows = (bytes / row_bytes).max(64);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut data: Vec<u8> = (0..rows * row_bytes / 8)
        .flat_map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()
        })
        .collect();
    // Each block starts with two f16 scales: keep them small and finite (0x1c00 is 2^-8).
    for block in data.chunks_exact_mut(QType::Q4K.block_bytes()) {
        block[..4].copy_from_slice(&[0, 0x1c, 0, 0x1c]);
    }
    let w = QMatrix::from_bytes(QType::Q4K, rows, cols, data).map_err(|e| super::EngineError::Device(e.to_string()))?;
    let x: Vec<f32> = (0..cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
    let mut out = vec![0f32; rows];
    let pool = pool::global();
    matmul_many(&[&w], &x, 1, &mut [&mut out], Isa::Auto, pool);
    let started = Instant::now();
    let mut runs = 0u32;
    while runs < 2 || started.elapsed() < budget {
        matmul_many(&[&w], &x, 1, &mut [&mut out], Isa::Auto, pool);
        black_box(&out);
        runs += 1;
    }
    Ok(w.size_in_bytes() as f64 * runs as f64 / started.elapsed().as_secs_f64().max(1e-9))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_is_short_and_plausible() {
        let started = Instant::now();
        let p = measure().unwrap();
        assert!(started.elapsed() < Duration::from_millis(1500), "the probe took {:?}", started.elapsed());
        // Bounds any machine clears by far, even in a debug build: 10 MFLOP/s, 100 MB/s.
        assert!(p.flops > 1e7 && p.flops.is_finite(), "{p:?}");
        assert!(p.mem_bandwidth > 1e8 && p.mem_bandwidth.is_finite(), "{p:?}");
        assert!(p.decode_bandwidth > 1e7 && p.decode_bandwidth.is_finite(), "{p:?}");
    }
}
