//! [`BertWeights`]: a checkpoint's tensors on the host (safetensors import), checked against the
//! configuration, with the fused QKV concatenation and the position table the model loads.

use super::{read_file, BertConfig, BertError, BertResult};
use std::collections::HashMap;
use std::path::Path;

/// A host tensor in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// The checkpoint's tensors on the host in f32, by Hugging Face name (the `bert.` prefix
/// stripped); F32, F16 and BF16 tensors are read, others (the `position_ids` buffer) skipped.
#[derive(Debug, Clone, Default)]
pub struct BertWeights {
    tensors: HashMap<String, HostTensor>,
}

impl BertWeights {
    /// Reads a `model.safetensors` file.
    ///
    /// # Errors
    /// [`BertError::MissingFile`] / [`BertError::Io`]; [`BertError::Tensor`] for a file that is
    /// not safetensors.
    pub fn load(path: &Path) -> BertResult<Self> {
        let bytes = read_file(path)?;
        Self::from_safetensors(&bytes)
    }

    /// Parses safetensors bytes.
    ///
    /// # Errors
    /// [`BertError::Tensor`] (name `*`) for bytes that are not safetensors.
    pub fn from_safetensors(bytes: &[u8]) -> BertResult<Self> {
        use safetensors::Dtype;
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| BertError::Tensor { name: "*".into(), message: format!("not a safetensors file: {e}") })?;
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            let raw = view.data();
            let data: Vec<f32> = match view.dtype() {
                Dtype::F32 => raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
                Dtype::F16 => raw.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                Dtype::BF16 => raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                _ => continue,
            };
            let name = name.strip_prefix("bert.").unwrap_or(&name).to_string();
            tensors.insert(name, HostTensor { shape: view.shape().to_vec(), data });
        }
        Ok(Self { tensors })
    }

    /// Builds weights from named tensors (tests, conversions).
    pub fn from_tensors(tensors: HashMap<String, HostTensor>) -> Self {
        Self { tensors }
    }

    /// The tensor `name`, checked to have `shape`.
    ///
    /// # Errors
    /// [`BertError::Tensor`] when it is missing or of another shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> BertResult<&[f32]> {
        let t = self.tensors.get(name).ok_or_else(|| BertError::Tensor {
            name: name.into(),
            message: "missing (is this a BERT checkpoint of this config.json?)".into(),
        })?;
        if t.shape != shape {
            return Err(BertError::Tensor {
                name: name.into(),
                message: format!("shape {:?} does not match config.json, which implies {shape:?}", t.shape),
            });
        }
        Ok(&t.data)
    }

    /// Checks `cfg` ([`BertConfig::validate`]) and every tensor the model reads against it.
    ///
    /// # Errors
    /// [`BertError::Unsupported`] for a configuration `cfg.validate()` refuses; the first missing
    /// or mismatched tensor, as [`BertWeights::get`].
    pub fn validate(&self, cfg: &BertConfig) -> BertResult<()> {
        cfg.validate()?;
        for (name, shape) in Self::layout(cfg) {
            self.get(&name, &shape)?;
        }
        Ok(())
    }

    /// Every tensor a model of `cfg` reads, `(Hugging Face name, shape)`, in file order.
    pub fn layout(cfg: &BertConfig) -> Vec<(String, Vec<usize>)> {
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        let mut v = vec![
            ("embeddings.word_embeddings.weight".to_string(), vec![cfg.vocab_size, h]),
            ("embeddings.position_embeddings.weight".into(), vec![cfg.max_position_embeddings, h]),
            ("embeddings.token_type_embeddings.weight".into(), vec![cfg.type_vocab_size, h]),
            ("embeddings.LayerNorm.weight".into(), vec![h]),
            ("embeddings.LayerNorm.bias".into(), vec![h]),
        ];
        for l in 0..cfg.num_hidden_layers {
            let p = format!("encoder.layer.{l}.");
            for (name, shape) in [
                ("attention.self.query.weight", vec![h, h]),
                ("attention.self.query.bias", vec![h]),
                ("attention.self.key.weight", vec![h, h]),
                ("attention.self.key.bias", vec![h]),
                ("attention.self.value.weight", vec![h, h]),
                ("attention.self.value.bias", vec![h]),
                ("attention.output.dense.weight", vec![h, h]),
                ("attention.output.dense.bias", vec![h]),
                ("attention.output.LayerNorm.weight", vec![h]),
                ("attention.output.LayerNorm.bias", vec![h]),
                ("intermediate.dense.weight", vec![f, h]),
                ("intermediate.dense.bias", vec![f]),
                ("output.dense.weight", vec![h, f]),
                ("output.dense.bias", vec![h]),
                ("output.LayerNorm.weight", vec![h]),
                ("output.LayerNorm.bias", vec![h]),
            ] {
                v.push((format!("{p}{name}"), shape));
            }
        }
        v
    }

    /// The fused QKV weight `[3·hidden, hidden]` (rows `[query | key | value]`) and bias of layer
    /// `l`, in the layout of `MultiheadAttention`.
    ///
    /// # Errors
    /// As [`BertWeights::get`].
    pub fn qkv(&self, cfg: &BertConfig, l: usize) -> BertResult<(Vec<f32>, Vec<f32>)> {
        let h = cfg.hidden_size;
        let (mut w, mut b) = (Vec::with_capacity(3 * h * h), Vec::with_capacity(3 * h));
        for part in ["query", "key", "value"] {
            w.extend_from_slice(self.get(&format!("encoder.layer.{l}.attention.self.{part}.weight"), &[h, h])?);
            b.extend_from_slice(self.get(&format!("encoder.layer.{l}.attention.self.{part}.bias"), &[h])?);
        }
        Ok((w, b))
    }

    /// Position table `[max_position_embeddings, hidden]` with token type 0 folded in (f32 sum).
    ///
    /// # Errors
    /// As [`BertWeights::get`].
    pub fn position_table(&self, cfg: &BertConfig) -> BertResult<Vec<f32>> {
        let h = cfg.hidden_size;
        let pos = self.get("embeddings.position_embeddings.weight", &[cfg.max_position_embeddings, h])?;
        let tt = &self.get("embeddings.token_type_embeddings.weight", &[cfg.type_vocab_size, h])?[..h];
        Ok(pos.chunks_exact(h).flat_map(|r| r.iter().zip(tt).map(|(a, b)| a + b)).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

        /// A mutated `model.safetensors` (bytes flipped, cut short, or random bytes) loads or is
        /// refused with a typed error; never a panic (reliability issue's fuzzing of the Hugging
        /// Face loader).
        #[test]
        fn mutated_weight_files_load_or_are_refused(m in te_nn::checkpoint::fuzz::mutation()) {
            let data: Vec<u8> = (0..48u8).collect();
            let w = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![3, 4], &data).unwrap();
            let h = safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, vec![8], &data[..16]).unwrap();
            let file = safetensors::serialize([("bert.pooler.dense.weight", &w), ("x", &h)], None).unwrap();
            let bytes = m.apply(file);
            if let Err(e) = BertWeights::from_safetensors(&bytes) {
                prop_assert!(matches!(e, BertError::Tensor { .. }), "{e}");
            }
        }
    }

    #[test]
    fn weights_report_missing_and_mismatched_tensors() {
        let mut t = HashMap::new();
        t.insert("embeddings.LayerNorm.weight".to_string(), HostTensor { shape: vec![4], data: vec![1.0; 4] });
        let w = BertWeights::from_tensors(t);
        let e = w.get("embeddings.LayerNorm.weight", &[8]).unwrap_err();
        assert!(e.to_string().contains("[4]") && e.to_string().contains("[8]"), "{e}");
        let e = w.validate(&BertConfig::minilm_l6()).unwrap_err();
        assert!(e.to_string().contains("word_embeddings"), "{e}");
    }
}
