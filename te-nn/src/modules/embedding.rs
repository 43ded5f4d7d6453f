//! `Embedding` (PyTorch `nn.Embedding`, Megatron's word and position embeddings): a lookup
//! table `[num_embeddings, embedding_dim]` indexed by [`TokenIds`], with its gradient
//! accumulated by the deterministic scatter-add of [`te_runtime::ops::embedding`].

use super::init::normal;
use super::token_ids::TokenIds;
use super::visit::{join_path, Module, ModuleVisitor, ModuleVisitorMut, Param, ParamKind, ParamMut};
use super::{next_module_id, KernelSpec, KernelTarget, Stamp};
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::ops::elementwise::add_assign;
use te_runtime::ops::embedding::{embedding_backward, embedding_forward, EmbeddingGradIndex};
use te_runtime::ops::{check_dtype, check_shape};
use te_runtime::{Device, Error, Result, Tensor};

const MODULE: &str = "Embedding";

/// Arguments of [`Embedding::new`].
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingConfig {
    /// Rows of the table (the vocabulary, or the longest sequence for positions).
    pub num_embeddings: usize,
    /// Width of a row (the model's hidden size).
    pub embedding_dim: usize,
    /// Dtype of the table and its gradient: f32, bf16 or f16. Default BF16.
    pub params_dtype: DType,
    /// Init `N(0, init_std)`. Default 0.02 (GPT-2's word embedding; its positions use 0.01).
    pub init_std: f32,
    /// Init seed.
    pub seed: u64,
}

impl EmbeddingConfig {
    /// A `[num_embeddings, embedding_dim]` BF16 table initialized `N(0, 0.02)` from seed 0.
    pub fn new(num_embeddings: usize, embedding_dim: usize) -> Self {
        Self { num_embeddings, embedding_dim, params_dtype: DType::BF16, init_std: 0.02, seed: 0 }
    }
}

/// What [`Embedding::forward`] saves for [`Embedding::backward`]: the ids (shared).
#[derive(Debug)]
pub struct EmbeddingCtx {
    stamp: Stamp<1>,
    ids: TokenIds,
    index: Arc<EmbeddingGradIndex>,
}

/// A lookup table: `forward(ids [..]) = weight[ids] [.., embedding_dim]` in `params_dtype`
/// (also under `fp8_autocast`: a lookup has no GEMM). Ids outside `[0, num_embeddings)` give
/// zero rows and no gradient. The weight gradient accumulates over backwards in `params_dtype`
/// (each backward sums its tokens in f32 and adds once).
#[derive(Debug)]
pub struct Embedding {
    dev: Arc<Device>,
    id: u64,
    cfg: EmbeddingConfig,
    weight: Tensor,
    grad: Option<Tensor>,
    version: u64,
}

impl Embedding {
    /// A table initialized `N(0, init_std)`.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty table or a non-high-precision dtype; allocation failures.
    pub fn new(dev: &Arc<Device>, cfg: EmbeddingConfig) -> Result<Self> {
        let config = |message: String| Error::Config { module: MODULE, message };
        if cfg.num_embeddings == 0 || cfg.embedding_dim == 0 {
            return Err(config(format!(
                "num_embeddings = {} and embedding_dim = {} must be ≥ 1",
                cfg.num_embeddings, cfg.embedding_dim
            )));
        }
        if !cfg.params_dtype.is_high_precision() {
            return Err(config(format!("params_dtype must be f32, bf16 or f16, got {}", cfg.params_dtype)));
        }
        let shape = [cfg.num_embeddings, cfg.embedding_dim];
        let weight =
            Tensor::from_f32(dev, cfg.params_dtype, &shape, &normal(shape[0] * shape[1], cfg.init_std, cfg.seed))?;
        Ok(Self { dev: dev.clone(), id: next_module_id(), cfg, weight, grad: None, version: 0 })
    }

    /// The configuration.
    pub fn config(&self) -> &EmbeddingConfig {
        &self.cfg
    }

    /// The table `[num_embeddings, embedding_dim]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The accumulated gradient of the table (`params_dtype`), `None` before the first backward.
    pub fn weight_grad(&self) -> Option<&Tensor> {
        self.grad.as_ref()
    }

