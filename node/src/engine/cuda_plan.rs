//! The fused CUDA decode step's launch planning that needs no GPU: the kernels' argument
//! layouts (`Seg`, `MvArgs`, `AttnArgs`, `EmbedArgs`, as decode.cu declares them), the weight
//! formats' codes and sizes, and how launches are shaped from a GPU's figures (`MvGrids`: each
//! `mv` launch's kernel instance, rows a warp and grid; split-K slices; the gate/up ring's stages;
//! grouped attention's grid). Kept apart from `cuda_decode` so that it builds, and its tests run,
//! without the `cuda` feature. It does not touch a device, allocate, or launch anything.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]
/// Threads per `mv` block: 8 warps, one output row each at a time.
pub(crate) const MV_THREADS: u32 = 256;
/// Launch shapes, with their defaults; `SHOAL_FUSED_<NAME>` overrides one (a tuning aid).
pub(crate) fn tuned(name: &str, default: u32) -> u32 {
    overridden(name).unwrap_or(default)
}

/// `SHOAL_FUSED_<NAME>` where it is set to a number (for shapes whose default is computed).
pub(crate) fn overridden(name: &str) -> Option<u32> {
    std::env::var(format!("SHOAL_FUSED_{name}")).ok().and_then(|v| v.parse().ok())
}

pub(crate) const FMT_F32: i32 = 0;
pub(crate) const FMT_F16: i32 = 1;
pub(crate) const FMT_BF16: i32 = 2;
pub(crate) const FMT_Q8_0: i32 = 8;
pub(crate) const FMT_Q4_K: i32 = 12;
pub(crate) const FMT_Q6_K: i32 = 14;
/// Values in a step of `dot_q4_k_q8`'s Q4_K rows (decode.cu's `Q4_PER_STEP` blocks of 256).
pub(crate) const Q4_STEP_VALUES: i32 = 8 * 256;

pub(crate) const MODE_STORE: i32 = 0;
pub(crate) const MODE_ADD: i32 = 1;
pub(crate) const MODE_SILU: i32 = 2;
pub(crate) const MODE_GELU_TANH: i32 = 3;

/// `Seg` in decode.cu: one matrix of a fused matrix-vector product.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct Seg {
    pub(crate) w: u64,
    pub(crate) bias: u64,
    pub(crate) fmt: i32,
    pub(crate) rows: i32,
}

/// `MvArgs` in decode.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct MvArgs {
    pub(crate) seg: [Seg; 3],
    pub(crate) nseg: i32,
    pub(crate) cols: i32,
    pub(crate) slice: i32,
    pub(crate) q4k: i32,
    pub(crate) pairs: i32,
    pub(crate) stream: i32,
    pub(crate) x: u64,
    pub(crate) norm_w: u64,
    pub(crate) eps: f32,
    pub(crate) mode: i32,
    pub(crate) out: u64,
    pub(crate) partial: u64,
    pub(crate) preload: i32,
    pub(crate) launch: i32,
    pub(crate) trace: u64,
    pub(crate) tag_in: i32,
    pub(crate) tag_out: i32,
    pub(crate) tag: u64,
    pub(crate) ahead: [u64; 2],
    pub(crate) ahead_bytes: i64,
    /// An LM head's: the step's greedy pick words (`pick_greedy`), or 0.
    pub(crate) pick: u64,
    pub(crate) pick_scratch: u64,
}

/// `AttnArgs` in decode.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct AttnArgs {
    pub(crate) qkv: u64,
    pub(crate) kv: u64,
    pub(crate) inv_freq: u64,
    pub(crate) q_norm: u64,
    pub(crate) k_norm: u64,
    pub(crate) pos: u64,
    pub(crate) out: u64,
    pub(crate) cache_fmt: i32,
    pub(crate) heads: i32,
    pub(crate) kv_heads: i32,
    pub(crate) d: i32,
    pub(crate) rope_halves: i32,
    pub(crate) window: i32,
    pub(crate) scale: f32,
    pub(crate) softcap: f32,
    pub(crate) eps: f32,
    pub(crate) launch: i32,
    pub(crate) trace: u64,
    pub(crate) tagged: i32,
    pub(crate) tag: u64,
    pub(crate) out_q8: i32,
    pub(crate) splits: i32,
    pub(crate) split_keys: i32,
    pub(crate) partial: u64,
    pub(crate) count: u64,
}

/// `EmbedArgs` in decode.cu.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub(crate) struct EmbedArgs {
    pub(crate) table: u64,
    pub(crate) fmt: i32,
    pub(crate) cols: i32,
    pub(crate) scale: f32,
    /// Where the step's token id is found: the address of a u32 (the step arguments' last word).
    pub(crate) token_at: u64,
    pub(crate) out: u64,
}

