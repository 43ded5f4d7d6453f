//! What a checkpoint's `trainer.toml` (and the run's `latest.toml`) records: [`Latest`], with
//! the model in its `[model]` table ([`ModelSection`]).

use crate::config::{Precision, TrainConfig};
use crate::error::TrainError;
use crate::trainer::Pack;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use te_models::decoder::{DecoderConfig, HfArchitecture};
use te_models::gpt::GptConfig;
use te_nn::fp8::{DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe};

/// The model a checkpoint holds, as `trainer.toml` records it (its `[model]` table): what
/// `te generate` rebuilds.
///
/// The FP8 recipe is a `[model.recipe]` table of `DelayedScaling`'s fields, which every version
/// writes and reads, and for the other recipes a table of theirs beside it that takes its place:
/// `[model.block_scaling]` (`Float8BlockScaling`) or `[model.current_scaling]`
/// (`Float8CurrentScaling`); [`ModelSection::fp8_recipe`] is the recipe the run trained with.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSection {
    /// The run's precision.
    pub precision: Precision,
    /// The architecture (`[model.config]`).
    pub config: GptConfig,
    /// The FP8 recipe of delayed-scaling runs (`[model.recipe]`); TE's default `DelayedScaling`
    /// when one of the tables below names the recipe.
    pub recipe: DelayedScaling,
    /// Blockwise FP8 in place of `recipe` (`[model.block_scaling]`; `te train --recipe block`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_scaling: Option<Float8BlockScaling>,
    /// Current scaling in place of `recipe` (`[model.current_scaling]`; `te train --recipe
    /// current`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_scaling: Option<Float8CurrentScaling>,
    /// The pretrained decoder a fine-tuning run (`Trainer::finetune`, `te train --model`)
    /// started from (`[model.decoder]`); absent for a GPT run and in checkpoints written before
    /// the section. `config` then holds only the run's window and vocabulary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decoder: Option<DecoderSection>,
}

/// The decoder of a fine-tuning run, as its checkpoints record it (`[model.decoder]`): what `te
/// generate --checkpoint` rebuilds the model from (the pretrained model's configuration and
/// tokenizer, with the checkpoint's fine-tuned weights), and what a resumed run must share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecoderSection {
    /// The transformers class of the model ([`DecoderSection::architecture_of`]:
    /// `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Gemma3ForCausalLM`).
    pub architecture: String,
    /// How the run packed its documents: `blocks` or `thd` ([`Pack::name`]).
    pub pack: String,
    /// The pretrained model the run started from, absolute: a `.gguf` file or a Hugging Face
    /// directory (`CheckpointOptions::model_source`); absent when the run did not say.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<PathBuf>,
}

impl DecoderSection {
    /// The section of a fine-tuning run of a model of `cfg` packed as `pack`, started from
    /// `source`.
    pub fn new(cfg: &DecoderConfig, pack: Pack, source: Option<PathBuf>) -> Self {
        Self { architecture: Self::architecture_of(cfg).to_string(), pack: pack.name().to_string(), source }
    }

    /// The transformers class of a model of `cfg`, from the features that tell the family's
    /// members apart (as `te export` names a model built in code): sandwich norms or scaled
    /// embeddings, Gemma 3; q/k norms, Qwen3; q/k/v biases without an output bias, Qwen2; else
    /// Llama. The multimodal Gemma 3's text model is `Gemma3ForCausalLM`.
    pub fn architecture_of(cfg: &DecoderConfig) -> &'static str {
        let arch = if cfg.sandwich_norm || cfg.scale_embeddings {
            HfArchitecture::Gemma3
        } else if cfg.qk_norm {
            HfArchitecture::Qwen3
        } else if cfg.qkv_bias && !cfg.proj_bias {
            HfArchitecture::Qwen2
        } else {
            HfArchitecture::Llama
        };
        arch.class_name()
    }
}

impl ModelSection {
    /// The section of a run of `cfg` in `precision`.
    pub fn new(cfg: &TrainConfig, precision: Precision) -> Self {
        let (recipe, block_scaling, current_scaling) = match cfg.recipe {
            Recipe::Delayed(r) => (r, None, None),
            Recipe::Block(r) => (DelayedScaling::default(), Some(r), None),
            Recipe::Current(r) => (DelayedScaling::default(), None, Some(r)),
        };
        Self { precision, config: cfg.model.clone(), recipe, block_scaling, current_scaling, decoder: None }
    }

