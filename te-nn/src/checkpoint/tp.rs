//! Tensor-parallel checkpoint files: a checkpoint file (a model's, or its optimizer's state) split
//! into one file per rank of a tensor-parallel group, each rank's slices
//! (`te_nn::parallel::TpLayout`), and merged back, bit for bit. A rank's file is an ordinary
//! safetensors file of the same tensor names (`model.safetensors` → `model.tp-1-of-2.safetensors`)
//! with the source's `__metadata__` plus `te_tp_rank` and `te_tp_size`; a TP=2 run's checkpoint
//! merges into the file a single GPU loads, and a single GPU's splits for TP=2.

use super::atomic::{io_error, write_atomic};
use super::format::parse;
use crate::parallel::{TpLayout, TpRank};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use te_runtime::{Error, Result};

/// `__metadata__` key of a rank's file: its rank in the group.
pub const TP_RANK_KEY: &str = "te_tp_rank";
/// `__metadata__` key of a rank's file: the group's size.
pub const TP_SIZE_KEY: &str = "te_tp_size";

/// The file of rank `rank` of `size` for the checkpoint file `path`: `dir/model.safetensors` →
/// `dir/model.tp-<rank>-of-<size>.safetensors`.
pub fn shard_path(path: &Path, rank: usize, size: usize) -> PathBuf {
    let stem = path.file_stem().map_or_else(|| "checkpoint".into(), |s| s.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}.tp-{rank}-of-{size}.safetensors"))
}

/// Bytes an element of `dtype` takes (sub-byte types are refused: no tensor of this library
/// has one).
fn elem_bytes(name: &str, dtype: safetensors::Dtype) -> Result<usize> {
    let bits = dtype.bitsize();
    if bits % 8 == 0 && bits > 0 {
        Ok(bits / 8)
    } else {
        Err(Error::Checkpoint { message: format!("{name}: {dtype:?} elements are not whole bytes: cannot split it") })
    }
}

/// One parsed file: its bytes and metadata.
struct File {
    bytes: Vec<u8>,
    meta: HashMap<String, String>,
}

impl File {
    fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| io_error(path, "cannot read", e))?;
        parse(&bytes, path)?;
        let (_, header) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| Error::Checkpoint { message: format!("{}: {e}", path.display()) })?;
        let meta = header.metadata().clone().unwrap_or_default();
        Ok(Self { bytes, meta })
    }

    fn tensors(&self, path: &Path) -> Result<SafeTensors<'_>> {
        parse(&self.bytes, path)
    }
}

/// Writes `tensors` (name, dtype, shape, bytes) with `meta` to `path`, atomically.
fn write(
    path: &Path,
    tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)],
    meta: HashMap<String, String>,
) -> Result<()> {
    let views = tensors
        .iter()
        .map(|(name, dtype, shape, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| Error::Checkpoint { message: format!("{}: {name}: {e}", path.display()) })
        })
        .collect::<Result<Vec<_>>>()?;
    write_atomic(path, |tmp| {
        safetensors::serialize_to_file(views, Some(meta), tmp).map_err(|e| io_error(tmp, "cannot write", e))
    })
}

/// Splits the checkpoint file `input` into one file per rank of `layout` ([`shard_path`] of
/// `output`, e.g. `output = out/model.safetensors`); returns their paths, rank by rank.
///
/// # Errors
/// [`Error::Checkpoint`] for an unreadable, corrupt or already split file (it has
/// `te_tp_size`), or an I/O failure; [`Error::Dist`] for a tensor that does not split over the
/// group (naming it).
pub fn split_file(input: &Path, layout: &TpLayout, output: &Path) -> Result<Vec<PathBuf>> {
    let file = File::read(input)?;
    if file.meta.contains_key(TP_SIZE_KEY) {
        return Err(Error::Checkpoint {
            message: format!(
                "{}: already one rank's file of a tensor-parallel checkpoint: merge it first",
                input.display()
            ),
        });
    }
    let st = file.tensors(input)?;
    let mut names: Vec<&str> = st.names();
    names.sort_unstable();
    let mut paths = Vec::with_capacity(layout.size);
    for rank in 0..layout.size {
        let tp = TpRank { rank, size: layout.size };
        let mut out = Vec::with_capacity(names.len());
        for &name in &names {
            let t = st.tensor(name).map_err(|e| Error::internal("checkpoint::split_file", e.to_string()))?;
            let split = layout.split_of(name);
            let shape = split.shard_shape(name, t.shape(), tp)?;
            let bytes = split.shard(name, t.data(), t.shape(), elem_bytes(name, t.dtype())?, tp)?;
            out.push((name.to_owned(), t.dtype(), shape, bytes));
        }
        let mut meta = file.meta.clone();
        meta.insert(TP_RANK_KEY.into(), rank.to_string());
        meta.insert(TP_SIZE_KEY.into(), layout.size.to_string());
        let path = shard_path(output, rank, layout.size);
        write(&path, &out, meta)?;
        paths.push(path);
    }
    Ok(paths)
}