    /// Replaces the table; contexts saved before are refused afterwards.
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] unless `[num_embeddings, embedding_dim]` of
    /// `params_dtype`.
    pub fn set_weight(&mut self, weight: Tensor) -> Result<()> {
        let dt = self.cfg.params_dtype;
        check_dtype(MODULE, "weight", &weight, |d| d == dt, &format!("{dt} (params_dtype)"))?;
        check_shape(MODULE, "weight", &weight, &[self.cfg.num_embeddings, self.cfg.embedding_dim])?;
        self.weight = weight;
        self.version += 1;
        Ok(())
    }

    /// Adds `g` (`[num_embeddings, embedding_dim]`, any high-precision dtype) to the accumulated
    /// gradient: a tied LM head's weight gradient (the head's GEMM reads this table). Taken
    /// over as the accumulator, without a copy, when none is held yet and `g` is of
    /// `params_dtype`.
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] for a `g` of another shape or an FP8 one; kernel
    /// failures.
    pub fn accumulate_weight_grad(&mut self, g: Tensor) -> Result<()> {
        check_shape(MODULE, "weight_grad", &g, self.weight.shape())?;
        match &mut self.grad {
            Some(acc) => add_assign(&self.dev, acc, &g),
            None if g.dtype() == self.cfg.params_dtype => {
                self.grad = Some(g);
                Ok(())
            }
            None => {
                let mut acc = Tensor::zeros(&self.dev, self.cfg.params_dtype, self.weight.shape())?;
                add_assign(&self.dev, &mut acc, &g)?;
                self.grad = Some(acc);
                Ok(())
            }
        }
    }

    /// Writes of the table since creation ([`Embedding::set_weight`]): a reader of the table
    /// (a tied LM head) refreshes its copy when this changes.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Drops the accumulated gradient.
    pub fn zero_grad(&mut self) {
        self.grad = None;
    }

    /// `weight[ids]`: shape `ids.shape() + [embedding_dim]` (`[s, b, hidden]` for `[s, b]` ids),
    /// and the context for backward.
    ///
    /// # Errors
    /// Kernel failures.
    pub fn forward(&mut self, ids: &TokenIds) -> Result<(Tensor, EmbeddingCtx)> {
        let mut shape = ids.shape().to_vec();
        shape.push(self.cfg.embedding_dim);
        let mut out = Tensor::empty(&self.dev, self.cfg.params_dtype, &shape)?;
        embedding_forward(&self.dev, &self.weight, ids.data(), &mut out)?;
        // The backward sums each id's tokens from the ids grouped by id (built and uploaded here
        // unless the ids bring it: `TokenIds::with_grad_index`).
        let index = match ids.grad_index() {
            Some(index) => index.clone(),
            None => Arc::new(EmbeddingGradIndex::from_host(&self.dev, ids.host())?),
        };
        Ok((out, EmbeddingCtx { stamp: Stamp::new(self.id, [self.version]), ids: ids.clone(), index }))
    }

    /// `weight[ids]` for inference: as [`Embedding::forward`], nothing kept (the ids are not
    /// shared, so a graph's static ids stay updatable).
    ///
    /// # Errors
    /// Kernel failures.
    pub fn infer(&self, ids: &TokenIds) -> Result<Tensor> {
        let mut shape = ids.shape().to_vec();
        shape.push(self.cfg.embedding_dim);
        let mut out = Tensor::empty(&self.dev, self.cfg.params_dtype, &shape)?;
        embedding_forward(&self.dev, &self.weight, ids.data(), &mut out)?;
        Ok(out)
    }

    /// Accumulates `weight.grad[ids[t]] += grad_output[t]` (no input gradient: ids are discrete).
    ///
    /// # Errors
    /// [`Error::Context`] for another module's or a stale context; [`Error::Shape`] /
    /// [`Error::DType`] unless `grad_output` is `ids.shape() + [embedding_dim]`, f32/bf16/f16;
    /// kernel failures.
    pub fn backward(&mut self, ctx: EmbeddingCtx, grad_output: &Tensor) -> Result<()> {
        ctx.stamp.check(MODULE, Stamp::new(self.id, [self.version]))?;
        let mut shape = ctx.ids.shape().to_vec();
        shape.push(self.cfg.embedding_dim);
        check_shape(MODULE, "grad_output", grad_output, &shape)?;
        let grad = match &mut self.grad {
            Some(g) => g,
            None => self.grad.insert(Tensor::zeros(&self.dev, self.cfg.params_dtype, self.weight.shape())?),
        };
        embedding_backward(&self.dev, grad_output, &ctx.index, grad)
    }
}

/// The table as a [`Param`] (read through `&Embedding`, written through `&mut Embedding`).
struct Weight<R>(R);

impl<R: Deref<Target = Embedding>> Param for Weight<R> {
    fn shape(&self) -> &[usize] {
        self.0.weight.shape()
    }

    fn dtype(&self) -> DType {
        self.0.weight.dtype()
    }

    fn tensor(&self) -> Option<&Tensor> {
        Some(&self.0.weight)
    }

    fn grad(&self) -> Option<&Tensor> {
        self.0.grad.as_ref()
    }
}

impl<R: DerefMut<Target = Embedding>> ParamMut for Weight<R> {
    fn set(&mut self, value: Tensor) -> Result<()> {
        self.0.set_weight(value)
    }

    fn zero_grad(&mut self) {
        self.0.zero_grad();
    }

    fn grad_mut(&mut self) -> Option<&mut Tensor> {
        self.0.grad.as_mut()
    }

    fn take_grad(&mut self) -> Option<Tensor> {
        self.0.grad.take()
    }
}

impl Module for Embedding {
    /// One parameter, `weight` ([`ParamKind::Embedding`]).
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visitor.param(&join_path(prefix, "weight"), ParamKind::Embedding, &Weight(self))
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visitor.param(&join_path(prefix, "weight"), ParamKind::Embedding, &mut Weight(self))
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.cfg.kernel_specs(target, specs);
    }
}
