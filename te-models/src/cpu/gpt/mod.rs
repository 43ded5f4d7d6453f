//! CPU twin of [`crate::gpt::Gpt`]: the same architecture, parameter names, shapes and
//! init, in f32 on the host, with the forward intermediates kept for the backward (no
//! recompute), and an AdamW step over its parameters ([`GptAdamW`]). This is the path `te train
//! --preset tiny` takes on a machine without a GPU, and the oracle the GPU model is checked
//! against.
//!
//! Layout as on the GPU: hidden states `[s, b, hidden]` row-major (token `t = i·b + j` is
//! position `i` of sequence `j`). Parts: token embedding plus the learned position embedding,
//! `num_layers` pre-LN layers (`h = x + dropout(proj(attn(qkv(ln1(x)))))`, `y = h +
//! dropout(fc2(gelu(fc1(ln2(h)))))`, causal softmax attention with scale `1/√head_dim`, GELU
//! with TE's tanh approximation), the final LayerNorm, the LM head without bias and the mean
//! cross-entropy over the targets that are not [`IGNORE_INDEX`].
//!
//! Arithmetic: GEMMs in f32 (`matrixmultiply`, rows split over the rayon pool; the GPU
//! accumulates in f32 too) rather than the f64 [`te_reference::gemm::gemm_tn`], and
//! attention with the forward's probabilities kept rather than
//! [`te_reference::transformer::MhaRef`]'s recompute: the speed a CPU training run needs.
//! Norms, embeddings, dropout masks, the loss, the scaling update and the AdamW arithmetic are
//! the CPU reference's ([`te_reference::modules::NormRef`], [`te_reference::embedding`],
//! [`te_reference::dropout`], [`te_reference::cross_entropy`],
//! [`te_reference::scaling`], [`te_reference::optimizer`]). [`GemmPrecision`] emulates the
//! GPU's GEMM numerics on the GEMM *inputs*: rounded to BF16, or fake-quantized to FP8 as the
//! recipe's quantizers cast them ([`te_nn::fp8::ScalingRecipe`]'s host casts: delayed scaling
//! per operand as TE's `DelayedScaling` does, with amax histories, forward scales updated
//! after each [`GptRef::forward_loss`] and gradient scales after each [`GptRef::backward`];
//! current scaling with each operand's own amax; blockwise scaling; E4M3 inputs and weights,
//! E5M2 output gradients under HYBRID; the casts equal [`te_runtime::numerics::round_to`] bit
//! for bit). Everything else stays f32 (the GPU keeps activations in BF16).
//!
//! Hidden dropout: the GPU's Philox masks (seed of layer `l` = `seed + 16·(l + 1)`, offsets
//! `2n + 1` and `2n + 2` for the `n`-th [`GptRef::forward_loss`]), so a GPU model and its twin
//! that ran the same number of forwards drop the same elements. [`GptRef::loss`] (evaluation)
//! runs without dropout.
//!
//! Generation: [`GptRef::logits`] (the evaluation forward's logits) and [`GptRef::generate`],
//! the reference decode loop (the whole prefix through the forward at every step, the next token
//! from [`crate::generate::SamplingConfig`]).
//!
//! Files: this one holds the model and its forward/backward orchestration; `params` the
//! parameter layout, init and loading; `math` the f32 GEMM, attention and GELU pieces;
//! `precision` the BF16/FP8 GEMM-input emulation under each recipe; `adamw` [`GptAdamW`];
//! `generate` the decode loop.

mod adamw;
mod checkpoint;
mod decode;
mod generate;
mod math;
mod params;
mod precision;
#[cfg(test)]
mod tests;

pub use adamw::{GptAdamW, GptAdamWConfig, GptStepStats};
pub use decode::KvCache;
pub use params::NamedParam;
pub use precision::GemmPrecision;

use crate::gpt::{GptConfig, IGNORE_INDEX};
use math::{attention_backward, attention_forward, column_sums, dgelu, gelu_tanh, gemm, linear, par_fill, View};
use params::PER_LAYER;
use precision::Operands;
use te_codegen::DType;
use te_nn::modules::NormKind;
use te_reference::cross_entropy::cross_entropy;
use te_reference::dropout::{keep_mask, kept};
use te_reference::embedding;
use te_reference::modules::NormRef;
use te_runtime::ops::dropout::{keep_scale, DropoutParams};
use te_runtime::{Error, Result};

