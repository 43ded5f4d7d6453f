//! Tests of the tokenized data on a tiny SentencePiece vocabulary whose ids are worked out by
//! hand: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3, `a` 4, `b` 5, `c` 6, `ab` 7, then the 256
//! byte tokens (byte `x` at `8 + x`).

use std::collections::HashSet;
use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_models::tokenizer::{SpmVocab, Tokenizer};
use te_models::IGNORE_INDEX;

use super::*;
use crate::data::Batcher;

const EOS: u32 = 1;
const BOS: u32 = 2;
const A: u32 = 4;
const B: u32 = 5;
const C: u32 = 6;
const AB: u32 = 7;

/// The byte token of ASCII `c`.
fn byte(c: char) -> u32 {
    8 + c as u32
}

fn vocab() -> SpmVocab {
    let mut v = SpmVocab { bos: Some(BOS), eos: Some(EOS), add_space_prefix: Some(false), ..SpmVocab::default() };
    let head = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2), ("a", 1), ("b", 1), ("c", 1), ("ab", 1)];
    for (t, ty) in head {
        v.tokens.push(t.into());
        v.token_types.push(ty);
        v.scores.push(if t == "ab" { 1.0 } else { 0.0 });
    }
    for b in 0..=255u8 {
        v.tokens.push(format!("<0x{b:02X}>"));
        v.token_types.push(6);
        v.scores.push(0.0);
    }
    v
}

fn tokenizer() -> Tokenizer {
    Tokenizer::from_spm(vocab()).unwrap()
}

fn tokenizer_with(edit: impl FnOnce(&mut SpmVocab)) -> Tokenizer {
    let mut v = vocab();
    edit(&mut v);
    Tokenizer::from_spm(v).unwrap()
}

fn write(path: &Path, text: impl AsRef<[u8]>) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

#[test]
fn each_document_is_bos_ids_eos() {
    let tok = tokenizer();
    let data = TokenDataset::from_texts(&["abc", "c", "xab"], &tok).unwrap();
    let docs = data.docs();
    assert_eq!(docs.num_documents(), 3);
    assert_eq!(docs.document(0).unwrap(), [BOS, AB, C, EOS]);
    assert_eq!(docs.document(1).unwrap(), [BOS, C, EOS]);
    assert_eq!(docs.document(2).unwrap(), [BOS, byte('x'), AB, EOS]);
    assert_eq!(docs.document(3), None);
    // One stream: EOS between documents, then the next one's BOS.
    assert_eq!(docs.tokens(), [BOS, AB, C, EOS, BOS, C, EOS, BOS, byte('x'), AB, EOS]);
    assert_eq!(docs.offsets(), [0, 4, 7, 11]);
    assert_eq!(data.cache_status(), &CacheStatus::Off);
    assert_eq!(document_ids(&tok, "ab").unwrap(), [BOS, AB, EOS]);

    // No BOS when the tokenizer adds none; one EOS even when the tokenizer appends it itself.
    let plain = tokenizer_with(|v| v.add_bos = Some(false));
    assert_eq!(document_ids(&plain, "ab").unwrap(), [AB, EOS]);
    let eos = tokenizer_with(|v| v.add_eos = Some(true));
    assert_eq!(document_ids(&eos, "ab").unwrap(), [BOS, AB, EOS]);

    let e = document_ids(&tokenizer_with(|v| v.eos = None), "ab").unwrap_err();
    assert!(matches!(e, DataError::NoEos) && e.to_string().contains("no EOS"), "{e}");
    let e = TokenDataset::from_texts(&["ab", ""], &tok).unwrap_err();
    assert!(matches!(&e, DataError::EmptyDocument { origin } if origin == "text 1"), "{e}");
    let none: [&str; 0] = [];
    assert!(matches!(TokenDataset::from_texts(&none, &tok), Err(DataError::NoDocuments { .. })));
}

