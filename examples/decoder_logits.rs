//! Runs a decoder LLM (a `.gguf` file or a Hugging Face directory) on texts and prompts and writes
//! what it computed in the files `benches/anchors/compare_logits.py` compares with transformers':
//!
//! - `ids.json`: the token ids our tokenizer gave (`{"texts": [{"name", "ids"}], "prompts": [...]}`,
//!   the input of `benches/anchors/decoder_reference.py`, so both sides see the same ids);
//! - `logits_<name>.npy`: f32 `[T, vocab]` teacher-forced logits of each text's first
//!   `--max-length` tokens (one forward from position 0);
//! - `result.json`: `{"perplexity": {name: {mean_nll, perplexity, tokens}}, "greedy": {name: [ids]}}`
//!   (sliding-window perplexity of each whole text; greedy continuations without an EOS stop).
//!
//! ```text
//! cargo run --release --example decoder_logits -- --model MODEL --out DIR \
//!     --text name=FILE ... --prompt name=TEXT ... [--precision bf16|fp8|fp8-head] [--cpu]
//! ```

use clap::Parser;
use std::path::PathBuf;
use te_models::cpu::decoder::{DecoderPrecision, DecoderRef};
use te_models::decoder::{load_model, CausalLm, DecodeOptions, Decoder, GpuPrecision};
use te_nn::fp8::Recipe;

#[derive(Parser)]
struct Args {
    /// A `.gguf` file or a Hugging Face directory.
    #[arg(long)]
    model: PathBuf,
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// `name=FILE`: a text to score (repeatable).
    #[arg(long)]
    text: Vec<String>,
    /// `name=TEXT`: a prompt to continue greedily (repeatable).
    #[arg(long)]
    prompt: Vec<String>,
    /// bf16, fp8 (the layers' GEMMs, current scaling) or fp8-head (and the LM head).
    #[arg(long, default_value = "bf16")]
    precision: String,
    /// Run the CPU model (f32) instead of the GPU one.
    #[arg(long)]
    cpu: bool,
    /// New tokens per prompt.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Perplexity window and the logits' length.
    #[arg(long, default_value_t = 512)]
    max_length: usize,
    /// Perplexity stride.
    #[arg(long, default_value_t = 256)]
    stride: usize,
}

/// The model on the CPU or the GPU.
enum Runner {
    Cpu(Box<DecoderRef>),
    Gpu(Box<Decoder>),
}

fn split(kv: &str) -> (String, String) {
    let (k, v) = kv.split_once('=').unwrap_or_else(|| panic!("`{kv}` must be name=value"));
    (k.to_string(), v.to_string())
}

fn npy(path: &std::path::Path, data: &[f32], rows: usize, cols: usize) -> std::io::Result<()> {
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(data.iter().flat_map(|x| x.to_le_bytes()));
    std::fs::write(path, bytes)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    std::fs::create_dir_all(&a.out)?;
    let loaded = load_model(&a.model)?;
    let tok = loaded.tokenizer;
    let encode = |s: &str| -> Result<Vec<i32>, Box<dyn std::error::Error>> {
        Ok(tok.encode(s, true)?.into_iter().map(|x| x as i32).collect())
    };
    let texts: Vec<(String, Vec<i32>)> = a
        .text
        .iter()
        .map(|kv| {
            let (name, file) = split(kv);
            Ok((name, encode(&std::fs::read_to_string(file)?)?))
        })
        .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    let prompts: Vec<(String, Vec<i32>)> = a
        .prompt
        .iter()
        .map(|kv| split(kv))
        .map(|(n, p)| Ok((n, encode(&p)?)))
        .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    let list = |v: &[(String, Vec<i32>)]| -> Vec<serde_json::Value> {
        v.iter().map(|(n, ids)| serde_json::json!({"name": n, "ids": ids})).collect()
    };
    let ids_json = serde_json::json!({"texts": list(&texts), "prompts": list(&prompts)});
    std::fs::write(a.out.join("ids.json"), ids_json.to_string())?;

    let mut runner = if a.cpu {
        Runner::Cpu(Box::new(DecoderRef::new(loaded.weights, DecoderPrecision::F32)?))
    } else {
        let precision = match a.precision.as_str() {
            "bf16" => GpuPrecision::Bf16,
            "fp8" => GpuPrecision::Fp8 { recipe: Recipe::Current(Default::default()), lm_head: false },
            "fp8-head" => GpuPrecision::Fp8 { recipe: Recipe::Current(Default::default()), lm_head: true },
            other => return Err(format!("--precision {other}: give bf16, fp8 or fp8-head").into()),
        };
        let dev = te_runtime::Device::new(0)?;
        let m = Decoder::new(&dev, loaded.weights, precision)?;
        eprintln!("parameters on the GPU: {:.1} MB", m.parameter_bytes() as f64 / 1e6);
        Runner::Gpu(Box::new(m))
    };
    let model: &mut dyn CausalLm = match &mut runner {
        Runner::Cpu(m) => m.as_mut(),
        Runner::Gpu(m) => m.as_mut(),
    };
    eprintln!("{}", model.describe());
    let vocab = model.config().vocab_size;
    let mut ppl = serde_json::Map::new();
    for (name, ids) in &texts {
        let head = &ids[..ids.len().min(a.max_length)];
        let logits = match &mut runner {
            Runner::Cpu(m) => m.logits(&[head])?,
            Runner::Gpu(m) => m.logits(&[head])?,
        };
        npy(&a.out.join(format!("logits_{name}.npy")), &logits, head.len(), vocab)?;
        let model: &mut dyn CausalLm = match &mut runner {
            Runner::Cpu(m) => m.as_mut(),
            Runner::Gpu(m) => m.as_mut(),
        };
        let p = model.perplexity(ids, a.max_length, a.stride)?;
        eprintln!("{name}: {} tokens, perplexity {:.4}", ids.len(), p.perplexity);
        ppl.insert(
            name.clone(),
            serde_json::json!({"mean_nll": p.mean_nll, "perplexity": p.perplexity, "tokens": p.tokens}),
        );
    }
    let model: &mut dyn CausalLm = match &mut runner {
        Runner::Cpu(m) => m.as_mut(),
        Runner::Gpu(m) => m.as_mut(),
    };
    let mut greedy = serde_json::Map::new();
    let batch: Vec<Vec<i32>> = prompts.iter().map(|(_, ids)| ids.clone()).collect();
    if !batch.is_empty() {
        let opts = DecodeOptions { stop_at_eos: false, ..DecodeOptions::greedy(a.new_tokens) };
        let out = model.generate(&batch, &opts, &mut |_, _| Ok(()))?;
        for ((name, _), new) in prompts.iter().zip(&out) {
            greedy.insert(name.clone(), serde_json::json!(new));
            let text = tok.decode(&new.iter().map(|&x| x as u32).collect::<Vec<_>>(), true)?;
            eprintln!("{name}: {text:?}");
        }
    }
    std::fs::write(a.out.join("result.json"), serde_json::json!({"perplexity": ppl, "greedy": greedy}).to_string())?;
    Ok(())
}
