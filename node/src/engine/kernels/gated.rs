//! The gated MLP's elementwise step on the CPU, `act(gate) * up`, in one pass over the kernel
//! `pool` (an even share per thread for one row). Both activations are written as
//! `v · sigmoid(c)`: SiLU is `v / (1 + e^-v)` and tanh-approximated GELU is the same identity
//! `0.5 v (1 + tanh z) = v / (1 + e^-2z)`, with `e^x` a branch-free polynomial (Cephes' expf,
//! within 2 ulp) so that the loop vectorizes (AVX2 when the CPU has it). Results differ from
//! candle's libm-based ops only in the last bits. It does not handle other activations or dtypes.

use super::pool::Pool;
use super::SendPtr;

/// The gate activations the families use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Silu,
    GeluTanh,
}

/// Fewest values per pool task (below this a task claim costs more than it saves), and most (a
/// prompt's many rows stay in tasks small enough to balance between threads).
const MIN_CHUNK: usize = 2048;
const MAX_CHUNK: usize = 65536;

/// `out[i] = act(gate[i]) * up[i]`.
pub fn gated(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32], pool: &Pool) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    let n = out.len();
    // One even share per thread (whole vectors of 16), within the bounds above.
    let chunk = n.div_ceil(pool.threads()).next_multiple_of(16).clamp(MIN_CHUNK, MAX_CHUNK);
    let ptr = SendPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let (a, b) = (t * chunk, ((t + 1) * chunk).min(n));
        // SAFETY: tasks write disjoint ranges of `out`, which outlives the job.
        let o = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(a), b - a) };
        gated_slice(act, &gate[a..b], &up[a..b], o);
    };
    let tasks = n.div_ceil(chunk);
    if tasks <= 1 {
        (0..tasks).for_each(task);
    } else {
        pool.run(tasks, &task);
    }
}

/// One chunk, with the widest vectors this CPU has.
pub fn gated_slice(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::x86::has_avx2() {
        // SAFETY: the CPU supports AVX2 and FMA (checked just above).
        unsafe { gated_avx2(act, gate, up, out) };
        return;
    }
    gated_portable(act, gate, up, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn gated_avx2(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    gated_portable(act, gate, up, out)
}

#[inline(always)]
pub fn gated_portable(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32]) {
    #[allow(clippy::excessive_precision)]
    const SQRT_TWO_OVER_PI: f32 = 0.79788456080286535587989211986876373;
    match act {
        Gate::Silu => out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (&v, &u))| *o = v / (1.0 + exp(-v)) * u),
        Gate::GeluTanh => out.iter_mut().zip(gate.iter().zip(up)).for_each(|(o, (&v, &u))| {
            let z = SQRT_TWO_OVER_PI * v * (1.0 + 0.044715 * v * v);
            *o = v / (1.0 + exp(-2.0 * z)) * u
        }),
    }
}

/// `e^x` without branches or calls (Cephes' expf): `x = n ln 2 + r`, `e^r` by a degree-6
/// polynomial, `2^n` built in the exponent bits. Inputs are clamped to keep `2^n` normal, so
/// very large results saturate near `f32::MAX` and very small ones near the smallest normal.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Adding and subtracting 1.5 · 2^23 rounds to the nearest integer (ties to even).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * 0.693_359_375 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    er * f32::from_bits((((n as i32) + 127) as u32) << 23)
}