/// How `mv` launches are shaped on this GPU.
#[derive(Clone, Copy)]
pub(crate) struct MvGrids {
    /// Most `mv` blocks of `MV_THREADS` per launch (row blocks loop beyond it; 0: one block per
    /// 8 rows); half as many of 16 warps.
    pub(crate) mv_blocks: u32,
    /// Warps of an unsplit `mv` block (16, or 8 with `SHOAL_FUSED_MV_THREADS=256`); split
    /// launches, the ring and the Q6_K pairs kernels take `MV_THREADS` (256) always.
    pub(crate) mv_warps: u32,
    /// The same for `mv_gated_q4_k_ring` (known once the plan has sized its shared memory).
    pub(crate) ring_blocks: u32,
    /// Whether f16/bf16 launches with more rows than warps take two rows a warp.
    pub(crate) mv_pairs: bool,
    /// The same for Q4_K launches (`SHOAL_FUSED_Q4_PAIRS=0`: one row a warp at a time).
    pub(crate) q4_pairs: bool,
    /// Q6_K rows with int8 activations two a warp (`mv_q6_k_q8_pairs`): the most blocks of such
    /// a launch, 3 an SM (both rows' loads in registers bound it), or 0 (`SHOAL_FUSED_Q6_PAIRS=0`:
    /// one row a warp at a time).
    pub(crate) q6_pairs_blocks: u32,
    /// Rows a warp (of a one-row-a-warp grid) from which Q6_K launches take their rows two a
    /// warp (`SHOAL_FUSED_Q6_PAIRS_ROWS`, 4): the LM heads and a 7B's down (6 rows a warp), not
    /// the 1.5B's down (1.8). One H200 (session 54, two rounds, 7B Q4_K_M): 16 (heads only)
    /// 508.6 / 512.9 -> 4: 515.1 / 515.3 tok/s; its trace's Q6_K downs 24.5 -> 23.1 µs a layer.
    pub(crate) q6_pairs_rows: u32,
    /// Whether those Q6_K launches take their rows four a warp, one step at a time
    /// (`mv_q6_k_q8_quads`; `SHOAL_FUSED_Q6_QUADS=0`: two a warp). One H200 (session 66, two
    /// alternating rounds): 7B Q4_K_M 536.3 / 540.9 -> 548.4 / 549.2 tok/s, 1.5B Q4_K_M (Q6_K
    /// head) 1,132.8 / 1,153.2 -> 1,144.4 / 1,164.2; the 1.5B's head 84.5 -> 74.4 µs.
    pub(crate) q6_quads: bool,
    /// Whether o's launch (the one taking attention's values as int8, `tag_in` 2) takes its Q4_K
    /// rows two a warp however many warps its grid has (`o_in_pairs`).
    pub(crate) o_pairs: bool,
}

/// An `mv` launch as it runs: its kernel instance, `pairs` (rows two a warp) and grid.
pub(crate) struct MvShape {
    pub(crate) kernel: &'static str,
    pub(crate) pairs: i32,
    pub(crate) blocks: u32,
    pub(crate) slices: u32,
    pub(crate) threads: u32,
}

impl MvGrids {
    /// The shape of a launch of `rows` rows planned for `kernel` with `args`.
    pub(crate) fn shape(&self, kernel: &'static str, args: &MvArgs, rows: u32) -> MvShape {
        // A block takes 8 or 16 rows (or gate/up pairs) at a time, a warp each; a split grid's
        // blocks loop over more rows so that each staged input slice serves several.
        let slices = (args.cols as u32).div_ceil(args.slice as u32);
        let ring = kernel == "mv_gated_q4_k_ring";
        let warps = if ring || slices > 1 { MV_THREADS / 32 } else { self.mv_warps };
        // Fewer ring-kernel blocks fit on an SM (their rings bound them): a grid of `ring_blocks`.
        let most = if ring { self.ring_blocks } else { self.mv_blocks * (MV_THREADS / 32) / warps };
        let cap = if most == 0 { u32::MAX } else { (most / slices).max(1) };
        // f16/bf16 rows beyond one per warp go two to a warp (`pairs` in decode.cu), and so do
        // Q4_K rows (`mv_q4_k_pairs`) of matrices with even numbers of rows, and o's int8 rows
        // whatever its grid where `o_pairs`.
        let more_rows_than_warps = rows > cap.saturating_mul(warps);
        let rows_come_in = |n: i32| args.seg[..args.nseg as usize].iter().all(|s| s.rows % n == 0);
        let even = rows_come_in(2);
        let o_two_a_warp = self.o_pairs && args.tag_in == 2;
        let q4_pairs = self.q4_pairs && kernel == "mv_q4_k" && (more_rows_than_warps || o_two_a_warp) && even;
        // Q6_K pairs only where each warp has several rows (LM heads, a 7B's down): with a few
        // (the 1.5B's down) the fewer blocks cost more than the pairs save.
        let many_rows = rows >= cap.saturating_mul(warps).saturating_mul(self.q6_pairs_rows);
        let q6_pairs = self.q6_pairs_blocks > 0 && kernel == "mv_q6_k" && args.q4k == 2 && many_rows && even;
        // Those Q6_K rows go four a warp instead (`mv_q6_k_q8_quads`, `pairs` 2) where every
        // matrix's rows come in fours.
        let q6_quads = q6_pairs && self.q6_quads && rows_come_in(4);
        let pairs = if q6_quads { 2 } else { i32::from(q4_pairs || q6_pairs || (self.mv_pairs && matches!(kernel, "mv_f16" | "mv_bf16") && more_rows_than_warps)) };
        let kernel = match (kernel, q4_pairs || q6_pairs, args.q4k == 2) {
            ("mv_q4_k", true, true) => "mv_q4_k_q8_pairs",
            ("mv_q4_k", false, true) => "mv_q4_k_q8",
            ("mv_q4_k", true, false) => "mv_q4_k_pairs",
            ("mv_q6_k", true, true) if q6_quads => "mv_q6_k_q8_quads",
            ("mv_q6_k", true, true) => "mv_q6_k_q8_pairs",
            ("mv_q6_k", false, true) => "mv_q6_k_q8",
            ("mv_any", _, true) => "mv_any_q8",
            _ => kernel,
        };
        // A 2-stage ring walks each slot's gate/up rows as one run where a row is not a whole
        // number of steps (8 Q4_K blocks: `mv_gated_q4_k_ring_2_run`).
        let kernel = match (ring, args.stream, args.cols % Q4_STEP_VALUES) {
            (true, 2, 1..) => "mv_gated_q4_k_ring_2_run",
            _ => kernel,
        };
        let (cap, warps) = if q6_pairs { ((self.q6_pairs_blocks / slices).max(1), MV_THREADS / 32) } else { (cap, warps) };
        let blocks = rows.div_ceil(warps << pairs).clamp(1, cap);
        MvShape { kernel, pairs, blocks, slices, threads: warps * 32 }
    }