#[test]
fn sources_are_files_directories_and_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    write(&d.join("corpus/b.txt"), "b");
    write(&d.join("corpus/sub/a.MD"), "\u{feff}a");
    write(&d.join("corpus/sub/skip.json"), "{}");
    write(&d.join("corpus/notes.bin"), [0xff]);
    write(&d.join("corpus/sub/shard.jsonl"), "{\"text\": \"cc\"}\n");
    write(&d.join("rows.jsonl"), "{\"text\": \"c\", \"id\": 1}\n\n  \r\n{\"text\": \"ab\"}\r\n");
    write(&d.join("one.data"), "abc");
    let files = source_files(&[d.join("corpus"), d.join("rows.jsonl"), d.join("one.data")]).unwrap();
    let names: Vec<_> = files.iter().map(|f| (f.path.strip_prefix(d).unwrap().to_path_buf(), f.format)).collect();
    let want = [
        ("corpus/b.txt", SourceFormat::Text),
        ("corpus/sub/a.MD", SourceFormat::Text),
        ("corpus/sub/shard.jsonl", SourceFormat::Jsonl),
        ("rows.jsonl", SourceFormat::Jsonl),
        ("one.data", SourceFormat::Text),
    ];
    assert_eq!(names, want.map(|(p, f)| (std::path::PathBuf::from(p), f)));

    let docs = read_documents(&[d.join("corpus"), d.join("rows.jsonl")]).unwrap();
    let texts: Vec<_> = docs.iter().map(|x| (x.text.as_str(), x.origin.rsplit('/').next().unwrap())).collect();
    // The byte-order mark is dropped; blank lines are skipped, line numbers count them.
    let want = [("b", "b.txt"), ("a", "a.MD"), ("cc", "shard.jsonl:1"), ("c", "rows.jsonl:1"), ("ab", "rows.jsonl:4")];
    assert_eq!(texts, want);

    let data = TokenDataset::build(&[d.join("rows.jsonl"), d.join("corpus")], &tokenizer(), None).unwrap();
    let want = [BOS, C, EOS, BOS, AB, EOS, BOS, B, EOS, BOS, A, EOS, BOS, C, C, EOS];
    assert_eq!(data.docs().tokens(), want);

    let none: [&Path; 0] = [];
    assert!(matches!(source_files(&none), Err(DataError::NoSources)));
    let e = source_files(&[d.join("missing")]).unwrap_err();
    assert!(matches!(&e, DataError::Io { path, .. } if path.ends_with("missing")), "{e}");
    std::fs::create_dir(d.join("empty")).unwrap();
    write(&d.join("empty/x.csv"), "a");
    let e = TokenDataset::build(&[d.join("empty")], &tokenizer(), None).unwrap_err();
    assert!(matches!(e, DataError::NoDocuments { .. }) && e.to_string().contains("txt/md/jsonl"), "{e}");
    write(&d.join("latin1.txt"), b"ab\xe9");
    let e = TokenDataset::build(&[d.join("latin1.txt")], &tokenizer(), None).unwrap_err();
    assert!(matches!(e, DataError::NotUtf8 { at: 2, .. }), "{e}");
    write(&d.join("empty.txt"), "");
    let e = TokenDataset::build(&[d.join("empty.txt")], &tokenizer(), None).unwrap_err();
    assert!(matches!(&e, DataError::EmptyDocument { origin } if origin.ends_with("empty.txt")), "{e}");
}