    /// The FP8 recipe the run trained with (FP8 runs) or would have (BF16 runs): current
    /// scaling, else blockwise, else `recipe`.
    pub fn fp8_recipe(&self) -> Recipe {
        match (self.current_scaling, self.block_scaling) {
            (Some(r), _) => r.into(),
            (None, Some(r)) => r.into(),
            (None, None) => self.recipe.into(),
        }
    }

    /// Whether a run of `other`'s model, precision and FP8 recipe continues this one (fields
    /// of `recipe` that a block or current table replaces do not count), `self` being the
    /// checkpoint's: a fine-tuning run's decoder must be of the same architecture and packing
    /// (its source path does not count: a moved file is the same model). A checkpoint without
    /// a decoder section written before the section existed is taken to be of the same
    /// decoder; one with the section does not continue a GPT run.
    pub(crate) fn same_run(&self, other: &ModelSection) -> bool {
        let decoder = match (&self.decoder, &other.decoder) {
            (Some(a), Some(b)) => (&a.architecture, &a.pack) == (&b.architecture, &b.pack),
            (Some(_), None) => false,
            (None, _) => true,
        };
        decoder
            && (self.precision, &self.config, self.fp8_recipe()) == (other.precision, &other.config, other.fp8_recipe())
    }
}

/// What `latest.toml` (and each checkpoint's `trainer.toml`) records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Latest {
    /// The checkpoint directory's name (`step-NNNNNNN`), relative to the run's directory.
    pub dir: String,
    /// Optimizer steps done.
    pub step: u64,
    /// The model's dropout stream position.
    pub dropout_offset: u64,
    /// Sequences per micro-batch (a resumed run must share it, and the settings below: they
    /// fix the data order and the schedule).
    pub batch: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub seq_length: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Data order seed.
    pub data_seed: u64,
    /// Model (init and dropout) seed.
    pub model_seed: u64,
    /// Ranks of the tensor-parallel group whose files the checkpoint holds (`te checkpoint
    /// split`); absent for a single-GPU checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<usize>,
    /// Ranks of the data-parallel run that wrote it (each read its own shard of every global
    /// batch of `data_parallel × batch` sequences); absent for a single-GPU run. Every rank
    /// holds the same weights and FP8 state, so the files are a single GPU's: a resumed run
    /// must have the same data-parallel size to keep the data order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel: Option<usize>,
    /// The model (absent in checkpoints written before `te generate`).
    #[serde(default)]
    pub model: Option<ModelSection>,
}

