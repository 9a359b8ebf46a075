//! Per-sequence KV cache for one shard: one growing key/value buffer per layer.
//! Buffers grow by doubling and are written in place, so a decode step never copies the
//! history; they are never shared between sequences and never evicted here.

use candle_core::{DType, Device, Tensor};

use super::Result;

const INITIAL_CAPACITY: usize = 256;

/// Positions of KV cache that placement reserves memory for in every layer: Ollama's default
/// context, which most chats stay within; a shorter context (the model's or `--context`) reserves
/// less. Past it the cache still grows, into memory placement did not set aside.
pub const RESERVED_POSITIONS: usize = 4096;

/// Bytes one layer's cache takes once it holds `positions` positions: the buffers it grows to
/// (doubling from `INITIAL_CAPACITY`), in f32, the width on a CPU (a GPU keeps the caches of
/// half-precision and quantized models at half width, `device::cache_dtype`: half of this).
pub fn reserved_bytes(kv_heads: usize, head_dim: usize, positions: usize) -> u64 {
    (2 * kv_heads * capacity_for(positions) * head_dim * DType::F32.size_in_bytes()) as u64
}

/// Positions a layer's buffers hold once they have room for `needed`: `INITIAL_CAPACITY`
/// doubled as often as it takes (every capacity is a power of two, so growing from any smaller
/// one lands here too).
fn capacity_for(needed: usize) -> usize {
    needed.max(1).next_power_of_two().max(INITIAL_CAPACITY)
}

/// Keys and values of one layer, laid out `(1, kv_heads, capacity, head_dim)`.
#[derive(Debug, Default)]
pub struct LayerCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
    len: usize,
}

impl LayerCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `(1, kv_heads, t, head_dim)` keys and values; returns views of the whole history.
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (_, kv_heads, t, head_dim) = k.dims4()?;
        let needed = self.len + t;
        let (kb, vb) = self.reserve(needed, kv_heads, head_dim, k.dtype(), k.device())?;
        let (kb, vb) = (kb.clone(), vb.clone());
        kb.slice_set(&k.contiguous()?, 2, self.len)?;
        vb.slice_set(&v.contiguous()?, 2, self.len)?;
        self.len = needed;
        Ok((kb.narrow(2, 0, self.len)?, vb.narrow(2, 0, self.len)?))
    }

    /// Makes room for `needed` positions (growing by doubling, history kept) and returns the
    /// whole key and value buffers, `(1, kv_heads, capacity, head_dim)`.
    pub fn reserve(&mut self, needed: usize, kv_heads: usize, head_dim: usize, dtype: DType, device: &Device) -> Result<(&Tensor, &Tensor)> {
        let capacity = self.k.as_ref().map(|b| b.dim(2)).transpose()?.unwrap_or(0);
        if needed > capacity {
            let shape = (1, kv_heads, capacity_for(needed), head_dim);
            self.k = Some(grow(self.k.take(), shape, dtype, device, self.len)?);
            self.v = Some(grow(self.v.take(), shape, dtype, device, self.len)?);
        }
        // Both buffers exist now: they were just created or grown above when absent.
        Ok((self.k.as_ref().expect("allocated above"), self.v.as_ref().expect("allocated above")))
    }

    /// Counts `n` more positions as written (by a kernel that wrote the buffers `reserve` gave).
    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// The whole key and value buffers, `(1, kv_heads, capacity, head_dim)`, once allocated.
    pub fn buffers(&self) -> Option<(&Tensor, &Tensor)> {
        Some((self.k.as_ref()?, self.v.as_ref()?))
    }

    /// Forgets everything after the first `len` positions.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

fn grow(old: Option<Tensor>, shape: (usize, usize, usize, usize), dtype: DType, device: &Device, len: usize) -> Result<Tensor> {
    let buf = Tensor::zeros(shape, dtype, device)?;
    if let Some(old) = old {
        if len > 0 {
            buf.slice_set(&old.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
        }
    }
    Ok(buf)
}

/// The caches of every layer a shard holds, plus the number of positions processed.
#[derive(Debug)]
pub struct ShardCache {
    pub layers: Vec<LayerCache>,
    device: Device,
}

impl ShardCache {
    pub fn new(num_layers: usize, device: &Device) -> Self {
        ShardCache { layers: (0..num_layers).map(|_| LayerCache::default()).collect(), device: device.clone() }
    }

    /// Number of positions already in the cache (the next token's position).
    pub fn position(&self) -> usize {
        self.layers.first().map(LayerCache::len).unwrap_or(0)
    }

    pub fn truncate(&mut self, len: usize) {
        self.layers.iter_mut().for_each(|l| l.truncate(len));
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Bytes of keys and values one position takes over every layer, at the buffers' width (0
    /// before any layer has a buffer). A sliding-window layer reads at most its window of them.
    pub fn bytes_per_position(&self) -> Result<u64> {
        let mut bytes = 0;
        for (k, v) in self.layers.iter().filter_map(LayerCache::buffers) {
            for t in [k, v] {
                let (_, heads, _, head_dim) = t.dims4()?;
                bytes += (heads * head_dim * t.dtype().size_in_bytes()) as u64;
            }
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What placement reserves for a layer is what its cache really allocates for that many
    /// positions, including the doubling past a power of two.
    #[test]
    fn reserved_bytes_equal_what_a_layer_allocates() {
        let (kv_heads, head_dim) = (2, 16);
        for positions in [1, 255, 256, 257, 600, 1024] {
            let mut layer = LayerCache::default();
            let step = Tensor::zeros((1, kv_heads, 1, head_dim), DType::F32, &Device::Cpu).unwrap();
            for _ in 0..positions {
                layer.append(&step, &step).unwrap();
            }
            let (k, v) = layer.buffers().unwrap();
            let allocated = ((k.elem_count() + v.elem_count()) * DType::F32.size_in_bytes()) as u64;
            assert_eq!(reserved_bytes(kv_heads, head_dim, positions), allocated, "{positions} positions");
        }
    }
}
