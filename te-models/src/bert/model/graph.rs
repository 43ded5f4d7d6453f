//! `te embed`'s batches replayed from CUDA graphs, one per padded shape `[b, s]`
//! ([`Bert::set_cuda_graph`]). The sentences are sorted by length and padded to multiples of
//! 16, so a run meets few shapes many times: the first batch of a shape runs eagerly (it loads
//! the kernels and picks the GEMM algorithms), the second is captured, and every later one of
//! that shape replays: the ids, the padding tables and the pooling mask refilled in place, the
//! pooled sums copied out of the graph's output.

use super::{pool_mask, Bert};
use crate::bert::{BertError, BertResult};
use std::collections::{HashMap, HashSet};
use te_codegen::DType;
use te_nn::modules::{PaddingSeqlens, TokenIds};
use te_runtime::graph::Graph;
use te_runtime::Tensor;

/// The graphs of one model, by padded shape `(b, s)`.
#[derive(Debug, Default)]
pub(super) struct BatchGraphs {
    enabled: bool,
    /// Shapes run eagerly once: captured at their next batch.
    warm: HashSet<(usize, usize)>,
    graphs: HashMap<(usize, usize), BatchGraph>,
    /// Batches replayed so far.
    replays: u64,
}

impl BatchGraphs {
    /// Whether batches may replay from graphs.
    pub(super) fn enabled(&self) -> bool {
        self.enabled
    }
}

/// A captured batch of one shape and the static inputs it reads.
#[derive(Debug)]
struct BatchGraph {
    graph: Graph,
    tokens: TokenIds,
    /// Kept alive: the graph reads them (constant for the shape).
    _positions: TokenIds,
    padding: PaddingSeqlens,
    /// The pooling mask `[b, s]`, hidden dtype.
    mask: Tensor,
    /// The pooled sums `[b, hidden]` f32 the latest replay wrote.
    sums: Tensor,
}

impl Bert {
    /// Replays `te embed`'s batches from CUDA graphs, one per padded shape (on by default in
    /// `te embed`; off here until set): bit for bit the eager batches, without the host's
    /// per-kernel launch cost. Graphs are dropped when it is turned off. Pooling on the host
    /// ([`Bert::set_host_pooling`]) always runs eagerly.
    pub fn set_cuda_graph(&mut self, on: bool) {
        self.graphs.enabled = on;
        if !on {
            self.graphs.graphs.clear();
            self.graphs.warm.clear();
        }
    }

    /// Batches replayed from graphs so far ([`Bert::set_cuda_graph`]).
    pub fn graph_replays(&self) -> u64 {
        self.graphs.replays
    }

    /// The pooled sums `[b, hidden]` (f32, a tensor of their own) of one checked batch from its
    /// shape's graph, capturing it when the shape ran eagerly before; `None` for a shape met
    /// for the first time (marked: the caller runs it eagerly).
    pub(super) fn embed_graphed(&mut self, ids: &[i32], seq: usize, lens: &[usize]) -> BertResult<Option<Tensor>> {
        let key = (lens.len(), seq);
        if !self.graphs.graphs.contains_key(&key) {
            if self.graphs.warm.insert(key) {
                return Ok(None);
            }
            let g = self.capture_batch(ids, seq, lens)?;
            self.graphs.graphs.insert(key, g);
        }
        let dev = self.dev.clone();
        let Some(g) = self.graphs.graphs.get_mut(&key) else {
            return Err(te_runtime::Error::internal("Bert::embed_graphed", "the graph of a shape just captured").into());
        };
        g.tokens.update(&dev, ids)?;
        g.padding.update(&dev, lens)?;
        g.mask.copy_from(&Tensor::from_f32(&dev, g.mask.dtype(), g.mask.shape(), &pool_mask(lens, seq))?)?;
        g.graph.replay()?;
        let out = Tensor::empty(&dev, DType::F32, g.sums.shape())?;
        out.copy_from(&g.sums)?;
        self.graphs.replays += 1;
        Ok(Some(out))
    }

    /// Captures the batch's hidden states and pooling on static inputs made from it.
    fn capture_batch(&mut self, ids: &[i32], seq: usize, lens: &[usize]) -> BertResult<BatchGraph> {
        let dev = self.dev.clone();
        let batch = lens.len();
        let (tokens, positions) = self.token_tables(ids, batch, seq)?;
        let padding = PaddingSeqlens::new(&dev, lens)?;
        let mask = Tensor::from_f32(&dev, DType::BF16, &[batch, seq], &pool_mask(lens, seq))?;
        let (graph, sums) = Graph::capture(&dev, || {
            let hidden = self.hidden_from(&tokens, &positions, lens, Some(&padding)).map_err(runtime)?;
            self.pool_sums(&hidden, &mask).map_err(runtime)
        })?;
        Ok(BatchGraph { graph, tokens, _positions: positions, padding, mask, sums })
    }
}

/// A model error inside a capture closure as the runtime's (an input error is an argument one).
fn runtime(e: BertError) -> te_runtime::Error {
    match e {
        BertError::Runtime(r) => r,
        other => te_runtime::Error::Argument { op: "Bert", message: other.to_string() },
    }
}
