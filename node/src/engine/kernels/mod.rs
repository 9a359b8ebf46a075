//! shoal's own CPU kernels for GGUF-quantized matrices: `QMatrix` holds a weight matrix in its
//! stored block format and multiplies it with f32 activations by quantizing them to 8 bits and
//! taking integer dot products (AVX-512 or AVX2 on x86-64 when the CPU has it, else portable Rust), spread
//! over the kernel `pool`. Decode takes one activation row per weight row; prompts take up to four
//! rows per unpacked weight block. On x86-64, k-quant rows are stored interleaved by eight
//! (`RowLayout`). Formats: Q4_K, Q6_K (× Q8_K) and Q8_0, Q5_0 (× Q8_0).
//! It does not handle f32/f16 or other GGUF formats: those stay on candle's `QMatMul`.

pub mod act;
pub mod attend;
pub mod gated;
#[cfg(target_arch = "aarch64")]
pub mod neon;
pub mod pool;
pub mod softmax;
pub mod portable;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use act::{Q8x4, Q8K};

/// The weight formats these kernels multiply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QType {
    Q4K,
    Q6K,
    Q8_0,
    Q5_0,
}

impl QType {
    pub fn from_ggml(t: GgmlDType) -> Option<QType> {
        match t {
            GgmlDType::Q4K => Some(QType::Q4K),
            GgmlDType::Q6K => Some(QType::Q6K),
            GgmlDType::Q8_0 => Some(QType::Q8_0),
            GgmlDType::Q5_0 => Some(QType::Q5_0),
            _ => None,
        }
    }

    /// Values per block.
    pub fn block_len(self) -> usize {
        match self {
            QType::Q4K | QType::Q6K => 256,
            QType::Q8_0 | QType::Q5_0 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q4K => 144,
            QType::Q6K => 210,
            QType::Q8_0 => 34,
            QType::Q5_0 => 22,
        }
    }

    fn k_quant(self) -> bool {
        matches!(self, QType::Q4K | QType::Q6K)
    }

    /// Values per repacked unit (a k-quant block, or a group of four 32-value blocks): rows must
    /// hold whole units.
    pub fn group_len(self) -> usize {
        if self.k_quant() { 256 } else { 128 }
    }

    /// Rewrites row-major GGUF blocks into the kernels' step order, in place (`portable.rs`).
    fn repack(self, data: &mut [u8]) {
        let unit = self.group_len() / self.block_len() * self.block_bytes();
        for g in data.chunks_exact_mut(unit) {
            match self {
                QType::Q4K => portable::repack_q4k(g),
                QType::Q6K => portable::repack_q6k(g),
                QType::Q8_0 => portable::repack_q8_0x4(g),
                QType::Q5_0 => portable::repack_q5_0x4(g),
            }
        }
    }
}

/// How a matrix's step-ordered blocks are arranged (`portable.rs` has both).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowLayout {
    /// Row after row.
    Rows,
    /// Rows in groups of eight, the blocks of each group interleaved so that every 32-bit lane of
    /// a 256-bit register belongs to one row (Q4_K and Q6_K).
    Interleaved8,
}

impl RowLayout {
    /// The layout this machine's kernels stream fastest for a `ty` matrix of `rows` rows: the
    /// interleaved one for k-quants on x86-64 with AVX2 (measured in L2 on Zen 4: about 1.8× the
    /// row layout's Q4_K rate), rows elsewhere.
    pub fn preferred(ty: QType, rows: usize) -> RowLayout {
        #[cfg(target_arch = "x86_64")]
        if ty.k_quant() && rows % 8 == 0 && x86::has_avx2() {
            return RowLayout::Interleaved8;
        }
        let _ = (ty, rows);
        RowLayout::Rows
    }
}

/// Which implementation runs the dot products (tests pin one; `Auto` picks the fastest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Auto,
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "aarch64")]
    Neon,
    #[cfg(target_arch = "aarch64")]
    NeonDotProd,
}

