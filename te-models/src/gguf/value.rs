//! Metadata values ([`MetadataValue`], [`MetadataArray`]) and their encoding.
//!
//! The GGUF spec (`docs/gguf.md` in ggml; read by `gguf_init_from_file_impl` in
//! `ggml/src/gguf.cpp`): a value is a `u32` type id, then its payload, little-endian:
//!
//! | id | type | payload |
//! |---|---|---|
//! | 0, 1 | `u8`, `i8` | 1 byte |
//! | 2, 3 | `u16`, `i16` | 2 bytes |
//! | 4, 5, 6 | `u32`, `i32`, `f32` | 4 bytes |
//! | 7 | bool | 1 byte (ggml reads any non-zero byte as true) |
//! | 8 | string | `u64` byte length, UTF-8 bytes, no terminator |
//! | 9 | array | `u32` element type id, `u64` count, the elements' payloads |
//! | 10, 11, 12 | `u64`, `i64`, `f64` | 8 bytes |
//!
//! Arrays of arrays are refused, as ggml refuses them.

use super::cursor::{Cursor, Short};
use te_runtime::{Error, Result};

/// GGUF value type ids.
pub(crate) mod type_id {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

macro_rules! values {
    ($($variant:ident($t:ident) = $id:ident, $name:literal, $size:literal;)*) => {
        /// One metadata value of a GGUF file (the spec's `gguf_metadata_value_t`).
        #[derive(Clone, Debug, PartialEq)]
        pub enum MetadataValue {
            $(
                #[doc = concat!("A `", $name, "` (GGUF value type `", stringify!($id), "`).")]
                $variant($t),
            )*
            /// A UTF-8 string (GGUF value type `STRING`).
            String(String),
            /// An array of one element type (GGUF value type `ARRAY`; never nested).
            Array(MetadataArray),
        }

        /// The elements of a metadata array, of one type.
        #[derive(Clone, Debug, PartialEq)]
        pub enum MetadataArray {
            $(
                #[doc = concat!("`", $name, "` elements.")]
                $variant(Vec<$t>),
            )*
            /// UTF-8 string elements (e.g. `tokenizer.ggml.tokens`).
            String(Vec<String>),
        }

        impl MetadataValue {
            /// The value's type as errors print it: `u32`, `string`, `array of f32 (262144)`.
            pub fn type_name(&self) -> String {
                match self {
                    $(MetadataValue::$variant(_) => $name.to_string(),)*
                    MetadataValue::String(_) => "string".to_string(),
                    MetadataValue::Array(a) => format!("array of {} ({})", a.element_type_name(), a.len()),
                }
            }
        }

        impl MetadataArray {
            /// Elements.
            pub fn len(&self) -> usize {
                match self {
                    $(MetadataArray::$variant(v) => v.len(),)*
                    MetadataArray::String(v) => v.len(),
                }
            }

            /// Whether the array has no elements.
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }

            /// The element type's name: `u32`, `string`, ...
            pub fn element_type_name(&self) -> &'static str {
                match self {
                    $(MetadataArray::$variant(_) => $name,)*
                    MetadataArray::String(_) => "string",
                }
            }
        }

        $(
            impl From<$t> for MetadataValue {
                fn from(v: $t) -> Self {
                    MetadataValue::$variant(v)
                }
            }
            impl From<Vec<$t>> for MetadataValue {
                fn from(v: Vec<$t>) -> Self {
                    MetadataValue::Array(MetadataArray::$variant(v))
                }
            }
        )*

        /// Reads the payload of a scalar of type `ty` (not a string or an array).
        fn read_scalar(c: &mut Cursor<'_>, ty: u32) -> Option<Result<MetadataValue, Short>> {
            match ty {
                $(type_id::$id => Some(read_one!(c, $t).map(MetadataValue::$variant)),)*
                _ => None,
            }
        }

        /// Reads `n` fixed-size elements of type `ty` (not strings) in one bounds check.
        fn read_fixed_array(c: &mut Cursor<'_>, ty: u32, n: u64) -> Option<Result<MetadataArray, Short>> {
            match ty {
                $(type_id::$id => Some((|| -> Result<MetadataArray, Short> {
                    let need = n.saturating_mul($size);
                    let bytes = c.take(need)?;
                    Ok(MetadataArray::$variant(bytes.chunks_exact($size).map(|b| decode!($t, b)).collect()))
                })()),)*
                _ => None,
            }
        }

        /// Appends a scalar's type id and payload (`None` for a string or an array).
        fn write_scalar(out: &mut Vec<u8>, v: &MetadataValue) -> bool {
            match v {
                $(MetadataValue::$variant(x) => {
                    out.extend(type_id::$id.to_le_bytes());
                    out.extend(encode!($t, *x));
                    true
                })*
                _ => false,
            }
        }

