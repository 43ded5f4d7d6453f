//! [`DecoderWeights`]: a decoder's parameters on the host in f32 under the internal names (the
//! table of the [module docs](super)), imported from a Hugging Face directory
//! ([`DecoderWeights::from_hf_dir`]), from Hugging Face-named tensors in memory
//! ([`DecoderWeights::from_hf_tensors`]) or from internal names ([`DecoderWeights::from_tensors`]),
//! every one checked against the configuration, every problem reported at once
//! ([`WeightReport`], as `te_nn::checkpoint` reports a checkpoint that does not match a model).

use super::config::DecoderConfig;
use super::hf_config::{read_hf_config, HfArchitecture};
use super::names::{hf_layout, ParamSource};
use super::safetensors_dir::Checkpoint;
use super::{DecoderError, DecoderResult};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

/// A host tensor in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values (`shape.iter().product()` of them).
    pub data: Vec<f32>,
}

/// Why a checkpoint's tensors do not match a configuration: every problem, by tensor name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightReport {
    /// Tensors the configuration needs that the checkpoint lacks.
    pub missing: Vec<String>,
    /// Tensors of the checkpoint that the configuration has no place for.
    pub unexpected: Vec<String>,
    /// `name: [found] where config.json implies [wanted]`.
    pub mismatched: Vec<String>,
    /// `name: DTYPE` for tensors stored in a dtype other than F32, BF16 and F16.
    pub unsupported_dtype: Vec<String>,
}

impl WeightReport {
    /// Whether nothing is wrong.
    pub fn is_empty(&self) -> bool {
        self.missing.is_empty()
            && self.unexpected.is_empty()
            && self.mismatched.is_empty()
            && self.unsupported_dtype.is_empty()
    }
}

impl fmt::Display for WeightReport {
    /// `missing (n): a, b; unexpected (n): …; mismatched (n): …; unsupported dtype (n): …`, each
    /// list cut after 12 names.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lists = [
            ("missing", &self.missing),
            ("unexpected", &self.unexpected),
            ("mismatched", &self.mismatched),
            ("unsupported dtype (F32, BF16 and F16 are read)", &self.unsupported_dtype),
        ];
        let mut first = true;
        for (what, list) in lists.into_iter().filter(|(_, l)| !l.is_empty()) {
            let shown: Vec<&str> = list.iter().take(12).map(String::as_str).collect();
            let more = if list.len() > 12 { format!(", … and {} more", list.len() - 12) } else { String::new() };
            write!(f, "{}{what} ({}): {}{more}", if first { "" } else { "; " }, list.len(), shown.join(", "))?;
            first = false;
        }
        Ok(())
    }
}

/// What the check knows of one available tensor.
struct Available<'a> {
    shape: &'a [usize],
    /// The dtype's name when it is not one the import reads.
    bad_dtype: Option<&'a str>,
    /// Values when the length is known not to match the shape (internal tensors given in code).
    len_mismatch: Option<usize>,
}

/// The report of `layout` against the `available` tensors (names in the layout's spelling);
/// names `skip` accepts are neither used nor unexpected.
fn check(
    layout: &[ParamSource],
    available: &BTreeMap<String, Available<'_>>,
    skip: impl Fn(&str) -> bool,
) -> WeightReport {
    let mut report = WeightReport::default();
    let mut used = BTreeSet::new();
    for (name, shape) in layout.iter().flat_map(|p| &p.hf) {
        used.insert(name.as_str());
        let Some(a) = available.get(name) else {
            report.missing.push(name.clone());
            continue;
        };
        if a.shape != shape.as_slice() {
            report.mismatched.push(format!("{name}: {:?} where config.json implies {shape:?}", a.shape));
        } else if let Some(n) = a.len_mismatch {
            report.mismatched.push(format!("{name}: {n} values for the shape {shape:?}"));
        }
        if let Some(d) = a.bad_dtype {
            report.unsupported_dtype.push(format!("{name}: {d}"));
        }
    }
    report.unexpected = available.keys().filter(|n| !used.contains(n.as_str()) && !skip(n)).cloned().collect();
    report
}

/// Concatenates each parameter's sources (along dimension 0) from `values` (by source name).
fn assemble(layout: Vec<ParamSource>, values: &mut BTreeMap<String, Vec<f32>>) -> BTreeMap<String, WeightTensor> {
    layout
        .into_iter()
        .map(|p| {
            let mut data = Vec::with_capacity(p.shape.iter().product());
            for (name, _) in &p.hf {
                data.extend(values.remove(name).unwrap_or_default());
            }
            (p.name, WeightTensor { shape: p.shape, data })
        })
        .collect()
}

/// A decoder's parameters in f32 under the internal names, with the configuration they were
/// checked against.
#[derive(Debug, Clone)]
pub struct DecoderWeights {
    cfg: DecoderConfig,
    pub(super) architecture: Option<HfArchitecture>,
    tensors: BTreeMap<String, WeightTensor>,
}

/// The Hugging Face name of `name` under `arch`'s layout in the `model.` spelling of
/// [`hf_layout`], or `None` for a tensor of another part of the checkpoint.
fn canonical(arch: HfArchitecture, name: &str) -> Option<String> {
    if arch.ignored_prefixes().iter().any(|p| name.starts_with(p)) {
        return None;
    }
    if arch == HfArchitecture::Gemma3Multimodal {
        if let Some(rest) = name.strip_prefix("language_model.lm_head.") {
            return Some(format!("lm_head.{rest}"));
        }
    }
    for p in arch.weight_prefixes() {
        if let Some(rest) = name.strip_prefix(p) {
            return Some(format!("model.{rest}"));
        }
    }
    Some(name.to_string())
}