/// Merges the files of every rank of `layout` (`inputs[r]` is rank `r`'s, as [`split_file`]
/// writes them) into the one file `output`: the inverse of [`split_file`], bit for bit.
///
/// # Errors
/// [`Error::Checkpoint`] for unreadable or corrupt files, files of another group size or in
/// another order, files whose tensor names or dtypes differ, an I/O failure; [`Error::Dist`]
/// for slices that do not make a whole tensor or replicated tensors that differ between ranks.
pub fn merge_files(inputs: &[PathBuf], layout: &TpLayout, output: &Path) -> Result<()> {
    if inputs.len() != layout.size {
        return Err(Error::Checkpoint {
            message: format!(
                "{} files for a tensor-parallel size of {}: give every rank's file",
                inputs.len(),
                layout.size
            ),
        });
    }
    let files = inputs.iter().map(|p| File::read(p)).collect::<Result<Vec<_>>>()?;
    for (rank, (f, path)) in files.iter().zip(inputs).enumerate() {
        let (r, n) = (f.meta.get(TP_RANK_KEY), f.meta.get(TP_SIZE_KEY));
        if r != Some(&rank.to_string()) || n != Some(&layout.size.to_string()) {
            return Err(Error::Checkpoint {
                message: format!(
                    "{}: expected rank {rank} of {} ({TP_RANK_KEY} {r:?}, {TP_SIZE_KEY} {n:?}): give the files in rank order",
                    path.display(),
                    layout.size
                ),
            });
        }
    }
    let sts = files.iter().zip(inputs).map(|(f, p)| f.tensors(p)).collect::<Result<Vec<_>>>()?;
    let mut names: Vec<&str> = sts[0].names();
    names.sort_unstable();
    let mut out = Vec::with_capacity(names.len());
    for &name in &names {
        let parts = sts
            .iter()
            .zip(inputs)
            .map(|(st, p)| {
                st.tensor(name).map_err(|_| Error::Checkpoint {
                    message: format!("{}: has no tensor `{name}`, rank 0's file has", p.display()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let dtype = parts[0].dtype();
        if let Some(p) = parts.iter().position(|t| t.dtype() != dtype) {
            return Err(Error::Checkpoint {
                message: format!("{name}: {dtype:?} in rank 0's file, {:?} in rank {p}'s", parts[p].dtype()),
            });
        }
        // The whole shape: the slices' shape with the split dimension summed over ranks.
        let split = layout.split_of(name);
        let mut shape = parts[0].shape().to_vec();
        if let Some(len) = split.dim().and_then(|d| shape.get_mut(d)) {
            *len *= layout.size;
        }
        let slices: Vec<&[u8]> = parts.iter().map(|t| t.data()).collect();
        let bytes = split.merge(name, &slices, &shape, elem_bytes(name, dtype)?)?;
        out.push((name.to_owned(), dtype, shape, bytes));
    }
    if let Some((p, st)) = inputs.iter().zip(&sts).skip(1).find(|(_, st)| st.names().len() != names.len()) {
        return Err(Error::Checkpoint {
            message: format!("{}: holds {} tensors, rank 0's file {}", p.display(), st.names().len(), names.len()),
        });
    }
    let mut meta = files[0].meta.clone();
    meta.remove(TP_RANK_KEY);
    meta.remove(TP_SIZE_KEY);
    write(output, &out, meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::host::{save_host, HostParam};
    use crate::checkpoint::SaveOptions;
    use te_codegen::DType;

    /// A checkpoint of one layer's worth of TE tensors (bf16 weights, f32 biases and an FP8
    /// state, a u64 step), split for TP = 2 and merged back: the same tensors and metadata; the
    /// slices have the sliced shapes.
    #[test]
    fn split_then_merge_is_the_identity() {
        let dir = tempfile::tempdir().unwrap();
        let (heads, d, hidden, ffn) = (4, 8, 32, 64);
        let qkv_rows = 3 * heads * d;
        let vals = |n: usize, k: f32| (0..n).map(|i| (i as f32 * 0.37 + k).sin()).collect::<Vec<f32>>();
        let (qkv_w, qkv_b, proj_w, fc1_w, fc2_w, norm) = (
            vals(qkv_rows * hidden, 1.0),
            vals(qkv_rows, 2.0),
            vals(hidden * hidden, 3.0),
            vals(ffn * hidden, 4.0),
            vals(hidden * ffn, 5.0),
            vals(hidden, 6.0),
        );
        let params = [
            HostParam {
                path: "layers.0.self_attention.layernorm_qkv.weight",
                dtype: DType::BF16,
                shape: &[qkv_rows, hidden],
                values: &qkv_w,
            },
            HostParam {
                path: "layers.0.self_attention.layernorm_qkv.bias",
                dtype: DType::F32,
                shape: &[qkv_rows],
                values: &qkv_b,
            },
            HostParam {
                path: "layers.0.self_attention.layernorm_qkv.layer_norm_weight",
                dtype: DType::BF16,
                shape: &[hidden],
                values: &norm,
            },
            HostParam {
                path: "layers.0.self_attention.proj.weight",
                dtype: DType::BF16,
                shape: &[hidden, hidden],
                values: &proj_w,
            },
            HostParam {
                path: "layers.0.layernorm_mlp.fc1_weight",
                dtype: DType::BF16,
                shape: &[ffn, hidden],
                values: &fc1_w,
            },
            HostParam {
                path: "layers.0.layernorm_mlp.fc2_weight",
                dtype: DType::E4M3,
                shape: &[hidden, ffn],
                values: &fc2_w,
            },
        ];
        let snap = crate::fp8::ScalingSnapshot {
            amax_history: vec![1.0, 2.0, 3.0],
            scale: vec![2.0, 4.0, 1.0],
            scale_inv: vec![0.5, 0.25, 1.0],
            history_len: 1,
        };
        let input = dir.path().join("model.safetensors");
        let mut options = SaveOptions::default();
        options.metadata.insert("step".into(), "7".into());
        save_host(&params, &[("layers.0.layernorm_mlp.fc1_fp8_fwd".into(), snap)], &input, &options).unwrap();
        let layout = TpLayout::new(heads, heads, d, ffn, 2).unwrap();
        let out = dir.path().join("split").join("model.safetensors");
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        let paths = split_file(&input, &layout, &out).unwrap();
        assert_eq!(paths[1], dir.path().join("split").join("model.tp-1-of-2.safetensors"));
        let r1 = File::read(&paths[1]).unwrap();
        assert_eq!(
            (r1.meta[TP_RANK_KEY].as_str(), r1.meta[TP_SIZE_KEY].as_str(), r1.meta["step"].as_str()),
            ("1", "2", "7")
        );
        let st = r1.tensors(&paths[1]).unwrap();
        let shape = |n: &str| st.tensor(n).unwrap().shape().to_vec();
        assert_eq!(shape("layers.0.self_attention.layernorm_qkv.weight"), [qkv_rows / 2, hidden]);
        assert_eq!(shape("layers.0.self_attention.proj.weight"), [hidden, hidden / 2]);
        assert_eq!(shape("layers.0.layernorm_mlp.fc1_weight"), [ffn / 2, hidden]);
        assert_eq!(shape("layers.0.layernorm_mlp.fc2_weight"), [hidden, ffn / 2]);
        assert_eq!(shape("layers.0.layernorm_mlp.fc1_fp8_fwd.amax_history"), [3, 1]);
        let merged = dir.path().join("merged.safetensors");
        merge_files(&paths, &layout, &merged).unwrap();
        let (a, b) = (File::read(&input).unwrap(), File::read(&merged).unwrap());
        assert_eq!(a.meta, b.meta);
        let (sa, sb) = (a.tensors(&input).unwrap(), b.tensors(&merged).unwrap());
        let mut names = sa.names();
        names.sort();
        let mut names_b = sb.names();
        names_b.sort();
        assert_eq!(names, names_b);
        for n in names {
            let (ta, tb) = (sa.tensor(n).unwrap(), sb.tensor(n).unwrap());
            assert_eq!((ta.dtype(), ta.shape(), ta.data()), (tb.dtype(), tb.shape(), tb.data()), "{n}");
        }
        // Errors: files out of order, too few, a split file split again, a layout that does
        // not divide.
        let swapped = [paths[1].clone(), paths[0].clone()];
        assert!(merge_files(&swapped, &layout, &merged).unwrap_err().to_string().contains("rank order"));
        assert!(merge_files(&paths[..1], &layout, &merged).unwrap_err().to_string().contains("every rank"));
        assert!(split_file(&paths[0], &layout, &out).unwrap_err().to_string().contains("merge it first"));
        let three = TpLayout { size: 3, ..layout };
        let e = split_file(&input, &three, &out).unwrap_err().to_string();
        assert!(e.contains("does not split over 3"), "{e}");
    }
}
