//! A file written by llama.cpp's own Python package (gguf-py 0.19.0,
//! `te-models/tests/data/make_gguf_py_fixture.py`): its container and metadata read here, and
//! each type's seeded random blocks (`<type>.raw`) decode to gguf-py's numpy dequantization of
//! them (`<type>.expected`, F32).

use crate::gguf::{GgmlType, GgufFile};
use half::bf16;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/gguf_py_fixture.gguf");

#[test]
fn gguf_py_metadata_reads() {
    let file = GgufFile::open(FIXTURE).unwrap();
    let m = file.metadata();
    assert_eq!((file.version(), file.alignment()), (3, 32));
    assert_eq!(m.architecture().unwrap(), "gemma3");
    assert_eq!(m.get_u32(&m.arch_key("block_count").unwrap()).unwrap(), 18);
    assert_eq!(m.get_u32("gemma3.attention.head_count").unwrap(), 4);
    assert_eq!(m.get_f32("gemma3.rope.freq_base").unwrap(), 1e6);
    assert_eq!(m.get_f32("fixture.f64").unwrap(), -2.5);
    assert_eq!(m.get_i32("fixture.i32").unwrap(), -7);
    assert_eq!(m.get_u64("fixture.u64").unwrap(), 1 << 40);
    assert_eq!(m.get_i32("fixture.i8").unwrap(), -3);
    assert_eq!(m.get_u32("fixture.u16").unwrap(), 65535);
    assert!(m.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(m.get_str("tokenizer.ggml.model").unwrap(), "llama");
    assert_eq!(m.get_str_array("tokenizer.ggml.tokens").unwrap(), ["<pad>", "<eos>", "<bos>", "▁the", "<0x0A>"]);
    assert_eq!(m.get_f32_array("tokenizer.ggml.scores").unwrap(), [0.0, 0.0, 0.0, -3.25, -1000.0]);
    assert_eq!(m.get_i32_array("tokenizer.ggml.token_type").unwrap(), [3, 3, 3, 1, 6]);
    assert_eq!(m.get_u32("tokenizer.ggml.bos_token_id").unwrap(), 2);
    assert_eq!(file.tensors().len(), 22);
}

#[test]
fn gguf_py_blocks_decode_to_gguf_py_values() {
    let file = GgufFile::open(FIXTURE).unwrap();
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ];
    for ty in types {
        let name = ty.name().to_lowercase();
        let raw = file.tensor(&format!("{name}.raw")).unwrap();
        let want = file.tensor(&format!("{name}.expected")).unwrap();
        assert_eq!((raw.ggml_type(), raw.shape()), (ty, vec![3, 256]), "{name}");
        assert_eq!((want.ggml_type(), want.shape()), (GgmlType::F32, vec![3, 256]), "{name}");
        let (got, want) = (raw.to_f32().unwrap(), want.to_f32().unwrap());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{name} element {i}: {g} vs gguf-py {w}");
        }
        let got16 = raw.to_bf16().unwrap();
        assert_eq!(got16, want.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), "{name}");
    }
}