#[test]
fn jsonl_errors_name_the_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("{\"text\": \"a\"}\n{\"text\": \"b\"", 2, "not JSON"),
        ("{\"text\": \"a\"}\n\n[\"a\"]\n", 3, "a JSON array, not an object"),
        ("{\"body\": \"a\", \"id\": 3}\n", 1, "no \"text\" field (the object has: "),
        ("{\"text\": \"a\"}\n{\"text\": 7}\n", 2, "\"text\" is a number, not a string"),
        ("{\"text\": null}\n", 1, "\"text\" is a null"),
    ];
    for (i, (body, line, says)) in cases.into_iter().enumerate() {
        let path = dir.path().join(format!("bad{i}.jsonl"));
        write(&path, body);
        let e = read_documents(&[&path]).unwrap_err();
        let DataError::Jsonl { path: p, line: l, message } = &e else { panic!("case {i}: {e}") };
        assert_eq!((p, *l), (&path, line), "case {i}: {e}");
        assert!(message.contains(says), "case {i}: {message}");
        assert!(e.to_string().starts_with(&format!("{}:{line}: ", path.display())), "{e}");
        assert!(e.to_string().contains("string \"text\" field"), "{e}");
    }
    // The first bad line in file order is reported, though lines are parsed in parallel.
    let path = dir.path().join("many.jsonl");
    write(&path, "{\"text\": \"a\"}\n".repeat(500) + "1\n" + &"{\"text\": \"a\"}\n".repeat(500) + "2\n");
    assert!(matches!(read_documents(&[&path]), Err(DataError::Jsonl { line: 501, .. })));
    let e = TokenDataset::build(&[&path], &tokenizer(), None).unwrap_err();
    assert!(matches!(e, DataError::Jsonl { line: 501, .. }), "{e}");
}

/// The cache files of a directory.
fn cache_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    files
}

#[test]
fn the_cache_is_reused_until_the_data_or_tokenizer_changes() {
    let dir = tempfile::tempdir().unwrap();
    let (data, cache) = (dir.path().join("data"), dir.path().join("run/cache"));
    write(&data.join("1.txt"), "abc ab");
    write(&data.join("2.jsonl"), "{\"text\": \"cab\"}\n{\"text\": \"b\"}\n");
    let tok = tokenizer();
    let first = TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap();
    assert_eq!(first.cache_status(), &CacheStatus::Written);
    let path = first.cache_path().unwrap().to_path_buf();
    assert_eq!(cache_files(&cache), std::slice::from_ref(&path), "one file, no temporary left behind");
    assert!(path.file_name().unwrap().to_str().unwrap().starts_with("tokens-"));

    let again = TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap();
    assert_eq!(again.cache_status(), &CacheStatus::Hit, "the second run reads the cache");
    assert_eq!(again.docs(), first.docs());
    assert_eq!(again.cache_path(), Some(path.as_path()));
    assert_eq!(again.vocab_size(), tok.vocab_size());
    // The same tokens as without a cache.
    assert_eq!(TokenDataset::build(&[&data], &tok, None).unwrap().docs(), first.docs());

    // Any change of the data or of the tokenizer: another key, tokenized again.
    let other_tok = tokenizer_with(|v| v.scores[7] = -1.0); // "ab" no longer merges first
    let t = TokenDataset::build(&[&data], &other_tok, Some(&cache)).unwrap();
    assert_eq!(t.cache_status(), &CacheStatus::Written);
    assert_ne!(t.cache_path(), Some(path.as_path()));
    let no_bos = TokenDataset::build(&[&data], &tokenizer_with(|v| v.add_bos = Some(false)), Some(&cache)).unwrap();
    assert_eq!(no_bos.cache_status(), &CacheStatus::Written);
    assert_eq!(no_bos.docs().num_tokens(), first.docs().num_tokens() - 3);

    write(&data.join("1.txt"), "abc abc");
    let edited = TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap();
    assert_eq!(edited.cache_status(), &CacheStatus::Written, "edited text");
    assert_ne!(edited.docs(), first.docs());
    write(&data.join("sub/3.md"), "c");
    let added = TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap();
    assert_eq!(added.cache_status(), &CacheStatus::Written, "a new file");
    assert_eq!(added.docs().num_documents(), 4);
    // Back to the first data: its cache file is still there.
    write(&data.join("1.txt"), "abc ab");
    std::fs::remove_file(data.join("sub/3.md")).unwrap();
    assert_eq!(TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap().cache_status(), &CacheStatus::Hit);
}

