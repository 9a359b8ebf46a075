//! shoal's quantized kernels against their references: for every weight format the models use
//! (Q4_K, Q6_K, Q8_0, Q5_0) and both layouts (row after row, and the k-quants' interleaved groups
//! of eight rows), row dequantization equals candle's, every implementation (portable, AVX2 /
//! AVX-512 or NEON where the CPU has them) agrees with the portable one for 1..9 activation rows, and the
//! result stays within the 8-bit activation error of the f32 product of the dequantized matrix.
//! Activation quantization is bit-identical across implementations; the pool runs each task once;
//! the fused MLP activation agrees with candle's SiLU / GELU ops; decode attention agrees with a plain
//! softmax over the cache, whatever the pool size.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rand::{Rng, SeedableRng};
use shoal::engine::kernels::act::{self, Q8x4, Q8K};
use shoal::engine::kernels::pool::Pool;
use shoal::engine::kernels::{matmul_many, Isa, QMatrix, RowLayout};

const TYPES: [GgmlDType; 4] = [GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q8_0, GgmlDType::Q5_0];

fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    if shoal::engine::kernels::x86::has_avx2() {
        v.push(Isa::Avx2);
    }
    #[cfg(target_arch = "x86_64")]
    if shoal::engine::kernels::x86::has_avx512() {
        v.push(Isa::Avx512);
    }
    #[cfg(target_arch = "aarch64")]
    v.push(Isa::Neon);
    #[cfg(target_arch = "aarch64")]
    if shoal::engine::kernels::neon::has_dotprod() {
        v.push(Isa::NeonDotProd);
    }
    v
}

fn random(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.random::<f32>() - 0.5) * 2.0 * scale).collect()
}

fn quantized(dtype: GgmlDType, rows: usize, cols: usize, seed: u64) -> (QTensor, QMatrix) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let w = Tensor::from_vec(random(&mut rng, rows * cols, 0.1), (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, dtype).unwrap();
    let m = QMatrix::from_qtensor(&q).unwrap().expect("a supported format");
    (q, m)
}

/// The shapes and layouts each format is tested in: rows that do not fill groups of eight, and
/// for the k-quants also whole groups in both layouts.
fn layouts(dtype: GgmlDType) -> Vec<(usize, RowLayout)> {
    let mut v = vec![(37, RowLayout::Rows)];
    if matches!(dtype, GgmlDType::Q4K | GgmlDType::Q6K) {
        v.extend([(40, RowLayout::Rows), (40, RowLayout::Interleaved8)]);
    }
    v
}

fn quantized_in(dtype: GgmlDType, rows: usize, cols: usize, seed: u64, layout: RowLayout) -> (QTensor, QMatrix) {
    let (q, _) = quantized(dtype, rows, cols, seed);
    let m = QMatrix::from_qtensor_in(&q, Some(layout)).unwrap().expect("a supported format");
    assert_eq!(m.layout, layout);
    (q, m)
}

fn reference_f32(w: &[f32], x: &[f32], m: usize, rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * rows];
    for a in 0..m {
        for r in 0..rows {
            out[a * rows + r] = (0..cols).map(|c| x[a * cols + c] as f64 * w[r * cols + c] as f64).sum::<f64>() as f32;
        }
    }
    out
}

#[test]
fn dequantized_rows_equal_candle_for_every_format() {
    for dtype in TYPES {
        for (rows, layout) in layouts(dtype) {
            let (q, m) = quantized_in(dtype, rows, 512, 1, layout);
            let ours = m.dequantize();
            let theirs = q.dequantize(&Device::Cpu).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(ours, theirs, "{dtype:?} {layout:?}");
        }
    }
}