    /// Input values a block takes of a split launch's rows (`args.cols` of them; `args.slice` is
    /// set to it). `SHOAL_FUSED_SPLIT_K`: at most that many (whole 256-value blocks; slices as
    /// equal as they can be). Otherwise the most slices of 1,024 to 3,072 values whose grid gives
    /// every warp the same number of rows, with no last pass that only some warps take (its
    /// blocks' end is the launch's tail); failing that, at most 2,048. One H100, two alternating
    /// rounds in each of two calls (session 38), the 7B's down (18,944 values, 3,584 rows) in 7
    /// slices (every warp 3 row pairs, or 6 Q6_K rows) rather than 10 (4.3 pairs): 7B Q4_K_M decode
    /// 425.9 / 425.3 and 428.6 / 425.3 -> 434.2 / 434.6 and 434.7 / 431.6 tok/s, 7B f16 195.2 /
    /// 195.1 -> 197.4 / 197.4; the 1.5B's (8,960 values, 1,536 rows) stays at 5 slices (one
    /// pass), as 3 or 4 were slower. This rule against the old one (`SHOAL_FUSED_SPLIT_K=2048`,
    /// session 39, same build): 7B Q4_K_M 429.5 / 429.6 -> 434.8 / 434.3, 7B f16 195.0 / 195.1 ->
    /// 197.5 / 197.5, the 1.5B unchanged.
    pub(crate) fn split_slice(&self, kernel: &'static str, args: &MvArgs, rows: u32) -> i32 {
        let cols = args.cols as usize;
        let slice_of = |slices: usize| (cols.div_ceil(256).div_ceil(slices) * 256) as i32;
        if let Some(most) = overridden("SPLIT_K") {
            return slice_of(cols.div_ceil((most as usize).next_multiple_of(256)));
        }
        let whole_passes = |slices: usize| {
            let shape = self.shape(kernel, &MvArgs { slice: slice_of(slices), ..*args }, rows);
            let passes = rows as f64 / f64::from(shape.blocks * ((shape.threads / 32) << shape.pairs));
            passes.ceil() - passes < 0.05
        };
        match (cols.div_ceil(3072)..=cols.div_ceil(1024)).rev().find(|&slices| whole_passes(slices)) {
            Some(slices) => slice_of(slices),
            None => slice_of(cols.div_ceil(2048)),
        }
    }
}

/// Whether o's rows go two a warp (`MvGrids::o_pairs`) for a step whose gate/up ring takes
/// `ring_per_sm` blocks an SM (None: no ring): where it takes at most 2. o's blocks of 512 threads at 64
/// registers then fill half an SM's registers, not all of them (the 7B's o: 112 blocks, not
/// 224), and the ring's two blocks of 256 threads fit beside them, so they start while attention
/// and o run and send their first copies before o ends, not after. One H100 (session 42, 64-token
/// prompts, three calls, alternating, off -> on): 7B Q4_K_M 452.2 / 449.5 -> 457.4 / 454.0,
/// 450.2 / 452.4 -> 455.0 / 454.9, 447.7 / 448.0 -> 451.9 / 454.7 tok/s (o's own work 2.7 -> 4.0
/// us a layer; gate/up's first wait 2.8 -> 1.2-1.4 us after o's end, its span 32.8 -> 31.0). Where
/// the ring takes 4 an SM (the 1.5B) nothing fits beside o, and pairs only slowed o (1.5B Q4_K_M
/// 1053.3 / 1044.2 -> 1028.7 / 1031.6). `SHOAL_FUSED_O_PAIRS`: 0 never, 1 always.
pub(crate) fn o_in_pairs(ring_per_sm: Option<u32>) -> bool {
    match overridden("O_PAIRS") {
        Some(n) => n != 0,
        None => ring_per_sm.is_some_and(|n| n <= 2),
    }
}

/// The ring's stages for a gate/up launch of `rows` row pairs (`args` as planned, before the
/// ring): 3 where a block of 3 stages fits (`block_limit` bytes of shared memory), at least 2 of
/// them fit an SM (the fewest measured: one block's 8 warps an SM was never tried), and that grid
/// still gives every warp at least 4 pairs; else 2.
pub(crate) fn ring_stages(args: &MvArgs, rows: u32, sms: u32, smem_per_sm: usize, reserved: usize, block_limit: usize) -> i32 {
    let bytes = mv_smem(&MvArgs { stream: 3, q4k: 0, ..*args });
    let per_sm = blocks_per_sm_by_smem(smem_per_sm, reserved, bytes);
    let warps = sms * per_sm * (MV_THREADS / 32);
    if bytes <= block_limit && per_sm >= 2 && rows >= 4 * warps { 3 } else { 2 }
}