#[test]
fn a_torn_or_corrupt_cache_is_rebuilt() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("docs.jsonl");
    write(&data, "{\"text\": \"abcabc\"}\n{\"text\": \"ca\"}\n");
    let (tok, cache) = (tokenizer(), dir.path().join("cache"));
    let built = TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap();
    let path = built.cache_path().unwrap().to_path_buf();
    let good = std::fs::read(&path).unwrap();
    // Header 128 bytes + 10 tokens × 4 ([BOS ab c ab c EOS] [BOS c a EOS]) + 3 offsets × 8.
    assert_eq!(good.len(), 128 + 10 * 4 + 3 * 8);

    let mut flipped = good.clone();
    flipped[128 + 5] ^= 1;
    let mut vocab = good.clone();
    vocab[48] ^= 1;
    let mut version = good.clone();
    version[8] = 99;
    let damaged: [(&str, Vec<u8>, &str); 6] = [
        ("truncated", good[..good.len() - 3].to_vec(), "truncated"),
        ("header only", good[..60].to_vec(), "shorter than"),
        ("a flipped token bit", flipped, "checksum"),
        ("another vocabulary size", vocab, "vocabulary size"),
        ("another version", version, "format version 99"),
        ("not a cache", vec![b'x'; good.len()], "magic"),
    ];
    for (what, bytes, says) in damaged {
        std::fs::write(&path, &bytes).unwrap();
        let rebuilt = TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap();
        let CacheStatus::Rebuilt { reason } = rebuilt.cache_status() else {
            panic!("{what}: {:?}", rebuilt.cache_status())
        };
        assert!(reason.contains(says), "{what}: {reason}");
        assert_eq!(rebuilt.docs(), built.docs(), "{what}");
        assert_eq!(std::fs::read(&path).unwrap(), good, "{what}: the file is rewritten whole");
        assert_eq!(TokenDataset::build(&[&data], &tok, Some(&cache)).unwrap().cache_status(), &CacheStatus::Hit);
    }

    // A cache directory that cannot be made: a typed error, not a panic.
    let e = TokenDataset::build(&[&data], &tok, Some(&data.join("cache"))).unwrap_err();
    assert!(matches!(e, DataError::CacheWrite { .. }) && e.to_string().contains("writable"), "{e}");
}

/// `n` documents; document `d` is `len(d)` tokens `d × 1000 + i` (every token distinct).
fn numbered(lens: &[usize]) -> TokenDocs {
    TokenDocs::from_documents(
        lens.iter().enumerate().map(|(d, &n)| (0..n).map(|i| (d * 1000 + i) as u32).collect::<Vec<_>>()),
    )
}

#[test]
fn the_split_holds_out_whole_documents_deterministically() {
    let docs = numbered(&[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]);
    let s = docs.split(0.2, 42).unwrap();
    assert_eq!(s, docs.split(0.2, 42).unwrap(), "the same seed, the same split");
    assert_eq!((s.train.num_documents(), s.val.num_documents()), (8, 2));
    assert_eq!(s.val_documents.len(), 2);
    // Both sides keep the documents whole and in order; together they are all.
    let mut all: Vec<&[u32]> = s.train.documents().chain(s.val.documents()).collect();
    all.sort();
    let mut want: Vec<&[u32]> = docs.documents().collect();
    want.sort();
    assert_eq!(all, want);
    let val: Vec<&[u32]> = s.val_documents.iter().map(|&i| docs.document(i).unwrap()).collect();
    assert_eq!(val, s.val.documents().collect::<Vec<_>>());
    let seeds: HashSet<Vec<usize>> = (0..8).map(|seed| docs.split(0.2, seed).unwrap().val_documents).collect();
    assert!(seeds.len() > 1, "the seed draws the documents");

    // At least one document on each side.
    assert_eq!(docs.split(0.0, 1).unwrap().val.num_documents(), 1);
    assert_eq!(docs.split(1.0, 1).unwrap().train.num_documents(), 1);
    let two = numbered(&[2, 2]);
    let s = two.split(0.5, 3).unwrap();
    assert_eq!((s.train.num_documents(), s.val.num_documents()), (1, 1));

    let e = numbered(&[5]).split(0.1, 0).unwrap_err();
    assert!(matches!(e, DataError::TooFewDocuments { documents: 1 }) && e.to_string().contains("at least 2"), "{e}");
    for bad in [-0.1, 1.5, f64::NAN] {
        assert!(matches!(docs.split(bad, 0), Err(DataError::BadFraction { .. })), "{bad}");
    }
}

