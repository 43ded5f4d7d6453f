//! CPU offload of a [`Gpt`]'s saved layer inputs ([`Gpt::set_offload_activations`]; TE's
//! `get_cpu_offload_context`): under full recompute the inputs of the first `n` layers go to
//! pinned host memory during the forward and come back, a layer ahead, in the backward
//! (`te_runtime::offload`), and the memory estimate that accounts for it.

use super::{Gpt, GptConfig, MODEL};
use te_nn::modules::Recompute;
use te_runtime::offload::OffloadPlan;
use te_runtime::Result;

/// The plan of a forward of `layers` offloading `n`, checked against the recompute mode.
pub(super) fn plan(layers: usize, mode: Recompute, n: usize) -> Result<OffloadPlan> {
    OffloadPlan::for_forward(MODEL, layers, n, mode.is_full())
}

impl Gpt {
    /// Offloads the saved inputs (`[s, b, hidden]` in `params_dtype`; sequence parallel: this
    /// rank's positions) of the first `n` layers to pinned host memory, as
    /// `crate::decoder::train::DecoderLm::set_offload_activations` does (TE's
    /// `get_cpu_offload_context` with `num_layers = n`; 0 turns it off): copied out on a side
    /// stream after the layer's forward, the device copy freed (stream ordered) once the copy
    /// finished and the next layer's forward was issued, copied back while the backward of the
    /// layer above runs. The same steps bit for bit (dropout masks included); pinned buffers
    /// allocated once per shape and reused ([`Gpt::offload_pinned_bytes`]). Built for
    /// [`Recompute::Full`]: the forward refuses it without ([`te_runtime::Error::Config`]).
    ///
    /// # Errors
    /// [`te_runtime::Error::Config`] for `n` above the layer count; driver failures creating the side
    /// stream.
    pub fn set_offload_activations(&mut self, n: usize) -> Result<()> {
        let layers = self.layers.len();
        self.offload.set(&self.dev, layers, n)
    }

    /// The layers whose inputs are offloaded ([`Gpt::set_offload_activations`]; 0: none).
    pub fn offload_activations(&self) -> usize {
        self.offload.layers()
    }

    /// Bytes of pinned host memory the offload holds (0 before the first forward with offload).
    pub fn offload_pinned_bytes(&self) -> u64 {
        self.offload.pinned_bytes()
    }

    /// [`Gpt::training_bytes_with`] under full recompute with the inputs of the first
    /// `offloaded` layers in host memory: the device keeps the other layers' inputs and two
    /// offloaded ones in flight (`t · h` elements of `params_dtype` each, over `tp` ranks as the
    /// estimate's activations are). Without full recompute, or with nothing offloaded, the
    /// plain estimate.
    pub fn training_bytes_offloaded(
        cfg: &GptConfig,
        batch: usize,
        fp8: bool,
        tp: usize,
        mode: Recompute,
        offloaded: usize,
    ) -> u64 {
        let base = Self::training_bytes_with(cfg, batch, fp8, tp, mode);
        if !mode.is_full() || offloaded == 0 {
            return base;
        }
        let t = batch as f64 * cfg.seq_length as f64;
        let input = (t * cfg.hidden_size as f64 * cfg.params_dtype.size_bytes() as f64 / tp.max(1) as f64) as u64;
        OffloadPlan::device_estimate(base, cfg.num_layers, offloaded, input)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offloaded_inputs_leave_the_gpt_estimate_but_two_in_flight() {
        let small = GptConfig::small();
        let full = Recompute::Full;
        let base = Gpt::training_bytes_with(&small, 8, true, 1, full);
        let input = 8 * 1024 * 768 * small.params_dtype.size_bytes() as u64;
        assert_eq!(Gpt::training_bytes_offloaded(&small, 8, true, 1, full, 0), base);
        assert_eq!(Gpt::training_bytes_offloaded(&small, 8, true, 1, full, 11), base - 9 * input);
        let none = Recompute::None;
        assert_eq!(
            Gpt::training_bytes_offloaded(&small, 8, true, 1, none, 11),
            Gpt::training_bytes_with(&small, 8, true, 1, none)
        );
        let e = plan(12, none, 3).unwrap_err().to_string();
        assert!(e.contains("Recompute::Full"), "{e}");
        assert!(plan(12, full, 13).is_err());
    }
}
