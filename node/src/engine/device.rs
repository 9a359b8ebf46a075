//! Which device the engine computes on: `--device auto|cpu|cuda[:N]`, opened once per process
//! and shared, plus what a GPU is (name, memory) for the node's advert. Without the `cuda`
//! feature only the CPU exists and asking for CUDA is a clear error; `auto` never fails.
//! It does not measure speed (`probe.rs` does) nor decide placement.

use std::str::FromStr;

use candle_core::{DType, Device};

use super::{EngineError, Result};

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The first CUDA GPU when this build has CUDA and the machine a GPU, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            other => match other.strip_prefix("cuda:") {
                Some(n) => n.parse().map(DeviceChoice::Cuda).map_err(|_| format!("`{s}`: expected cuda:N with N a GPU index")),
                None => Err(format!("`{s}` is not a device: use auto, cpu, cuda or cuda:N")),
            },
        }
    }
}

/// The device a node's shards live on. Cloning shares the device (and its CUDA stream).
#[derive(Debug, Clone)]
pub struct ComputeDevice {
    device: Device,
    gpu: Option<GpuInfo>,
}

/// A GPU as the node advertises it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuInfo {
    pub name: String,
    pub index: usize,
    pub memory_total: u64,
    pub memory_free: u64,
}

/// GPU memory a node keeps out of its offer when no `--memory-limit` says what to offer: room
/// for a prompt chunk's transient tensors beside the weights and the KV cache placement reserves
/// (attention's scores and softmax, the MLP's activations, the dequantize-then-GEMM scratch,
/// cuBLAS's workspace): about 0.6 GB for a 7B model at a 4,096-token context by their shapes
/// (arithmetic, not measured).
pub const GPU_WORKSPACE: u64 = 1 << 30;

/// What a GPU node offers: `limit` (at most the GPU's memory), else what is free now less
/// `GPU_WORKSPACE`.
pub fn gpu_offer(free: u64, total: u64, limit: Option<u64>) -> u64 {
    limit.map_or(free.saturating_sub(GPU_WORKSPACE), |l| l.min(total))
}

impl ComputeDevice {
    pub fn cpu() -> Self {
        ComputeDevice { device: Device::Cpu, gpu: None }
    }

    /// Opens the device `choice` names; `Auto` falls back to the CPU when no GPU can be opened.
    pub fn open(choice: DeviceChoice) -> Result<Self> {
        match choice {
            DeviceChoice::Cpu => Ok(Self::cpu()),
            DeviceChoice::Cuda(i) => Self::open_cuda(i),
            DeviceChoice::Auto => match Self::open_cuda(0) {
                Ok(d) => Ok(d),
                Err(e) => {
                    if cfg!(feature = "cuda") {
                        tracing::info!("no usable CUDA GPU ({e}); computing on the CPU");
                    }
                    Ok(Self::cpu())
                }
            },
        }
    }

    #[cfg(feature = "cuda")]
    fn open_cuda(index: usize) -> Result<Self> {
        let device = Device::new_cuda(index).map_err(|e| EngineError::Device(format!("cuda:{index}: {e}")))?;
        let cuda = device.as_cuda_device().map_err(|e| EngineError::Device(e.to_string()))?;
        let ctx = cuda.cuda_stream().context().clone();
        let name = ctx.name().unwrap_or_else(|_| "NVIDIA GPU".into());
        let (free, total) = ctx.mem_get_info().map_err(|e| EngineError::Device(format!("cuda:{index}: {e}")))?;
        Ok(ComputeDevice { device, gpu: Some(GpuInfo { name, index, memory_total: total as u64, memory_free: free as u64 }) })
    }

    #[cfg(not(feature = "cuda"))]
    fn open_cuda(index: usize) -> Result<Self> {
        Err(EngineError::Device(format!("cuda:{index}: this shoal was built without CUDA (build with scripts/build-cuda.sh or `--features cuda`)")))
    }

    /// The candle device, for code that already works on candle tensors (the engine, tests).
    pub fn candle(&self) -> &Device {
        &self.device
    }