#[test]
fn blocks_are_windows_of_the_document_stream() {
    let docs = numbered(&[40, 3, 70, 25]);
    let stream = docs.tokens();
    let (seq, batch) = (16, 5);
    let mut blocks = Batcher::new(9, seq, batch);
    for _ in 0..4 {
        let x = blocks.next(stream, "train").unwrap();
        for b in 0..batch {
            let start = stream.iter().position(|&t| t as i32 == x.ids[b]).unwrap();
            for t in 0..seq {
                assert_eq!(x.ids[t * batch + b], stream[start + t] as i32);
                assert_eq!(x.targets[t * batch + b], stream[start + t + 1] as i32, "across document boundaries");
            }
        }
    }
    // The windows a seed draws do not depend on the token type: bytes and u32 ids agree.
    let bytes: Vec<u8> = (0..200u8).collect();
    let wide: Vec<u32> = bytes.iter().map(|&b| u32::from(b)).collect();
    assert_eq!(
        Batcher::new(3, 8, 4).next(&bytes, "train").unwrap(),
        Batcher::new(3, 8, 4).next(&wide, "train").unwrap()
    );
    // Data-parallel ranks read their parts of the global batch.
    let whole = Batcher::new(5, 8, 6).next(stream, "train").unwrap();
    for rank in 0..3 {
        let part = Batcher::sharded(5, 8, 2, rank, 3).next(stream, "train").unwrap();
        for t in 0..8 {
            assert_eq!(part.ids[t * 2..t * 2 + 2], whole.ids[t * 6 + rank * 2..t * 6 + rank * 2 + 2]);
        }
    }
    let e = Batcher::new(0, 200, 1).next(stream, "validation").unwrap_err();
    assert!(matches!(e, DataError::TooShort { len: 138, need: 201, .. }) && e.to_string().contains("tokens"), "{e}");
}

/// Checks the rules of one `thd` row of `seq` tokens of `docs` (numbered: token `d × 1000 + i`)
/// and returns its sequences' `(document, first index, length)`.
fn check_row(row: &ThdRow, seq: usize) -> Vec<(usize, usize, usize)> {
    assert_eq!((row.ids.len(), row.targets.len(), row.position_ids.len()), (seq, seq, seq));
    let cu: Vec<usize> = row.cu_seqlens.iter().map(|&c| c as usize).collect();
    assert_eq!(cu[0], 0);
    assert!(cu.windows(2).all(|w| w[0] < w[1]), "cu_seqlens increase: {cu:?}");
    assert!(*cu.last().unwrap() <= seq);
    assert_eq!(row.max_seqlen, cu.windows(2).map(|w| w[1] - w[0]).max().unwrap());
    let mut seqs = Vec::new();
    for w in cu.windows(2) {
        let ids = &row.ids[w[0]..w[1]];
        let (doc, first) = (ids[0] as usize / 1000, ids[0] as usize % 1000);
        assert_eq!(first % seq, 0, "pieces are cut every seq tokens of a document");
        for (i, &id) in ids.iter().enumerate() {
            assert_eq!(id as usize, doc * 1000 + first + i, "one document, in order");
            assert_eq!(row.position_ids[w[0] + i], i as i32, "positions restart at each sequence");
            let want = if i + 1 < ids.len() { ids[i + 1] } else { IGNORE_INDEX };
            assert_eq!(row.targets[w[0] + i], want, "targets stay inside the sequence");
        }
        seqs.push((doc, first, ids.len()));
    }
    let tail = *cu.last().unwrap();
    assert!(row.ids[tail..].iter().all(|&t| t == 0), "padding ids");
    assert!(row.targets[tail..].iter().all(|&t| t == IGNORE_INDEX), "padding targets");
    assert!(row.position_ids[tail..].iter().all(|&t| t == 0), "padding positions");
    seqs
}

