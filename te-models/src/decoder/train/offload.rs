//! CPU offload of a [`DecoderLm`]'s saved layer inputs ([`DecoderLm::set_offload_activations`];
//! TE's `get_cpu_offload_context`): under full recompute the inputs of the first `n` layers go
//! to pinned host memory during the forward and come back, a layer ahead, in the backward
//! (`te_runtime::offload`), and the memory estimate that accounts for it.

use super::DecoderLm;
use crate::decoder::DecoderConfig;
use te_nn::modules::Recompute;
use te_runtime::offload::OffloadPlan;
use te_runtime::Result;

impl DecoderLm {
    /// Offloads the saved inputs (`[s, b, hidden]` in the model's dtype) of the first `n`
    /// layers to pinned host memory (TE's `get_cpu_offload_context` with `num_layers = n`;
    /// `n = num_layers − 1`, all but the last, is the usual setting; 0 turns it off). Each input
    /// is copied out on a side stream after the kernel that wrote it, its device copy freed
    /// (stream ordered) once the copy finished and the next layer's forward was issued, and
    /// copied back while the backward of the layer above runs. The values only travel: training
    /// is the same bit for bit. Pinned buffers are allocated once per shape and reused across
    /// steps ([`DecoderLm::offload_pinned_bytes`]); no host synchronization but the first
    /// step's `cuMemHostAlloc`.
    ///
    /// Built for [`Recompute::Full`] (what a layer saves is its input only); the forward refuses
    /// it without ([`te_runtime::Error::Config`]: add `Recompute::Full`, `te train --recompute full`).
    ///
    /// # Errors
    /// [`te_runtime::Error::Config`] for `n` above the layer count; driver failures creating the side
    /// stream.
    pub fn set_offload_activations(&mut self, n: usize) -> Result<()> {
        let layers = self.layers.len();
        self.offload.set(&self.dev, layers, n)
    }

    /// The layers whose inputs are offloaded ([`DecoderLm::set_offload_activations`]; 0: none).
    pub fn offload_activations(&self) -> usize {
        self.offload.layers()
    }

    /// Bytes of pinned host memory the offload holds (0 before the first forward with offload).
    pub fn offload_pinned_bytes(&self) -> u64 {
        self.offload.pinned_bytes()
    }

    /// The plan of the next forward, checked against the recompute mode.
    pub(super) fn offload_plan(&self) -> Result<OffloadPlan> {
        OffloadPlan::for_forward("DecoderLm", self.layers.len(), self.offload_activations(), self.recompute.is_full())
    }

    /// [`DecoderLm::training_bytes_with`] with the inputs of the first `offloaded` layers in
    /// host memory (full recompute): the device keeps the other layers' inputs and two
    /// offloaded ones in flight (`t · h` 16-bit elements each). Without full recompute, or with
    /// nothing offloaded, the plain estimate.
    pub fn training_bytes_offloaded(
        cfg: &DecoderConfig,
        batch: usize,
        seq: usize,
        fp8: bool,
        mode: Recompute,
        offloaded: usize,
    ) -> u64 {
        let base = Self::training_bytes_with(cfg, batch, seq, fp8, mode);
        if !mode.is_full() || offloaded == 0 {
            return base;
        }
        let input = (batch as f64 * seq as f64 * cfg.hidden_size as f64 * 2.0) as u64;
        OffloadPlan::device_estimate(base, cfg.num_layers, offloaded, input)
    }

    /// Host bytes the offload pins for the inputs of `offloaded` layers (`t · h` 16-bit
    /// elements each).
    pub fn offload_host_bytes(cfg: &DecoderConfig, batch: usize, seq: usize, offloaded: usize) -> u64 {
        (batch as f64 * seq as f64 * cfg.hidden_size as f64 * 2.0) as u64 * offloaded.min(cfg.num_layers) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> DecoderConfig {
        let json = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
         "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 8192, "hidden_act": "silu"}"#;
        DecoderConfig::from_hf_json(json).unwrap()
    }

    #[test]
    fn offloaded_inputs_leave_the_device_estimate_but_two_in_flight() {
        let cfg = cfg();
        let full = Recompute::Full;
        let base = DecoderLm::training_bytes_with(&cfg, 2, 4096, true, full);
        let input = 2 * 4096 * 4096 * 2u64;
        assert_eq!(DecoderLm::training_bytes_offloaded(&cfg, 2, 4096, true, full, 0), base);
        assert_eq!(DecoderLm::training_bytes_offloaded(&cfg, 2, 4096, true, full, 1), base);
        // All but the last: 31 inputs leave, two of them are in flight at a time.
        assert_eq!(DecoderLm::training_bytes_offloaded(&cfg, 2, 4096, true, full, 31), base - 29 * input);
        assert_eq!(DecoderLm::offload_host_bytes(&cfg, 2, 4096, 31), 31 * input);
        // Without full recompute nothing is offloaded.
        let none = Recompute::None;
        assert_eq!(
            DecoderLm::training_bytes_offloaded(&cfg, 2, 4096, true, none, 31),
            DecoderLm::training_bytes_with(&cfg, 2, 4096, true, none)
        );
    }
}
