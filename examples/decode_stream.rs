//! Streams a Qwen2.5-1.5B-shaped set of quantized matrices (random blocks, the model's Q4_K_M mix:
//! 28 layers of q/k/v, o, gate+up and down, then the Q6_K output matrix) through shoal's decode
//! matrix-vector kernels, pass after pass, beside a plain memory read over the same threads, and
//! prints both rates and their ratio: the kernels' share of the decode roofline with no other
//! work in the way. With `L2=q4k` (or `q6k`) it instead times one 768×1536 matrix that stays in
//! the L2 cache: the kernel's compute rate with no memory stream. Usage: `decode_stream [THREADS]
//! [PASSES]`. A development aid for tuning the kernels; asserts nothing.

use std::time::{Duration, Instant};

use shoal::engine::bench::read_bandwidth;
use shoal::engine::kernels::pool::Pool;
use shoal::engine::kernels::{matmul_many, Isa, QMatrix, QType};

fn random_matrix(ty: QType, rows: usize, cols: usize, seed: &mut u64) -> anyhow::Result<QMatrix> {
    let bytes = rows * cols / ty.block_len() * ty.block_bytes();
    let mut data = vec![0u8; bytes];
    for chunk in data.chunks_mut(8) {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        chunk.copy_from_slice(&seed.to_le_bytes()[..chunk.len()]);
    }
    // Small finite f16 scales (0x1c00 is 2^-8) where each format keeps them.
    for block in data.chunks_exact_mut(ty.block_bytes()) {
        match ty {
            QType::Q4K => block[..4].copy_from_slice(&[0, 0x1c, 0, 0x1c]),
            QType::Q6K => block[208..210].copy_from_slice(&[0, 0x1c]),
            _ => block[..2].copy_from_slice(&[0, 0x1c]),
        }
    }
    Ok(QMatrix::from_bytes(ty, rows, cols, data)?)
}

fn main() -> anyhow::Result<()> {
    let threads: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let passes: usize = std::env::args().nth(2).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let pool = Pool::new(threads);
    let (hidden, inter, kv, vocab, layers) = (1536, 8960, 256, 151936, 28);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    if let Ok(ty) = std::env::var("L2") {
        let ty = if ty == "q6k" { QType::Q6K } else { QType::Q4K };
        let w = random_matrix(ty, 768, hidden, &mut seed)?;
        let x: Vec<f32> = (0..hidden).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
        let mut o = vec![0f32; 768];
        let mut best = f64::MAX;
        for _ in 0..3000 {
            let t0 = Instant::now();
            matmul_many(&[&w], &x, 1, &mut [&mut o], Isa::Auto, &pool);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        println!("{ty:?} 768x{hidden} in L2, {threads} threads: {:.1} GB/s ({:.1} ns per block per thread)", w.size_in_bytes() as f64 / best / 1e9, best * 1e9 * threads as f64 / (768 * hidden / 256) as f64);
        return Ok(());
    }
    // Groups sharing one input, as the model calls them; Q4_K_M gives half the layers Q6_K v and down.
    let mut groups: Vec<(Vec<QMatrix>, usize)> = Vec::new();
    for l in 0..layers {
        let wide = if l % 2 == 0 { QType::Q6K } else { QType::Q4K };
        groups.push((vec![random_matrix(QType::Q4K, hidden, hidden, &mut seed)?, random_matrix(QType::Q4K, kv, hidden, &mut seed)?, random_matrix(wide, kv, hidden, &mut seed)?], hidden));
        groups.push((vec![random_matrix(QType::Q4K, hidden, hidden, &mut seed)?], hidden));
        groups.push((vec![random_matrix(QType::Q4K, inter, hidden, &mut seed)?, random_matrix(QType::Q4K, inter, hidden, &mut seed)?], hidden));
        groups.push((vec![random_matrix(wide, hidden, inter, &mut seed)?], inter));
    }
    groups.push((vec![random_matrix(QType::Q6K, vocab, hidden, &mut seed)?], hidden));
    let bytes: usize = groups.iter().flat_map(|(g, _)| g.iter().map(|w| w.size_in_bytes())).sum();
    let mut outs: Vec<Vec<Vec<f32>>> = groups.iter().map(|(g, _)| g.iter().map(|w| vec![0f32; w.rows]).collect()).collect();
    let xs: Vec<Vec<f32>> = [hidden, inter].iter().map(|&k| (0..k).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect()).collect();
    let pass = |outs: &mut Vec<Vec<Vec<f32>>>| {
        let t0 = Instant::now();
        for ((g, k), o) in groups.iter().zip(outs.iter_mut()) {
            let ws: Vec<&QMatrix> = g.iter().collect();
            let mut os: Vec<&mut [f32]> = o.iter_mut().map(|v| v.as_mut_slice()).collect();
            matmul_many(&ws, &xs[usize::from(*k != hidden)], 1, &mut os, Isa::Auto, &pool);
        }
        t0.elapsed().as_secs_f64()
    };
    pass(&mut outs);
    let mut kernel = Vec::new();
    let mut memory = Vec::new();
    for _ in 0..passes {
        kernel.push(bytes as f64 / pass(&mut outs));
        memory.push(read_bandwidth(threads, 256 << 20, Duration::from_millis(100)));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (k, m) = (median(&mut kernel), median(&mut memory));
    println!("{:.0} MB per pass, {threads} threads: kernels {:.1} GB/s, memory read {:.1} GB/s, ratio {:.2} (best kernel pass {:.1} GB/s)", bytes as f64 / 1e6, k / 1e9, m / 1e9, k / m, kernel.last().copied().unwrap_or(0.0) / 1e9);
    Ok(())
}