#[test]
fn thd_rows_hold_every_token_once_within_documents() {
    let mut rng = StdRng::seed_from_u64(7);
    let lens: Vec<usize> = (0..300)
        .map(|_| if rng.random_bool(0.1) { rng.random_range(40..200) } else { rng.random_range(1..40) })
        .collect();
    let docs = numbered(&lens);
    let seq = 64;
    let rows = pack_thd(&docs, seq, 11, "train").unwrap();
    assert_eq!(rows, pack_thd(&docs, seq, 11, "train").unwrap(), "seeded");
    assert_ne!(rows, pack_thd(&docs, seq, 12, "train").unwrap(), "another seed, another order");
    let mut seen = vec![Vec::new(); lens.len()];
    for row in &rows {
        for (doc, first, len) in check_row(row, seq) {
            seen[doc].push((first, len));
        }
    }
    for (d, pieces) in seen.iter_mut().enumerate() {
        pieces.sort_unstable();
        let covered: Vec<usize> = pieces.iter().flat_map(|&(f, n)| f..f + n).collect();
        assert_eq!(covered, (0..lens[d]).collect::<Vec<_>>(), "document {d}: every token exactly once");
    }
    // First fit fills rows: few more rows than the tokens need.
    let total: usize = lens.iter().sum();
    assert!(rows.len() >= total.div_ceil(seq));
    let real: usize = rows.iter().map(ThdRow::real_tokens).sum();
    assert_eq!(real, total);
    assert!((real as f64) / ((rows.len() * seq) as f64) > 0.9, "{} rows for {total} tokens", rows.len());

    // Documents of the real pipeline: EOS ends each, and its target is ignored.
    let tok = tokenizer();
    let data = TokenDataset::from_texts(&["abcabc", "c", "ababab cab", "a"], &tok).unwrap();
    let rows = pack_thd(data.docs(), 6, 0, "train").unwrap();
    let mut eos = 0;
    for row in &rows {
        for (i, &id) in row.ids[..row.real_tokens()].iter().enumerate() {
            if id == EOS as i32 {
                eos += 1;
                assert_eq!(row.targets[i], IGNORE_INDEX, "no target after a document's end");
                assert!(row.cu_seqlens.contains(&(i as i32 + 1)), "a sequence ends at EOS");
            }
            if id == BOS as i32 {
                assert_eq!(row.position_ids[i], 0, "BOS starts a sequence");
            }
        }
    }
    assert_eq!(eos, 4);
}

