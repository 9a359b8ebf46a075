//! Per-sequence KV cache for one shard: one growing key/value buffer per layer.
//! Buffers grow by doubling and are written in place, so a decode step never copies the
//! history; they are never shared between sequences and never evicted here.

use candle_core::{DType, Device, Tensor};

use super::Result;

const INITIAL_CAPACITY: usize = 256;

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
            let mut new_cap = capacity.max(INITIAL_CAPACITY);
            while new_cap < needed {
                new_cap *= 2;
            }
            let shape = (1, kv_heads, new_cap, head_dim);
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
}