/// Tensors a Hugging Face checkpoint may hold that the model recomputes or shares: RoPE's
/// `inv_freq` buffers of old checkpoints, and `lm_head.weight` of a tied model (transformers
/// ignores it too).
fn skippable(cfg: &DecoderConfig, name: &str) -> bool {
    name.ends_with(".rotary_emb.inv_freq") || (cfg.tie_word_embeddings && name == "lm_head.weight")
}

impl DecoderWeights {
    /// Imports a Hugging Face model directory: `config.json` ([`DecoderConfig::from_hf_config`])
    /// and `model.safetensors` or the shards of `model.safetensors.index.json`, tensors in F32,
    /// BF16 or F16 widened to f32 and mapped onto the internal names (q/k/v and gate/up
    /// concatenated). Tensors of the multimodal Gemma's vision tower and projector are skipped.
    ///
    /// # Errors
    /// The errors of [`DecoderConfig::from_hf_config`]; [`DecoderError::MissingFile`] without
    /// weights; [`DecoderError::Json`] for a bad index or one naming an absent shard;
    /// [`DecoderError::Safetensors`] for unreadable files; [`DecoderError::Weights`] listing every
    /// missing, unexpected, mis-shaped and wrongly typed tensor.
    pub fn from_hf_dir(dir: &Path) -> DecoderResult<Self> {
        let (cfg, arch) = read_hf_config(dir)?;
        let ck = Checkpoint::open(dir)?;
        let mut canonical_names = BTreeMap::new();
        let mut available = BTreeMap::new();
        for (name, e) in &ck.entries {
            if let Some(c) = canonical(arch, name) {
                let bad_dtype = e.float_dtype().is_none().then_some(e.dtype.as_str());
                available.insert(c.clone(), Available { shape: &e.shape, bad_dtype, len_mismatch: None });
                canonical_names.insert(c, name.as_str());
            }
        }
        let layout = hf_layout(&cfg);
        let report = check(&layout, &available, |n| skippable(&cfg, n));
        if !report.is_empty() {
            return Err(DecoderError::Weights { source_name: dir.display().to_string(), report });
        }
        let wanted: BTreeSet<&str> =
            layout.iter().flat_map(|p| &p.hf).filter_map(|(n, _)| canonical_names.get(n.as_str()).copied()).collect();
        let read = ck.read(&wanted)?;
        let mut values: BTreeMap<String, Vec<f32>> =
            read.into_iter().filter_map(|(name, v)| canonical(arch, &name).map(|c| (c, v))).collect();
        let tensors = assemble(layout, &mut values);
        Ok(Self { cfg, architecture: Some(arch), tensors })
    }

    /// Builds weights from Hugging Face-named tensors in memory (names of `LlamaForCausalLM`:
    /// `model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`), checked and mapped as
    /// [`DecoderWeights::from_hf_dir`] does.
    ///
    /// # Errors
    /// [`DecoderError::Config`] for a configuration [`DecoderConfig::validate`] refuses;
    /// [`DecoderError::Weights`] listing every missing, unexpected or mis-shaped tensor.
    pub fn from_hf_tensors(cfg: DecoderConfig, tensors: BTreeMap<String, WeightTensor>) -> DecoderResult<Self> {
        cfg.validate()?;
        let layout = hf_layout(&cfg);
        let available = tensors.iter().map(|(n, t)| (n.clone(), available_of(t))).collect();
        let report = check(&layout, &available, |n| skippable(&cfg, n));
        if !report.is_empty() {
            return Err(DecoderError::Weights { source_name: "Hugging Face tensors".into(), report });
        }
        let mut values = tensors.into_iter().map(|(n, t)| (n, t.data)).collect();
        let tensors = assemble(layout, &mut values);
        Ok(Self { cfg, architecture: None, tensors })
    }

    /// Builds weights from tensors under the internal names (a GPU model's parameters, a
    /// conversion), checked against `cfg`.
    ///
    /// # Errors
    /// [`DecoderError::Config`] for a configuration [`DecoderConfig::validate`] refuses;
    /// [`DecoderError::Weights`] listing every missing, unexpected or mis-shaped tensor (a value
    /// count that does not match its shape counts as mis-shaped).
    pub fn from_tensors(cfg: DecoderConfig, tensors: BTreeMap<String, WeightTensor>) -> DecoderResult<Self> {
        cfg.validate()?;
        let layout: Vec<ParamSource> = hf_layout(&cfg)
            .into_iter()
            .map(|p| ParamSource { hf: vec![(p.name.clone(), p.shape.clone())], ..p })
            .collect();
        let available = tensors.iter().map(|(n, t)| (n.clone(), available_of(t))).collect();
        let report = check(&layout, &available, |_| false);
        if !report.is_empty() {
            return Err(DecoderError::Weights { source_name: "internal tensors".into(), report });
        }
        Ok(Self { cfg, architecture: None, tensors })
    }

    /// The configuration the weights were checked against.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The Hugging Face architecture of the directory or GGUF file they came from (`None` when
    /// built in code).
    pub fn architecture(&self) -> Option<HfArchitecture> {
        self.architecture
    }

    /// The parameter `name` (internal name).
    pub fn get(&self, name: &str) -> Option<&WeightTensor> {
        self.tensors.get(name)
    }

    /// Every parameter by internal name.
    pub fn tensors(&self) -> &BTreeMap<String, WeightTensor> {
        &self.tensors
    }

    /// The configuration and the parameters, by internal name.
    pub fn into_parts(self) -> (DecoderConfig, BTreeMap<String, WeightTensor>) {
        (self.cfg, self.tensors)
    }
}

fn available_of(t: &WeightTensor) -> Available<'_> {
    let n: usize = t.shape.iter().product();
    Available { shape: &t.shape, bad_dtype: None, len_mismatch: (t.data.len() != n).then_some(t.data.len()) }
}
