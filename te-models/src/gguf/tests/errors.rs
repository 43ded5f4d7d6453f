//! Every way a file is refused: a typed checkpoint error naming the file and what is wrong.

use super::{checkpoint_message, Raw};
use crate::gguf::{GgmlType, GgufFile, GgufWriter};

/// The message of the error `raw` is refused with (it must name `raw.gguf`).
fn refused(raw: &Raw) -> String {
    checkpoint_message(raw.parse().unwrap_err(), "raw.gguf")
}

fn assert_mentions(m: &str, parts: &[&str]) {
    for p in parts {
        assert!(m.contains(p), "`{m}` lacks `{p}`");
    }
}

/// One F32 tensor `t` of 4 elements at `offset`, with its data (16 bytes) at the data section.
fn one_tensor(dims: &[u64], ty: u32, offset: u64) -> Raw {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", dims, ty, offset).pad(32).raw(&[0; 16]);
    r
}

#[test]
fn every_truncation_before_the_end_of_the_data_is_an_error() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "gemma3").unwrap();
    w.add_metadata("tokenizer.ggml.tokens", vec!["a".to_string(), "bc".into()]).unwrap();
    w.add_tensor("w", &[2, 32], GgmlType::Q8_0, &[1.0; 64]).unwrap();
    w.add_tensor("b", &[3], GgmlType::F32, &[1.0; 3]).unwrap();
    let bytes = w.to_bytes().unwrap();
    let file = GgufFile::from_bytes(bytes.clone(), "full.gguf").unwrap();
    let last = file.tensor("b").unwrap().info();
    let end = (file.data_offset() + last.offset() + last.n_bytes()) as usize;
    for n in 0..end {
        let e = GgufFile::from_bytes(bytes[..n].to_vec(), "cut.gguf").unwrap_err();
        let m = checkpoint_message(e, "cut.gguf");
        assert!(m.contains("truncated"), "{n}: {m}");
    }
    // Cutting only the padding after the last tensor loses nothing.
    assert!(GgufFile::from_bytes(bytes[..end].to_vec(), "cut.gguf").is_ok());
}

#[test]
fn bad_magic_and_versions() {
    let mut r = Raw::header(3, 0, 0);
    r.bytes[..4].copy_from_slice(b"GGML");
    assert_mentions(&refused(&r), &["not a GGUF file", "GGML", "47 47 4d 4c"]);
    assert_mentions(&refused(&Raw::header(1, 0, 0)), &["version 1", "no longer"]);
    assert_mentions(&refused(&Raw::header(4, 0, 0)), &["version 4", "not supported"]);
    assert_mentions(&refused(&Raw::header(3u32.swap_bytes(), 0, 0)), &["big-endian"]);
    assert!(Raw::header(2, 0, 0).parse().is_ok() && Raw::header(3, 0, 0).parse().is_ok());
}

#[test]
fn counts_larger_than_the_file_are_refused_before_allocating() {
    for (n_tensors, n_kv) in [(0, u64::MAX), (u64::MAX, 0), (1 << 40, 1 << 40), (1, 0), (0, 1)] {
        assert_mentions(&refused(&Raw::header(3, n_tensors, n_kv)), &["header claims", "truncated"]);
    }
    // A string or array length past the end is a short read, not an allocation.
    let mut r = Raw::header(3, 0, 1);
    r.u64(u64::MAX).raw(&[0; 16]);
    assert_mentions(&refused(&r), &["key of metadata entry 0", "truncated"]);
    let mut r = Raw::header(3, 0, 1);
    r.string("tokens").u32(9).u32(8).u64(u64::MAX / 2).raw(&[0; 16]);
    assert_mentions(&refused(&r), &["`tokens`", "truncated"]);
}

#[test]
fn tensor_data_past_the_end_is_refused() {
    let mut r = one_tensor(&[4], 0, 0);
    r.bytes.truncate(r.bytes.len() - 1);
    assert_mentions(&refused(&r), &["tensor `t`", "past the end", "truncated"]);
    assert_mentions(&refused(&one_tensor(&[4], 0, 32)), &["`t`", "past the end"]);
    assert_mentions(&refused(&one_tensor(&[4], 0, u64::MAX - 31)), &["`t`", "past the end"]);
    assert!(one_tensor(&[4], 0, 0).parse().is_ok());
}

#[test]
fn unknown_types_and_misaligned_offsets_are_named() {
    assert_mentions(&refused(&one_tensor(&[4], 99, 0)), &["tensor `t`", "ggml type id 99", "does not define"]);
    assert_mentions(&refused(&one_tensor(&[4], 4, 0)), &["type id 4"]);
    assert_mentions(&refused(&one_tensor(&[4], 0, 4)), &["`t`", "offset 4", "alignment 32"]);
    // The alignment is the file's own.
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("general.alignment", 8).tensor("t", &[4], 0, 8).pad(8).raw(&[0; 24]);
    assert_eq!(r.parse().unwrap().tensor("t").unwrap().info().offset(), 8);
}

#[test]
fn bad_alignments_are_refused() {
    for (a, want) in [(48, "not a power of two"), (0, "not a power of two")] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", a);
        assert_mentions(&refused(&r), &["general.alignment", want]);
    }
    let mut r = Raw::header(3, 0, 1);
    r.kv_str("general.alignment", "32");
    assert_mentions(&refused(&r), &["`general.alignment`", "string \"32\""]);
}

#[test]
fn duplicates_are_refused() {
    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("a", 1).kv_u32("a", 2);
    assert_mentions(&refused(&r), &["`a` appears twice"]);
    let mut r = Raw::header(3, 2, 0);
    r.tensor("t", &[4], 0, 0).tensor("t", &[4], 0, 0).pad(32).raw(&[0; 16]);
    assert_mentions(&refused(&r), &["tensors 0 and 1", "`t`"]);
}

#[test]
fn bad_shapes_are_refused() {
    assert_mentions(&refused(&one_tensor(&[1, 1, 1, 1, 4], 0, 0)), &["`t`", "5 dimensions"]);
    assert_mentions(&refused(&one_tensor(&[u64::MAX, 2], 0, 0)), &["`t`", "more elements"]);
    assert_mentions(&refused(&one_tensor(&[1 << 62, 4], 0, 0)), &["`t`", "more elements"]);
    // A Q4_K row of 100 elements is not a whole 256-element block; 512 in 2 rows of 256 is.
    let q4k = GgmlType::Q4_K.id();
    assert_mentions(&refused(&one_tensor(&[100, 256], q4k, 0)), &["`t`", "q4_K", "rows of 100", "256-element"]);
    assert_mentions(&refused(&one_tensor(&[128, 2], q4k, 0)), &["rows of 128"]);
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[256, 2], q4k, 0).pad(32).raw(&[0; 288]);
    assert_eq!(r.parse().unwrap().tensor("t").unwrap().shape(), [2, 256]);
}

#[test]
fn bad_metadata_is_named() {
    let mut r = Raw::header(3, 0, 1);
    r.string("k").u32(13).u32(0);
    assert_mentions(&refused(&r), &["`k`", "value type 13"]);
    let mut r = Raw::header(3, 0, 1);
    r.u64(2).raw(&[0xc3, 0x28]).u32(4).u32(0);
    assert_mentions(&refused(&r), &["metadata entry 0", "not UTF-8"]);
    let mut r = Raw::header(3, 1, 0);
    r.u64(1).raw(&[0xff]).u32(1).u64(4).u32(0).u64(0).pad(32).raw(&[0; 16]);
    assert_mentions(&refused(&r), &["name of tensor 0", "not UTF-8"]);
}
