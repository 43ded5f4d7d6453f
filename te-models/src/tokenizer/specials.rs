//! The text of special tokens matched as whole tokens before a SentencePiece vocabulary splits
//! what is left, llama.cpp's `tokenizer_st_partition` (src/llama-vocab.cpp): every control,
//! unknown and user-defined token is a candidate (`cache_special_tokens`); the longest texts go
//! first, each taking its non-overlapping occurrences left to right in the text that earlier
//! (longer) tokens left over. llama.cpp scans the text once per special token; here one
//! Aho-Corasick pass finds every occurrence of every candidate and the same greedy order picks
//! among them, so a vocabulary with thousands of special tokens costs one pass over the text.
//! llama.cpp's per-model `lstrip`/`rstrip` attributes (Phi-3, Jina) are not modelled.

use std::collections::BTreeMap;

use aho_corasick::{AhoCorasick, MatchKind};

use super::error::{TokenizerError, TokenizerResult};

/// A piece of the text after special tokens are taken out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    /// Text between special tokens (never empty).
    Text(&'a str),
    /// A special token matched in the text.
    Token(u32),
}

/// Finds special tokens in text.
#[derive(Debug, Clone)]
pub(crate) struct SpecialMatcher {
    automaton: AhoCorasick,
    /// The id of each pattern; patterns are in priority order (longest text first, then lowest id).
    ids: Vec<u32>,
}

impl SpecialMatcher {
    /// A matcher of `(id, text)` pairs; `None` when there is nothing to match (empty texts are
    /// never matched).
    pub fn new(mut specials: Vec<(u32, &str)>) -> TokenizerResult<Option<Self>> {
        specials.retain(|(_, t)| !t.is_empty());
        if specials.is_empty() {
            return Ok(None);
        }
        // llama.cpp sorts by length, longest first (its std::sort leaves ties unordered; ids break them here).
        specials.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(&b.0)));
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::Standard)
            .build(specials.iter().map(|(_, t)| t.as_bytes()))
            .map_err(|e| TokenizerError::SpecialMatcher { count: specials.len(), message: e.to_string() })?;
        Ok(Some(Self { automaton, ids: specials.iter().map(|(id, _)| *id).collect() }))
    }

    /// `text` split into special tokens and the text around them, in order.
    pub fn split<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        // Every occurrence of every pattern, in priority order, then left to right.
        let mut found: Vec<(usize, usize, usize)> =
            self.automaton.find_overlapping_iter(text).map(|m| (m.pattern().as_usize(), m.start(), m.end())).collect();
        found.sort_unstable();
        // Greedy: an occurrence is taken when it overlaps nothing taken before it, which is what
        // llama.cpp's fragment-by-fragment search gives (an occurrence overlapping a longer
        // token's would straddle two fragments; one overlapping an earlier occurrence of the same
        // token starts before the search resumes).
        let mut taken: BTreeMap<usize, (usize, u32)> = BTreeMap::new();
        for (pattern, start, end) in found {
            let overlaps = taken.range(..end).next_back().is_some_and(|(_, &(e, _))| e > start);
            if !overlaps {
                taken.insert(start, (end, self.ids[pattern]));
            }
        }
        let mut out = Vec::with_capacity(2 * taken.len() + 1);
        let mut at = 0;
        for (start, (end, id)) in taken {
            if start > at {
                out.push(Fragment::Text(&text[at..start]));
            }
            out.push(Fragment::Token(id));
            at = end;
        }
        if at < text.len() {
            out.push(Fragment::Text(&text[at..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(specials: &[(u32, &str)], text: &'static str) -> Vec<Fragment<'static>> {
        SpecialMatcher::new(specials.to_vec()).unwrap().unwrap().split(text)
    }

    #[test]
    fn tokens_and_text_alternate() {
        use Fragment::*;
        let s = [(7, "<b>"), (8, "<eot>")];
        assert_eq!(split(&s, "<b>hi<eot>"), [Token(7), Text("hi"), Token(8)]);
        assert_eq!(split(&s, "a<b><b>c"), [Text("a"), Token(7), Token(7), Text("c")]);
        assert_eq!(split(&s, "plain"), [Text("plain")]);
        assert_eq!(split(&s, ""), []);
    }

    #[test]
    fn longer_tokens_win_even_when_they_start_later() {
        use Fragment::*;
        // llama.cpp takes "bcd" (longer) first, then finds no "ab" in the "a" left over.
        assert_eq!(split(&[(1, "ab"), (2, "bcd")], "abcd"), [Text("a"), Token(2)]);
        // Equal lengths: the lower id goes first ("xy" before "yz").
        assert_eq!(split(&[(5, "yz"), (4, "xy")], "xyz"), [Token(4), Text("z")]);
        // One token's own occurrences do not overlap: "aaa" in "aaaa" once, leftmost.
        assert_eq!(split(&[(3, "aaa")], "aaaa"), [Token(3), Text("a")]);
    }

    #[test]
    fn nothing_to_match_is_none() {
        assert!(SpecialMatcher::new(vec![]).unwrap().is_none());
        assert!(SpecialMatcher::new(vec![(0, "")]).unwrap().is_none());
    }
}