    pub fn is_gpu(&self) -> bool {
        self.gpu.is_some()
    }

    pub fn gpu(&self) -> Option<&GpuInfo> {
        self.gpu.as_ref()
    }

    /// GPU memory free now (it changes as models load), or `None` on the CPU.
    pub fn gpu_memory_free(&self) -> Option<u64> {
        #[cfg(feature = "cuda")]
        if let Ok(cuda) = self.device.as_cuda_device() {
            return cuda.cuda_stream().context().mem_get_info().ok().map(|(free, _)| free as u64);
        }
        None
    }

    /// `cpu`, `cuda:0`: the backend name adverts and the cluster view show.
    pub fn label(&self) -> String {
        match &self.gpu {
            Some(g) => format!("cuda:{}", g.index),
            None => "cpu".into(),
        }
    }

    /// Waits until queued device work has finished (timing needs it; the CPU is always done).
    pub fn synchronize(&self) -> Result<()> {
        Ok(self.device.synchronize()?)
    }
}

/// The dtype activations and dense weights use on `device` for weights stored as `stored`:
/// f32 on the CPU (candle's CPU kernels are fastest and exact there); on a GPU the stored
/// half-precision type stays, so matrices run through cuBLAS at their own width.
pub fn compute_dtype(device: &Device, stored: DType) -> DType {
    match (device.is_cpu(), stored) {
        (false, DType::F16 | DType::BF16) => stored,
        _ => DType::F32,
    }
}

/// The dtype of the KV cache and of attention's products on `device`: the compute dtype, except
/// that quantized (GGUF) weights on a GPU keep f32 hidden states beside an f16 cache, as
/// llama.cpp does: half the cache's memory, and a prompt's scores and weighted sums multiplied
/// on the tensor cores rather than in f32 (those two products of two 4,096-token 7B Q4_K_M
/// prompts took 306 ms on an H200 with an f32 cache, the f16 model's 74 ms).
pub fn cache_dtype(device: &Device, stored: DType, quantized: bool) -> DType {
    match compute_dtype(device, stored) {
        DType::F32 if quantized && !device.is_cpu() => DType::F16,
        dtype => dtype,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_offers_its_limit_or_its_free_memory_less_the_workspace() {
        let gb = 1u64 << 30;
        assert_eq!(gpu_offer(70 * gb, 80 * gb, None), 69 * gb);
        assert_eq!(gpu_offer(gb / 2, 80 * gb, None), 0, "a nearly full GPU offers nothing");
        assert_eq!(gpu_offer(70 * gb, 80 * gb, Some(2 * gb)), 2 * gb, "a limit is what the operator offers");
        assert_eq!(gpu_offer(70 * gb, 80 * gb, Some(100 * gb)), 80 * gb, "never more than the GPU has");
    }

    #[test]
    fn device_names_parse_and_bad_ones_say_what_is_accepted() {
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        assert_eq!("CPU".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        let bad = "cuda:x".parse::<DeviceChoice>().unwrap_err();
        assert!(bad.contains("cuda:N"), "{bad}");
        let bad = "metal".parse::<DeviceChoice>().unwrap_err();
        assert!(bad.contains("auto, cpu, cuda"), "{bad}");
    }

    #[test]
    fn auto_always_opens_something_and_the_cpu_computes_in_f32() {
        let d = ComputeDevice::open(DeviceChoice::Auto).expect("auto never fails");
        assert_eq!(d.is_gpu(), d.gpu().is_some());
        assert_eq!(compute_dtype(&Device::Cpu, DType::BF16), DType::F32);
        assert_eq!(compute_dtype(&Device::Cpu, DType::F16), DType::F32);
        assert_eq!(cache_dtype(&Device::Cpu, DType::F32, true), DType::F32, "a CPU keeps a GGUF model's cache in f32");
        if !cfg!(feature = "cuda") {
            let e = ComputeDevice::open(DeviceChoice::Cuda(0)).unwrap_err();
            assert!(e.to_string().contains("without CUDA"), "{e}");
            assert_eq!(d.label(), "cpu");
        }
    }
}
