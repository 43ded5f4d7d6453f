//! [`InferenceParams`] (TE's name, `pytorch/attention/inference.py`): the KV cache of every
//! attention layer of a model for generation, preallocated, with the cached lengths on the
//! device so that a decode step's kernels (captured in a CUDA graph once) read where they are.
//!
//! A step of `s` new tokens per sequence: [`InferenceParams::begin_step`] (uploads the lengths
//! the step ends at: a host transfer, before a capture or a replay), the model's cached forward
//! (each attention layer appends its keys and values and attends over the cache,
//! `MultiheadAttention::infer_cached`), [`InferenceParams::end_step`]. The first step (the
//! prompt, the prefill) runs the normal attention over the new tokens; each later step takes
//! one token per sequence and runs the decode kernels (`ops::decode_attention`).

use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::decode_attention::{append_kv, append_kv_fp8, decode, decode_fp8, KvScales, Strided};
use te_runtime::{Device, Error, Result, Tensor};

const OP: &str = "InferenceParams";

/// The KV cache of a model: per attention layer `k` and `v` `[batch, capacity, groups,
/// head_dim]`, and the tokens cached per sequence (all sequences of a batch advance together).
#[derive(Debug)]
pub struct InferenceParams {
    dev: Arc<Device>,
    batch: usize,
    capacity: usize,
    groups: usize,
    head_dim: usize,
    layers: Vec<[Tensor; 2]>,
    /// An E4M3 cache's scales, f32 `[4]`: `k_scale, v_scale, k_scale_inv, v_scale_inv` (every
    /// layer's; [`InferenceParams::set_kv_scales`]).
    kv_scales: Option<CudaSlice<f32>>,
    /// i32 `[batch]`: the lengths after the step in flight.
    seqlens: CudaSlice<i32>,
    /// Tokens cached per sequence before the step in flight.
    len: usize,
    /// New tokens per sequence of the step begun (0: none).
    pending: usize,
}

/// One layer's view of the cache for a step: its keys and values, the device lengths after the
/// step, and the tokens cached before it.
#[derive(Debug)]
pub struct KvLayer<'a> {
    /// Keys `[batch, capacity, groups, head_dim]`.
    pub k: &'a mut Tensor,
    /// Values, as `k`.
    pub v: &'a mut Tensor,
    /// i32 `[batch]`: tokens per sequence once the step's are appended.
    pub seqlens: &'a CudaSlice<i32>,
    /// Tokens per sequence cached before the step.
    pub past: usize,
    /// New tokens per sequence of the step.
    pub new: usize,
    /// `[batch, capacity, groups, head_dim]` of `k` and `v`.
    pub shape: [usize; 4],
    /// The scales of an E4M3 cache (`None`: the cache holds the model's 16-bit dtype).
    pub scales: Option<KvScales<'a>>,
}

impl KvLayer<'_> {
    /// The decode kernels' problem ([`AttentionShape::decode`]) for `heads` query heads with
    /// `scale`.
    pub(crate) fn params(&self, heads: usize, scale: f32) -> AttentionShape {
        let [batch, capacity, groups, head_dim] = self.shape;
        AttentionShape::decode(batch, heads, groups, head_dim, capacity, scale)
    }

    /// Writes the step's `s` new keys and values per sequence (`new`: rows of the fused QKV
    /// projection) into the cache of the decode shape `p` ([`append_kv`], or
    /// [`append_kv_fp8`] into an E4M3 cache).
    ///
    /// # Errors
    /// The launcher's.
    pub fn append(&mut self, dev: &Device, p: &AttentionShape, s: usize, new: [Strided<'_>; 2]) -> Result<()> {
        let cache = [&mut *self.k, &mut *self.v];
        match self.scales {
            Some(sc) => append_kv_fp8(dev, p, s, new, self.seqlens, cache, sc),
            None => append_kv(dev, p, s, new, self.seqlens, cache),
        }
    }

    /// One query per sequence and head `q` over the cached tokens into `out` ([`decode`], or
    /// [`decode_fp8`] over an E4M3 cache).
    ///
    /// # Errors
    /// The launcher's.
    pub fn attend(&self, dev: &Device, p: &AttentionShape, q: Strided<'_>, out: (&mut Tensor, usize)) -> Result<()> {
        let cache = [&*self.k, &*self.v];
        match self.scales {
            Some(sc) => decode_fp8(dev, p, q, cache, sc, self.seqlens, out),
            None => decode(dev, p, q, cache, self.seqlens, out),
        }
    }
}

