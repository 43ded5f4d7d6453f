//! Round trips through the writer, files written field by field, files on disk.

use super::{checkpoint_message, Bytes, Raw};
use crate::gguf::{GgmlType, GgufFile, GgufWriter, MetadataArray, MetadataValue};
use half::{bf16, f16};

fn every_kind_of_metadata() -> Vec<(&'static str, MetadataValue)> {
    vec![
        ("general.architecture", "gemma3".into()),
        ("gemma3.block_count", 18u32.into()),
        ("gemma3.rope.freq_base", 1e6f32.into()),
        ("gemma3.attention.layer_norm_rms_epsilon", 1e-6f32.into()),
        ("u8", 200u8.into()),
        ("i8", (-100i8).into()),
        ("u16", 60000u16.into()),
        ("i16", (-30000i16).into()),
        ("i32", (-7i32).into()),
        ("u64", (1u64 << 50).into()),
        ("i64", (-(1i64 << 50)).into()),
        ("f64", 0.1f64.into()),
        ("tokenizer.ggml.add_bos_token", true.into()),
        ("tokenizer.ggml.tokens", vec!["<pad>".to_string(), "<eos>".into(), "<bos>".into(), "▁the".into()].into()),
        ("tokenizer.ggml.scores", vec![0.0f32, 0.0, 0.0, -3.5].into()),
        ("tokenizer.ggml.token_type", vec![3i32, 3, 3, 1].into()),
        ("empty", MetadataValue::Array(MetadataArray::U8(vec![]))),
        ("bools", vec![true, false, true].into()),
    ]
}

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut r = Bytes::new(seed);
    (0..n).map(|_| r.uniform(-3.0, 3.0)).collect()
}

#[test]
fn writer_files_read_back_in_both_versions_and_alignments() {
    for (version, alignment) in [(3, 32), (2, 32), (3, 64), (2, 1), (3, 4096)] {
        let mut w = GgufWriter::new();
        w.set_version(version).unwrap();
        w.set_alignment(alignment).unwrap();
        for (k, v) in every_kind_of_metadata() {
            w.add_metadata(k, v).unwrap();
        }
        let (a, b, c, q) = (values(1, 6), values(2, 40), values(3, 24), values(4, 3 * 64));
        w.add_tensor("a.f32", &[2, 3], GgmlType::F32, &a).unwrap();
        w.add_tensor("b.f16", &[2, 4, 5], GgmlType::F16, &b).unwrap();
        w.add_tensor("c.bf16", &[24], GgmlType::BF16, &c).unwrap();
        w.add_tensor("d.q8_0", &[3, 64], GgmlType::Q8_0, &q).unwrap();
        w.add_tensor("scalar", &[], GgmlType::F32, &[2.5]).unwrap();
        let file = GgufFile::from_bytes(w.to_bytes().unwrap(), "w.gguf").unwrap();

        assert_eq!(file.version(), version);
        assert_eq!(file.alignment(), u64::from(alignment));
        assert_eq!(file.data_offset() % u64::from(alignment), 0);
        let meta = file.metadata();
        let explicit = usize::from(alignment != 32);
        assert_eq!(meta.len(), every_kind_of_metadata().len() + explicit);
        for (k, v) in every_kind_of_metadata() {
            assert_eq!(meta.get(k), Some(&v), "{k}");
        }
        assert_eq!(meta.get_u32("general.alignment").ok(), (explicit == 1).then_some(alignment));

        let names: Vec<&str> = file.tensors().iter().map(|t| t.name()).collect();
        assert_eq!(names, ["a.f32", "b.f16", "c.bf16", "d.q8_0", "scalar"]);
        for t in file.tensors() {
            assert_eq!(t.offset() % u64::from(alignment), 0, "{}", t.name());
        }
        let t = file.tensor("b.f16").unwrap();
        assert_eq!((t.info().dims(), t.shape(), t.ggml_type()), (&[5u64, 4, 2][..], vec![2, 4, 5], GgmlType::F16));
        assert_eq!(file.tensor("a.f32").unwrap().to_f32().unwrap(), a);
        let f16s: Vec<f32> = b.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
        assert_eq!(t.to_f32().unwrap(), f16s);
        let bf16s: Vec<bf16> = c.iter().map(|&v| bf16::from_f32(v)).collect();
        assert_eq!(file.tensor("c.bf16").unwrap().to_bf16().unwrap(), bf16s);
        assert_eq!(file.tensor("scalar").unwrap().shape(), Vec::<usize>::new());
        assert_eq!(file.tensor("scalar").unwrap().to_f32().unwrap(), [2.5]);
        // Q8_0: within half a step (d = amax / 127, rounded to f16) of each value.
        let d8 = file.tensor("d.q8_0").unwrap();
        assert_eq!((d8.shape(), d8.data().len()), (vec![3, 64], 6 * 34));
        for (block, (x, y)) in q.chunks(32).zip(d8.to_f32().unwrap().chunks(32)).enumerate() {
            let d = f16::from_f32(x.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0).to_f32();
            for (x, y) in x.iter().zip(y) {
                assert!((x - y).abs() <= d * 0.5 + 127.0 * d * 1e-3, "block {block}: {x} vs {y}");
            }
        }
    }
}