        /// Appends an array's element type id, count and elements.
        fn write_array(out: &mut Vec<u8>, a: &MetadataArray) {
            match a {
                $(MetadataArray::$variant(v) => {
                    out.extend(type_id::$id.to_le_bytes());
                    out.extend((v.len() as u64).to_le_bytes());
                    for x in v {
                        out.extend(encode!($t, *x));
                    }
                })*
                MetadataArray::String(v) => {
                    out.extend(type_id::STRING.to_le_bytes());
                    out.extend((v.len() as u64).to_le_bytes());
                    for s in v {
                        write_string(out, s);
                    }
                }
            }
        }
    };
}

/// One value of type `$t` off the cursor (bool: any non-zero byte is true, as ggml reads it).
macro_rules! read_one {
    ($c:expr, bool) => {
        $c.u8().map(|b| b != 0)
    };
    ($c:expr, $t:ident) => {
        $c.$t()
    };
}

/// One value of type `$t` from its little-endian bytes `$b` (of its size).
macro_rules! decode {
    (bool, $b:expr) => {
        $b.first().is_some_and(|&x| x != 0)
    };
    ($t:ty, $b:expr) => {{
        let mut a = [0u8; std::mem::size_of::<$t>()];
        a.copy_from_slice($b);
        <$t>::from_le_bytes(a)
    }};
}

/// The little-endian bytes of `$x` of type `$t`.
macro_rules! encode {
    (bool, $x:expr) => {
        [u8::from($x)]
    };
    ($t:ty, $x:expr) => {
        $x.to_le_bytes()
    };
}

values! {
    U8(u8) = U8, "u8", 1;
    I8(i8) = I8, "i8", 1;
    U16(u16) = U16, "u16", 2;
    I16(i16) = I16, "i16", 2;
    U32(u32) = U32, "u32", 4;
    I32(i32) = I32, "i32", 4;
    F32(f32) = F32, "f32", 4;
    Bool(bool) = BOOL, "bool", 1;
    U64(u64) = U64, "u64", 8;
    I64(i64) = I64, "i64", 8;
    F64(f64) = F64, "f64", 8;
}

impl From<String> for MetadataValue {
    fn from(v: String) -> Self {
        MetadataValue::String(v)
    }
}

impl From<&str> for MetadataValue {
    fn from(v: &str) -> Self {
        MetadataValue::String(v.to_string())
    }
}

impl From<Vec<String>> for MetadataValue {
    fn from(v: Vec<String>) -> Self {
        MetadataValue::Array(MetadataArray::String(v))
    }
}

impl From<MetadataArray> for MetadataValue {
    fn from(v: MetadataArray) -> Self {
        MetadataValue::Array(v)
    }
}

/// Where a value is read, for errors: the file and the key.
pub(crate) struct ValueAt<'a> {
    /// The file (its path, or the name given to in-memory bytes).
    pub source: &'a str,
    /// The metadata key.
    pub key: &'a str,
}

impl ValueAt<'_> {
    fn error(&self, message: String) -> Error {
        Error::Checkpoint { message: format!("{}: metadata key `{}`: {message}", self.source, self.key) }
    }

    fn short(&self, s: Short) -> Error {
        s.error(self.source, &format!("the value of metadata key `{}`", self.key))
    }

    fn utf8(&self, bytes: &[u8], index: Option<u64>) -> Result<String> {
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            let which = index.map(|i| format!("string {i}")).unwrap_or_else(|| "the string".into());
            self.error(format!("{which} is not UTF-8 ({e}); the file is corrupt"))
        })
    }
}

/// Reads a value of GGUF type id `ty` (its payload follows at the cursor).
///
/// # Errors
/// [`Error::Checkpoint`] naming the file and the key for a type id GGUF does not define, a nested
/// array, a string that is not UTF-8, or bytes that end before the value does.
pub(crate) fn read_value(c: &mut Cursor<'_>, ty: u32, at: &ValueAt<'_>) -> Result<MetadataValue> {
    if let Some(v) = read_scalar(c, ty) {
        return v.map_err(|s| at.short(s));
    }
    match ty {
        type_id::STRING => {
            let bytes = c.string_bytes().map_err(|s| at.short(s))?;
            Ok(MetadataValue::String(at.utf8(bytes, None)?))
        }
        type_id::ARRAY => {
            let elem = c.u32().map_err(|s| at.short(s))?;
            let n = c.u64().map_err(|s| at.short(s))?;
            if let Some(a) = read_fixed_array(c, elem, n) {
                return a.map(MetadataValue::Array).map_err(|s| at.short(s));
            }
            match elem {
                type_id::STRING => {
                    // Each string takes at least its 8-byte length: no more can fit in what is left.
                    let mut v = Vec::with_capacity(usize::try_from(n).unwrap_or(usize::MAX).min(c.remaining() / 8));
                    for i in 0..n {
                        let bytes = c.string_bytes().map_err(|s| at.short(s))?;
                        v.push(at.utf8(bytes, Some(i))?);
                    }
                    Ok(MetadataValue::Array(MetadataArray::String(v)))
                }
                type_id::ARRAY => Err(at.error("an array of arrays, which ggml does not read either".into())),
                other => Err(at.error(format!("an array of element type {other}, which GGUF does not define (0–12)"))),
            }
        }
        other => Err(at.error(format!("value type {other}, which GGUF does not define (0–12)"))),
    }
}