/// How many blocks needing `bytes` of dynamic shared memory fit an SM at once (1 KB more a block
/// for static shared memory: the ring kernel's is under 1 KB), at most 4 (the ring kernel's
/// registers, as `MV_WAVES`, allow no more).
pub(crate) fn blocks_per_sm_by_smem(smem_per_sm: usize, reserved: usize, bytes: usize) -> u32 {
    (smem_per_sm / (bytes + reserved + 1024)).clamp(1, 4) as u32
}

/// `attend_group`'s limits as decode.cu defines them (`GRP_THREADS`, `GRP_TILE`, `GRP_STAGES`,
/// `GRP_TILE_BYTES`, `GRP_MAX_SPLITS`, ...; written by build.rs).
#[allow(dead_code)] // decode.cu's other `GRP_*` numbers come along
pub(crate) mod group {
    include!(concat!(env!("OUT_DIR"), "/decode_consts.rs"));
}

/// Blocks a KV head `attend_group` may launch with. A group's blocks wait for one another, so the
/// grid is at most what the GPU holds at once: two blocks an SM (its launch bounds), or fewer
/// where shared memory (`static_smem`, the kernel's own, besides `group_smem`) allows fewer,
/// shared over the KV heads, at most `GRP_MAX_SPLITS` (its merge). `None` where a layer does not
/// fit the kernel (an f16 or bf16 cache, at most `GRP_MAX_REP` query heads a KV head, head dims a
/// multiple of 32, its shared memory within a block's limit) or fewer than two blocks a KV head
/// would.
pub(crate) fn group_splits(attends: &[&AttnArgs], sms: u32, smem_per_sm: usize, reserved: usize, block_limit: usize, static_smem: usize) -> Option<u32> {
    let fits = |a: &&AttnArgs| a.cache_fmt != FMT_F32 && (a.heads / a.kv_heads) as u32 <= group::GRP_MAX_REP && a.d % 32 == 0 && group_smem(a) as usize + static_smem <= block_limit;
    if attends.is_empty() || !attends.iter().all(fits) {
        return None;
    }
    let kv_heads = attends.iter().map(|a| a.kv_heads as u32).max().unwrap_or(1);
    let most = attends.iter().map(|a| group_smem(a)).max().unwrap_or(0) as usize;
    let per_sm = blocks_per_sm_by_smem(smem_per_sm, reserved, most + static_smem).min(2);
    Some(per_sm * sms / kv_heads).filter(|&n| n >= 2).map(|n| n.min(group::GRP_MAX_SPLITS))
}

