//! Context parallelism in [`MultiheadAttention`] (TE's `set_context_parallel_group` of
//! `MultiheadAttention`, Megatron-LM's `--context-parallel-size`): the hidden states are this
//! rank's `2c` tokens of every sequence ([`ContextParallel::shard`]'s layout), the projections,
//! the q/k norms and RoPE run on them as they are (the caller gives the rotary angles of the
//! tokens' global positions, [`ContextParallel::positions`]), and the attention runs through
//! [`DotProductAttention::forward_context_parallel`] over every rank's keys and values (passed
//! around the ring or all-gathered, as the group's [`ContextParallel::comm_type`] says).

use super::{AttentionInputs, MultiheadAttention, MODULE};
use crate::modules::attention::{AttnMaskType, CpAttentionCtx, QkvFormat};
use crate::parallel::ContextParallel;
use te_runtime::{Error, Result, Tensor};

impl MultiheadAttention {
    /// Splits every sequence of the next forwards over `cp`'s ranks (`None`: the whole
    /// sequence on this rank, the default). The hidden states are then each rank's part
    /// `[2c, b, hidden]` (its chunks `r` and `2·cp − 1 − r`, [`ContextParallel::shard`]), the
    /// rotary angles `[2c, d]` those of the tokens' global positions, and the output this
    /// rank's rows of the whole sequence's; the attention is TE's context parallelism with the
    /// group's `cp_comm_type` (the ring or the all-gather, [`ContextParallel::comm_type`]; a
    /// causal mask runs as [`AttnMaskType::CausalBottomRight`] at each chunk's global position).
    /// Every rank of `cp` runs the same forwards and backwards.
    ///
    /// # Errors
    /// [`Error::Config`] for what is not built with context parallelism: tensor parallelism
    /// (`tp`), `bshd` hidden states, a padding mask (a mask other than `causal`,
    /// `causal_bottom_right` or `no_mask`).
    pub fn set_context_parallel(&mut self, cp: Option<ContextParallel>) -> Result<()> {
        let config = |message: String| Err(Error::Config { module: MODULE, message });
        let mask = self.cfg.attn_mask_type;
        let Some(cp) = cp else {
            self.attention.set_attn_mask_type(mask)?;
            self.cp = None;
            return Ok(());
        };
        if self.cfg.tp.as_ref().is_some_and(|tp| tp.size() > 1) {
            return config("context parallelism with tensor parallelism is not built yet: use one of them".into());
        }
        if self.cfg.qkv_format != QkvFormat::Sbhd {
            return config(format!(
                "context parallelism splits the sequence, the first dim of sbhd hidden states: use qkv_format sbhd, \
                 not {:?}",
                self.cfg.qkv_format
            ));
        }
        let run_as = match mask {
            AttnMaskType::Causal | AttnMaskType::CausalBottomRight => AttnMaskType::CausalBottomRight,
            AttnMaskType::NoMask => AttnMaskType::NoMask,
            other => {
                return config(format!(
                    "attn_mask_type {} with context parallelism is not built: use causal or no_mask",
                    other.name()
                ))
            }
        };
        self.attention.set_attn_mask_type(run_as)?;
        self.cp = Some(cp);
        Ok(())
    }

    /// The context-parallel group of [`MultiheadAttention::set_context_parallel`].
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.cp.as_ref()
    }

    /// The backward of the context-parallel attention: `(dq, dk, dv)` of this rank's tokens.
    pub(super) fn backward_context_parallel(
        &mut self,
        ctx: CpAttentionCtx,
        d_ctx: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let cp = self.cp.clone().ok_or_else(|| Error::Context {
            module: MODULE,
            message: "a context-parallel forward's context after set_context_parallel(None)".into(),
        })?;
        self.attention.backward_context_parallel(&cp, ctx, d_ctx)
    }
}

/// The inputs a context-parallel forward takes: no packed documents (`thd`) and no padding
/// lengths.
pub(super) fn check_inputs(cp: Option<&ContextParallel>, inputs: &AttentionInputs<'_>) -> Result<()> {
    if cp.is_some() && (inputs.thd.is_some() || inputs.seq_lens.is_some() || inputs.padding.is_some()) {
        return Err(Error::Config {
            module: MODULE,
            message: "context parallelism takes dense sequences: packed documents (thd) and padding lengths are not \
                      built with it"
                .into(),
        });
    }
    Ok(())
}