#[test]
fn thd_batches_shard_like_the_global_batch_across_epochs() {
    let docs = numbered(&[30, 5, 12, 64, 7, 7, 20, 3, 50, 9]);
    let (seq, b, world) = (32, 2, 3);
    let mut whole = ThdPacker::new(&docs, 5, seq, b * world, "train").unwrap();
    let epoch_rows = whole.rows_per_epoch();
    assert_eq!(epoch_rows, pack_thd(&docs, seq, 5, "train").unwrap().len());
    let mut ranks: Vec<ThdPacker> =
        (0..world).map(|r| ThdPacker::sharded(&docs, 5, seq, b, r, world, "train").unwrap()).collect();
    let mut late = ThdPacker::sharded(&docs, 5, seq, b, 2, world, "train").unwrap();
    late.skip(3);
    let steps = 3 * epoch_rows; // several epochs
    for step in 0..steps {
        let g = whole.next_batch();
        assert_eq!((g.rows, g.ids.len()), (b * world, b * world * seq));
        check_batch(&g, seq);
        let parts: Vec<ThdBatch> = ranks.iter_mut().map(ThdPacker::next_batch).collect();
        for (r, part) in parts.iter().enumerate() {
            let rows = r * b * seq..(r + 1) * b * seq;
            assert_eq!(part.ids, g.ids[rows.clone()], "step {step} rank {r}");
            assert_eq!(part.targets, g.targets[rows.clone()]);
            assert_eq!(part.position_ids, g.position_ids[rows]);
        }
        if step == 3 {
            assert_eq!(late.next_batch(), parts[2], "skip counts global batches");
        }
    }
    assert!(whole.epoch() >= 2, "epochs roll over: {}", whole.epoch());

    // Each epoch packs a new document order.
    let mut one = ThdPacker::new(&docs, 5, seq, 1, "train").unwrap();
    let first: Vec<ThdBatch> = (0..epoch_rows).map(|_| one.next_batch()).collect();
    assert_eq!(one.epoch(), 0);
    let second: Vec<ThdBatch> = (0..one.rows_per_epoch().max(1)).map(|_| one.next_batch()).collect();
    assert_eq!(one.epoch(), 1);
    assert_ne!(first, second);
}

/// Checks a batch's tables against its rows' layout.
fn check_batch(g: &ThdBatch, seq: usize) {
    let n = g.num_seqs();
    assert_eq!((g.cu_seqlens.len(), g.cu_seqlens_padded.len()), (n + 1, n + 1));
    assert_eq!(g.cu_seqlens_padded[n] as usize, g.rows * seq);
    for s in 0..n {
        let len = g.cu_seqlens[s + 1] - g.cu_seqlens[s];
        let (start, slot) = (g.cu_seqlens_padded[s] as usize, g.cu_seqlens_padded[s + 1] - g.cu_seqlens_padded[s]);
        assert!(len >= 1 && slot >= len && len as usize <= g.max_seqlen);
        assert_eq!(g.position_ids[start], 0, "sequence {s} starts at its padded offset");
        assert_eq!(g.targets[start + len as usize - 1], IGNORE_INDEX);
    }
    assert_eq!(g.real_tokens(), g.targets.iter().filter(|&&t| t != IGNORE_INDEX).count() + n);
}

#[test]
fn the_thd_order_of_a_seed_is_pinned() {
    // A resumed run must read the data it started with: the generator, the cut and first fit
    // must not change.
    let docs = numbered(&[5, 9, 3, 6, 2]);
    let rows = pack_thd(&docs, 8, 1234, "train").unwrap();
    let cu: Vec<Vec<i32>> = rows.iter().map(|r| r.cu_seqlens.clone()).collect();
    let starts: Vec<Vec<i32>> =
        rows.iter().map(|r| r.cu_seqlens[..r.num_seqs()].iter().map(|&c| r.ids[c as usize]).collect()).collect();
    // Order 4, 1, 2, 0, 3: document 4 opens row 0; document 1's first piece (8 tokens) does not
    // fit there and opens row 1, its 1-token tail joins row 0, as does document 2; document 0 (5)
    // fits no row and opens row 2; document 3 (6) opens row 3.
    assert_eq!(cu, [vec![0, 2, 3, 6], vec![0, 8], vec![0, 5], vec![0, 6]]);
    assert_eq!(starts, [vec![4000, 1008, 2000], vec![1000], vec![0], vec![3000]]);
}

