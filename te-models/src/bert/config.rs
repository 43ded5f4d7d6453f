//! [`BertConfig`]: the fields of a Hugging Face `config.json` the model uses, and its parsing.

use super::{read_file, BertError, BertResult};
use std::path::{Path, PathBuf};
use te_nn::modules::Activation;

/// The fields of a Hugging Face `BertConfig` the model uses.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads` (divides `hidden_size`).
    pub num_attention_heads: usize,
    /// `intermediate_size` (the MLP width).
    pub intermediate_size: usize,
    /// `max_position_embeddings` (rows of the position table; the longest sequence).
    pub max_position_embeddings: usize,
    /// `type_vocab_size` (≥ 1; only token type 0 is used).
    pub type_vocab_size: usize,
    /// `layer_norm_eps`.
    pub layer_norm_eps: f32,
    /// `hidden_act`: `gelu` → [`Activation::GeluErf`]; `gelu_new`, `gelu_pytorch_tanh` →
    /// [`Activation::Gelu`] (tanh); `relu` → [`Activation::Relu`].
    pub activation: Activation,
}

impl BertConfig {
    /// all-MiniLM-L6-v2's configuration.
    pub fn minilm_l6() -> Self {
        Self {
            vocab_size: 30522,
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            activation: Activation::GeluErf,
        }
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// An upper estimate of the device memory (bytes) of running this encoder on batches of at
    /// most `tokens` (padded) tokens, what `te embed` checks against the free memory before it
    /// uploads the weights: every parameter in bf16 and, for FP8 GEMMs, their E4M3 copies (4
    /// bytes a parameter in all); one layer's activations at a time, per token `8h + 2f` bf16
    /// elements (inputs, norm outputs, the fused QKV output, the attention output, the MLP's
    /// hidden activation twice) and the pooled f32 output; fixed workspaces (256 MiB). The fused
    /// attention keeps no `[s, s]` scores.
    pub fn inference_bytes(&self, tokens: usize) -> u64 {
        let (h, f) = (self.hidden_size as f64, self.intermediate_size as f64);
        let tables = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) as f64 * h;
        let layer = 4.0 * h * h + 2.0 * h * f + f + 9.0 * h;
        let params = tables + self.num_hidden_layers as f64 * layer;
        let activations = tokens as f64 * ((8.0 * h + 2.0 * f) * 2.0 + 4.0 * h);
        (params * 4.0 + activations + (256u64 << 20) as f64) as u64
    }