/// The instance of an attention kernel (`attend`, `attend_group`) compiled for these layers'
/// head dim where they all share 64 or 128 (`attend_group_d128`: 91 registers against 126,
/// session 52; `attend_d128`: 122 against 128 and a quarter fewer instructions, session 53), else
/// the generic one.
pub(crate) fn for_head_dim(kernel: &'static str, head_dims: &[usize]) -> &'static str {
    let shared = head_dims.first().copied().filter(|&d| head_dims.iter().all(|&e| e == d));
    match (kernel, shared) {
        ("attend", Some(64)) => "attend_d64",
        ("attend", Some(128)) => "attend_d128",
        ("attend_group", Some(64)) => "attend_group_d64",
        ("attend_group", Some(128)) => "attend_group_d128",
        _ => kernel,
    }
}

/// Dynamic shared memory of an `attend_group` block, as decode.cu lays it out: `GRP_STAGES`
/// tiles of keys and of values, each at most `GRP_TILE` rows (a multiple of 16) of the head's
/// bytes plus 16 and at most `GRP_TILE_BYTES`, then the group's query heads in f32.
pub(crate) fn group_smem(a: &AttnArgs) -> u32 {
    use group::{GRP_STAGES, GRP_TILE, GRP_TILE_BYTES};
    let row = a.d as u32 * if a.cache_fmt == FMT_F32 { 4 } else { 2 } + 16;
    let tile = (GRP_TILE_BYTES / row / 16 * 16).min(GRP_TILE);
    GRP_STAGES * 2 * tile * row + (a.heads / a.kv_heads) as u32 * a.d as u32 * 4
}

/// Dynamic shared memory of one `mv` block: its input slice as f32; for Q4_K rows also a second
/// copy in the order their kernel reads, and the sums of each 16 values. The ring kernel
/// (`stream` stages) holds the input as int8 with its scales and sums, then its ring of rows
/// (`q4k_ring_smem` in decode.cu).
pub(crate) fn mv_smem(a: &MvArgs) -> usize {
    let n = a.slice as usize;
    if a.stream > 0 {
        n + n / 32 * 4 + n / 16 * 4 + a.stream as usize * (MV_THREADS as usize / 32) * 2 * fmt_bytes(FMT_Q4_K, n)
    } else if a.q4k != 0 {
        n * 4 * 2 + n / 16 * 4
    } else {
        n * 4
    }
}

/// Bytes that `n` values of a row take in `fmt` (`fmt_bytes` in decode.cu; `n` whole blocks).
pub(crate) fn fmt_bytes(fmt: i32, n: usize) -> usize {
    match fmt {
        FMT_F32 => n * 4,
        FMT_F16 | FMT_BF16 => n * 2,
        FMT_Q8_0 => n / 32 * 34,
        FMT_Q4_K => n / 256 * 144,
        _ => n / 256 * 210,
    }
}

/// The smallest f16/bf16 gate (and up) matrix whose read-ahead is taken from its end.
pub(crate) const READ_AHEAD_END_MIN: usize = 16 << 20;

/// Where o's blocks pull gate/up's rows (`gate_up`, as planned) into L2 while they wait for
/// attention: (offset into each of gate and up, bytes of each). `front` and `end` are the
/// windows' sizes over both matrices, half from each and at most the whole matrix.
///
/// A 16-bit matrix of at least `READ_AHEAD_END_MIN` bytes gives its last `end / 2` bytes: its
/// last rows, which a grid of more blocks than fit at once reaches last, so nothing else fetches
/// them early (the first rows' warps load theirs before they wait). One H100 (session 74,
/// alternating rounds, front 2 MB -> end 6 MB): Qwen2.5-1.5B f16 +1.7 to +2.7% (gate/up's span
/// 22.1 -> 18.7 µs a layer, at its bytes' time), 3B f16 +2.0%, 7B f16 +0.5%; the 0.5B (8.7 MB
/// matrices) lost 2.7–6.5% and the 1.5B Q4_K_M 0.7–2.8%, so they, like every quantized or smaller
/// matrix, keep the first `front / 2` bytes.
pub(crate) fn read_ahead(front: usize, end: usize, gate_up: &MvArgs) -> (u64, i64) {
    let matrix = gate_up.seg[0].rows as usize * fmt_bytes(gate_up.seg[0].fmt, gate_up.cols as usize);
    let sixteen_bit = gate_up.seg[..2].iter().all(|s| matches!(s.fmt, FMT_F16 | FMT_BF16));
    if end > 0 && sixteen_bit && matrix >= READ_AHEAD_END_MIN {
        let bytes = (end / 2).min(matrix);
        return ((matrix - bytes) as u64, bytes as i64);
    }
    (0, (front / 2).min(matrix) as i64)
}

/// The widest hidden size whose all-f16/bf16 step runs with every kernel preferring the most
/// shared memory (`step_carveout`).
pub(crate) const CARVEOUT_HIDDEN_MAX: usize = 2048;

/// The shared-memory carveout (percent of each SM's unified L1 and shared memory) that every
/// kernel of a fused step prefers, or `None` to leave each kernel to the driver. One value for the
/// whole chain: a carveout that changes from launch to launch cost the 3B and 7B f16 6–10% on an
/// H200 (session 72). 100 where every matrix is f16/bf16 and the hidden size is at most
/// `CARVEOUT_HIDDEN_MAX`; on an H100 (session 73, alternating rounds) that took Qwen2.5 0.5B,
/// 1.5B and 3B f16 decode up 2.6%, 3.1–4.1% and 3.3%, and cost the 7B f16 1.9%, Llama-3-8B
/// 1.8% and the 1.5B Q4_K_M 0.9%; on an H200 the 1.5B and 3B f16 +0.9% and +1.4%, the 7B
/// −4.1%. `setting`: `SHOAL_FUSED_CARVEOUT`, a percent for every step, or `none`.
pub(crate) fn step_carveout(setting: Option<&str>, all_16bit: bool, hidden: usize) -> Option<u32> {
    let by_shape = (all_16bit && hidden <= CARVEOUT_HIDDEN_MAX).then_some(100);
    match setting.map(str::trim) {
        Some("none") => None,
        Some(v) => v.parse::<u32>().map_or(by_shape, |percent| Some(percent.min(100))),
        None => by_shape,
    }
}

/// The `mv` instance in decode.cu for a launch (`gated`: act(gate)·up) whose matrices are in
/// `fmts`: one per format, or `_any` when they differ.
pub(crate) fn mv_kernel(gated: bool, fmts: &[i32]) -> &'static str {
    let same = fmts.windows(2).all(|w| w[0] == w[1]);
    let names: [&'static str; 2] = match fmts.first().copied().filter(|_| same) {
        Some(FMT_F32) => ["mv_f32", "mv_gated_f32"],
        Some(FMT_F16) => ["mv_f16", "mv_gated_f16"],
        Some(FMT_BF16) => ["mv_bf16", "mv_gated_bf16"],
        Some(FMT_Q8_0) => ["mv_q8_0", "mv_gated_q8_0"],
        Some(FMT_Q4_K) => ["mv_q4_k", "mv_gated_q4_k"],
        Some(FMT_Q6_K) => ["mv_q6_k", "mv_gated_q6_k"],
        _ => ["mv_any", "mv_gated_any"],
    };
    names[usize::from(gated)]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H100's grids (132 SMs) with every pairing on, as `FusedDecode::build` sets them.
    fn h100() -> MvGrids {
        MvGrids { mv_blocks: 132 * 4, mv_warps: 16, ring_blocks: 132 * 3, mv_pairs: true, q4_pairs: true, q6_pairs_blocks: 132 * 3, q6_pairs_rows: 4, q6_quads: true, o_pairs: false }
    }

    /// A down launch (`rows` x `cols`, one matrix of `fmt`, added into the residual) as planned:
    /// the kernel and int8 activations `Planner::mv` picks for the format.
    fn down(fmt: i32, rows: i32, cols: i32) -> (&'static str, MvArgs) {
        let mut args = MvArgs { nseg: 1, cols, slice: cols, mode: MODE_ADD, ..MvArgs::default() };
        args.seg[0] = Seg { fmt, rows, ..Seg::default() };
        let kernel = mv_kernel(false, &[fmt]);
        args.q4k = if fmt == FMT_Q4_K || fmt == FMT_Q6_K { 2 } else { 0 };
        (kernel, args)
    }

    #[test]
    fn the_ring_deepens_only_where_every_warp_still_streams_four_row_pairs() {
        // A gate/up launch of `rows` x `cols` Q4_K rows on a GPU of (SMs, shared memory an SM,
        // the most a block may have); 1 KB reserved a block.
        let stages = |rows: i32, cols: i32, (sms, per_sm, per_block): (u32, usize, usize)| {
            let mut args = MvArgs { nseg: 2, cols, slice: cols, mode: MODE_SILU, ..MvArgs::default() };
            args.seg[0] = Seg { fmt: FMT_Q4_K, rows, ..Seg::default() };
            args.seg[1] = args.seg[0];
            ring_stages(&args, rows as u32, sms, per_sm, 1024, per_block - 1024)
        };
        let h100 = (132, 228 * 1024, 227 * 1024);
        let a100 = (108, 164 * 1024, 163 * 1024);
        // Qwen2.5-7B's gate/up: 3 stages fit 2 blocks an SM, 2,112 warps, 9 pairs each.
        assert_eq!(stages(18_944, 3_584, h100), 3);
        // Qwen2.5-1.5B's: 4 blocks an SM either way, 4,224 warps, 2.1 pairs each.
        assert_eq!(stages(8_960, 1_536, h100), 2);
        // A 70B-class gate/up (28,672 x 8,192): 3 stages (232 KB a block) do not fit a block; 2 do.
        assert_eq!(stages(28_672, 8_192, h100), 2);
        // On an A100 the 7B's 3-stage blocks (101 KB) fit one an SM: it keeps 2 stages, 2 an SM.
        assert_eq!(stages(18_944, 3_584, a100), 2);
    }

    #[test]
    fn attention_takes_the_instance_compiled_for_a_head_dim_every_layer_shares() {
        assert_eq!(for_head_dim("attend_group", &[128; 28]), "attend_group_d128");
        assert_eq!(for_head_dim("attend", &[128; 28]), "attend_d128");
        assert_eq!(for_head_dim("attend_group", &[64; 24]), "attend_group_d64");
        assert_eq!(for_head_dim("attend", &[64; 24]), "attend_d64");
        assert_eq!(for_head_dim("attend_group", &[128, 128, 64]), "attend_group");
        assert_eq!(for_head_dim("attend", &[96; 4]), "attend");
        assert_eq!(for_head_dim("attend_group", &[]), "attend_group");
    }

    #[test]
    fn two_stage_rings_of_rows_not_whole_steps_walk_them_as_one_run() {
        // Qwen2.5-1.5B's gate/up (2 stages, rows of 6 Q4_K blocks: not whole steps of 8) takes
        // `mv_gated_q4_k_ring_2_run`, the 3B's (rows of 8) and the 7B's (3 stages)
        // `mv_gated_q4_k_ring`; all in blocks of 8 warps over the ring's grid.
        let grids = h100();
        let gate_up = |rows: i32, cols: i32, stream: i32| {
            let mut args = MvArgs { nseg: 2, cols, slice: cols, mode: MODE_SILU, stream, ..MvArgs::default() };
            args.seg[0] = Seg { fmt: FMT_Q4_K, rows, ..Seg::default() };
            args.seg[1] = args.seg[0];
            let shape = grids.shape("mv_gated_q4_k_ring", &args, rows as u32);
            (shape.kernel, shape.threads, shape.blocks)
        };
        assert_eq!(gate_up(11_008, 2_048, 2), ("mv_gated_q4_k_ring", 256, 132 * 3));
        assert_eq!(gate_up(8_960, 1_536, 2), ("mv_gated_q4_k_ring_2_run", 256, 132 * 3));
        assert_eq!(gate_up(18_944, 3_584, 3), ("mv_gated_q4_k_ring", 256, 132 * 3));
    }

    #[test]
    fn unsplit_launches_take_blocks_of_512_threads_and_split_ones_of_256() {
        let grids = h100();
        // Qwen2.5-7B's o (3,584 x 3,584 Q4_K, added into the residual, rows whole): one row a warp
        // in 224 blocks of 16 warps.
        let (kernel, args) = down(FMT_Q4_K, 3584, 3584);
        let shape = grids.shape(kernel, &args, 3584);
        assert_eq!((shape.kernel, shape.threads, shape.blocks, shape.slices), ("mv_q4_k_q8", 512, 224, 1));
        // Its down (split in 7 slices): 75 blocks of 8 warps a slice, as the slice rule assumes.
        let (kernel, args) = down(FMT_Q4_K, 3584, 18944);
        let shape = grids.shape(kernel, &MvArgs { slice: 2816, ..args }, 3584);
        assert_eq!((shape.threads, shape.blocks, shape.slices), (256, 75, 7));
    }

    #[test]
    fn o_takes_rows_two_a_warp_in_half_the_blocks_where_the_ring_fits_beside_it() {
        // The 7B's ring (3 stages, 2 blocks an SM) fits beside o's halved grid; the 1.5B's (4 an
        // SM) does not; a step with no ring keeps o as it is.
        assert!(o_in_pairs(Some(2)));
        assert!(!o_in_pairs(Some(4)));
        assert!(!o_in_pairs(None));
        // Qwen2.5-7B's o taking attention's int8 values: 112 blocks of 16 warps, two rows each.
        let grids = MvGrids { o_pairs: true, ..h100() };
        let (kernel, args) = down(FMT_Q4_K, 3584, 3584);
        let o = MvArgs { tag_in: 2, ..args };
        let shape = grids.shape(kernel, &o, 3584);
        assert_eq!((shape.kernel, shape.pairs, shape.threads, shape.blocks), ("mv_q4_k_q8_pairs", 1, 512, 112));
        // Other launches keep their shapes.
        assert_eq!(grids.shape(kernel, &args, 3584).blocks, 224);
    }

    #[test]
    fn grouped_attention_launches_no_more_blocks_than_the_gpu_holds_at_once() {
        let attn = |heads: i32, kv_heads: i32, d: i32, cache_fmt: i32| AttnArgs { heads, kv_heads, d, cache_fmt, ..AttnArgs::default() };
        // An H200: 132 SMs of 228 KB, 1 KB reserved a block, 227 KB a block at most; the kernel's
        // static shared memory as ptxas gives it for sm_90.
        const STATIC: usize = 19_232;
        let h200 = |layers: &[AttnArgs]| group_splits(&layers.iter().collect::<Vec<_>>(), 132, 233_472, 1024, 232_448, STATIC);
        // Qwen2.5-1.5B (12 query heads, 2 KV heads, d = 128, f16 cache): two stages of 64 keys and
        // their values, 71 KB a block, two an SM, 132 a KV head, capped at the merge's 128.
        assert_eq!(group_smem(&attn(12, 2, 128, FMT_F16)), 2 * 2 * 64 * 272 + 6 * 128 * 4);
        assert_eq!(h200(&[attn(12, 2, 128, FMT_F16)]), Some(128));
        // Qwen2.5-7B (28 / 4): 2 × 132 ÷ 4.
        assert_eq!(h200(&[attn(28, 4, 128, FMT_F16)]), Some(66));
        // The layer with the most KV heads bounds the grid; bf16 caches too.
        assert_eq!(h200(&[attn(28, 4, 128, FMT_BF16), attn(32, 8, 128, FMT_BF16)]), Some(33));
        // d = 256 with 16 query heads a KV head: 32-key tiles, 82 KB a block, still two an SM.
        assert_eq!(group_smem(&attn(32, 2, 256, FMT_F16)), 2 * 2 * 32 * 528 + 16 * 256 * 4);
        assert_eq!(h200(&[attn(32, 2, 256, FMT_F16)]), Some(128));
        // A GPU of 100 KB an SM holds one 1.5B block an SM: 80 ÷ 2; one of 88 KB none (71 KB of
        // dynamic shared memory fit, but not with the kernel's static 19 KB).
        assert_eq!(group_splits(&[&attn(12, 2, 128, FMT_F16)], 80, 102_400, 1024, 101_376, STATIC), Some(40));
        assert_eq!(group_splits(&[&attn(12, 2, 128, FMT_F16)], 80, 90_112, 1024, 89_088, STATIC), None);
        // Shapes the kernel does not take keep the per-query-head split.
        assert_eq!(h200(&[attn(12, 2, 128, FMT_F32)]), None);
        assert_eq!(h200(&[attn(34, 2, 128, FMT_F16)]), None);
        assert_eq!(h200(&[attn(12, 2, 80, FMT_F16)]), None);
        assert_eq!(h200(&[attn(12, 2, 128, FMT_F16), attn(12, 2, 128, FMT_F32)]), None);
        // Fewer than two blocks a KV head is no split.
        assert_eq!(group_splits(&[&attn(128, 128, 128, FMT_F16)], 60, 233_472, 1024, 232_448, STATIC), None);
    }

    #[test]
    fn o_reads_ahead_half_from_gate_and_half_from_up_large_16_bit_matrices_from_their_ends() {
        let gate_up = |fmt: i32, rows: i32, cols: i32| {
            let mut args = MvArgs { nseg: 2, cols, slice: cols, mode: MODE_SILU, ..MvArgs::default() };
            args.seg[0] = Seg { fmt, rows, ..Seg::default() };
            args.seg[1] = args.seg[0];
            args
        };
        let (front, end) = (2 << 20, 6 << 20);
        // The first 1 MB of each of Qwen2.5-7B's Q4_K gate and up (38 MB each).
        assert_eq!(read_ahead(front, end, &gate_up(FMT_Q4_K, 18944, 3584)), (0, 1 << 20));
        // The last 3 MB of each of Qwen2.5-1.5B's f16 gate and up (27.5 MB each) and of bf16 ones.
        let matrix = 8960 * 1536 * 2;
        assert_eq!(read_ahead(front, end, &gate_up(FMT_F16, 8960, 1536)), (matrix - (3 << 20), 3 << 20));
        assert_eq!(read_ahead(front, end, &gate_up(FMT_BF16, 8960, 1536)), (matrix - (3 << 20), 3 << 20));
        // Without an end window, the front one; 0.5B's f16 matrices (8.7 MB) are too small for it.
        assert_eq!(read_ahead(front, 0, &gate_up(FMT_F16, 8960, 1536)), (0, 1 << 20));
        assert_eq!(read_ahead(front, end, &gate_up(FMT_F16, 4864, 896)), (0, 1 << 20));
        // A small model's whole f16 matrix (64 rows of 256 values, 32 KB) is the most.
        assert_eq!(read_ahead(front, end, &gate_up(FMT_F16, 64, 256)), (0, 32 << 10));
        assert_eq!(read_ahead(0, end, &gate_up(FMT_F16, 64, 256)), (0, 0));
    }

    #[test]
    fn split_slices_give_every_warp_whole_passes_where_some_count_does() {
        let grids = h100();
        // Qwen2.5-7B's down (18,944 values, 3,584 rows): 7 slices of 2,816 values in f16, Q4_K and
        // Q6_K, each a grid whose warps all take 3 row pairs (Q6_K: 2 row quads in blocks of 8
        // warps, 3 an SM), not 10 of 2,048.
        for fmt in [FMT_F16, FMT_Q4_K, FMT_Q6_K] {
            let (kernel, args) = down(fmt, 3584, 18944);
            let slice = grids.split_slice(kernel, &args, 3584);
            assert_eq!(slice, 2816, "format {fmt}");
            let shape = grids.shape(kernel, &MvArgs { slice, ..args }, 3584);
            assert_eq!(shape.slices, 7);
            if fmt == FMT_Q6_K {
                assert_eq!((shape.kernel, shape.pairs, shape.blocks, shape.threads), ("mv_q6_k_q8_quads", 2, 56, 256));
            }
            let rows_a_pass = shape.blocks * ((shape.threads / 32) << shape.pairs);
            let last_pass = 3584 - (3584 - 1) / rows_a_pass * rows_a_pass;
            assert!(last_pass >= rows_a_pass * 95 / 100, "format {fmt}: {rows_a_pass} rows a pass, {last_pass} in the last");
        }
        // Qwen2.5-1.5B's down (8,960 values, 1,536 rows): 5 slices of 1,792 values, one pass of row
        // pairs (f16, Q4_K); Q6_K rows one a warp (under 2 a warp: no pairs) have no whole-pass
        // count, and keep 5 too.
        for fmt in [FMT_F16, FMT_Q4_K, FMT_Q6_K] {
            let (kernel, args) = down(fmt, 1536, 8960);
            let slice = grids.split_slice(kernel, &args, 1536);
            assert_eq!(slice, 1792, "format {fmt}");
            if fmt == FMT_Q6_K {
                assert_eq!(grids.shape(kernel, &MvArgs { slice, ..args }, 1536).kernel, "mv_q6_k_q8");
            }
        }
    }

    #[test]
    fn small_16_bit_steps_prefer_all_shared_memory_and_a_setting_overrides_the_rule() {
        // Qwen2.5-1.5B and -3B in f16 (hidden 1,536 and 2,048): every kernel at 100.
        assert_eq!(step_carveout(None, true, 1536), Some(100));
        assert_eq!(step_carveout(None, true, 2048), Some(100));
        // Qwen2.5-7B in f16 (3,584) and any quantized step: the driver's choice per kernel.
        assert_eq!(step_carveout(None, true, 3584), None);
        assert_eq!(step_carveout(None, false, 1536), None);
        // `SHOAL_FUSED_CARVEOUT`: a percent (at most 100) for any step, or `none`; anything else
        // is ignored.
        assert_eq!(step_carveout(Some("50"), false, 3584), Some(50));
        assert_eq!(step_carveout(Some("250"), true, 1536), Some(100));
        assert_eq!(step_carveout(Some("none"), true, 1536), None);
        assert_eq!(step_carveout(Some("lots"), true, 1536), Some(100));
    }

    #[test]
    fn q6_k_launches_of_many_rows_a_warp_take_them_four_a_warp_where_they_come_in_fours() {
        let grids = h100();
        // Qwen2.5-7B's LM head (152,064 x 3,584 Q6_K, rows whole): 396 blocks of 8 warps, 12
        // passes of row quads.
        let (kernel, args) = down(FMT_Q6_K, 152_064, 3584);
        let head = MvArgs { mode: MODE_STORE, ..args };
        let shape = grids.shape(kernel, &head, 152_064);
        assert_eq!((shape.kernel, shape.pairs, shape.blocks, shape.threads), ("mv_q6_k_q8_quads", 2, 396, 256));
        // Rows not in fours take them two a warp; so does `SHOAL_FUSED_Q6_QUADS=0`.
        let (kernel, odd) = down(FMT_Q6_K, 152_066, 3584);
        assert_eq!(grids.shape(kernel, &odd, 152_066).kernel, "mv_q6_k_q8_pairs");
        let pairs = MvGrids { q6_quads: false, ..h100() };
        let shape = pairs.shape(kernel, &head, 152_064);
        assert_eq!((shape.kernel, shape.pairs, shape.blocks), ("mv_q6_k_q8_pairs", 1, 396));
    }
}
