//! The tokenizer a GGUF file stores in its metadata (llama.cpp's `llama_vocab::load`, gguf-py's
//! `tokenizer.ggml.*` keys): `tokenizer.ggml.model` `llama` is a SentencePiece vocabulary
//! ([`SpmVocab`]: tokens, scores, token types), `gpt2` a byte-level BPE one ([`BpeVocab`]:
//! tokens, token types, merges, the pre-tokenizer `tokenizer.ggml.pre`); the special ids and
//! flags are the `*_token_id` / `add_*_token` / `add_space_prefix` keys, absent ones taking
//! llama.cpp's defaults.

use super::{BpeVocab, SpmVocab, Tokenizer, TokenizerError, TokenizerResult};
use crate::gguf::Metadata;

impl Tokenizer {
    /// The tokenizer of a GGUF file's metadata (see the module docs).
    ///
    /// # Errors
    /// [`TokenizerError::Gguf`] for a missing or mistyped key (naming it);
    /// [`TokenizerError::Unsupported`] for a tokenizer model other than `llama` and `gpt2`
    /// (llama.cpp's `bert`, `t5`, `rwkv`, ...); the vocabulary's own errors (lengths that
    /// disagree, special ids outside the vocabulary, ...).
    pub fn from_gguf(meta: &Metadata) -> TokenizerResult<Tokenizer> {
        let tokens = meta.get_str_array("tokenizer.ggml.tokens")?.to_vec();
        let token_types = meta
            .optional("tokenizer.ggml.token_type", |m, k| m.get_i32_array(k).map(<[i32]>::to_vec))?
            .unwrap_or_default();
        let id = |key: &str| meta.optional(key, Metadata::get_u32);
        let flag = |key: &str| meta.optional(key, Metadata::get_bool);
        let eog =
            [id("tokenizer.ggml.eot_token_id")?, id("tokenizer.ggml.eom_token_id")?].into_iter().flatten().collect();
        let (bos, eos) = (id("tokenizer.ggml.bos_token_id")?, id("tokenizer.ggml.eos_token_id")?);
        let (add_bos, add_eos) = (flag("tokenizer.ggml.add_bos_token")?, flag("tokenizer.ggml.add_eos_token")?);
        match meta.get_str("tokenizer.ggml.model")? {
            "llama" => Tokenizer::from_spm(SpmVocab {
                tokens,
                scores: meta
                    .optional("tokenizer.ggml.scores", |m, k| m.get_f32_array(k).map(<[f32]>::to_vec))?
                    .unwrap_or_default(),
                token_types,
                bos,
                eos,
                unk: id("tokenizer.ggml.unknown_token_id")?,
                eog,
                add_bos,
                add_eos,
                add_space_prefix: flag("tokenizer.ggml.add_space_prefix")?,
            }),
            "gpt2" => Tokenizer::from_bpe(BpeVocab {
                tokens,
                token_types,
                merges: meta.get_str_array("tokenizer.ggml.merges")?.to_vec(),
                pre: meta.optional("tokenizer.ggml.pre", |m, k| m.get_str(k).map(str::to_string))?,
                bos,
                eos,
                eog,
                add_bos,
                add_eos,
            }),
            other => Err(TokenizerError::Unsupported {
                message: format!(
                    "GGUF tokenizer.ggml.model `{other}`: the decoder LLMs' tokenizers are `llama` (SentencePiece) \
                     and `gpt2` (byte-level BPE)"
                ),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{GgufFile, GgufWriter, MetadataValue};

    fn file(entries: Vec<(&str, MetadataValue)>) -> GgufFile {
        let mut w = GgufWriter::new();
        for (k, v) in entries {
            w.add_metadata(k, v).unwrap();
        }
        GgufFile::from_bytes(w.to_bytes().unwrap(), "test.gguf").unwrap()
    }

    fn strings(v: &[&str]) -> MetadataValue {
        v.iter().map(|s| s.to_string()).collect::<Vec<String>>().into()
    }

    /// A SentencePiece vocabulary read from the keys llama.cpp writes: merges by score, BOS
    /// added, EOS known.
    #[test]
    fn a_sentencepiece_vocabulary_reads_from_its_keys() {
        let f = file(vec![
            ("tokenizer.ggml.model", "llama".to_string().into()),
            ("tokenizer.ggml.tokens", strings(&["<pad>", "<eos>", "<bos>", "▁", "a", "b", "▁a", "ab", "▁ab"])),
            ("tokenizer.ggml.scores", vec![0.0f32, 0.0, 0.0, -1.0, -2.0, -2.0, -0.5, -0.7, -0.1].into()),
            ("tokenizer.ggml.token_type", vec![3i32, 3, 3, 1, 1, 1, 1, 1, 1].into()),
            ("tokenizer.ggml.bos_token_id", 2u32.into()),
            ("tokenizer.ggml.eos_token_id", 1u32.into()),
            ("tokenizer.ggml.add_bos_token", true.into()),
            ("tokenizer.ggml.add_space_prefix", false.into()),
        ]);
        let t = Tokenizer::from_gguf(f.metadata()).unwrap();
        assert_eq!((t.bos_id(), t.vocab_size()), (Some(2), 9));
        assert!(t.is_eos(1));
        // " ab": ▁ a b → ▁a (−0.5) beats ab (−0.7) → ▁a b → ▁ab (−0.1).
        assert_eq!(t.encode(" ab", true).unwrap(), [2, 8]);
        assert_eq!(t.decode(&[2, 8], true).unwrap(), " ab");
    }

    /// Missing or mistyped keys and other tokenizer models are typed errors naming them.
    #[test]
    fn bad_metadata_is_named() {
        let e = Tokenizer::from_gguf(file(vec![]).metadata()).unwrap_err().to_string();
        assert!(e.contains("tokenizer.ggml.tokens"), "{e}");
        let e = Tokenizer::from_gguf(
            file(vec![("tokenizer.ggml.model", "t5".to_string().into()), ("tokenizer.ggml.tokens", strings(&["a"]))])
                .metadata(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("`t5`") && e.contains("SentencePiece"), "{e}");
        let e = Tokenizer::from_gguf(
            file(vec![
                ("tokenizer.ggml.model", "llama".to_string().into()),
                ("tokenizer.ggml.tokens", strings(&["a"])),
                ("tokenizer.ggml.bos_token_id", "two".to_string().into()),
            ])
            .metadata(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("tokenizer.ggml.bos_token_id"), "{e}");
    }
}