#[test]
fn every_kernel_agrees_with_the_reference_for_every_format() {
    let pool = Pool::new(2);
    let cols = 768;
    for (dtype, (rows, layout)) in TYPES.into_iter().flat_map(|t| layouts(t).into_iter().map(move |l| (t, l))) {
        let (_, w) = quantized_in(dtype, rows, cols, 2, layout);
        let wf = w.dequantize();
        for m in [1usize, 2, 3, 4, 5, 7, 9] {
            let mut rng = rand::rngs::StdRng::seed_from_u64(m as u64);
            let x = random(&mut rng, m * cols, 1.0);
            let exact = reference_f32(&wf, &x, m, rows, cols);
            let max = exact.iter().fold(0f32, |a, v| a.max(v.abs()));
            let mut portable = vec![0f32; m * rows];
            matmul_many(&[&w], &x, m, &mut [&mut portable], Isa::Portable, &pool);
            // 8-bit activations: the product stays within a few percent of the largest output.
            let err = exact.iter().zip(&portable).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err <= 0.03 * max, "{dtype:?} {layout:?} m={m}: error {err} against max {max}");
            // candle's own quantized matmul quantizes activations the same way.
            let xt = Tensor::from_vec(x.clone(), (m, cols), &Device::Cpu).unwrap();
            let theirs = QMatMul::from_qtensor(quantized(dtype, rows, cols, 2).0).unwrap();
            let theirs = theirs.forward(&xt).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let diff = theirs.iter().zip(&portable).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff <= 1e-4 * max.max(1.0), "{dtype:?} {layout:?} m={m}: portable vs candle differ by {diff}");
            for isa in isas() {
                let mut out = vec![0f32; m * rows];
                matmul_many(&[&w], &x, m, &mut [&mut out], isa, &pool);
                let diff = out.iter().zip(&portable).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(diff <= 1e-5 * max.max(1.0), "{dtype:?} {layout:?} m={m} {isa:?}: differs from portable by {diff}");
            }
        }
    }
}

#[test]
fn grouped_matrices_equal_separate_ones() {
    let pool = Pool::new(2);
    let cols = 512;
    let mats: Vec<QMatrix> = TYPES.iter().enumerate().map(|(i, &t)| quantized(t, 20 + 3 * i, cols, 10 + i as u64).1).collect();
    let refs: Vec<&QMatrix> = mats.iter().collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for m in [1usize, 6] {
        let x = random(&mut rng, m * cols, 1.0);
        let mut together: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; m * w.rows]).collect();
        let mut outs: Vec<&mut [f32]> = together.iter_mut().map(|v| v.as_mut_slice()).collect();
        matmul_many(&refs, &x, m, &mut outs, Isa::Auto, &pool);
        for (w, t) in mats.iter().zip(&together) {
            let mut alone = vec![0f32; m * w.rows];
            matmul_many(&[w], &x, m, &mut [&mut alone], Isa::Auto, &pool);
            assert_eq!(&alone, t, "{:?}", w.ty);
        }
    }
}

#[test]
fn activation_quantization_is_identical_across_implementations() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut x = random(&mut rng, 4096, 3.0);
    // Exact halves after scaling, ties in magnitude with opposite signs, and an all-zero block.
    x[3] = -3.0;
    x[9] = 3.0;
    x[300] = 0.5;
    x[512..768].iter_mut().for_each(|v| *v = 0.0);
    let mut a = vec![Q8K::default(); 16];
    let mut b = vec![Q8K::default(); 16];
    act::quantize_q8k_portable(&x, &mut a);
    act::quantize_q8k(&x, &mut b);
    for (p, q) in a.iter().zip(&b) {
        assert_eq!((p.d, p.qs, p.ybs, p.nbl, p.nbh), (q.d, q.qs, q.ybs, q.nbl, q.nbh));
    }
    let mut a = vec![Q8x4::default(); 32];
    let mut b = vec![Q8x4::default(); 32];
    act::quantize_q8x4_portable(&x, &mut a);
    act::quantize_q8x4(&x, &mut b);
    for (p, q) in a.iter().zip(&b) {
        assert_eq!((p.d, p.qs, p.lsum), (q.d, q.qs, q.lsum));
    }
}