impl Isa {
    fn resolve(self) -> Isa {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Auto if x86::has_avx512() => Isa::Avx512,
            #[cfg(target_arch = "x86_64")]
            Isa::Auto if x86::has_avx2() => Isa::Avx2,
            #[cfg(target_arch = "aarch64")]
            Isa::Auto if neon::has_dotprod() => Isa::NeonDotProd,
            #[cfg(target_arch = "aarch64")]
            Isa::Auto => Isa::Neon,
            #[cfg(not(target_arch = "aarch64"))]
            Isa::Auto => Isa::Portable,
            other => other,
        }
    }
}

/// A `rows × cols` weight matrix (`y = x W^T`) in a GGUF block format, row-major, each block (or
/// group of four 32-value blocks) rewritten in step order at load: the only copy of the weights.
#[derive(Debug)]
pub struct QMatrix {
    pub ty: QType,
    pub rows: usize,
    pub cols: usize,
    pub layout: RowLayout,
    row_bytes: usize,
    data: WeightBytes,
}

/// The wrapping sum of `words`: the memory-read probe's pass, with the widest loads this CPU has.
pub fn read_sum(words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if x86::has_avx2() {
        // SAFETY: AVX2 is present (checked above).
        return unsafe { x86::read_sum(words) };
    }
    words.iter().fold(0u64, |a, x| a.wrapping_add(*x))
}

/// A matrix's bytes: from 2 MiB up in a `HugePageBuffer`, below on the heap.
#[derive(Debug)]
enum WeightBytes {
    Heap(Vec<u8>),
    Mapped(HugePageBuffer),
}

impl WeightBytes {
    /// A copy of `data`, in a `HugePageBuffer` from 2 MiB up (on the heap if mapping fails).
    fn copy_of(data: &[u8]) -> WeightBytes {
        if data.len() >= HugePageBuffer::HUGE_PAGE {
            if let Ok(mut map) = HugePageBuffer::zeroed(data.len()) {
                map.copy_from_slice(data);
                return WeightBytes::Mapped(map);
            }
        }
        WeightBytes::Heap(data.to_vec())
    }
}

impl std::ops::Deref for WeightBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            WeightBytes::Heap(v) => v,
            WeightBytes::Mapped(m) => m,
        }
    }
}

impl std::ops::DerefMut for WeightBytes {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            WeightBytes::Heap(v) => v,
            WeightBytes::Mapped(m) => m,
        }
    }
}

/// Zeroed memory in its own anonymous mapping that asks the OS for transparent huge pages (Linux;
/// elsewhere, or with THP off, it keeps small pages). Decode streams every weight matrix once per
/// token: with 4 KiB pages the hardware prefetchers stop at each page edge and the TLB misses
/// every few blocks, which costs the single-core weight stream about a fifth of its rate here.
#[derive(Debug)]
pub struct HugePageBuffer(memmap2::MmapMut);

impl HugePageBuffer {
    pub const HUGE_PAGE: usize = 2 << 20;

    pub fn zeroed(len: usize) -> std::io::Result<HugePageBuffer> {
        let map = memmap2::MmapMut::map_anon(len)?;
        // Only a hint: the mapping works the same without it.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(HugePageBuffer(map))
    }
}

impl std::ops::Deref for HugePageBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0
    }
}

impl std::ops::DerefMut for HugePageBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.0
    }
}

/// Errors building a `QMatrix`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KernelError {
    /// The tensor is not a matrix whose rows are whole blocks of a supported format.
    #[error("unsupported quantized matrix: {0}")]
    Unsupported(String),
    /// The tensor's bytes could not be read or do not match its shape.
    #[error("quantized matrix data: {0}")]
    Data(String),
}