#[test]
fn packing_errors_say_what_to_fix() {
    let docs = numbered(&[4, 4]);
    let e = pack_thd(&docs, 0, 0, "train").unwrap_err();
    assert!(matches!(e, DataError::Zero { name: "seq" }) && e.to_string().contains("at least 1"), "{e}");
    let e = ThdPacker::new(&docs, 0, 8, 0, "train").unwrap_err();
    assert!(matches!(e, DataError::Zero { name: "batch" }), "{e}");
    let empty = TokenDocs::default();
    assert_eq!((empty.num_documents(), empty.num_tokens()), (0, 0));
    let e = ThdPacker::new(&empty, 0, 8, 1, "validation").unwrap_err();
    assert!(matches!(e, DataError::NoTokens { split: "validation" }) && e.to_string().contains("validation"), "{e}");
    // Empty documents (only through TokenDocs::from_documents) are skipped by the packing.
    let holes = TokenDocs::from_documents([vec![], vec![7u32, 8], vec![]]);
    let rows = pack_thd(&holes, 4, 0, "train").unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].cu_seqlens, [0, 2]);
}

#[test]
fn first_fit_takes_the_first_row_with_room_and_grows_past_its_bound() {
    // Sized for no tokens: one row, then more as pieces come.
    let mut fit = pack::FirstFit::new(0, 4);
    let rows: Vec<usize> = [3, 3, 1, 4, 2, 1, 1].into_iter().map(|len| fit.place(len)).collect();
    // Free after each: [1], [1, 1], [0, 1], [0, 1, 0], [0, 1, 0, 2], [0, 0, 0, 2], [0, 0, 0, 1].
    assert_eq!(rows, [0, 1, 0, 2, 3, 1, 3]);
}

/// Damaged data files and token caches (te-nn's checkpoint mutations: bytes flipped, the file
/// cut short, grown, replaced or kept): a `.jsonl`, a text file and the binary cache each build
/// a dataset or are refused with a typed error; a damaged cache is rebuilt, never trusted (its
/// documents equal the fresh tokenization); never a panic.
mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use te_nn::checkpoint::fuzz::{mutation, Mutation};

    /// Builds `name` holding `bytes` (and a cache), returning the documents or the error.
    fn build(name: &str, bytes: &[u8], cache: Option<&Path>) -> Result<TokenDataset, DataError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        write(&path, bytes);
        TokenDataset::build(&[&path], &tokenizer(), cache)
    }

    fn jsonl_case(m: &Mutation) -> Result<(), TestCaseError> {
        let good = b"{\"text\": \"ab c\"}\n{\"text\": \"cab\", \"id\": 2}\n\n{\"text\": \"b\"}\n".to_vec();
        match build("data.jsonl", &m.apply(good), None) {
            Ok(d) => prop_assert!(d.docs().num_documents() >= 1),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        Ok(())
    }

    fn text_case(m: &Mutation) -> Result<(), TestCaseError> {
        match build("data.txt", &m.apply(b"ab c\ncab b\n".to_vec()), None) {
            Ok(d) => prop_assert!(d.docs().num_tokens() >= 1),
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        Ok(())
    }

    fn cache_case(m: &Mutation) -> Result<(), TestCaseError> {
        let dir = tempfile::tempdir().unwrap();
        let (data, cache) = (dir.path().join("data.txt"), dir.path().join("cache"));
        write(&data, "ab c\ncab b\n");
        let fresh = TokenDataset::build(&[&data], &tokenizer(), Some(&cache)).unwrap();
        let file = fresh.cache_path().unwrap().to_path_buf();
        let damaged = m.apply(std::fs::read(&file).unwrap());
        let unchanged = damaged == std::fs::read(&file).unwrap();
        std::fs::write(&file, damaged).unwrap();
        let again = TokenDataset::build(&[&data], &tokenizer(), Some(&cache)).unwrap();
        prop_assert_eq!(again.docs(), fresh.docs());
        if unchanged {
            prop_assert_eq!(again.cache_status(), &CacheStatus::Hit);
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn damaged_jsonl_builds_or_is_refused(m in mutation()) {
            jsonl_case(&m)?;
        }

        #[test]
        fn damaged_text_builds_or_is_refused(m in mutation()) {
            text_case(&m)?;
        }

        #[test]
        fn a_damaged_cache_is_rebuilt_never_trusted(m in mutation()) {
            cache_case(&m)?;
        }
    }
}
