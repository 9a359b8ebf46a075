//! The gated MLP's elementwise step on the CPU, `act(gate) * up`, in one pass over the kernel
//! `pool` (chunks of rows shared out like the matmuls' tasks). The formulas are candle's own
//! (`silu`, tanh-approximated `gelu`), evaluated in the same order, so results are bit-identical
//! to candle's two separate ops. It does not handle other activations or dtypes.

use super::pool::Pool;
use super::SendPtr;

/// The gate activations the families use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Silu,
    GeluTanh,
}

/// Values per pool task: large enough to amortize a task claim, small enough to balance.
const CHUNK: usize = 8192;

/// `out[i] = act(gate[i]) * up[i]`.
pub fn gated(act: Gate, gate: &[f32], up: &[f32], out: &mut [f32], pool: &Pool) {
    assert!(gate.len() == up.len() && up.len() == out.len());
    let n = out.len();
    let ptr = SendPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let (a, b) = (t * CHUNK, ((t + 1) * CHUNK).min(n));
        // SAFETY: tasks write disjoint ranges of `out`, which outlives the job.
        let o = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(a), b - a) };
        let (g, u) = (&gate[a..b], &up[a..b]);
        match act {
            Gate::Silu => o.iter_mut().zip(g.iter().zip(u)).for_each(|(o, (&v, &u))| *o = v / (1.0 + (-v).exp()) * u),
            Gate::GeluTanh => {
                #[allow(clippy::excessive_precision)]
                const SQRT_TWO_OVER_PI: f32 = 0.79788456080286535587989211986876373;
                o.iter_mut().zip(g.iter().zip(u)).for_each(|(o, (&v, &u))| *o = 0.5 * v * (1.0 + f32::tanh(SQRT_TWO_OVER_PI * v * (1.0 + 0.044715 * v * v))) * u)
            }
        }
    };
    let tasks = n.div_ceil(CHUNK);
    if tasks <= 1 {
        (0..tasks).for_each(task);
    } else {
        pool.run(tasks, &task);
    }
}