impl QMatrix {
    /// Copies a GGUF tensor's blocks; `None` when its format or shape is not one these kernels take.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<QMatrix>, KernelError> {
        QMatrix::from_qtensor_in(q, None)
    }

    /// As `from_qtensor`, in a given layout rather than this machine's preferred one (tests compare
    /// layouts; `Interleaved8` needs k-quant rows in whole groups of eight).
    pub fn from_qtensor_in(q: &QTensor, layout: Option<RowLayout>) -> Result<Option<QMatrix>, KernelError> {
        let Some(ty) = QType::from_ggml(q.dtype()) else { return Ok(None) };
        let Ok((rows, cols)) = q.shape().dims2() else { return Ok(None) };
        if cols % ty.group_len() != 0 {
            return Ok(None);
        }
        let data = q.data().map_err(|e| KernelError::Data(e.to_string()))?;
        let layout = layout.unwrap_or_else(|| RowLayout::preferred(ty, rows));
        QMatrix::repacked(ty, rows, cols, WeightBytes::copy_of(&data), layout).map(Some)
    }

    /// A matrix from raw GGUF blocks (`rows * cols / block_len` blocks, row after row), repacked
    /// in place.
    pub fn from_bytes(ty: QType, rows: usize, cols: usize, data: Vec<u8>) -> Result<QMatrix, KernelError> {
        let bytes = if data.len() < HugePageBuffer::HUGE_PAGE { WeightBytes::Heap(data) } else { WeightBytes::copy_of(&data) };
        QMatrix::repacked(ty, rows, cols, bytes, RowLayout::preferred(ty, rows))
    }

    /// A `rows × cols` matrix of `ty` from its GGUF blocks in `data`, repacked in place, or why
    /// the bytes cannot be one.
    fn repacked(ty: QType, rows: usize, cols: usize, mut data: WeightBytes, layout: RowLayout) -> Result<QMatrix, KernelError> {
        if cols == 0 || cols % ty.group_len() != 0 {
            return Err(KernelError::Unsupported(format!("{cols} columns are not whole {ty:?} groups of {}", ty.group_len())));
        }
        let row_bytes = cols / ty.block_len() * ty.block_bytes();
        if data.len() != rows * row_bytes {
            return Err(KernelError::Data(format!("{} bytes for {rows}×{cols} {ty:?}", data.len())));
        }
        ty.repack(&mut data);
        if layout == RowLayout::Interleaved8 {
            if !ty.k_quant() || rows % 8 != 0 {
                return Err(KernelError::Unsupported(format!("{rows} {ty:?} rows do not interleave in eights")));
            }
            let (q4k, bb) = (ty == QType::Q4K, ty.block_bytes());
            for group in data.chunks_exact_mut(8 * row_bytes) {
                let rows_of = group.to_vec();
                for (i, out) in group.chunks_exact_mut(8 * bb).enumerate() {
                    let blocks = std::array::from_fn(|j| &rows_of[j * row_bytes + i * bb..j * row_bytes + (i + 1) * bb]);
                    portable::interleave_x8(q4k, blocks, out);
                }
            }
        }
        Ok(QMatrix { ty, rows, cols, layout, row_bytes, data })
    }

    pub fn size_in_bytes(&self) -> usize {
        self.data.len()
    }

    /// Row `r` (layout `Rows`).
    fn row(&self, r: usize) -> &[u8] {
        &self.data[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Rows `8 g .. 8 g + 8` (layout `Interleaved8`).
    fn group(&self, g: usize) -> &[u8] {
        &self.data[8 * g * self.row_bytes..8 * (g + 1) * self.row_bytes]
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let group;
        let w = match self.layout {
            RowLayout::Rows => self.row(r),
            RowLayout::Interleaved8 => {
                group = portable::row_of_x8_group(self.ty == QType::Q4K, self.group(r / 8), r % 8);
                &group
            }
        };
        match self.ty {
            QType::Q4K => portable::dequantize_q4k(w, out),
            QType::Q6K => portable::dequantize_q6k(w, out),
            QType::Q8_0 => portable::dequantize_q8_0(w, out),
            QType::Q5_0 => portable::dequantize_q5_0(w, out),
        }
    }

    /// The whole matrix as f32, row-major (for tests and references).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        for (r, o) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, o);
        }
        out
    }
}

/// `m` activation rows quantized for one family of formats.
enum Acts {
    K(Vec<Q8K>),
    Zero(Vec<Q8x4>),
}

