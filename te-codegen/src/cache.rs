//! The persistent kernel cache.
//!
//! Key: BLAKE3 of the cache schema version, the rendered source, the NVRTC options, the arch and
//! the NVRTC version. Entry: a header (magic, schema, kind, length, BLAKE3 checksum of the
//! payload) and the CUBIN/PTX. Writes go to a temporary file in the same directory that is then
//! renamed over the entry, so readers never see a partial file and concurrent writers of the
//! same entry all succeed. A corrupt or truncated entry is deleted and reported as a miss. An
//! unwritable directory degrades the cache to a no-op with one warning ([`DiskCache::put`]), or
//! is an error where the entry must reach the disk ([`DiskCache::try_put`], `te prewarm`).
//!
//! Location: `$TE_KERNEL_CACHE_DIR` if set, else `<user cache dir>/te/kernels`
//! (`~/.cache/te/kernels` on Linux). `TE_KERNEL_CACHE_DISABLE=1` turns it off.

use crate::nvrtc::{Binary, BinaryKind};
use crate::{Arch, Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Environment variable overriding the cache directory.
pub const CACHE_DIR_ENV: &str = "TE_KERNEL_CACHE_DIR";
/// Environment variable that disables the disk cache when set to anything but `0`/empty.
pub const CACHE_DISABLE_ENV: &str = "TE_KERNEL_CACHE_DISABLE";
/// Version of the entry format and key derivation.
pub const CACHE_SCHEMA: u32 = 1;

const MAGIC: &[u8; 4] = b"TEKC";
const HEADER_LEN: usize = 4 + 4 + 1 + 8 + 32;

/// The on-disk kernel cache (or a disabled one).
#[derive(Debug)]
pub struct DiskCache {
    dir: Option<PathBuf>,
    write_failed: AtomicBool,
}

/// A cache key: hex BLAKE3 digest.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CacheKey(String);

impl CacheKey {
    /// The hex digest.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl DiskCache {
    /// The cache the environment asks for (see the module docs).
    pub fn from_env() -> Self {
        let disabled = std::env::var(CACHE_DISABLE_ENV).map(|v| !v.is_empty() && v != "0").unwrap_or(false);
        if disabled {
            return Self::disabled();
        }
        match Self::default_dir() {
            Some(dir) => Self::at(dir),
            None => Self::disabled(),
        }
    }

    /// The directory [`DiskCache::from_env`] uses, if any.
    pub fn default_dir() -> Option<PathBuf> {
        match std::env::var_os(CACHE_DIR_ENV) {
            Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
            _ => dirs::cache_dir().map(|d| d.join("te").join("kernels")),
        }
    }

    /// A cache in `dir` (created on first write).
    pub fn at(dir: impl Into<PathBuf>) -> Self {
        Self { dir: Some(dir.into()), write_failed: AtomicBool::new(false) }
    }

    /// A cache that stores nothing.
    pub fn disabled() -> Self {
        Self { dir: None, write_failed: AtomicBool::new(false) }
    }

    /// The directory, or `None` when disabled.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The key of a compiled module.
    pub fn key(source: &str, options: &[String], arch: Arch, nvrtc_version: (i32, i32)) -> CacheKey {
        let mut h = blake3::Hasher::new();
        h.update(&CACHE_SCHEMA.to_le_bytes());
        h.update(&(source.len() as u64).to_le_bytes());
        h.update(source.as_bytes());
        for o in options {
            h.update(&(o.len() as u64).to_le_bytes());
            h.update(o.as_bytes());
        }
        h.update(arch.name().as_bytes());
        h.update(&nvrtc_version.0.to_le_bytes());
        h.update(&nvrtc_version.1.to_le_bytes());
        CacheKey(h.finalize().to_hex().to_string())
    }

    fn path(&self, key: &CacheKey) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join(format!("{}.tekc", key.0)))
    }

    /// The entry for `key`, or `None` on a miss. A corrupt or truncated entry is deleted and
    /// counts as a miss.
    pub fn get(&self, key: &CacheKey) -> Option<Binary> {
        let path = self.path(key)?;
        let data = std::fs::read(&path).ok()?;
        match decode(&data) {
            Some(b) => Some(b),
            None => {
                tracing::warn!("discarding corrupt kernel cache entry {}", path.display());
                let _ = std::fs::remove_file(&path);
                None
            }
        }
    }

    /// Stores `binary` under `key` atomically. Failures are not errors: the first one logs a
    /// warning and turns the disk cache off for this process (kernels stay cached in memory).
    /// [`DiskCache::try_put`] is the strict form.
    pub fn put(&self, key: &CacheKey, binary: &Binary) {
        if self.write_failed.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = self.write(key, binary) {
            if !self.write_failed.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    "kernel cache directory {} is not writable ({e}); kernels are cached in memory only. \
                     Set {CACHE_DIR_ENV} to a writable directory or {CACHE_DISABLE_ENV}=1 to silence this",
                    self.dir.as_deref().unwrap_or(Path::new("")).display()
                );
            }
        }
    }

    /// Stores `binary` under `key` atomically, or says why it could not: what `te prewarm` needs,
    /// where an entry that is not on disk is a failure. A disabled cache stores nothing and
    /// succeeds. Unlike [`DiskCache::put`], a failure neither warns nor turns the cache off.
    ///
    /// # Errors
    /// [`Error::CacheWrite`] naming the directory and the I/O error.
    pub fn try_put(&self, key: &CacheKey, binary: &Binary) -> Result<()> {
        self.write(key, binary)
            .map_err(|source| Error::CacheWrite { dir: self.dir.clone().unwrap_or_default(), source })
    }

    fn write(&self, key: &CacheKey, binary: &Binary) -> std::io::Result<()> {
        match self.path(key) {
            Some(path) => write_atomic(&path, &encode(binary)),
            None => Ok(()),
        }
    }

    /// Number of entries and their total size in bytes (0, 0 when disabled or absent).
    pub fn usage(&self) -> (usize, u64) {
        let Some(dir) = &self.dir else { return (0, 0) };
        let Ok(rd) = std::fs::read_dir(dir) else { return (0, 0) };
        rd.filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "tekc"))
            .filter_map(|e| e.metadata().ok())
            .fold((0, 0), |(n, b), m| (n + 1, b + m.len()))
    }
}

fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other(format!("cache entry {} has no directory", path.display())))?;
    if let Err(e) = std::fs::create_dir_all(dir) {
        // `File exists` would hide what is wrong.
        return Err(match dir.metadata() {
            Ok(m) if !m.is_dir() => std::io::Error::new(std::io::ErrorKind::NotADirectory, "it is not a directory"),
            _ => e,
        });
    }
    let mut tmp = tempfile::Builder::new().prefix(".tmp-").tempfile_in(dir)?;
    tmp.write_all(bytes)?;
    tmp.as_file().sync_data()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

fn encode(b: &Binary) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + b.bytes.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&CACHE_SCHEMA.to_le_bytes());
    out.push(match b.kind {
        BinaryKind::Cubin => 0,
        BinaryKind::Ptx => 1,
    });
    out.extend_from_slice(&(b.bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(blake3::hash(&b.bytes).as_bytes());
    out.extend_from_slice(&b.bytes);
    out
}

fn decode(data: &[u8]) -> Option<Binary> {
    if data.len() < HEADER_LEN || &data[..4] != MAGIC {
        return None;
    }
    if u32::from_le_bytes(data[4..8].try_into().ok()?) != CACHE_SCHEMA {
        return None;
    }
    let kind = match data[8] {
        0 => BinaryKind::Cubin,
        1 => BinaryKind::Ptx,
        _ => return None,
    };
    let len = u64::from_le_bytes(data[9..17].try_into().ok()?) as usize;
    let payload = &data[HEADER_LEN..];
    if payload.len() != len || blake3::hash(payload).as_bytes() != &data[17..49] {
        return None;
    }
    Some(Binary { kind, bytes: payload.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 3000, failure_persistence: None, ..ProptestConfig::default() })]

        /// Entries mutated on disk (bytes flipped, cut short, grown, or random bytes) never
        /// decode to anything but the binary that was stored, and never panic (reliability
        /// issue's fuzzing of the cache-entry reader).
        #[test]
        fn mutated_entries_decode_only_as_what_was_stored(
            flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..6),
            cut in any::<usize>(),
            grow in prop::collection::vec(any::<u8>(), 0..24),
            how in 0u8..4,
            ptx in any::<bool>(),
        ) {
            let stored = Binary { kind: if ptx { BinaryKind::Ptx } else { BinaryKind::Cubin }, bytes: (0..200u8).collect() };
            let good = encode(&stored);
            let mut data = good.clone();
            for (i, x) in flips {
                let i = i % data.len();
                data[i] ^= x;
            }
            match how {
                0 => data.truncate(cut % (data.len() + 1)),
                1 => data.extend(&grow),
                2 => data = grow.clone(),
                _ => {}
            }
            if let Some(b) = decode(&data) {
                prop_assert_eq!(&data, &good);
                prop_assert_eq!(b, stored);
            }
        }
    }

    fn bin() -> Binary {
        Binary { kind: BinaryKind::Cubin, bytes: (0..=255u8).cycle().take(5000).collect() }
    }

    #[test]
    fn roundtrip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let cache = DiskCache::at(dir.path());
        let key = DiskCache::key("src", &["-a".into()], Arch::Sm90a, (13, 0));
        assert_eq!(cache.get(&key), None);
        cache.put(&key, &bin());
        assert_eq!(cache.get(&key), Some(bin()));
        assert_eq!(cache.usage().0, 1);

        // Truncated: discarded, then a miss.
        let path = cache.path(&key).unwrap();
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 7]).unwrap();
        assert_eq!(cache.get(&key), None);
        assert!(!path.exists(), "a truncated entry is deleted");

        // A flipped payload byte fails the checksum.
        let mut bad = full.clone();
        bad[HEADER_LEN + 10] ^= 0xff;
        std::fs::write(&path, &bad).unwrap();
        assert_eq!(cache.get(&key), None);
    }

    #[test]
    fn keys_cover_every_input() {
        let base = DiskCache::key("s", &["-o".into()], Arch::Sm90a, (13, 0));
        assert_ne!(base, DiskCache::key("t", &["-o".into()], Arch::Sm90a, (13, 0)));
        assert_ne!(base, DiskCache::key("s", &["-p".into()], Arch::Sm90a, (13, 0)));
        assert_ne!(base, DiskCache::key("s", &["-o".into()], Arch::Sm89, (13, 0)));
        assert_ne!(base, DiskCache::key("s", &["-o".into()], Arch::Sm90a, (13, 1)));
        assert_eq!(base, DiskCache::key("s", &["-o".into()], Arch::Sm90a, (13, 0)));
    }

    #[test]
    fn unwritable_dir_degrades_to_noop() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let cache = DiskCache::at(file.join("sub"));
        let key = DiskCache::key("s", &[], Arch::Sm90a, (13, 0));
        cache.put(&key, &bin());
        cache.put(&key, &bin());
        assert!(cache.write_failed.load(Ordering::Relaxed));
        assert_eq!(cache.get(&key), None);
    }

    #[test]
    fn try_put_says_why_and_does_not_turn_the_cache_off() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let key = DiskCache::key("s", &[], Arch::Sm90a, (13, 0));
        for cache in [DiskCache::at(&file), DiskCache::at(file.join("sub"))] {
            let err = cache.try_put(&key, &bin()).unwrap_err();
            assert!(matches!(&err, Error::CacheWrite { dir, .. } if Some(dir.as_path()) == cache.dir()), "{err}");
            let msg = err.to_string();
            assert!(msg.to_lowercase().contains("not a directory") && msg.contains(CACHE_DIR_ENV), "{msg}");
            assert!(!cache.write_failed.load(Ordering::Relaxed));
        }
        let cache = DiskCache::at(dir.path().join("new"));
        cache.try_put(&key, &bin()).unwrap();
        assert_eq!(cache.get(&key), Some(bin()));
        DiskCache::disabled().try_put(&key, &bin()).unwrap();
    }

    #[test]
    fn concurrent_writers_all_succeed() {
        let dir = tempfile::tempdir().unwrap();
        let key = DiskCache::key("s", &[], Arch::Sm90a, (13, 0));
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    let cache = DiskCache::at(dir.path());
                    for _ in 0..20 {
                        cache.put(&key, &bin());
                        if let Some(b) = cache.get(&key) {
                            assert_eq!(b, bin());
                        }
                    }
                    assert!(!cache.write_failed.load(Ordering::Relaxed));
                });
            }
        });
        assert_eq!(DiskCache::at(dir.path()).get(&key), Some(bin()));
    }
}
