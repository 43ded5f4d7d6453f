//! The SPM encoder against a naive statement of llama.cpp's rule on random vocabularies: merge the
//! adjacent pair whose concatenation is a token of the highest score (ties: the leftmost) until
//! none is left; characters that are no token become their bytes. This checks the priority
//! queue, its stale entries and the cutting of the text where no merge can cross.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;

use super::*;

/// The naive rule: O(n²), no queue, no cutting.
fn naive(scores: &HashMap<String, f32>, text: &str) -> Vec<String> {
    let mut symbols: Vec<String> = text.replace(' ', "▁").chars().map(String::from).collect();
    loop {
        let mut best: Option<(f32, usize)> = None;
        for i in 1..symbols.len() {
            let joined = format!("{}{}", symbols[i - 1], symbols[i]);
            if let Some(&s) = scores.get(&joined) {
                if best.is_none_or(|(b, _)| s > b) {
                    best = Some((s, i - 1));
                }
            }
        }
        let Some((_, i)) = best else { break };
        let right = symbols.remove(i + 1);
        symbols[i].push_str(&right);
    }
    symbols
        .into_iter()
        .flat_map(
            |s| {
                if scores.contains_key(&s) {
                    vec![s]
                } else {
                    s.bytes().map(|b| format!("<0x{b:02X}>")).collect()
                }
            },
        )
        .collect()
}

/// Random pieces over a small alphabet (so that merges, ties and pieces across ▁ happen), with
/// scores from a small set (so that ties happen).
fn pieces() -> impl Strategy<Value = BTreeMap<String, i8>> {
    let piece = prop::collection::vec(prop::sample::select(vec!['a', 'b', 'c', '▁', 'é']), 1..5)
        .prop_map(|c| c.into_iter().collect::<String>());
    prop::collection::btree_map(piece, -3i8..=0, 1..40)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn encode_follows_the_naive_rule(
        pieces in pieces(),
        text in prop::collection::vec(prop::sample::select(vec!['a', 'b', 'c', ' ', 'é', 'x']), 0..40),
    ) {
        let text: String = text.into_iter().collect();
        let list: Vec<(&str, f32, i32)> = pieces.iter().map(|(p, &s)| (p.as_str(), f32::from(s), NORMAL)).collect();
        let t = Tokenizer::from_spm(spm_vocab(&list, true)).unwrap();
        let scores: HashMap<String, f32> = list.iter().map(|&(p, s, _)| (p.to_string(), s)).collect();
        prop_assert_eq!(super::pieces(&t, &text), naive(&scores, &text));
    }
}
