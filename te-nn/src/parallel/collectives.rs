//! Process-group plumbing the parallel hooks share: the collectives along the first (token)
//! dim of an activation, run on the group's stream and waited for, in the tensor's own dtype.
//! [`super::GemmParallel`] and [`super::SequenceParallel`] call them; the process groups are
//! `te_runtime::dist`'s, their layout [`super::DeviceMesh`]'s.

use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::{Error, Result, Tensor};

/// Every rank's `x [d0, ...]` concatenated in rank order along the first dim:
/// `[size · d0, ...]` (NCCL all-gather).
///
/// # Errors
/// NCCL and allocation errors.
pub(crate) fn all_gather_rows(group: &ProcessGroup, x: &Tensor) -> Result<Tensor> {
    let mut out = Tensor::empty(group.device(), x.dtype(), &gathered_shape(x.shape(), group.size()))?;
    group.all_gather(x, &mut out)?;
    group.wait()?;
    Ok(out)
}

/// The sum of every rank's partial `x`: whole on every rank (all-reduce, in place), or with
/// `scatter` this rank's shard of it along the first dim (reduce-scatter: `[d0 / size, ...]`).
///
/// # Errors
/// [`Error::Shape`] naming `module` for a first dim that does not divide by the group's size
/// (`scatter`); NCCL and allocation errors.
pub(crate) fn sum_rows(group: &ProcessGroup, module: &'static str, mut x: Tensor, scatter: bool) -> Result<Tensor> {
    if !scatter {
        group.all_reduce(&mut x, ReduceOp::Sum)?;
        group.wait()?;
        return Ok(x);
    }
    let shape = scattered_shape(module, x.shape(), group.size())?;
    let mut out = Tensor::empty(group.device(), x.dtype(), &shape)?;
    group.reduce_scatter(&x, &mut out, ReduceOp::Sum)?;
    group.wait()?;
    Ok(out)
}

/// `shape` with its first dim times `size`: the whole of `size` ranks' shards.
pub(crate) fn gathered_shape(shape: &[usize], size: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    if let Some(d0) = out.first_mut() {
        *d0 *= size;
    }
    out
}

/// `shape` with its first dim over `size`: one rank's shard of it.
///
/// # Errors
/// [`Error::Shape`] naming `module` when the first dim does not divide by `size` (or there is
/// none).
pub(crate) fn scattered_shape(module: &'static str, shape: &[usize], size: usize) -> Result<Vec<usize>> {
    let mut out = shape.to_vec();
    match out.first_mut() {
        Some(d0) if size > 0 && *d0 % size == 0 => {
            *d0 /= size;
            Ok(out)
        }
        _ => Err(Error::Shape {
            op: module,
            message: format!(
                "sequence parallelism splits the first dim of {shape:?} over {size} ranks: make it a multiple of {size}"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gathering multiplies the first dim by the group's size, scattering divides it; a first
    /// dim that does not divide is a typed error naming the module and what to change.
    #[test]
    fn first_dim_shapes_of_gather_and_scatter() {
        assert_eq!(gathered_shape(&[16, 2, 64], 4), [64, 2, 64]);
        assert_eq!(gathered_shape(&[], 4), [0usize; 0]);
        assert_eq!(scattered_shape("m", &[64, 2, 64], 4).unwrap(), [16, 2, 64]);
        let e = scattered_shape("LayerNormMLP", &[30, 64], 4).unwrap_err().to_string();
        assert!(
            e.contains("LayerNormMLP") && e.contains("[30, 64] over 4 ranks") && e.contains("multiple of 4"),
            "{e}"
        );
        assert!(scattered_shape("m", &[], 2).is_err());
        assert!(scattered_shape("m", &[4], 0).is_err());
    }
}
