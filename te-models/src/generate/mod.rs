//! Text generation's host-side pieces (the generation issue: `te generate`): how the next token is
//! drawn from the logits ([`SamplingConfig`], Hugging Face `generate`'s temperature / top-k /
//! top-p semantics, drawn from the project's Philox stream so that a device sampler can match it
//! bit for bit) and how a byte-level model's output becomes text as it streams ([`Utf8Stream`]).

pub mod decode;
mod sampling;
mod utf8;

pub use sampling::SamplingConfig;
pub use utf8::Utf8Stream;
