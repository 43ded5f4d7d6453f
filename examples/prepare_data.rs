//! Tokenizes a corpus with a pretrained model's tokenizer and packs it for training, as `te train
//! --model` does: documents from text files, directories and `.jsonl` files (a
//! `"text"` field a line), each `[BOS] + ids + [EOS]`, cached in a binary token file under
//! `--cache` (a second run reads it back), split by documents, then packed both ways — windows of
//! `seq + 1` tokens across documents, and `thd` rows of whole documents with `cu_seqlens` — and
//! prints what a run would see.
//!
//! ```text
//! cargo run --release --example prepare_data -- --model MODEL --data FILE_OR_DIR ... \
//!     [--cache DIR] [--seq 2048] [--batch 8] [--val 0.05] [--seed 0]
//! ```
//!
//! `MODEL` is a `.gguf` file or a Hugging Face directory: only its tokenizer is read.

use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;
use te_models::decoder::load_tokenizer;
use te_train::data::{pack_thd, Batcher, CacheStatus, TokenDataset};

#[derive(Parser)]
struct Args {
    /// A `.gguf` file or a Hugging Face directory (its tokenizer only).
    #[arg(long)]
    model: PathBuf,
    /// Text files, directories or `.jsonl` files (repeatable).
    #[arg(long, required = true)]
    data: Vec<PathBuf>,
    /// Where the token cache goes (default: no cache).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// Sequences per batch (for the sample batch printed).
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Fraction of the documents held out for validation.
    #[arg(long, default_value_t = 0.05)]
    val: f64,
    /// Seed of the split and the packing order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let t = Instant::now();
    let tokenizer = load_tokenizer(&a.model)?;
    println!(
        "tokenizer of {}: {} tokens, loaded in {:.2} s",
        a.model.display(),
        tokenizer.vocab_size(),
        t.elapsed().as_secs_f64()
    );
    let t = Instant::now();
    let dataset = TokenDataset::build(&a.data, &tokenizer, a.cache.as_deref())?;
    let docs = dataset.docs();
    let how = match dataset.cache_status() {
        CacheStatus::Off => "tokenized (no cache)".to_string(),
        CacheStatus::Hit => "read back from the cache".to_string(),
        CacheStatus::Written => "tokenized and cached".to_string(),
        CacheStatus::Rebuilt { reason } => format!("tokenized again ({reason})"),
    };
    println!(
        "{} documents, {} tokens: {how} in {:.2} s{}",
        docs.num_documents(),
        docs.num_tokens(),
        t.elapsed().as_secs_f64(),
        dataset.cache_path().map(|p| format!(" ({})", p.display())).unwrap_or_default()
    );
    let split = docs.split(a.val, a.seed)?;
    println!(
        "split: {} training documents ({} tokens), {} validation documents ({} tokens)",
        split.train.num_documents(),
        split.train.num_tokens(),
        split.val.num_documents(),
        split.val.num_tokens()
    );
    let blocks = Batcher::new(a.seed, a.seq, a.batch).next(split.train.tokens(), "train")?;
    println!(
        "blocks: {} windows of {} tokens per epoch; a batch is [{}, {}] ids and targets",
        split.train.num_tokens() / (a.seq + 1),
        a.seq + 1,
        a.seq,
        a.batch
    );
    let first: Vec<i32> = (0..16.min(a.seq)).map(|t| blocks.ids[t * a.batch]).collect();
    println!(
        "  the first batch's sequence 0 starts with {first:?}: {:?}",
        tokenizer.decode(&first.iter().map(|&i| i as u32).collect::<Vec<_>>(), false)?
    );
    let t = Instant::now();
    let rows = pack_thd(&split.train, a.seq, a.seed, "train")?;
    let real: usize = rows.iter().map(|r| r.real_tokens()).sum();
    let seqs: usize = rows.iter().map(|r| r.num_seqs()).sum();
    println!(
        "thd: {} rows of {} tokens per epoch, {seqs} document pieces, {:.1} % of the slots real tokens (packed in {:.2} s)",
        rows.len(),
        a.seq,
        100.0 * real as f64 / (rows.len() * a.seq).max(1) as f64,
        t.elapsed().as_secs_f64()
    );
    if let Some(r) = rows.first() {
        let shown: Vec<i32> = r.cu_seqlens.iter().take(8).copied().collect();
        println!(
            "  row 0: cu_seqlens {shown:?}{}, max_seqlen {}",
            if r.cu_seqlens.len() > 8 { " …" } else { "" },
            r.max_seqlen
        );
    }
    Ok(())
}