fn quantize_rows(x: &[f32], m: usize, k: usize, k_quant: bool, isa: Isa, pool: &pool::Pool) -> Acts {
    let per_row = if k_quant { k / 256 } else { k / 128 };
    let rows_per_task = (m / (4 * pool.threads())).max(1);
    let tasks = m.div_ceil(rows_per_task);
    macro_rules! run {
        ($ty:ty, $variant:ident, $fast:path, $portable:path) => {{
            let mut out = vec![<$ty>::default(); m * per_row];
            let ptr = SendPtr(out.as_mut_ptr());
            let task = |t: usize| {
                let r0 = t * rows_per_task;
                let r1 = (r0 + rows_per_task).min(m);
                // SAFETY: tasks cover disjoint row ranges of `out`, which outlives the job.
                let dst = unsafe { std::slice::from_raw_parts_mut(ptr.get().add(r0 * per_row), (r1 - r0) * per_row) };
                let src = &x[r0 * k..r1 * k];
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 | Isa::Avx512 => $fast(src, dst),
                    _ => $portable(src, dst),
                }
            };
            if m == 1 { task(0) } else { pool.run(tasks, &task) }
            Acts::$variant(out)
        }};
    }
    if k_quant {
        run!(Q8K, K, act::quantize_q8k, act::quantize_q8k_portable)
    } else {
        run!(Q8x4, Zero, act::quantize_q8x4, act::quantize_q8x4_portable)
    }
}

#[derive(Clone, Copy)]
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
// SAFETY: used only to hand disjoint parts of one buffer to pool tasks.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}
impl<T> SendPtr<T> {
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// One weight row against `R` activation rows.
#[inline]
fn dot_rows<const R: usize>(w: &QMatrix, row: usize, acts: &Acts, a_rows: [usize; R], isa: Isa) -> [f32; R] {
    let wr = w.row(row);
    match acts {
        Acts::K(a) => {
            let per = w.cols / 256;
            let ar: [&[Q8K]; R] = a_rows.map(|i| &a[i * per..(i + 1) * per]);
            match (isa, w.ty) {
                // SAFETY: `Isa::Avx2` / `Avx512` are only chosen when the CPU has those features
                // (`Isa::resolve`, or a test that checked them).
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, QType::Q4K) => unsafe { x86::avx2::dot_q4k::<R>(wr, ar) },
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, QType::Q6K) => unsafe { x86::avx2::dot_q6k::<R>(wr, ar) },
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, QType::Q4K) => unsafe { x86::avx512::dot_q4k::<R>(wr, ar) },
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, QType::Q6K) => unsafe { x86::avx512::dot_q6k::<R>(wr, ar) },
                // SAFETY: NEON is part of every aarch64 CPU; `NeonDotProd` is only chosen when the
                // CPU has FEAT_DotProd (`Isa::resolve`, or a test that checked it).
                #[cfg(target_arch = "aarch64")]
                (Isa::Neon, QType::Q4K) => unsafe { neon::plain::dot_q4k::<R>(wr, ar) },
                #[cfg(target_arch = "aarch64")]
                (Isa::Neon, QType::Q6K) => unsafe { neon::plain::dot_q6k::<R>(wr, ar) },
                #[cfg(target_arch = "aarch64")]
                (Isa::NeonDotProd, QType::Q4K) => unsafe { neon::dotprod::dot_q4k::<R>(wr, ar) },
                #[cfg(target_arch = "aarch64")]
                (Isa::NeonDotProd, QType::Q6K) => unsafe { neon::dotprod::dot_q6k::<R>(wr, ar) },
                (_, QType::Q4K) => ar.map(|a| portable::dot_q4k(wr, a)),
                (_, QType::Q6K) => ar.map(|a| portable::dot_q6k(wr, a)),
                _ => unreachable!("k-quant activations are made only for k-quant weights"),
            }
        }
        Acts::Zero(a) => {
            let per = w.cols / 128;
            let ar: [&[Q8x4]; R] = a_rows.map(|i| &a[i * per..(i + 1) * per]);
            match (isa, w.ty) {
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, QType::Q8_0) => unsafe { x86::avx2::dot_q8_0::<R>(wr, ar) },
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx2, QType::Q5_0) => unsafe { x86::avx2::dot_q5_0::<R>(wr, ar) },
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, QType::Q8_0) => unsafe { x86::avx512::dot_q8_0::<R>(wr, ar) },
                #[cfg(target_arch = "x86_64")]
                (Isa::Avx512, QType::Q5_0) => unsafe { x86::avx512::dot_q5_0::<R>(wr, ar) },
                // SAFETY: as above.
                #[cfg(target_arch = "aarch64")]
                (Isa::Neon, QType::Q8_0) => unsafe { neon::plain::dot_q8_0::<R>(wr, ar) },
                #[cfg(target_arch = "aarch64")]
                (Isa::Neon, QType::Q5_0) => unsafe { neon::plain::dot_q5_0::<R>(wr, ar) },
                #[cfg(target_arch = "aarch64")]
                (Isa::NeonDotProd, QType::Q8_0) => unsafe { neon::dotprod::dot_q8_0::<R>(wr, ar) },
                #[cfg(target_arch = "aarch64")]
                (Isa::NeonDotProd, QType::Q5_0) => unsafe { neon::dotprod::dot_q5_0::<R>(wr, ar) },
                (_, QType::Q8_0) => ar.map(|a| portable::dot_q8_0(wr, a)),
                (_, QType::Q5_0) => ar.map(|a| portable::dot_q5_0(wr, a)),
                _ => unreachable!("32-element activations are made only for 32-element weights"),
            }
        }
    }
}

