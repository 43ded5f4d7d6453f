//! A bounds-checked little-endian reader over a file's bytes: every read that would pass the end
//! is a [`Short`] (where, how many bytes were needed, how many were left), which the parser turns
//! into a typed error naming what it was reading. Nothing here allocates from a size read off
//! the file: callers take a slice first, then copy it.

use te_runtime::Error;

/// A read that ran past the end of the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Short {
    /// Byte offset of the read.
    pub at: usize,
    /// Bytes it needed (saturated at `u64::MAX`).
    pub need: u64,
    /// Bytes left after `at`.
    pub left: usize,
}

impl Short {
    /// The checkpoint error of this short read in `source`, while reading `what`.
    pub fn error(self, source: &str, what: &str) -> Error {
        Error::Checkpoint {
            message: format!(
                "{source}: truncated or corrupt GGUF file: reading {what} at byte {} needs {} byte(s), {} left \
                 (download the file again)",
                self.at, self.need, self.left
            ),
        }
    }
}

/// Reads little-endian values from `bytes`, front to back.
pub(crate) struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

macro_rules! read_le {
    ($($name:ident: $t:ty),* $(,)?) => {$(
        /// The next value, little-endian.
        pub fn $name(&mut self) -> Result<$t, Short> {
            let b = self.take_array::<{ std::mem::size_of::<$t>() }>()?;
            Ok(<$t>::from_le_bytes(b))
        }
    )*};
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, pos: 0 }
    }

    /// Bytes read so far (the offset of the next read).
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes left.
    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// The next `n` bytes, or [`Short`] when fewer are left (`n` is checked before any use).
    pub fn take(&mut self, n: u64) -> Result<&'a [u8], Short> {
        let short = Short { at: self.pos, need: n, left: self.remaining() };
        let n = usize::try_from(n).map_err(|_| short)?;
        let end = self.pos.checked_add(n).ok_or(short)?;
        let out = self.bytes.get(self.pos..end).ok_or(short)?;
        self.pos = end;
        Ok(out)
    }

    /// The next `N` bytes as an array.
    pub fn take_array<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    read_le!(u8: u8, i8: i8, u16: u16, i16: i16, u32: u32, i32: i32, u64: u64, i64: i64, f32: f32, f64: f64);

    /// A GGUF string: a `u64` byte length, then that many bytes (not NUL-terminated). The bytes
    /// are returned as they are; the caller checks UTF-8.
    pub fn string_bytes(&mut self) -> Result<&'a [u8], Short> {
        let n = self.u64()?;
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_little_endian_and_stops_at_the_end() {
        let bytes = [1u8, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, b'h', b'i'];
        let mut c = Cursor::new(&bytes);
        assert_eq!(c.u32(), Ok(1));
        assert_eq!(c.string_bytes(), Ok(&b"hi"[..]));
        assert_eq!(c.remaining(), 0);
        assert_eq!(c.u8(), Err(Short { at: 14, need: 1, left: 0 }));
        let mut c = Cursor::new(&bytes);
        assert_eq!(c.take(u64::MAX), Err(Short { at: 0, need: u64::MAX, left: 14 }));
        assert_eq!(c.pos(), 0);
        let e = Short { at: 3, need: 8, left: 2 }.error("x.gguf", "the tensor count");
        assert!(e.to_string().contains("x.gguf") && e.to_string().contains("the tensor count"), "{e}");
    }
}
