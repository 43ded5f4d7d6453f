//! CPU reference of `MultiheadAttention` (input norm fused into the QKV projection, no rotary
//! embedding) and of the pre-LN `TransformerLayer` without dropout, over hidden states
//! `[s, b, hidden]` (sbhd), composed of the exact references of its parts.

use super::attention;
use super::modules::{self, DenseRef, MlpGrads, NormRef};
use te_codegen::spec::Activation;
use te_runtime::ops::attention_shape::AttentionShape;

/// The attention block: input norm, QKV `[(h + 2g)·d, hidden]` with rows `[q | k | v]`,
/// attention, output projection.
#[derive(Debug, Clone)]
pub struct MhaRef<'a> {
    /// Input norm.
    pub norm: NormRef<'a>,
    /// QKV projection.
    pub qkv: DenseRef<'a>,
    /// Output projection `[hidden, h·d]`.
    pub proj: DenseRef<'a>,
    /// The attention problem (layout sbhd, `sq = sk = s`, no padding mask).
    pub shape: AttentionShape,
}

/// Gradients of the attention block.
#[derive(Debug, Clone)]
pub struct MhaGrads {
    /// `[s·b, hidden]`.
    pub dx: Vec<f32>,
    /// Norm, QKV (in `dw1`/`db1`).
    pub qkv: MlpGrads,
    /// Output projection weight.
    pub dw_proj: Vec<f32>,
    /// Output projection bias.
    pub db_proj: Vec<f32>,
}

/// Columns `[from, from + width)` of a `[rows, cols]` matrix.
fn columns(x: &[f32], cols: usize, from: usize, width: usize) -> Vec<f32> {
    x.chunks_exact(cols).flat_map(|r| r[from..from + width].iter().copied()).collect()
}

impl MhaRef<'_> {
    fn rows(&self) -> usize {
        self.shape.sq * self.shape.batch
    }

    /// `(q, k, v, attention output)` for `x: [s·b, hidden]`.
    fn parts(&self, x: &[f32]) -> [Vec<f32>; 4] {
        let c = &self.shape;
        let (h, g, d) = (c.heads, c.groups, c.head_dim);
        let (qkv, _) = modules::layernorm_linear_forward(&self.norm, &self.qkv, x, self.rows());
        let w = (h + 2 * g) * d;
        let q = columns(&qkv, w, 0, h * d);
        let k = columns(&qkv, w, h * d, g * d);
        let v = columns(&qkv, w, (h + g) * d, g * d);
        let o = attention::forward(c, None, &q, &k, &v).out;
        [q, k, v, o]
    }

    /// The block's output `[s·b, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let [_, _, _, o] = self.parts(x);
        self.proj.forward(&o, self.rows())
    }

    /// Gradients for `dy: [s·b, hidden]`.
    pub fn backward(&self, dy: &[f32], x: &[f32]) -> MhaGrads {
        let c = &self.shape;
        let (h, g, d) = (c.heads, c.groups, c.head_dim);
        let [q, k, v, o] = self.parts(x);
        let (d_o, dw_proj, db_proj) = self.proj.backward(dy, &o, self.rows());
        let gr = attention::backward(c, None, &q, &k, &v, &d_o);
        let d_qkv: Vec<f32> = (0..self.rows())
            .flat_map(|r| {
                let q = &gr.dq[r * h * d..(r + 1) * h * d];
                let k = &gr.dk[r * g * d..(r + 1) * g * d];
                let v = &gr.dv[r * g * d..(r + 1) * g * d];
                q.iter().chain(k).chain(v).copied().collect::<Vec<_>>()
            })
            .collect();
        let qkv = modules::layernorm_linear_backward(&self.norm, &self.qkv, &d_qkv, x, self.rows());
        MhaGrads { dx: qkv.dx.clone(), qkv, dw_proj, db_proj }
    }
}

/// A pre-LN layer: `h = x + mha(x)`, `y = h + mlp(norm2(h))`, no dropout.
#[derive(Debug, Clone)]
pub struct LayerRef<'a> {
    /// The attention block.
    pub mha: MhaRef<'a>,
    /// The MLP's norm.
    pub norm2: NormRef<'a>,
    /// fc1.
    pub fc1: DenseRef<'a>,
    /// fc2.
    pub fc2: DenseRef<'a>,
    /// The MLP activation.
    pub activation: Activation,
}

/// Gradients of a layer.
#[derive(Debug, Clone)]
pub struct LayerGrads {
    /// `[s·b, hidden]`.
    pub dx: Vec<f32>,
    /// Of the attention block.
    pub mha: MhaGrads,
    /// Of the MLP block.
    pub mlp: MlpGrads,
}

impl LayerRef<'_> {
    /// `y` for `x: [s·b, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let rows = self.mha.rows();
        let h1: Vec<f32> = x.iter().zip(self.mha.forward(x)).map(|(a, b)| a + b).collect();
        let m = modules::layernorm_mlp_forward(&self.norm2, &self.fc1, self.activation, &self.fc2, &h1, rows);
        h1.iter().zip(m).map(|(a, b)| a + b).collect()
    }

    /// Gradients for `dy`.
    pub fn backward(&self, dy: &[f32], x: &[f32]) -> LayerGrads {
        let rows = self.mha.rows();
        let h1: Vec<f32> = x.iter().zip(self.mha.forward(x)).map(|(a, b)| a + b).collect();
        let mlp = modules::layernorm_mlp_backward(&self.norm2, &self.fc1, self.activation, &self.fc2, dy, &h1, rows);
        let d_h1: Vec<f32> = mlp.dx.iter().zip(dy).map(|(a, b)| a + b).collect();
        let mha = self.mha.backward(&d_h1, x);
        let dx = d_h1.iter().zip(&mha.dx).map(|(a, b)| a + b).collect();
        LayerGrads { dx, mha, mlp }
    }
}
