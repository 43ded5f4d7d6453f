//! Streaming UTF-8: the bytes a byte-level model emits (or the pieces of a tokenizer's tokens,
//! `crate::tokenizer::DecodeStream`), printed as text as soon as each character is complete.

/// Turns a stream of bytes into text as it comes: [`Utf8Stream::push`] returns what the byte
/// completes (nothing while a multi-byte character is unfinished), with U+FFFD (the replacement
/// character, as `String::from_utf8_lossy`) for each byte sequence that cannot be UTF-8.
/// Concatenating every return of `push` and [`Utf8Stream::finish`] gives
/// `String::from_utf8_lossy` of all the bytes.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `byte`; returns the text it completes ("" while a character is unfinished).
    pub fn push(&mut self, byte: u8) -> String {
        self.push_bytes(&[byte])
    }

    /// Adds `bytes` (a token's piece); returns the text they complete, as many [`Utf8Stream::push`]
    /// calls would.
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to `valid_up_to` is valid UTF-8.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // An unfinished character at the end: wait for its next byte.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        // Bytes that cannot be UTF-8: one replacement character, then go on after them.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + n);
                        }
                    }
                }
            }
        }
    }

    /// Ends the stream: U+FFFD for an unfinished character, else "".
    pub fn finish(&mut self) -> String {
        if self.pending.is_empty() {
            return String::new();
        }
        self.pending.clear();
        char::REPLACEMENT_CHARACTER.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn stream(bytes: &[u8]) -> Vec<String> {
        let mut s = Utf8Stream::new();
        let mut parts: Vec<String> = bytes.iter().map(|&b| s.push(b)).collect();
        parts.push(s.finish());
        parts
    }

    #[test]
    fn characters_come_out_when_complete() {
        let parts = stream("aé€😀".as_bytes());
        // 'a' at once; 'é' (2 bytes) at its second; '€' (3) at its third; '😀' (4) at its fourth.
        assert_eq!(parts, ["a", "", "é", "", "", "€", "", "", "", "😀", ""]);
    }

    #[test]
    fn bad_bytes_become_replacement_characters() {
        assert_eq!(stream(&[0xff, b'a']).concat(), "\u{fffd}a");
        // A lead byte followed by ASCII: the lead is replaced, the ASCII kept.
        assert_eq!(stream(&[0xe2, 0x82, b'x']).concat(), "\u{fffd}x");
        // A truncated character at the end.
        assert_eq!(stream(&[b'o', b'k', 0xf0, 0x9f]).concat(), "ok\u{fffd}");
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn matches_from_utf8_lossy(bytes in prop::collection::vec(any::<u8>(), 0..40), text in ".{0,12}") {
            prop_assert_eq!(stream(&bytes).concat(), String::from_utf8_lossy(&bytes).into_owned());
            prop_assert_eq!(stream(text.as_bytes()).concat(), text);
        }

        #[test]
        fn chunks_match_bytes(bytes in prop::collection::vec(any::<u8>(), 0..40), cuts in prop::collection::vec(0usize..40, 0..6)) {
            // The same bytes pushed in pieces (a tokenizer's tokens) give the same text.
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
            cuts.sort_unstable();
            let mut s = Utf8Stream::new();
            let mut text = String::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([bytes.len()]) {
                text.push_str(&s.push_bytes(&bytes[at..c]));
                at = c;
            }
            text.push_str(&s.finish());
            prop_assert_eq!(text, String::from_utf8_lossy(&bytes).into_owned());
        }
    }
}