const MODEL: &str = "GptRef";

/// What one layer's forward keeps: its input, the attention's `q|k|v` and probabilities, the
/// residual stream, the MLP pre-activation, the masks and every GEMM operand as cast.
#[derive(Debug)]
struct LayerCtx {
    x: Vec<f32>,
    qkv: Vec<f32>,
    /// `[b·heads]` blocks of `[s, s]`.
    probs: Vec<Vec<f32>>,
    h1: Vec<f32>,
    pre: Vec<f32>,
    /// The GELU's `tanh` of each pre-activation.
    tanh: Vec<f32>,
    masks: [Option<Vec<u8>>; 2],
    /// The operands of qkv, proj, fc1, fc2 as cast.
    gemms: [Operands; 4],
}

/// A forward up to the logits and what the backward keeps of it.
struct Forward {
    /// `[s·b, vocab]`.
    logits: Vec<f32>,
    layers: Vec<LayerCtx>,
    /// Input of the final norm.
    last: Vec<f32>,
    /// The operands of the LM head.
    head: Operands,
    /// The FP8 amaxes of every GEMM's `[input, weight]`.
    amaxes: Vec<[f32; 2]>,
}

/// What [`GptRef::forward_loss`] saves for [`GptRef::backward`].
#[derive(Debug)]
pub struct GptRefCtx {
    ids: Vec<i32>,
    shape: [usize; 2],
    layers: Vec<LayerCtx>,
    /// Input of the final norm.
    last: Vec<f32>,
    /// The operands of the LM head.
    head: Operands,
    dlogits: Vec<f32>,
    /// The configuration of the model that made it.
    cfg: GptConfig,
}

/// The CPU GPT (see the module docs): parameters in the GPU model's order and names.
#[derive(Debug, Clone)]
pub struct GptRef {
    cfg: GptConfig,
    params: Vec<NamedParam>,
    precision: GemmPrecision,
    /// One per GEMM (`4·l + {qkv, proj, fc1, fc2}`, then the LM head) under an FP8 recipe that
    /// keeps scaling state (delayed scaling), else empty.
    fp8: Vec<te_nn::fp8::HostScalingState>,
    forwards: u64,
}

impl GptRef {
    fn norm<'a>(&self, gamma: &'a [f32], beta: &'a [f32]) -> NormRef<'a> {
        NormRef { kind: NormKind::LayerNorm, gamma, beta: Some(beta), eps: 1e-5, zero_centered_gamma: false }
    }

    /// `residual + dropout(x)` with the Philox mask of `(seed, offset)`, or without dropout.
    fn residual_dropout(
        &self,
        x: &[f32],
        residual: &[f32],
        dropout: Option<DropoutParams>,
    ) -> (Vec<f32>, Option<Vec<u8>>) {
        match dropout {
            Some(params) => {
                let mask = keep_mask(x.len(), params);
                let scale = keep_scale(params.p);
                let y = (0..x.len()).map(|i| residual[i] + if kept(&mask, i) { x[i] * scale } else { 0.0 }).collect();
                (y, Some(mask))
            }
            None => (residual.iter().zip(x).map(|(r, v)| r + v).collect(), None),
        }
    }

    fn check_batch(&self, ids: &[i32], targets: &[i32], s: usize, b: usize) -> Result<()> {
        let shape = |message: String| Err(Error::Shape { op: MODEL, message });
        if s == 0 || b == 0 || s > self.cfg.seq_length {
            return shape(format!("need 1 ≤ s ≤ seq_length = {} and b ≥ 1, got s = {s}, b = {b}", self.cfg.seq_length));
        }
        if ids.len() != s * b || targets.len() != s * b {
            return shape(format!(
                "ids and targets must be [s, b] = [{s}, {b}], got {} and {} values",
                ids.len(),
                targets.len()
            ));
        }
        let v = self.cfg.vocab_size as i32;
        if let Some(t) = ids.iter().find(|&&t| !(0..v).contains(&t)) {
            return Err(Error::Argument { op: MODEL, message: format!("token id {t} outside [0, {v})") });
        }
        if let Some(t) = targets.iter().find(|&&t| t != IGNORE_INDEX && !(0..v).contains(&t)) {
            return Err(Error::Argument {
                op: MODEL,
                message: format!("target {t} outside [0, {v}) and not {IGNORE_INDEX}"),
            });
        }
        Ok(())
    }

