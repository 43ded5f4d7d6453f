//! Test support (`cfg(test)` or the `fuzz` feature): the file mutations the loader fuzz tests apply (reliability issue): bytes flipped,
//! then the file cut short, grown, replaced by other bytes, or kept at its length.

use proptest::prelude::*;

/// How one fuzz case damages a file.
#[derive(Debug, Clone)]
pub struct Mutation {
    flips: Vec<(usize, u8)>,
    cut: usize,
    other: Vec<u8>,
    how: u8,
}

impl Mutation {
    /// `bytes` damaged as this case says.
    pub fn apply(&self, mut bytes: Vec<u8>) -> Vec<u8> {
        for &(i, x) in &self.flips {
            let i = i % bytes.len().max(1);
            if let Some(b) = bytes.get_mut(i) {
                *b ^= x;
            }
        }
        match self.how {
            0 => bytes.truncate(self.cut % (bytes.len() + 1)),
            1 => bytes.extend(&self.other),
            2 => bytes.clone_from(&self.other),
            _ => {}
        }
        bytes
    }
}

/// Up to 5 flipped bytes, then one of the four endings.
pub fn mutation() -> impl Strategy<Value = Mutation> {
    (
        prop::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        any::<usize>(),
        prop::collection::vec(any::<u8>(), 0..64),
        0u8..4,
    )
        .prop_map(|(flips, cut, other, how)| Mutation { flips, cut, other, how })
}
