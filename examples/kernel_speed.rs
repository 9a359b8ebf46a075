//! Times shoal's quantized matmul kernels on random matrices of model-like shapes: GB/s of
//! weights for one activation row (decode) and GMAC/s for many (prompts); and decode attention
//! (`attend`) over a Qwen2.5-1.5B layer's cache of 512 to 8,192 positions, in GB/s of keys and
//! values. A development aid for tuning the kernels; not used by tests and asserts nothing.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use shoal::engine::kernels::attend::{attend_one, KvView};
use shoal::engine::kernels::pool::Pool;
use shoal::engine::kernels::{matmul_many, Isa, QMatrix};

fn main() -> anyhow::Result<()> {
    let threads: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(1);
    let only: Option<String> = std::env::args().nth(2);
    let pool = Pool::new(threads);
    // The last two are larger than the L3 cache: decode streams them from memory.
    for (dtype, rows, cols) in [(GgmlDType::Q4K, 8960, 1536), (GgmlDType::Q6K, 1536, 8960), (GgmlDType::Q8_0, 8192, 640), (GgmlDType::Q5_0, 2048, 640), (GgmlDType::Q4K, 49152, 1536), (GgmlDType::Q6K, 32768, 1536)] {
        if only.as_ref().is_some_and(|o| !format!("{dtype:?}").eq_ignore_ascii_case(o)) {
            continue;
        }
        let w = Tensor::randn(0f32, 0.1, (rows, cols), &Device::Cpu)?;
        let q = QMatrix::from_qtensor(&QTensor::quantize(&w, dtype)?)?.expect("supported");
        let big = rows * cols > 32 << 20;
        for m in [1usize, 64] {
            if big && m > 1 {
                continue;
            }
            let x = Tensor::randn(0f32, 1.0, (m, cols), &Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
            let mut out = vec![0f32; m * rows];
            matmul_many(&[&q], &x, m, &mut [&mut out], Isa::Auto, &pool);
            // The best of many runs: on a shared machine that is the run nobody interrupted.
            let reps = if m == 1 { 300 } else { 20 };
            let mut s = f64::MAX;
            for _ in 0..reps {
                let t0 = Instant::now();
                matmul_many(&[&q], &x, m, &mut [&mut out], Isa::Auto, &pool);
                s = s.min(t0.elapsed().as_secs_f64());
            }
            println!("{dtype:?} {rows}x{cols} m={m}: {:.2} ms, {:.1} GB/s weights, {:.1} GMAC/s", s * 1e3, q.size_in_bytes() as f64 / s / 1e9, (m * rows * cols) as f64 / s / 1e9);
        }
    }
    if only.as_ref().is_none_or(|o| o.eq_ignore_ascii_case("attend")) {
        // 12 query heads over 2 KV heads of 128 values, f32 as a CPU keeps them.
        let (heads, kv_heads, d) = (12, 2, 128);
        let q = Tensor::randn(0f32, 1.0, heads * d, &Device::Cpu)?.to_vec1::<f32>()?;
        let mut out = vec![0f32; heads * d];
        for n in [512usize, 2048, 8192] {
            let k = Tensor::randn(0f32, 1.0, kv_heads * n * d, &Device::Cpu)?.to_vec1::<f32>()?;
            let v = Tensor::randn(0f32, 1.0, kv_heads * n * d, &Device::Cpu)?.to_vec1::<f32>()?;
            let kv = KvView { k: &k, v: &v, capacity: n };
            let mut s = f64::MAX;
            for _ in 0..100 {
                let t0 = Instant::now();
                attend_one(&q, heads, kv_heads, d, &kv, 0..n, 0.09, None, &mut out, &pool);
                s = s.min(t0.elapsed().as_secs_f64());
            }
            println!("attend {heads}/{kv_heads} heads x {d}, {n} positions: {:.1} us, {:.1} GB/s of keys and values", s * 1e6, (2 * kv_heads * n * d * 4) as f64 / s / 1e9);
        }
    }
    Ok(())
}