#[test]
fn q8_0_blocks_are_ggmls_reference_quantization() {
    let x = values(9, 64);
    let mut w = GgufWriter::new();
    w.add_tensor("q", &[64], GgmlType::Q8_0, &x).unwrap();
    w.add_tensor("z", &[32], GgmlType::Q8_0, &[0.0; 32]).unwrap();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap(), "q.gguf").unwrap();
    let data = file.tensor("q").unwrap().data();
    for (x, b) in x.chunks(32).zip(data.chunks(34)) {
        let amax = x.iter().map(|v| v.abs()).fold(0.0f32, f32::max);
        let d = amax / 127.0;
        assert_eq!(&b[..2], f16::from_f32(d).to_le_bytes());
        for (v, &q) in x.iter().zip(&b[2..]) {
            assert_eq!(q as i8, (v * (1.0 / d)).round() as i8);
        }
    }
    assert_eq!(file.tensor("z").unwrap().data(), [0u8; 34]);
    assert_eq!(file.tensor("z").unwrap().to_f32().unwrap(), [0.0; 32]);
}

#[test]
fn a_file_written_field_by_field_parses() {
    // Version 2, default alignment, two tensors; the data section starts at the next multiple
    // of 32, the second tensor 32 bytes into it.
    let mut r = Raw::header(2, 2, 2);
    r.kv_str("general.architecture", "llama").kv_u32("llama.block_count", 1);
    r.tensor("x", &[3], 0, 0).tensor("y", &[2, 2], 1, 32).pad(32);
    let start = r.bytes.len();
    r.raw(&[1.0f32, 2.0, -3.0].map(f32::to_le_bytes).concat()).pad(32);
    r.raw(&[0.5f32, 1.0, 2.0, 4.0].map(|v| f16::from_f32(v).to_le_bytes()).concat());
    let file = r.parse().unwrap();
    assert_eq!((file.version(), file.alignment(), file.data_offset()), (2, 32, start as u64));
    assert_eq!(file.metadata().architecture().unwrap(), "llama");
    assert_eq!(file.tensor("x").unwrap().to_f32().unwrap(), [1.0, 2.0, -3.0]);
    let y = file.tensor("y").unwrap();
    assert_eq!((y.shape(), y.info().offset(), y.info().n_bytes()), (vec![2, 2], 32, 8));
    assert_eq!(y.to_f32().unwrap(), [0.5, 1.0, 2.0, 4.0]);
    assert_eq!(file.len_bytes(), (start + 40) as u64);
    // The writer lays the same content out the same way.
    let mut w = GgufWriter::new();
    w.set_version(2).unwrap();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.block_count", 1u32).unwrap();
    w.add_tensor("x", &[3], GgmlType::F32, &[1.0, 2.0, -3.0]).unwrap();
    w.add_tensor("y", &[2, 2], GgmlType::F16, &[0.5, 1.0, 2.0, 4.0]).unwrap();
    let written = w.to_bytes().unwrap();
    assert_eq!(written[..r.bytes.len()], r.bytes[..]);
    assert!(written[r.bytes.len()..].iter().all(|&b| b == 0), "only padding follows");
}