    /// Parses a Hugging Face `config.json` text.
    ///
    /// # Errors
    /// [`BertError::Unsupported`] naming the field: `model_type` other than `bert`, `hidden_act`
    /// other than gelu / gelu_new / gelu_pytorch_tanh / relu, `position_embedding_type` other
    /// than `absolute`, a missing or non-positive size, heads that do not divide the hidden
    /// size, `is_decoder`/`add_cross_attention` set; [`BertError::Json`] for invalid JSON.
    pub fn from_json(text: &str) -> BertResult<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| BertError::Json { path: PathBuf::from("config.json"), message: e.to_string() })?;
        let unsupported = |field: &'static str, message: String| BertError::Unsupported { field, message };
        let str_field = |field: &'static str| v.get(field).and_then(|x| x.as_str());
        if let Some(t) = str_field("model_type") {
            if t != "bert" {
                return Err(unsupported("model_type", format!("`{t}`; only `bert` is supported")));
            }
        }
        for field in ["is_decoder", "add_cross_attention"] {
            if v.get(field).and_then(|x| x.as_bool()) == Some(true) {
                let field = if field == "is_decoder" { "is_decoder" } else { "add_cross_attention" };
                return Err(unsupported(
                    field,
                    "true; only encoders (self-attention, no decoder) are supported".into(),
                ));
            }
        }
        if let Some(p) = str_field("position_embedding_type") {
            if p != "absolute" {
                return Err(unsupported("position_embedding_type", format!("`{p}`; only `absolute` is supported")));
            }
        }
        let activation = match str_field("hidden_act").unwrap_or("gelu") {
            "gelu" => Activation::GeluErf,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::Gelu,
            "relu" => Activation::Relu,
            other => {
                return Err(unsupported(
                    "hidden_act",
                    format!("`{other}`; supported: gelu (erf), gelu_new / gelu_pytorch_tanh (tanh), relu"),
                ))
            }
        };
        let size = |field: &'static str| -> BertResult<usize> {
            match v.get(field).and_then(|x| x.as_u64()) {
                Some(n) if n > 0 => Ok(n as usize),
                Some(n) => Err(unsupported(field, format!("{n}; must be ≥ 1"))),
                None => Err(unsupported(field, "missing or not a positive integer".into())),
            }
        };
        let cfg = Self {
            vocab_size: size("vocab_size")?,
            hidden_size: size("hidden_size")?,
            num_hidden_layers: size("num_hidden_layers")?,
            num_attention_heads: size("num_attention_heads")?,
            intermediate_size: size("intermediate_size")?,
            max_position_embeddings: size("max_position_embeddings")?,
            type_vocab_size: v.get("type_vocab_size").and_then(|x| x.as_u64()).unwrap_or(2).max(1) as usize,
            layer_norm_eps: match v.get("layer_norm_eps") {
                None => 1e-12,
                Some(x) => match x.as_f64().map(|e| e as f32) {
                    Some(e) if e.is_finite() && e > 0.0 => e,
                    _ => return Err(unsupported("layer_norm_eps", format!("{x}; must be a finite number > 0"))),
                },
            },
            activation,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks a configuration made in code as [`BertConfig::from_json`] checks a file's: every
    /// size ≥ 1, heads that divide the hidden size, a finite `layer_norm_eps` > 0.
    ///
    /// # Errors
    /// [`BertError::Unsupported`] naming the field.
    pub fn validate(&self) -> BertResult<()> {
        let unsupported = |field: &'static str, message: String| Err(BertError::Unsupported { field, message });
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
            ("type_vocab_size", self.type_vocab_size),
        ];
        if let Some((field, n)) = sizes.into_iter().find(|&(_, n)| n == 0) {
            return unsupported(field, format!("{n}; must be ≥ 1"));
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return unsupported(
                "num_attention_heads",
                format!("{} does not divide hidden_size = {}", self.num_attention_heads, self.hidden_size),
            );
        }
        if !(self.layer_norm_eps.is_finite() && self.layer_norm_eps > 0.0) {
            return unsupported("layer_norm_eps", format!("{}; must be a finite number > 0", self.layer_norm_eps));
        }
        Ok(())
    }

    /// Reads and parses `path` (a `config.json`).
    ///
    /// # Errors
    /// [`BertError::MissingFile`] / [`BertError::Io`]; as [`BertConfig::from_json`].
    pub fn load(path: &Path) -> BertResult<Self> {
        let text = read_file(path)?;
        let text = String::from_utf8(text)
            .map_err(|e| BertError::Json { path: path.to_path_buf(), message: e.to_string() })?;
        Self::from_json(&text).map_err(|e| match e {
            BertError::Json { message, .. } => BertError::Json { path: path.to_path_buf(), message },
            e => e,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn inference_bytes_cover_the_weights_and_grow_with_the_batch() {
        let c = BertConfig::minilm_l6();
        // all-MiniLM-L6-v2 has 22.7 M parameters: 4 bytes each, plus the workspaces.
        let base = c.inference_bytes(0);
        assert!(base > 4 * 22_000_000 + (256 << 20) && base < 4 * 24_000_000 + (256 << 20), "{base}");
        assert!(c.inference_bytes(64 * 512) > base);
        let huge = BertConfig { hidden_size: usize::MAX, ..c };
        assert_eq!(huge.inference_bytes(usize::MAX), u64::MAX);
    }

    #[test]
    fn config_parses_minilm_and_names_unsupported_fields() {
        let text = r#"{"architectures":["BertModel"],"hidden_act":"gelu","hidden_size":384,"intermediate_size":1536,
            "layer_norm_eps":1e-12,"max_position_embeddings":512,"model_type":"bert","num_attention_heads":12,
            "num_hidden_layers":6,"position_embedding_type":"absolute","type_vocab_size":2,"vocab_size":30522}"#;
        assert_eq!(BertConfig::from_json(text).unwrap(), BertConfig::minilm_l6());
        let e = BertConfig::from_json(&text.replace("\"gelu\"", "\"silu\"")).unwrap_err();
        assert!(matches!(e, BertError::Unsupported { field: "hidden_act", .. }), "{e}");
        let e = BertConfig::from_json(&text.replace("absolute", "relative_key")).unwrap_err();
        assert!(e.to_string().contains("position_embedding_type"), "{e}");
        let e = BertConfig::from_json(&text.replace("\"num_attention_heads\":12", "\"num_attention_heads\":7"))
            .unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let e = BertConfig::from_json(&text.replace("\"hidden_size\":384,", "")).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
        let tanh = BertConfig::from_json(&text.replace("\"gelu\"", "\"gelu_new\"")).unwrap();
        assert_eq!(tanh.activation, Activation::Gelu);
        let e = BertConfig::from_json(&text.replace("1e-12", "-1")).unwrap_err();
        assert!(e.to_string().contains("layer_norm_eps"), "{e}");
    }

    const MINILM: &str = r#"{"hidden_act":"gelu","hidden_size":384,"intermediate_size":1536,"layer_norm_eps":1e-12,"max_position_embeddings":512,"model_type":"bert","num_attention_heads":12,"num_hidden_layers":6,"type_vocab_size":2,"vocab_size":30522}"#;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

        /// A mutated `config.json` (a field set to another JSON value, bytes flipped) parses to a
        /// config the model can be built from, or is refused with a typed error; never a panic
        /// (reliability issue's fuzzing of the Hugging Face loader).
        #[test]
        fn mutated_configs_parse_or_are_refused(
            field in prop::sample::select(vec![
                "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "hidden_act", "model_type",
            ]),
            value in prop_oneof![
                any::<i64>().prop_map(|v| v.to_string()),
                any::<f64>().prop_map(|v| format!("{v:e}")),
                Just("null".to_string()),
                Just("\"gelu\"".to_string()),
                Just("[]".to_string()),
            ],
            flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        ) {
            let mut v: serde_json::Value = serde_json::from_str(MINILM).unwrap();
            v[field] = serde_json::from_str(&value).unwrap_or(serde_json::Value::Null);
            let mut bytes = v.to_string().into_bytes();
            for (i, x) in flips {
                let i = i % bytes.len();
                bytes[i] ^= x;
            }
            if let Ok(cfg) = BertConfig::from_json(&String::from_utf8_lossy(&bytes)) {
                prop_assert!(cfg.hidden_size > 0 && cfg.hidden_size % cfg.num_attention_heads == 0);
                prop_assert!(cfg.layer_norm_eps.is_finite() && cfg.layer_norm_eps > 0.0);
                prop_assert!(cfg.vocab_size > 0 && cfg.num_hidden_layers > 0 && cfg.intermediate_size > 0);
            }
        }
    }
}