#[test]
fn the_pool_runs_every_task_exactly_once() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let pool = Pool::new(3);
    for tasks in [0usize, 1, 2, 5, 64, 1000] {
        let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
        pool.run(tasks, &|i| {
            hits[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "{tasks} tasks");
    }
    // After an idle spell the workers sleep, and wake for the next job.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let count = AtomicUsize::new(0);
    pool.run(10, &|_| {
        count.fetch_add(1, Ordering::Relaxed);
    });
    assert_eq!(count.load(Ordering::Relaxed), 10);
}

#[test]
fn the_gated_activation_agrees_with_candles_ops() {
    use shoal::engine::kernels::gated::{exp, gated, Gate};
    // The polynomial exp stays within a few ulp of the exact value over the range it serves.
    for i in -8000..=8000 {
        let x = i as f32 * 0.01;
        let exact = (x as f64).exp();
        let rel = ((exp(x) as f64 - exact) / exact).abs();
        assert!(rel < 4e-7, "exp({x}): relative error {rel}");
    }
    let pool = Pool::new(2);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let n = 20_000;
    let g = random(&mut rng, n, 12.0);
    let u = random(&mut rng, n, 2.0);
    let gt = Tensor::from_vec(g.clone(), n, &Device::Cpu).unwrap();
    let ut = Tensor::from_vec(u.clone(), n, &Device::Cpu).unwrap();
    for (act, theirs) in [(Gate::Silu, candle_nn::ops::silu(&gt).unwrap()), (Gate::GeluTanh, gt.gelu().unwrap())] {
        let theirs = (theirs * &ut).unwrap().to_vec1::<f32>().unwrap();
        let mut ours = vec![0f32; n];
        gated(act, &g, &u, &mut ours, &pool);
        // Relative to the value, absolute near zero (where candle's `1 + tanh` cancels).
        for (a, b) in ours.iter().zip(&theirs) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{act:?}: {a} vs {b}");
        }
    }
}

#[test]
fn decode_attention_agrees_with_a_plain_softmax_over_the_cache() {
    use shoal::engine::kernels::attend::{attend_one, KvView};
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let d = 64;
    // Grouped-query shapes (one to eight query heads per KV head), a window of keys that starts
    // past zero, with and without Gemma's soft-cap, on pools that split a KV head's heads; and
    // contexts long enough to be split into chunks of keys (`CHUNK_KEYS`), evenly or not.
    let cases = [(12, 2, 0..37, None), (4, 1, 5..50, Some(5.0f32)), (8, 8, 0..1, None), (16, 2, 3..29, Some(30.0)), (12, 2, 3..700, None), (4, 1, 0..1201, Some(30.0))];
    for (heads, kv_heads, keys, softcap) in cases {
        let capacity = keys.end.max(50);
        let q = random(&mut rng, heads * d, 1.0);
        let k = random(&mut rng, kv_heads * capacity * d, 1.0);
        let v = random(&mut rng, kv_heads * capacity * d, 1.0);
        let scale = 0.125f32;
        let mut expected = vec![0f64; heads * d];
        for h in 0..heads {
            let base = h / (heads / kv_heads) * capacity * d;
            let scores: Vec<f64> = keys
                .clone()
                .map(|j| {
                    let s = (0..d).map(|i| q[h * d + i] as f64 * k[base + j * d + i] as f64).sum::<f64>() * scale as f64;
                    softcap.map_or(s, |c| (s / c as f64).tanh() * c as f64)
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            for (s, j) in scores.iter().zip(keys.clone()) {
                for i in 0..d {
                    expected[h * d + i] += (s - max).exp() / sum * v[base + j * d + i] as f64;
                }
            }
        }
        for threads in [1, 2, 3] {
            let mut out = vec![f32::NAN; heads * d];
            attend_one(&q, heads, kv_heads, d, &KvView { k: &k, v: &v, capacity }, keys.clone(), scale, softcap, &mut out, &Pool::new(threads));
            for (i, (a, b)) in out.iter().zip(&expected).enumerate() {
                assert!((*a as f64 - b).abs() < 1e-5, "{heads}/{kv_heads} heads, {threads} threads, output {i}: {a} vs {b}");
            }
        }
    }
}