    /// The forward: mean loss, context and the FP8 amaxes of every GEMM's `[input, weight]`;
    /// `dropout_offset` is the offset of the first dropout call (`None`: no dropout).
    fn run(
        &self,
        ids: &[i32],
        targets: &[i32],
        s: usize,
        b: usize,
        dropout_offset: Option<u64>,
    ) -> Result<(f32, GptRefCtx, Vec<[f32; 2]>)> {
        self.check_batch(ids, targets, s, b)?;
        let Forward { logits, layers, last, head, amaxes } = self.logits_of(ids, s, b, dropout_offset, None);
        let v = self.cfg.vocab_size;
        let counted = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
        let grad_scale = if counted == 0 { 0.0 } else { 1.0 / counted as f32 };
        let (loss, dlogits) = cross_entropy(&logits, v, targets, IGNORE_INDEX, grad_scale);
        let mean =
            if counted == 0 { 0.0 } else { (loss.iter().map(|&l| f64::from(l)).sum::<f64>() / counted as f64) as f32 };
        let ctx = GptRefCtx { ids: ids.to_vec(), shape: [s, b], layers, last, head, dlogits, cfg: self.cfg.clone() };
        Ok((mean, ctx, amaxes))
    }

    /// The logits of checked `ids` `[s, b]`, with what the backward keeps. With a `cache`
    /// (decoding, no dropout), the tokens are at positions `cache.len()..`, attend over the
    /// cached keys and values too, and append theirs; the probabilities are not kept.
    fn logits_of(
        &self,
        ids: &[i32],
        s: usize,
        b: usize,
        dropout_offset: Option<u64>,
        mut cache: Option<&mut KvCache>,
    ) -> Forward {
        let cfg = &self.cfg;
        let (h, f, v, t) = (cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, s * b);
        let first = cache.as_ref().map_or(0, |c| c.len());
        let pos: Vec<i32> = (0..t).map(|i| (first + i / b) as i32).collect();
        let tok = embedding::forward(&self.params[0].value, h, ids);
        let wpe = embedding::forward(&self.params[1].value, h, &pos);
        let mut x: Vec<f32> = tok.iter().zip(&wpe).map(|(a, b)| a + b).collect();
        let mut amaxes = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let dropout = |k: u64| {
                dropout_offset.filter(|_| cfg.hidden_dropout > 0.0).map(|o| DropoutParams {
                    p: cfg.hidden_dropout,
                    seed: cfg.seed + 16 * (l as u64 + 1),
                    offset: o + k,
                })
            };
            let ln1 = self.norm(self.lp(l, 0), self.lp(l, 1)).forward(&x);
            let qkv_ops = self.gemm_operands(4 * l, &ln1, self.lp(l, 2), h, &mut amaxes);
            let qkv = linear(&qkv_ops.x, &qkv_ops.w, Some(self.lp(l, 3)), t, 3 * h, h);
            let (heads, d) = (cfg.num_attention_heads, h / cfg.num_attention_heads);
            let (o, probs) = match cache.as_deref_mut() {
                Some(c) => (c.attend(l, &qkv, s, heads, d), Vec::new()),
                None => attention_forward(&qkv, s, b, heads, d),
            };
            let proj_ops = self.gemm_operands(4 * l + 1, &o, self.lp(l, 4), h, &mut amaxes);
            let a = linear(&proj_ops.x, &proj_ops.w, Some(self.lp(l, 5)), t, h, h);
            let (h1, mask1) = self.residual_dropout(&a, &x, dropout(0));
            let ln2 = self.norm(self.lp(l, 6), self.lp(l, 7)).forward(&h1);
            let fc1_ops = self.gemm_operands(4 * l + 2, &ln2, self.lp(l, 8), h, &mut amaxes);
            let pre = linear(&fc1_ops.x, &fc1_ops.w, Some(self.lp(l, 9)), t, f, h);
            let tanh = par_fill(pre.len(), |i| gelu_tanh(pre[i]));
            let act = par_fill(pre.len(), |i| 0.5 * pre[i] * (1.0 + tanh[i]));
            let fc2_ops = self.gemm_operands(4 * l + 3, &act, self.lp(l, 10), f, &mut amaxes);
            let m = linear(&fc2_ops.x, &fc2_ops.w, Some(self.lp(l, 11)), t, h, f);
            let (y, mask2) = self.residual_dropout(&m, &h1, dropout(1));
            let layer_x = std::mem::replace(&mut x, y);
            layers.push(LayerCtx {
                x: layer_x,
                qkv,
                probs,
                h1,
                pre,
                tanh,
                masks: [mask1, mask2],
                gemms: [qkv_ops, proj_ops, fc1_ops, fc2_ops],
            });
        }
        if let Some(c) = cache {
            c.advance(s);
        }
        let yf = self.norm(self.tail(0), self.tail(1)).forward(&x);
        let head = self.gemm_operands(4 * cfg.num_layers, &yf, self.tail(2), h, &mut amaxes);
        let logits = linear(&head.x, &head.w, None, t, v, h);
        Forward { logits, layers, last: x, head, amaxes }
    }

    /// The logits `[s·b, vocab]` of `ids` `[s, b]` (row-major, token `i·b + j` at position `i`),
    /// as an evaluation forward computes them: no dropout, FP8 with the current scales, nothing
    /// recorded. The reference of decoding: the last position's row is the next token's logits.
    ///
    /// # Errors
    /// [`Error::Shape`] for `s = 0`, `b = 0`, `s > seq_length` or `ids` not `s · b` long;
    /// [`Error::Argument`] for an id outside `[0, vocab)`.
    pub fn logits(&self, ids: &[i32], s: usize, b: usize) -> Result<Vec<f32>> {
        self.check_batch(ids, &vec![IGNORE_INDEX; ids.len()], s, b)?;
        Ok(self.logits_of(ids, s, b, None, None).logits)
    }

    /// The mean cross-entropy over the targets that are not [`IGNORE_INDEX`] (0 when all are)
    /// and the context for [`GptRef::backward`], with hidden dropout (training). Under FP8 the
    /// forward amaxes enter the histories and the forward scales are updated afterwards.
    ///
    /// `ids`, `targets`: `[s, b]` row-major (`s · b` values, token `i·b + j` at position `i`).
    ///
    /// # Errors
    /// [`Error::Shape`] for `s = 0`, `b = 0`, `s > seq_length` or slices that are not `s · b`
    /// long; [`Error::Argument`] for an id outside `[0, vocab)` or a target outside it that is
    /// not [`IGNORE_INDEX`].
    pub fn forward_loss(&mut self, ids: &[i32], targets: &[i32], s: usize, b: usize) -> Result<(f32, GptRefCtx)> {
        let (loss, ctx, amaxes) = self.run(ids, targets, s, b, Some(2 * self.forwards + 1))?;
        self.forwards += 1;
        self.update_forward_scaling(&amaxes);
        Ok((loss, ctx))
    }

    /// The mean loss as [`GptRef::forward_loss`] computes it, for evaluation: no dropout, FP8
    /// with the current scales and nothing recorded.
    ///
    /// # Errors
    /// As [`GptRef::forward_loss`].
    pub fn loss(&self, ids: &[i32], targets: &[i32], s: usize, b: usize) -> Result<f32> {
        Ok(self.run(ids, targets, s, b, None)?.0)
    }

    /// The gradient of the mean loss of `ctx` for every parameter, `(name, values)` in
    /// [`GptRef::params`] order. Under FP8 the output-gradient amaxes enter the histories and
    /// the backward scales are updated afterwards.
    ///
    /// # Errors
    /// [`Error::Context`] for a context made by a model of another configuration.
    pub fn backward(&mut self, ctx: GptRefCtx) -> Result<Vec<(String, Vec<f32>)>> {
        let cfg = &self.cfg;
        let [s, b] = ctx.shape;
        let (h, f, v, t) = (cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, s * b);
        if ctx.cfg != *cfg {
            return Err(Error::Context {
                module: MODEL,
                message: "the context was made by a model of another configuration".into(),
            });
        }
        let heads = cfg.num_attention_heads;
        let mut grads: Vec<Vec<f32>> = self.params.iter().map(|p| vec![0.0; p.value.len()]).collect();
        let mut amaxes = Vec::new();
        let nl = cfg.num_layers;
        let (dyf, dw_head, _) = self.linear_backward(4 * nl, &ctx.dlogits, &ctx.head, [t, v, h], &mut amaxes);
        let (mut dx, dg, db) = self.norm(self.tail(0), self.tail(1)).backward(&dyf, &ctx.last);
        let base = 2 + PER_LAYER * nl;
        (grads[base], grads[base + 1], grads[base + 2]) = (dg, db, dw_head);
        for (l, c) in ctx.layers.iter().enumerate().rev() {
            let drop = |d: &[f32], mask: &Option<Vec<u8>>| match mask {
                Some(m) => {
                    let scale = keep_scale(cfg.hidden_dropout);
                    d.iter().enumerate().map(|(i, &g)| if kept(m, i) { g * scale } else { 0.0 }).collect()
                }
                None => d.to_vec(),
            };
            let dm = drop(&dx, &c.masks[1]);
            let (dact, dw2, db2) = self.linear_backward(4 * l + 3, &dm, &c.gemms[3], [t, h, f], &mut amaxes);
            let dpre = par_fill(dact.len(), |i| dact[i] * dgelu(c.pre[i], c.tanh[i]));
            let (dln2, dw1, db1) = self.linear_backward(4 * l + 2, &dpre, &c.gemms[2], [t, f, h], &mut amaxes);
            let (dn2, dg2, dbe2) = self.norm(self.lp(l, 6), self.lp(l, 7)).backward(&dln2, &c.h1);
            let dh1: Vec<f32> = dx.iter().zip(&dn2).map(|(a, b)| a + b).collect();
            let da = drop(&dh1, &c.masks[0]);
            let (d_o, dwp, dbp) = self.linear_backward(4 * l + 1, &da, &c.gemms[1], [t, h, h], &mut amaxes);
            let dqkv = attention_backward(&c.qkv, &c.probs, &d_o, s, b, heads, h / heads);
            let (dln1, dwqkv, dbqkv) = self.linear_backward(4 * l, &dqkv, &c.gemms[0], [t, 3 * h, h], &mut amaxes);
            let (dn1, dg1, dbe1) = self.norm(self.lp(l, 0), self.lp(l, 1)).backward(&dln1, &c.x);
            dx = dh1.iter().zip(&dn1).map(|(a, b)| a + b).collect();
            let layer = [dg1, dbe1, dwqkv, dbqkv, dwp, dbp, dg2, dbe2, dw1, db1, dw2, db2];
            for (i, g) in layer.into_iter().enumerate() {
                grads[2 + PER_LAYER * l + i] = g;
            }
        }
        let pos: Vec<i32> = (0..t).map(|i| (i / b) as i32).collect();
        embedding::backward(&dx, &ctx.ids, &mut grads[0], DType::F32, h);
        embedding::backward(&dx, &pos, &mut grads[1], DType::F32, h);
        self.update_backward_scaling(&amaxes);
        Ok(self.params.iter().zip(grads).map(|(p, g)| (p.name.clone(), g)).collect())
    }

    /// `(dx, dw, dbias)` of GEMM `g` (`[t, out, in]`) for `dy` with the forward's cast operands:
    /// `dy` cast as the dgrad and wgrad GEMMs read it (its amax added to `amaxes` under
    /// delayed-scaling FP8), `dbias` from the uncast `dy`.
    fn linear_backward(
        &self,
        g: usize,
        dy: &[f32],
        ops: &Operands,
        [t, n_out, n_in]: [usize; 3],
        amaxes: &mut Vec<f32>,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (c_dgrad, c_wgrad) = self.grad_casts(g, dy, n_out, amaxes);
        let dyq = c_dgrad.apply(dy);
        let dyq_w = c_wgrad.map(|c| c.apply(dy));
        let mut dx = vec![0.0; t * n_in];
        gemm(t, n_out, n_in, View::rows(&dyq, n_out), View::rows(&ops.w, n_in), 0.0, &mut dx);
        let mut dw = vec![0.0; n_out * n_in];
        let dy_w = dyq_w.as_deref().unwrap_or(&dyq);
        gemm(n_out, t, n_in, View::t(dy_w, n_out), View::rows(ops.wgrad_input(), n_in), 0.0, &mut dw);
        (dx, dw, column_sums(dy, n_out))
    }
}
