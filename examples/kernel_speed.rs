//! Times shoal's quantized matmul kernels on random matrices of model-like shapes: GB/s of
//! weights for one activation row (decode) and GMAC/s for many (prompts). The first shapes fit the
//! L3 cache (compute speed); the last two are streamed from memory as decode streams a model,
//! six copies (about 250 MB) in turn so no cache keeps any of them, printed beside the memory-read
//! probe of `shoal bench` taken in between. A development aid for tuning the kernels; not used by
//! tests and asserts nothing.

use std::time::{Duration, Instant};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
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
        let big = rows * cols > 32 << 20;
        let qt = QTensor::quantize(&w, dtype)?;
        let copies: Vec<QMatrix> = (0..if big { 6 } else { 1 }).map(|_| QMatrix::from_qtensor(&qt).map(|q| q.expect("supported"))).collect::<Result<_, _>>()?;
        let q = &copies[0];
        for m in [1usize, 64] {
            if big && m > 1 {
                continue;
            }
            let x = Tensor::randn(0f32, 1.0, (m, cols), &Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
            let mut out = vec![0f32; m * rows];
            matmul_many(&[q], &x, m, &mut [&mut out], Isa::Auto, &pool);
            // The best of many runs: on a shared machine that is the run nobody interrupted.
            let reps = if big { 10 } else if m == 1 { 300 } else { 20 };
            let mut s = f64::MAX;
            let mut probe = 0f64;
            for _ in 0..reps {
                let t0 = Instant::now();
                for q in &copies {
                    matmul_many(&[q], &x, m, &mut [&mut out], Isa::Auto, &pool);
                }
                s = s.min(t0.elapsed().as_secs_f64() / copies.len() as f64);
                if big {
                    probe = probe.max(shoal::engine::bench::read_bandwidth(threads, 256 << 20, Duration::from_millis(50)));
                }
            }
            let gbs = q.size_in_bytes() as f64 / s / 1e9;
            let vs_probe = if big { format!(" ({:.2} of the {:.1} GB/s read probe)", gbs / (probe / 1e9), probe / 1e9) } else { String::new() };
            println!("{dtype:?} {rows}x{cols} m={m}: {:.2} ms, {gbs:.1} GB/s weights{vs_probe}, {:.1} GMAC/s", s * 1e3, (m * rows * cols) as f64 / s / 1e9);
        }
    }
    Ok(())
}
