//! The backward of a [`DecoderLm`]: the LM head, the final norm, the layers from the last to
//! the first (each recomputed first under activation recompute, gathered first under ZeRO-3),
//! the embedding; each part handed to a hook once its gradients are complete.

use super::recompute;
use super::{DecoderLm, DecoderLmCtx, Dlogits, MODEL};
use te_nn::modules::{Linear, LinearCtx, Module};
use te_runtime::ops::elementwise::scale_assign;
use te_runtime::{Error, Result};

impl DecoderLm {
    /// Backward of the loss: every parameter gradient accumulates (call
    /// [`te_nn::Module::zero_grad`] between steps); a tied head's weight gradient goes to the
    /// embedding's.
    ///
    /// # Errors
    /// [`Error::Context`] for a context of another model or one made before a weight update;
    /// the modules' errors.
    pub fn backward(&mut self, ctx: DecoderLmCtx) -> Result<()> {
        self.backward_with(ctx, &mut |_| Ok(()))
    }

    /// [`DecoderLm::backward`] that calls `grads_ready` with each part once its gradients of
    /// this backward are complete, in the order they complete: an untied LM head, the final
    /// norm, the layers from the last to the first, the embedding (with a tied head's share);
    /// a data-parallel step starts each part's gradient reduction there, as `Gpt::backward_with`.
    ///
    /// # Errors
    /// As [`DecoderLm::backward`]; the hook's first error (the backward stops there).
    pub fn backward_with(
        &mut self,
        ctx: DecoderLmCtx,
        grads_ready: &mut dyn FnMut(&mut dyn Module) -> Result<()>,
    ) -> Result<()> {
        let head_backward = |head: &mut Linear, dlogits: Dlogits, lm_head: LinearCtx| match dlogits {
            Dlogits::High(d) => head.backward(lm_head, &d),
            Dlogits::Fp8 { mut dy8, dtype } => {
                dy8.ensure_transpose(&self.dev)?;
                head.backward_fp8(lm_head, &dy8, dtype)
            }
        };
        let d = match (&mut self.lm_head, &mut self.tied_head) {
            (Some(head), _) => {
                let d = head_backward(head, ctx.dlogits, ctx.lm_head)?;
                grads_ready(head)?;
                d
            }
            (None, Some(tied)) => {
                let d = head_backward(tied, ctx.dlogits, ctx.lm_head)?;
                if let Some(g) = tied.params_mut().take_weight_grad() {
                    self.embedding.accumulate_weight_grad(g)?;
                }
                d
            }
            (None, None) => return Err(Error::internal(MODEL, "no LM head")),
        };
        let mut d = self.final_norm.backward(ctx.final_norm, &d.reshape(&ctx.shape)?)?;
        grads_ready(&mut self.final_norm)?;
        let mut saved = ctx.layers;
        if saved.len() != self.layers.len() {
            return Err(Error::Context {
                module: MODEL,
                message: format!("a context of {} layers for a model of {}", saved.len(), self.layers.len()),
            });
        }
        while let Some(s) = saved.pop() {
            // Layer l − 1's offloaded input comes back while layer l's backward runs.
            if let Some(prev) = saved.last_mut() {
                prev.prefetch()?;
            }
            let l = saved.len();
            let layer = &mut self.layers[l];
            // ZeRO-3: the layer's weights for its recomputed forward and backward, the layer
            // below's gather started; released once its gradients are handed over.
            if let Some(z) = &mut self.zero3 {
                z.enter(l, layer, l.checked_sub(1))?;
            }
            d = recompute::backward_layer(layer, s, &d, ctx.inputs.as_ref())?;
            grads_ready(layer)?;
            if let Some(z) = &mut self.zero3 {
                z.leave(l, layer)?;
            }
        }
        let scale = self.cfg.embedding_scale(self.dtype);
        if scale != 1.0 {
            scale_assign(&self.dev, &mut d, scale)?;
        }
        self.embedding.backward(ctx.tokens, &d)?;
        grads_ready(&mut self.embedding)
    }
}
