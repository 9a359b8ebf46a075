//! Parts of weight matrices for tensor-parallel slices: a range of whole rows and/or a range of
//! columns of one tensor. GGUF parts are read block by block from the file (only the part's
//! bytes, quantized blocks kept whole, so a column range must fall on block boundaries);
//! safetensors parts are cut from the memory-mapped tensor after it is widened to f32.
//! It does not decide which part a member takes: `tp::TpLayout` does.

use std::ops::Range;
use std::os::unix::fs::FileExt;

use candle_core::quantized::{ggml_file, QMatMul};
use candle_core::{Device, Tensor};

use super::weights::{open, Matrix, Role, Weights};
use super::{EngineError, Result};

impl Weights {
    /// Values per quantization block of a stored matrix (1 for unquantized tensors), which is
    /// the granularity a column range of it must respect.
    pub fn block_len(&self, role: Role, layer: usize) -> Result<usize> {
        let name = self.name(role, layer);
        match self {
            Weights::Safetensors { .. } => Ok(1),
            Weights::Gguf { content, .. } => Ok(content.tensor_infos.get(&name).ok_or(EngineError::MissingTensor(name))?.ggml_dtype.block_size()),
        }
    }

    /// Rows `rows` and columns `cols` (all when `None`) of a matrix for `x @ W^T`.
    pub fn matmul_part(&self, role: Role, layer: usize, rows: Option<Range<usize>>, cols: Option<Range<usize>>, device: &Device) -> Result<Matrix> {
        let name = self.name(role, layer);
        match self {
            Weights::Safetensors { .. } => {
                let mut t = self.read_dense(&name, device)?;
                let (r, c) = t.dims2().map_err(|_| EngineError::InvalidModel(format!("tensor `{name}` is not a matrix")))?;
                if let Some(rows) = rows {
                    check_range(&name, "rows", &rows, r, 1)?;
                    t = t.narrow(0, rows.start, rows.len())?;
                }
                if let Some(cols) = cols {
                    check_range(&name, "columns", &cols, c, 1)?;
                    t = t.narrow(1, cols.start, cols.len())?;
                }
                Ok(Matrix::Candle(QMatMul::Tensor(t.contiguous()?)))
            }
            Weights::Gguf { path, content, .. } => {
                let info = content.tensor_infos.get(&name).ok_or_else(|| EngineError::MissingTensor(name.clone()))?;
                let (r, c) = match info.shape.dims() {
                    [r, c] => (*r, *c),
                    _ => return Err(EngineError::InvalidModel(format!("tensor `{name}` is not a matrix"))),
                };
                let block = info.ggml_dtype.block_size();
                let rows = rows.unwrap_or(0..r);
                let cols = cols.unwrap_or(0..c);
                check_range(&name, "rows", &rows, r, 1)?;
                check_range(&name, "columns", &cols, c, block)?;
                if c % block != 0 {
                    return Err(EngineError::InvalidModel(format!("tensor `{name}`: {c} columns are not whole blocks of {block}")));
                }
                let type_size = info.ggml_dtype.type_size();
                let row_bytes = c / block * type_size;
                let part_bytes = cols.len() / block * type_size;
                let skip = cols.start / block * type_size;
                let base = content.tensor_data_offset + info.offset;
                let file = open(path)?;
                let mut raw = vec![0u8; rows.len() * part_bytes];
                // `read_gguf_header` checked that the whole tensor lies inside the file.
                if part_bytes == row_bytes {
                    read_at(&file, path, &mut raw, base + (rows.start * row_bytes) as u64)?;
                } else {
                    for (i, dst) in raw.chunks_exact_mut(part_bytes).enumerate() {
                        read_at(&file, path, dst, base + ((rows.start + i) * row_bytes + skip) as u64)?;
                    }
                }
                let q = ggml_file::qtensor_from_ggml(info.ggml_dtype, &raw, vec![rows.len(), cols.len()], device)
                    .map_err(|e| EngineError::InvalidModel(format!("{}: tensor `{name}`: {e}", path.display())))?;
                Matrix::from_qtensor(q, device)
            }
        }
    }

    /// Elements `range` of a vector (a bias) as f32.
    pub fn vector_part(&self, role: Role, layer: usize, range: Range<usize>, device: &Device) -> Result<Tensor> {
        let name = self.name(role, layer);
        let v = self.read_dense(&name, device)?;
        let n = v.dims1().map_err(|_| EngineError::InvalidModel(format!("tensor `{name}` is not a vector")))?;
        check_range(&name, "elements", &range, n, 1)?;
        Ok(v.narrow(0, range.start, range.len())?.contiguous()?)
    }
}

fn check_range(name: &str, what: &str, r: &Range<usize>, len: usize, block: usize) -> Result<()> {
    if r.is_empty() || r.end > len {
        return Err(EngineError::Shard(format!("tensor `{name}`: {what} {r:?} are not inside its {len} {what}")));
    }
    if r.start % block != 0 || r.end % block != 0 {
        return Err(EngineError::Shard(format!("tensor `{name}`: {what} {r:?} do not fall on its quantization blocks of {block}")));
    }
    Ok(())
}

fn read_at(file: &std::fs::File, path: &std::path::Path, buf: &mut [u8], offset: u64) -> Result<()> {
    file.read_exact_at(buf, offset).map_err(|e| EngineError::Io { path: path.to_path_buf(), source: e })
}
