//! The parser under damaged files (te-nn's checkpoint mutations: bytes flipped, then the file cut
//! short, grown, replaced or kept): every file parses or is refused with a checkpoint error
//! naming it, and every tensor of one that parses decodes or is refused. Never a panic, never an
//! allocation sized by a corrupt count (the counts and lengths are bounded by the bytes left).

use super::Raw;
use crate::gguf::{GgmlType, GgufFile, GgufWriter};
use proptest::prelude::*;
use te_runtime::Error;

/// A small file of every kind of field: metadata scalars, a string, string and f32 arrays,
/// tensors of plain and block types (written raw, so every decoder is reached).
fn file_bytes() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "gemma3").unwrap();
    w.add_metadata("gemma3.block_count", 18u32).unwrap();
    w.add_metadata("tokenizer.ggml.tokens", vec!["<pad>".to_string(), "a".into()]).unwrap();
    w.add_metadata("tokenizer.ggml.scores", vec![0.0f32, -1.0]).unwrap();
    w.add_metadata("tokenizer.ggml.add_bos_token", true).unwrap();
    w.add_metadata("tokenizer.ggml.model", "llama").unwrap();
    w.add_metadata("tokenizer.ggml.token_type", vec![3i32, 1]).unwrap();
    w.add_tensor("f", &[2, 2], GgmlType::F16, &[1.0, 2.0, 3.0, 4.0]).unwrap();
    w.add_tensor("q", &[32], GgmlType::Q8_0, &[0.5; 32]).unwrap();
    w.add_raw_tensor("k", &[256], GgmlType::Q4_K, (0..144).map(|i| i as u8).collect()).unwrap();
    w.add_raw_tensor("s", &[256], GgmlType::Q6_K, (0..210).map(|i| (i * 7) as u8).collect()).unwrap();
    w.to_bytes().unwrap()
}

/// A version-2 file with alignment 8, written field by field.
fn raw_bytes() -> Vec<u8> {
    let mut r = Raw::header(2, 2, 1);
    r.kv_u32("general.alignment", 8);
    r.tensor("a", &[2], 0, 0).tensor("b", &[32], GgmlType::Q5_0.id(), 8).pad(8);
    r.raw(&[0; 8]).raw(&[1; 22]);
    r.bytes
}

fn parsed_or_refused(data: Vec<u8>) -> Result<(), TestCaseError> {
    match GgufFile::from_bytes(data, "fuzzed.gguf") {
        Ok(file) => {
            for t in file.iter_tensors() {
                for r in [t.to_f32().map(drop), t.to_bf16().map(drop)] {
                    if let Err(e) = r {
                        prop_assert!(matches!(&e, Error::Checkpoint { message } if message.contains("fuzzed")), "{e}");
                    }
                }
            }
            let m = file.metadata();
            // The tokenizer a GGUF file carries builds or is refused (a typed error).
            let _ = crate::tokenizer::Tokenizer::from_gguf(m);
            for r in [m.get_u32("gemma3.block_count").map(drop), m.get_str_array("tokenizer.ggml.tokens").map(drop)] {
                if let Err(e) = r {
                    prop_assert!(matches!(&e, Error::Checkpoint { message } if message.contains("fuzzed")), "{e}");
                }
            }
        }
        Err(e) => prop_assert!(matches!(&e, Error::Checkpoint { message } if message.contains("fuzzed")), "{e}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_files_are_parsed_or_refused(m in te_nn::checkpoint::fuzz::mutation()) {
        parsed_or_refused(m.apply(file_bytes()))?;
    }

    #[test]
    fn mutated_raw_files_are_parsed_or_refused(m in te_nn::checkpoint::fuzz::mutation()) {
        parsed_or_refused(m.apply(raw_bytes()))?;
    }

    /// Field-sized damage: one little-endian u32 or u64 of the header, metadata or tensor table
    /// overwritten with an extreme or random value (counts, lengths, type ids, dims, offsets).
    #[test]
    fn overwritten_fields_are_parsed_or_refused(
        at in 0usize..400,
        wide in any::<bool>(),
        value in prop_oneof![Just(0u64), Just(u64::MAX), Just(u32::MAX as u64), Just(1 << 40), 0u64..64, any::<u64>()],
    ) {
        let mut data = file_bytes();
        let at = at % data.len();
        let bytes = value.to_le_bytes();
        let n = if wide { 8 } else { 4 }.min(data.len() - at);
        data[at..at + n].copy_from_slice(&bytes[..n]);
        parsed_or_refused(data)?;
    }
}

#[test]
fn the_fuzzed_files_parse_undamaged() {
    let file = GgufFile::from_bytes(file_bytes(), "f").unwrap();
    assert_eq!(file.tensors().len(), 4);
    assert!(file.iter_tensors().all(|t| t.to_f32().is_ok()));
    let raw = GgufFile::from_bytes(raw_bytes(), "r").unwrap();
    assert_eq!((raw.version(), raw.alignment(), raw.tensors().len()), (2, 8, 2));
    assert!(raw.iter_tensors().all(|t| t.to_f32().is_ok()));
}
