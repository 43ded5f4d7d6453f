//! Benchmarks: memory-bound kernels against the copy bandwidth measured in the same run, the bulk
//! scale update, cuBLASLt GEMMs in TFLOP/s (FP8 beside BF16), the TE modules forward / backward /
//! both in BF16 and FP8 (both recipes), DotProductAttention fwd+bwd (unfused, TFLOP/s), one GPT
//! training step per preset, generation with the GPT `small` architecture (prefill and decode
//! tokens/s), the decoder's prefill eager against replayed from CUDA graphs, and the JIT costs
//! (NVRTC compile, warm disk cache, prewarm).
//!
//! `cargo bench --bench kernels [-- FILTER...]`, or on the GPU machine `.gpu/bin/kernels-bench
//! --bench [FILTER...]` (benchmarks whose name contains one of the filters; all without).
//! Without a GPU only the JIT benchmarks run. JSON goes to `$OUT/bench-kernels.json` (or
//! `target/bench-kernels.json`); `scripts/bench` runs it beside the PyTorch anchors.

// Benchmark code: a failed setup aborts the run with its message (unwrap, expect).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod harness;

mod activation;
mod attention;
mod breakdown;
mod cast;
mod cast_transpose;
mod decode_attention;
mod decoder;
mod decoder_train;
mod dropout;
mod elementwise;
mod embed;
mod gemm;
mod gemv;
mod generate;
mod gpt;
mod grouped_gemm;
mod jit;
mod linear;
mod modules;
mod moe;
mod norm;
mod optimizer;
mod prefill;
mod rope;
mod scaling;
mod softmax;

use harness::Bench;

fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let dev = if te_runtime::device::gpu_available() {
        Some(te_runtime::Device::new(0).unwrap_or_else(|e| panic!("cannot open the GPU: {e}")))
    } else {
        println!("no GPU: running only the JIT benchmarks");
        None
    };
    let mut b = Bench::new(dev, filters);
    let path = std::env::var_os("OUT").map(std::path::PathBuf::from).unwrap_or_else(|| "target".into());
    let path = path.join("bench-kernels.json");
    let mut failed = 0;
    if b.dev.is_some() {
        println!("device: {}", b.dev().name());
        b.measure_copy_bandwidth();
        let families: [fn(&mut Bench); 28] = [
            cast::run,
            cast_transpose::run,
            activation::run,
            norm::run,
            softmax::run,
            scaling::run,
            elementwise::run,
            optimizer::run,
            rope::run,
            dropout::run,
            gemm::run,
            grouped_gemm::run,
            moe::run,
            linear::run,
            attention::run,
            modules::run,
            gpt::run,
            generate::run,
            embed::run,
            gemv::run,
            decode_attention::run,
            gemv::decode_parts,
            decoder::run,
            prefill::run,
            decoder_train::run,
            decoder_train::layer_parts,
            decoder_train::llama_1b,
            breakdown::run,
        ];
        for run in families {
            // A family that panics (a failed launch, out of memory) is reported and the
            // others still run; the exit status is then 1.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&mut b))).is_err() {
                failed += 1;
            }
            b.write_json(&path);
        }
    }
    jit::run(&mut b);
    b.write_json(&path);
    b.print_table();
    println!("\nJSON written to {}", path.display());
    if failed > 0 {
        eprintln!("ERROR: {failed} benchmark families panicked (messages above); their rows are missing");
        std::process::exit(1);
    }
}