/// Appends a GGUF string: `u64` byte length, then the bytes.
pub(crate) fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

/// Appends a value: its `u32` type id, then its payload.
pub(crate) fn write_value(out: &mut Vec<u8>, v: &MetadataValue) {
    if write_scalar(out, v) {
        return;
    }
    match v {
        MetadataValue::String(s) => {
            out.extend(type_id::STRING.to_le_bytes());
            write_string(out, s);
        }
        MetadataValue::Array(a) => {
            out.extend(type_id::ARRAY.to_le_bytes());
            write_array(out, a);
        }
        // Scalars were written above.
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(v: MetadataValue) {
        let mut bytes = Vec::new();
        write_value(&mut bytes, &v);
        let mut c = Cursor::new(&bytes);
        let ty = c.u32().unwrap();
        let at = ValueAt { source: "mem", key: "k" };
        assert_eq!(read_value(&mut c, ty, &at).unwrap(), v);
        assert_eq!(c.remaining(), 0);
        // Every cut of the encoding is an error naming the key.
        for n in 4..bytes.len() {
            let mut c = Cursor::new(&bytes[..n]);
            let ty = c.u32().unwrap();
            let e = read_value(&mut c, ty, &at).unwrap_err();
            assert!(e.to_string().contains("`k`"), "{e}");
        }
    }

    #[test]
    fn every_type_round_trips() {
        for v in [
            MetadataValue::U8(7),
            MetadataValue::I8(-7),
            MetadataValue::U16(700),
            MetadataValue::I16(-700),
            MetadataValue::U32(70000),
            MetadataValue::I32(-70000),
            MetadataValue::F32(1.5e-6),
            MetadataValue::Bool(true),
            MetadataValue::Bool(false),
            MetadataValue::U64(1 << 40),
            MetadataValue::I64(-(1 << 40)),
            MetadataValue::F64(1e300),
            "gemma3".into(),
            "".into(),
            vec!["<pad>".to_string(), "▁the".to_string(), String::new()].into(),
            vec![0.5f32, -1.0].into(),
            vec![1i32, 6, 3].into(),
            vec![true, false].into(),
            vec![1u64, 2].into(),
            Vec::<u8>::new().into(),
        ] {
            round_trip(v);
        }
    }

    #[test]
    fn type_names() {
        assert_eq!(MetadataValue::U32(1).type_name(), "u32");
        assert_eq!(MetadataValue::from("x").type_name(), "string");
        assert_eq!(MetadataValue::from(vec![1.0f32; 3]).type_name(), "array of f32 (3)");
    }

    #[test]
    fn bad_types_nested_arrays_and_bad_utf8_are_errors() {
        let at = ValueAt { source: "f.gguf", key: "k" };
        let e = read_value(&mut Cursor::new(&[]), 13, &at).unwrap_err();
        assert!(e.to_string().contains("value type 13"), "{e}");
        let mut nested = type_id::ARRAY.to_le_bytes().to_vec();
        nested.extend(1u64.to_le_bytes());
        let e = read_value(&mut Cursor::new(&nested), type_id::ARRAY, &at).unwrap_err();
        assert!(e.to_string().contains("array of arrays"), "{e}");
        let mut bad = 2u64.to_le_bytes().to_vec();
        bad.extend([0xff, 0xfe]);
        let e = read_value(&mut Cursor::new(&bad), type_id::STRING, &at).unwrap_err();
        assert!(e.to_string().contains("not UTF-8") && e.to_string().contains("f.gguf"), "{e}");
        // A huge array count with few bytes is a short read, not an allocation.
        let mut huge = type_id::STRING.to_le_bytes().to_vec();
        huge.extend(u64::MAX.to_le_bytes());
        let e = read_value(&mut Cursor::new(&huge), type_id::ARRAY, &at).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        let mut huge = type_id::F32.to_le_bytes().to_vec();
        huge.extend(u64::MAX.to_le_bytes());
        assert!(read_value(&mut Cursor::new(&huge), type_id::ARRAY, &at).is_err());
    }
}