/// Interleaved rows `8 g .. 8 g + 8` of `w` against `R` activation rows: `[activation][row]`.
#[inline]
fn dot_group<const R: usize>(w: &QMatrix, g: usize, a: &[Q8K], a_rows: [usize; R], isa: Isa) -> [[f32; 8]; R] {
    let (group, per, q4k) = (w.group(g), w.cols / 256, w.ty == QType::Q4K);
    let ar: [&[Q8K]; R] = a_rows.map(|i| &a[i * per..(i + 1) * per]);
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `Isa::Avx2` / `Avx512` are only chosen when the CPU has those features; the
        // group holds `per` interleaved blocks and every activation row `per` blocks.
        let lanes = match (isa, q4k) {
            (Isa::Avx512, true) => Some(unsafe { x86::avx512::dot_q4k_x8::<R>(group.as_ptr(), per, ar, 0) }),
            (Isa::Avx512, false) => Some(unsafe { x86::avx512::dot_q6k_x8::<R>(group.as_ptr(), per, ar, 0) }),
            (Isa::Avx2, true) => Some(unsafe { x86::avx2::dot_q4k_x8::<R>(group.as_ptr(), per, ar, 0) }),
            (Isa::Avx2, false) => Some(unsafe { x86::avx2::dot_q6k_x8::<R>(group.as_ptr(), per, ar, 0) }),
            _ => None,
        };
        if let Some(lanes) = lanes {
            // SAFETY: a 256-bit register is eight f32 lanes.
            return lanes.map(|v| unsafe { std::mem::transmute::<std::arch::x86_64::__m256, [f32; 8]>(v) });
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    ar.map(|a| portable::dot_x8(q4k, group, a))
}

/// Rows `rows` of `w` against the one activation row in `acts` (decode).
fn gemv(w: &QMatrix, rows: std::ops::Range<usize>, acts: &Acts, isa: Isa, out: &mut [f32]) {
    if let (RowLayout::Interleaved8, Acts::K(a)) = (w.layout, acts) {
        #[cfg(target_arch = "x86_64")]
        {
            let (wr, gb, q4k) = (&w.data[rows.start * w.row_bytes..rows.end * w.row_bytes], 8 * w.row_bytes, w.ty == QType::Q4K);
            // SAFETY: as in `dot_group`.
            match isa {
                Isa::Avx512 => return unsafe { x86::avx512::gemv_x8(q4k, wr, gb, a, out) },
                Isa::Avx2 => return unsafe { x86::avx2::gemv_x8(q4k, wr, gb, a, out) },
                _ => {}
            }
        }
        for (g, o) in (rows.start / 8..rows.end / 8).zip(out.chunks_exact_mut(8)) {
            o.copy_from_slice(&dot_group::<1>(w, g, a, [0], isa)[0]);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    let wr = &w.data[rows.start * w.row_bytes..rows.end * w.row_bytes];
    #[cfg(target_arch = "x86_64")]
    let rb = w.row_bytes;
    match (acts, isa, w.ty) {
        // SAFETY: `Isa::Avx2` / `Avx512` are only chosen when the CPU has those features.
        #[cfg(target_arch = "x86_64")]
        (Acts::K(a), Isa::Avx512, QType::Q4K) => unsafe { x86::avx512::gemv_q4k(wr, rb, a, out) },
        #[cfg(target_arch = "x86_64")]
        (Acts::K(a), Isa::Avx512, QType::Q6K) => unsafe { x86::avx512::gemv_q6k(wr, rb, a, out) },
        #[cfg(target_arch = "x86_64")]
        (Acts::Zero(a), Isa::Avx512, QType::Q8_0) => unsafe { x86::avx512::gemv_q8_0(wr, rb, a, out) },
        #[cfg(target_arch = "x86_64")]
        (Acts::Zero(a), Isa::Avx512, QType::Q5_0) => unsafe { x86::avx512::gemv_q5_0(wr, rb, a, out) },
        #[cfg(target_arch = "x86_64")]
        (Acts::K(a), Isa::Avx2, QType::Q4K) => unsafe { x86::avx2::gemv_q4k(wr, rb, a, out) },
        #[cfg(target_arch = "x86_64")]
        (Acts::K(a), Isa::Avx2, QType::Q6K) => unsafe { x86::avx2::gemv_q6k(wr, rb, a, out) },
        #[cfg(target_arch = "x86_64")]
        (Acts::Zero(a), Isa::Avx2, QType::Q8_0) => unsafe { x86::avx2::gemv_q8_0(wr, rb, a, out) },
        #[cfg(target_arch = "x86_64")]
        (Acts::Zero(a), Isa::Avx2, QType::Q5_0) => unsafe { x86::avx2::gemv_q5_0(wr, rb, a, out) },
        _ => {
            for (o, r) in out.iter_mut().zip(rows) {
                *o = dot_rows::<1>(w, r, acts, [0], isa)[0];
            }
        }
    }
}

/// `out[i] = x · W_i^T` for every matrix `W_i` (all with `cols == k`), `x` being `m × k` row-major
/// and `out[i]` `m × W_i.rows`. Activations are quantized once per format family, and all the
/// matrices' rows are shared out as one job on the pool.
pub fn matmul_many(mats: &[&QMatrix], x: &[f32], m: usize, outs: &mut [&mut [f32]], isa: Isa, pool: &pool::Pool) {
    let isa = isa.resolve();
    let k = mats[0].cols;
    assert!(mats.iter().all(|w| w.cols == k), "matrices of one group share their input size");
    assert_eq!(x.len(), m * k);
    assert_eq!(mats.len(), outs.len());
    for (w, o) in mats.iter().zip(outs.iter()) {
        assert_eq!(o.len(), m * w.rows);
    }
    let acts_k = mats.iter().any(|w| w.ty.k_quant()).then(|| quantize_rows(x, m, k, true, isa, pool));
    let acts_0 = mats.iter().any(|w| !w.ty.k_quant()).then(|| quantize_rows(x, m, k, false, isa, pool));
    // Tasks: contiguous row ranges of each matrix, about 8 per thread in all (decode) or row tiles
    // small enough for their weights to stay in L2 while every activation row passes (prompts).
    let total_rows: usize = mats.iter().map(|w| w.rows).sum();
    // Both are whole groups of eight rows, for interleaved matrices.
    let chunk = if m == 1 { (total_rows / (8 * pool.threads())).clamp(16, 512) / 8 * 8 } else { 16 };
    let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
    for (i, w) in mats.iter().enumerate() {
        let mut r = 0;
        while r < w.rows {
            let end = (r + chunk).min(w.rows);
            tasks.push((i, r, end));
            r = end;
        }
    }
    let out_ptrs: Vec<SendPtr<f32>> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    let task = |t: usize| {
        let (i, r0, r1) = tasks[t];
        let w = mats[i];
        let acts = if w.ty.k_quant() { acts_k.as_ref() } else { acts_0.as_ref() }.expect("quantized above for this format");
        let out = out_ptrs[i];
        let n = w.rows;
        if m == 1 {
            // SAFETY: each task writes only its own rows r0..r1 of the one output row; `outs` outlives the job.
            let o = unsafe { std::slice::from_raw_parts_mut(out.get().add(r0), r1 - r0) };
            gemv(w, r0..r1, acts, isa, o);
            return;
        }
        // SAFETY: each task writes the entries (a, r) for its own rows r0..r1 only; `outs` outlives the job.
        let put = |a: usize, r: usize, v: f32| unsafe { *out.get().add(a * n + r) = v };
        // Activation rows in groups of 4 per unpacked weight block (8 measured no faster, even with
        // AVX-512's 32 registers); the tail runs with the group size it needs.
        let group = if isa == Isa::Portable { 1 } else { 4 };
        // `n` activation rows from `a` against every row of the task (eight at a time when interleaved).
        macro_rules! rows {
            ($n:literal, $a:expr) => {{
                let a = $a;
                if let (RowLayout::Interleaved8, Acts::K(k)) = (w.layout, acts) {
                    for g in r0 / 8..r1 / 8 {
                        let v = dot_group::<$n>(w, g, k, std::array::from_fn(|j| a + j), isa);
                        (0..$n).for_each(|j| (0..8).for_each(|l| put(a + j, 8 * g + l, v[j][l])));
                    }
                } else {
                    for r in r0..r1 {
                        let v = dot_rows::<$n>(w, r, acts, std::array::from_fn(|j| a + j), isa);
                        (0..$n).for_each(|j| put(a + j, r, v[j]));
                    }
                }
            }};
        }
        let mut a = 0;
        while a < m {
            let n = (m - a).min(group);
            match n {
                4 => rows!(4, a),
                3 => rows!(3, a),
                2 => rows!(2, a),
                _ => rows!(1, a),
            }
            a += n;
        }
    };
    pool.run(tasks.len(), &task);
}

/// `x W^T (+ bias)` for one matrix, as a candle op on a `(.., k)` f32 tensor.
pub struct QMatMulOp {
    pub weight: Arc<QMatrix>,
}

/// Applies several matrices sharing one input, returning one tensor per matrix.
pub fn forward_many(mats: &[&Arc<QMatrix>], x: &Tensor) -> candle_core::Result<Vec<Tensor>> {
    let dims = x.dims().to_vec();
    let k = *dims.last().ok_or_else(|| candle_core::Error::Msg("matmul input has no dimensions".into()))?;
    let x = x.to_dtype(candle_core::DType::F32)?.contiguous()?;
    let m = x.elem_count() / k.max(1);
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        return Err(candle_core::Error::Msg("quantized kernels run on CPU f32 tensors".into()));
    };
    let xs = &data[layout.start_offset()..layout.start_offset() + m * k];
    let mut bufs: Vec<Vec<f32>> = mats.iter().map(|w| vec![0f32; m * w.rows]).collect();
    {
        let mut outs: Vec<&mut [f32]> = bufs.iter_mut().map(|b| b.as_mut_slice()).collect();
        let ws: Vec<&QMatrix> = mats.iter().map(|w| w.as_ref()).collect();
        for w in &ws {
            if w.cols != k {
                return Err(candle_core::Error::Msg(format!("matmul input has {k} columns, the matrix {}", w.cols)));
            }
        }
        matmul_many(&ws, xs, m, &mut outs, Isa::Auto, pool::global());
    }
    drop(storage);
    bufs.into_iter()
        .zip(mats)
        .map(|(b, w)| {
            let mut shape = dims.clone();
            *shape.last_mut().expect("checked above") = w.rows;
            Tensor::from_vec(b, shape, x.device())
        })
        .collect()
}

impl CustomOp1 for QMatMulOp {
    fn name(&self) -> &'static str {
        "shoal-qmatmul"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(data) = storage else {
            return Err(candle_core::Error::Msg("quantized kernels take f32 input".into()));
        };
        let Some(xs) = layout.contiguous_offsets().map(|(a, b)| &data[a..b]) else {
            return Err(candle_core::Error::Msg("quantized kernels take contiguous input".into()));
        };
        let mut dims = layout.dims().to_vec();
        let k = *dims.last().unwrap_or(&0);
        if k != self.weight.cols {
            return Err(candle_core::Error::Msg(format!("matmul input has {k} columns, the matrix {}", self.weight.cols)));
        }
        let m = xs.len() / k;
        let mut out = vec![0f32; m * self.weight.rows];
        matmul_many(&[&self.weight], xs, m, &mut [&mut out], Isa::Auto, pool::global());
        *dims.last_mut().expect("k read above") = self.weight.rows;
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}