#[test]
fn open_maps_a_file_on_disk_and_names_it_in_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "qwen2").unwrap();
    w.add_tensor("w", &[2, 32], GgmlType::BF16, &values(5, 64)).unwrap();
    w.write(&path).unwrap();
    let file = GgufFile::open(&path).unwrap();
    assert_eq!(file.source(), path.display().to_string());
    assert_eq!(file.tensor("w").unwrap().to_bf16().unwrap().len(), 64);
    assert!(format!("{file:?}").contains("tensors: 1"));
    let names: Vec<_> = file.iter_tensors().map(|t| t.name()).collect();
    assert_eq!(names, ["w"]);
    let m = checkpoint_message(file.tensor("absent").unwrap_err(), "model.gguf");
    assert!(m.contains("`absent`"), "{m}");
    assert!(file.get_tensor("absent").is_none());

    let missing = dir.path().join("missing.gguf");
    let m = checkpoint_message(GgufFile::open(&missing).unwrap_err(), "missing.gguf");
    assert!(m.contains("cannot open"), "{m}");
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    checkpoint_message(GgufFile::open(&empty).unwrap_err(), "empty.gguf");
    let bad = w.write(dir.path().join("no/such/dir/x.gguf")).unwrap_err();
    checkpoint_message(bad, "x.gguf");
}

#[test]
fn raw_tensors_of_any_type_list_and_size() {
    // An IQ2_XXS tensor (66-byte blocks of 256) lists and bounds-checks; it does not decode.
    let mut w = GgufWriter::new();
    w.add_raw_tensor("iq", &[2, 256], GgmlType::IQ2_XXS, vec![0; 132]).unwrap();
    w.add_raw_tensor("k", &[512], GgmlType::Q4_K, vec![0; 288]).unwrap();
    let file = GgufFile::from_bytes(w.to_bytes().unwrap(), "iq.gguf").unwrap();
    let iq = file.tensor("iq").unwrap();
    assert_eq!((iq.ggml_type(), iq.info().n_elements(), iq.data().len()), (GgmlType::IQ2_XXS, 512, 132));
    let m = checkpoint_message(iq.to_f32().unwrap_err(), "iq.gguf");
    assert!(m.contains("`iq`") && m.contains("iq2_xxs") && m.contains("q4_K"), "{m}");
    checkpoint_message(iq.to_bf16().unwrap_err(), "iq.gguf");
    assert_eq!(file.tensor("k").unwrap().to_f32().unwrap(), vec![0.0; 512]);
}

#[test]
fn writer_refuses_what_it_cannot_write() {
    let mut w = GgufWriter::new();
    let refused = |r: te_runtime::Result<()>, want: &str| {
        let m = checkpoint_message(r.unwrap_err(), "GGUF writer");
        assert!(m.contains(want), "{m} lacks {want}");
    };
    refused(w.set_version(1), "version 1");
    refused(w.set_alignment(48), "48");
    refused(w.add_metadata("general.alignment", 64u32), "set_alignment");
    w.add_metadata("k", 1u32).unwrap();
    refused(w.add_metadata("k", 2u32), "twice");
    refused(w.add_tensor("t", &[2, 3], GgmlType::F32, &[0.0; 5]), "6 elements");
    refused(w.add_tensor("t", &[2, 30], GgmlType::Q8_0, &[0.0; 60]), "32-element");
    refused(w.add_tensor("t", &[256], GgmlType::Q4_K, &[0.0; 256]), "not written from f32");
    refused(w.add_tensor("t", &[1, 1, 1, 1, 1], GgmlType::F32, &[0.0]), "5 dims");
    refused(w.add_raw_tensor("t", &[256], GgmlType::Q6_K, vec![0; 209]), "209 bytes");
    w.add_tensor("t", &[1], GgmlType::F32, &[0.0]).unwrap();
    refused(w.add_tensor("t", &[1], GgmlType::F32, &[0.0]), "twice");
}