/// `latest.toml` (or a `trainer.toml`) at `path`, or `None` when there is none.
///
/// # Errors
/// [`TrainError::Resume`] for an unreadable file (not TOML, or a field this version cannot
/// read, named); [`TrainError::Output`] for an I/O error.
pub fn read_latest(path: &Path) -> Result<Option<Latest>, TrainError> {
    match std::fs::read_to_string(path) {
        Ok(text) => toml::from_str(&text)
            .map(Some)
            .map_err(|e| TrainError::Resume { path: path.to_path_buf(), message: format!("unreadable: {e}") }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TrainError::Output { path: path.to_path_buf(), source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_nn::fp8::Format;

    fn train_config() -> TrainConfig {
        TrainConfig {
            model: GptConfig { seed: 9, ..GptConfig::tiny() },
            steps: 10,
            batch: 8,
            grad_accum: 2,
            lr: 6e-4,
            warmup_steps: 1,
            min_lr: None,
            weight_decay: 0.1,
            max_grad_norm: 1.0,
            eval_interval: 5,
            eval_batches: 1,
            data_seed: 1,
            recipe: DelayedScaling { amax_history_len: 16, ..DelayedScaling::default() }.into(),
            skip_nonfinite_steps: 0,
            cuda_graph: false,
        }
    }

    fn latest(model: Option<ModelSection>) -> Latest {
        Latest {
            dir: "step-0000010".into(),
            step: 10,
            dropout_offset: 20,
            batch: 8,
            grad_accum: 2,
            seq_length: 128,
            lr: 6e-4,
            data_seed: 1,
            model_seed: 1,
            tensor_parallel: None,
            data_parallel: None,
            model,
        }
    }

    /// `latest.toml` round-trips with its model section, and one written before the section
    /// existed still reads (without it); a missing file is `None`, a broken one an error.
    #[test]
    fn latest_toml_round_trips_and_missing_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latest.toml");
        assert!(read_latest(&path).unwrap().is_none());
        let l = latest(Some(ModelSection::new(&train_config(), Precision::Fp8)));
        std::fs::write(&path, toml::to_string(&l).unwrap()).unwrap();
        assert_eq!(read_latest(&path).unwrap(), Some(l.clone()));
        let old = "dir = \"step-0000010\"\nstep = 10\ndropout_offset = 20\nbatch = 8\ngrad_accum = 2\n\
                   seq_length = 128\nlr = 6e-4\ndata_seed = 1\nmodel_seed = 1\n";
        std::fs::write(&path, old).unwrap();
        assert_eq!(read_latest(&path).unwrap(), Some(Latest { model: None, ..l }));
        std::fs::write(&path, "dir = 3").unwrap();
        assert!(matches!(read_latest(&path), Err(TrainError::Resume { .. })));
    }

    /// Every recipe round-trips through the `[model]` table: delayed in `[model.recipe]` (as
    /// every version wrote it), blockwise and current in their own tables beside it.
    #[test]
    fn every_recipe_round_trips_through_the_model_table() {
        let recipes: [Recipe; 3] = [
            DelayedScaling { amax_history_len: 16, fp8_dpa: true, ..Default::default() }.into(),
            Float8BlockScaling { w_block_scaling_dim: 1, ..Default::default() }.into(),
            Float8CurrentScaling { fp8_format: Format::E4M3, amax_epsilon: 1e-6, ..Default::default() }.into(),
        ];
        for (recipe, table) in
            recipes.into_iter().zip(["[model.recipe]", "[model.block_scaling]", "[model.current_scaling]"])
        {
            let cfg = TrainConfig { recipe, ..train_config() };
            let section = ModelSection::new(&cfg, Precision::Fp8);
            assert_eq!(section.fp8_recipe(), recipe);
            let text = toml::to_string(&latest(Some(section.clone()))).unwrap();
            assert!(text.contains(table) && text.contains("[model.recipe]"), "{text}");
            let back: Latest = toml::from_str(&text).unwrap();
            let back = back.model.unwrap();
            assert_eq!(back, section);
            assert!(back.same_run(&section));
            let bf16 = ModelSection::new(&cfg, Precision::Bf16);
            assert!(!back.same_run(&bf16), "another precision is another run");
        }
    }

    /// The `[model]` table of a blockwise run written before the current-scaling table (its
    /// `[model.recipe]` from `te train`'s delayed-scaling flags) still reads, as the blockwise
    /// recipe, and continues a run of that recipe whatever the delayed fields say.
    #[test]
    fn an_older_blockwise_section_reads_and_resumes() {
        let text = r#"
dir = "step-0000003"
step = 3
dropout_offset = 6
batch = 2
grad_accum = 1
seq_length = 32
lr = 0.0006
data_seed = 1234
model_seed = 1234

[model]
precision = "fp8"

[model.config]
vocab_size = 256
hidden_size = 128
num_layers = 2
num_attention_heads = 4
ffn_hidden_size = 512
seq_length = 32
hidden_dropout = 0.1
params_dtype = "bf16"
seed = 1234
fp8_lm_head = false

[model.recipe]
margin = 0.0
fp8_format = "hybrid"
amax_history_len = 16
amax_compute_algo = "most_recent"
reduce_amax = true
fp8_dpa = false

[model.block_scaling]
fp8_format = "e4m3"
power_2_scale = true
amax_epsilon = 0.0
x_block_scaling_dim = 1
w_block_scaling_dim = 2
grad_block_scaling_dim = 1
"#;
        let latest: Latest = toml::from_str(text).unwrap();
        let section = latest.model.unwrap();
        assert_eq!(section.fp8_recipe(), Recipe::Block(Float8BlockScaling::default()));
        assert!(!section.recipe.fp8_mha, "a field added later reads as its default");
        let model = GptConfig { seq_length: 32, seed: 1234, ..GptConfig::tiny() };
        let cfg = TrainConfig { model, recipe: Float8BlockScaling::default().into(), ..train_config() };
        assert!(section.same_run(&ModelSection::new(&cfg, Precision::Fp8)));
    }

    /// A decoder of the family: Gemma 3's features (sandwich norms, scaled embeddings).
    fn gemma_config() -> DecoderConfig {
        let text = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 512,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"]}"#;
        DecoderConfig::from_hf_json(text).unwrap()
    }

    /// A fine-tuning run's `[model.decoder]` round-trips (architecture, packing, source); a
    /// `[model]` table written before it still reads, without it.
    #[test]
    fn the_decoder_section_round_trips_and_older_files_read_without_it() {
        let cfg = gemma_config();
        let decoder = DecoderSection::new(&cfg, Pack::Thd, Some("/models/gemma-3-270m.gguf".into()));
        assert_eq!((decoder.architecture.as_str(), decoder.pack.as_str()), ("Gemma3ForCausalLM", "thd"));
        let section =
            ModelSection { decoder: Some(decoder.clone()), ..ModelSection::new(&train_config(), Precision::Fp8) };
        let text = toml::to_string(&latest(Some(section.clone()))).unwrap();
        assert!(text.contains("[model.decoder]") && text.contains("source = \"/models/gemma-3-270m.gguf\""), "{text}");
        let back: Latest = toml::from_str(&text).unwrap();
        assert_eq!(back.model.as_ref(), Some(&section));
        assert!(back.model.unwrap().same_run(&section));
        // No source: the key is left out, and reads back as none.
        let unsourced = ModelSection { decoder: Some(DecoderSection { source: None, ..decoder }), ..section };
        let text = toml::to_string(&latest(Some(unsourced.clone()))).unwrap();
        assert!(!text.contains("source"), "{text}");
        assert_eq!(toml::from_str::<Latest>(&text).unwrap().model, Some(unsourced));
        // A GPT run's section has no decoder table, and one written before it reads without it.
        let gpt = ModelSection::new(&train_config(), Precision::Bf16);
        let text = toml::to_string(&latest(Some(gpt.clone()))).unwrap();
        assert!(!text.contains("[model.decoder]"), "{text}");
        assert_eq!(toml::from_str::<Latest>(&text).unwrap().model.unwrap().decoder, None);
    }

    /// A fine-tuning run continues a checkpoint of the same architecture and packing wherever
    /// the model file now is; another packing, another architecture or a GPT run does not; a
    /// checkpoint written before the section continues.
    #[test]
    fn same_run_compares_the_decoder_but_not_its_source() {
        let base = ModelSection::new(&train_config(), Precision::Fp8);
        let with = |d: Option<DecoderSection>| ModelSection { decoder: d, ..base.clone() };
        let cfg = gemma_config();
        let ckpt = with(Some(DecoderSection::new(&cfg, Pack::Blocks, Some("/a/model.gguf".into()))));
        assert!(ckpt.same_run(&with(Some(DecoderSection::new(&cfg, Pack::Blocks, Some("/b/moved.gguf".into()))))));
        assert!(ckpt.same_run(&with(Some(DecoderSection::new(&cfg, Pack::Blocks, None)))));
        assert!(!ckpt.same_run(&with(Some(DecoderSection::new(&cfg, Pack::Thd, Some("/a/model.gguf".into()))))));
        let llama = DecoderConfig { sandwich_norm: false, scale_embeddings: false, qk_norm: false, ..cfg.clone() };
        let other = with(Some(DecoderSection::new(&llama, Pack::Blocks, None)));
        assert_eq!(other.decoder.as_ref().unwrap().architecture, "LlamaForCausalLM");
        assert!(!ckpt.same_run(&other));
        assert!(!ckpt.same_run(&base), "a GPT run does not continue a fine-tuning run");
        assert!(base.same_run(&ckpt), "a checkpoint written before the section");
    }

    /// A model section unknown to this version (a field it cannot read) is an error naming it.
    #[test]
    fn a_model_section_this_version_cannot_read_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latest.toml");
        let l = latest(Some(ModelSection::new(&train_config(), Precision::Bf16)));
        let text = toml::to_string(&l).unwrap().replace("params_dtype = \"bf16\"", "params_dtype = \"f8\"");
        std::fs::write(&path, text).unwrap();
        let e = read_latest(&path).unwrap_err().to_string();
        assert!(e.contains("unreadable") && e.contains("f8"), "{e}");
    }
}
