//! A megabyte of text through a Gemma-sized (262,144-token) SentencePiece vocabulary.

use std::collections::HashSet;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

const VOCAB: usize = 262_144;

/// Random words with every prefix of each (what BPE training leaves), with and without ▁.
fn big_vocab(rng: &mut StdRng) -> (SpmVocab, Vec<String>) {
    // ▁ alone is a token, as in every SentencePiece vocabulary (else a space before a character
    // that is no token falls back to the bytes of ▁).
    let mut v = spm_vocab(&[("▁", -1.0, NORMAL)], true);
    let mut seen: HashSet<String> = v.tokens.iter().cloned().collect();
    let mut words = Vec::new();
    'fill: while v.tokens.len() < VOCAB {
        let len = rng.random_range(2..10);
        let word: String = (0..len).map(|_| char::from(b'a' + rng.random_range(0..26u8))).collect();
        words.push(word.clone());
        for prefix in [String::new(), SPACE_MARK.to_string()] {
            for end in 1..=word.len() {
                let piece = format!("{prefix}{}", &word[..end]);
                if seen.insert(piece.clone()) {
                    v.scores.push(-(end as f32) - rng.random::<f32>());
                    v.tokens.push(piece);
                    v.token_types.push(NORMAL);
                    if v.tokens.len() == VOCAB {
                        break 'fill;
                    }
                }
            }
        }
    }
    (v, words)
}

/// `size` bytes of random words, commas, newlines and multi-byte characters.
fn text(rng: &mut StdRng, words: &[String], size: usize) -> String {
    let mut text = String::with_capacity(size + 64);
    while text.len() < size {
        text.push_str(&words[rng.random_range(0..words.len())]);
        text.push_str(match rng.random_range(0..20) {
            0 => "\n",
            1 => ", é ",
            2 => " 日本😀 ",
            _ => " ",
        });
    }
    text
}

/// Encodes, decodes, checks the round trip; returns the encode time.
fn time(t: &Tokenizer, text: &str, what: &str) -> f64 {
    let start = Instant::now();
    let ids = t.encode(text, true).unwrap();
    let encode = start.elapsed();
    let start = Instant::now();
    let back = t.decode(&ids, true).unwrap();
    let decode = start.elapsed();
    assert!(back == text, "the round trip changed the text");
    eprintln!("{what}: {} bytes → {} ids: encode {encode:?}, decode {decode:?}", text.len(), ids.len());
    encode.as_secs_f64()
}

#[test]
fn a_megabyte_encodes_in_well_under_seconds() {
    let mut rng = StdRng::seed_from_u64(7);
    let (mut vocab, words) = big_vocab(&mut rng);
    let start = Instant::now();
    let t = Tokenizer::from_spm(vocab.clone()).unwrap();
    eprintln!("build {:?}", start.elapsed());
    assert_eq!(t.vocab_size(), VOCAB);

    // Debug builds (the workspace's tests) take 100 kB; release builds time the full megabyte.
    let size = if cfg!(debug_assertions) { 100_000 } else { 1_000_000 };
    let text = text(&mut rng, &words, size);
    // No piece holds a character before ▁: the text is cut into words, each merged alone.
    let cut = time(&t, &text, "cut at spaces");
    // Every pair of the text's characters inside some piece: one queue over the whole text.
    let alphabet: Vec<char> = "abcdefghijklmnopqrstuvwxyz,é日本😀\n▁".chars().collect();
    let mut n = 0;
    for &a in &alphabet {
        for &b in &alphabet {
            let pair = format!("{a}{b}");
            if let Some(i) = vocab.tokens.iter().position(|t| *t == pair) {
                vocab.scores[i] = -2.0;
            } else {
                // In place of the last pieces (the round trip holds whatever the vocabulary).
                n += 1;
                let i = VOCAB - n;
                (vocab.tokens[i], vocab.scores[i]) = (pair, -2.0);
            }
        }
    }
    let t = Tokenizer::from_spm(vocab).unwrap();
    let whole = time(&t, &text, "one queue");
    if !cfg!(debug_assertions) {
        assert!(cut < 1.0 && whole < 3.0, "encoding 1 MB took {cut} s (cut), {whole} s (one queue)");
    }
}