impl InferenceParams {
    /// Caches for `num_layers` attention layers of `groups` key/value heads of `head_dim`
    /// channels, `batch` sequences of up to `capacity` tokens each (prompt and generated), in
    /// `dtype`: the model's (bf16 or f16), or E4M3 codes (vLLM's `kv_cache_dtype="fp8"`: half
    /// the bytes; per-tensor scales 1 until [`InferenceParams::set_kv_scales`], the queries stay
    /// 16-bit): `2 · num_layers · batch · capacity · groups · head_dim` elements.
    ///
    /// # Errors
    /// [`Error::Shape`] for a zero size or a head dim the decode kernels do not take (a multiple
    /// of 8 up to 256); [`Error::DType`] for a dtype other than bf16, f16 or e4m3; out of
    /// memory.
    pub fn new(
        dev: &Arc<Device>,
        num_layers: usize,
        batch: usize,
        capacity: usize,
        [groups, head_dim]: [usize; 2],
        dtype: DType,
    ) -> Result<Self> {
        if num_layers == 0 || batch == 0 || capacity == 0 || groups == 0 {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "layers {num_layers}, batch {batch}, capacity {capacity} and groups {groups} must all be ≥ 1"
                ),
            });
        }
        if head_dim == 0 || head_dim % 8 != 0 || head_dim > te_codegen::spec::DECODE_MAX_HEAD_DIM {
            return Err(Error::Shape {
                op: OP,
                message: format!("head_dim = {head_dim}: the decode kernels take multiples of 8 up to 256"),
            });
        }
        if !matches!(dtype, DType::BF16 | DType::F16 | DType::E4M3) {
            return Err(Error::DType { op: OP, arg: "dtype", expected: "bf16, f16 or e4m3".into(), got: dtype });
        }
        let kv_scales = (dtype == DType::E4M3).then(|| dev.stream().htod(&[1.0f32; 4])).transpose()?;
        let shape = [batch, capacity, groups, head_dim];
        let layers = (0..num_layers)
            .map(|_| Ok([Tensor::zeros(dev, dtype, &shape)?, Tensor::zeros(dev, dtype, &shape)?]))
            .collect::<Result<Vec<_>>>()?;
        let seqlens = dev.stream().alloc_zeros::<i32>(batch)?;
        Ok(Self { dev: dev.clone(), batch, capacity, groups, head_dim, layers, kv_scales, seqlens, len: 0, pending: 0 })
    }

    /// The per-tensor scales of an E4M3 cache: keys are stored as `E4M3(k · k_scale)` and read
    /// as `code / k_scale` (values likewise), so `448 / k_scale` is the largest key kept (1, the
    /// default: values up to 448, as an uncalibrated vLLM cache). For every layer, from the
    /// next append on (tokens cached before keep the scales they were stored with: set them
    /// before the prompt). Device memory, so a captured decode step reads the new values. A host
    /// upload: not inside a capture.
    ///
    /// # Errors
    /// [`Error::Config`] for a 16-bit cache; [`Error::Argument`] for scales that are not finite
    /// and positive; [`Error::Capture`] inside a capture; copy failures.
    pub fn set_kv_scales(&mut self, k_scale: f32, v_scale: f32) -> Result<()> {
        let Some(buf) = self.kv_scales.as_mut() else {
            return Err(Error::Config {
                module: OP,
                message: "the cache holds the model's 16-bit dtype: scales are for an e4m3 cache".into(),
            });
        };
        let values = KvScales::values(k_scale, v_scale)?;
        let stream = self.dev.stream();
        te_runtime::graph::refuse_in_capture(stream, "InferenceParams::set_kv_scales")?;
        stream.memcpy_htod(&values, buf)?;
        Ok(())
    }

    /// The cache's dtype: the model's, or E4M3.
    pub fn dtype(&self) -> DType {
        self.layers.first().map_or(DType::BF16, |[k, _]| k.dtype())
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per sequence the cache holds at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tokens cached per sequence (the position of the next one).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no token is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets every cached token (the memory stays, for the next sequences).
    pub fn reset(&mut self) {
        self.len = 0;
        self.pending = 0;
    }

    /// Begins a step of `s` new tokens per sequence: uploads the lengths it ends at. A host
    /// transfer: call it before a graph capture or replay of the step, not inside one.
    ///
    /// # Errors
    /// [`Error::Shape`] for `s = 0` or more tokens than the cache has room for;
    /// [`Error::Argument`] when a step is already begun; [`Error::Capture`] inside a capture.
    pub fn begin_step(&mut self, s: usize) -> Result<()> {
        if self.pending != 0 {
            return Err(Error::Argument { op: OP, message: "a step is already begun: end it first".into() });
        }
        if s == 0 || self.len + s > self.capacity {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "{s} new tokens per sequence with {} cached do not fit the capacity of {}: make the cache for the \
                     prompt and every new token",
                    self.len, self.capacity
                ),
            });
        }
        let stream = self.dev.stream();
        te_runtime::graph::refuse_in_capture(stream, "InferenceParams::begin_step")?;
        let lens = vec![(self.len + s) as i32; self.batch];
        stream.memcpy_htod(&lens, &mut self.seqlens)?;
        self.pending = s;
        Ok(())
    }

    /// Ends the step begun: its tokens count as cached.
    pub fn end_step(&mut self) {
        self.len += self.pending;
        self.pending = 0;
    }

    /// New tokens per sequence of the step begun (0: none).
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// Layer `l`'s cache for the step begun.
    ///
    /// # Errors
    /// [`Error::Argument`] without a step begun; [`Error::Shape`] for a layer the cache does not
    /// have.
    pub fn layer(&mut self, l: usize) -> Result<KvLayer<'_>> {
        if self.pending == 0 {
            return Err(Error::Argument {
                op: OP,
                message: "no step begun: call begin_step(new tokens) before the cached forward".into(),
            });
        }
        let n = self.layers.len();
        let Some([k, v]) = self.layers.get_mut(l) else {
            return Err(Error::Shape { op: OP, message: format!("layer {l} of a cache of {n} layers") });
        };
        let shape = [self.batch, self.capacity, self.groups, self.head_dim];
        let scales = self.kv_scales.as_ref().map(KvScales);
        Ok(KvLayer { k, v, seqlens: &self.seqlens, past: self.len, new: self.pending, shape, scales })
    }

    /// `[groups, head_dim]` of the cached heads.
    pub fn head_shape(&self) -> [usize; 2] {
        [self.groups, self.head_dim]
    }

    /// Layers cached.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
}
