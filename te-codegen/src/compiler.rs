//! Spec → rendered source → disk cache or NVRTC → binary.

use crate::cache::{CacheKey, DiskCache};
use crate::nvrtc::{Binary, Nvrtc};
use crate::render::render;
use crate::spec::KernelSpec;
use crate::Result;

/// Whether a kernel came from the disk cache or was compiled now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompileOutcome {
    /// NVRTC compiled it (and it was written to the disk cache, if enabled).
    Compiled,
    /// Read from the disk cache.
    Cached,
}

/// Compiles specs through the disk cache. Thread-safe; needs no GPU.
#[derive(Debug)]
pub struct KernelCompiler {
    nvrtc: Nvrtc,
    cache: DiskCache,
}

impl KernelCompiler {
    /// A compiler over `cache`.
    ///
    /// # Errors
    /// [`crate::Error::NvrtcMissing`] when libnvrtc cannot be loaded.
    pub fn new(cache: DiskCache) -> Result<Self> {
        Ok(Self { nvrtc: Nvrtc::load()?, cache })
    }

    /// A compiler over the cache the environment asks for ([`DiskCache::from_env`]).
    ///
    /// # Errors
    /// As [`KernelCompiler::new`].
    pub fn from_env() -> Result<Self> {
        Self::new(DiskCache::from_env())
    }

    /// The NVRTC in use.
    pub fn nvrtc(&self) -> &Nvrtc {
        &self.nvrtc
    }

    /// The disk cache in use.
    pub fn cache(&self) -> &DiskCache {
        &self.cache
    }

    /// The binary of `spec`, from the disk cache or compiled now.
    ///
    /// # Errors
    /// Invalid specs, template failures and NVRTC compile errors (see [`crate::Error`]).
    pub fn compile(&self, spec: &KernelSpec) -> Result<(Binary, CompileOutcome)> {
        self.compile_with(spec, |cache, key, bin| {
            cache.put(key, bin);
            Ok(())
        })
    }

    /// As [`KernelCompiler::compile`], but a kernel compiled now must reach the disk cache (when
    /// it is enabled): a failed write is an error, not a warning, and does not turn the cache off
    /// ([`DiskCache::try_put`]). What `te prewarm` uses.
    ///
    /// # Errors
    /// As [`KernelCompiler::compile`], and [`crate::Error::CacheWrite`] when the entry cannot be
    /// written.
    pub fn compile_persisted(&self, spec: &KernelSpec) -> Result<(Binary, CompileOutcome)> {
        self.compile_with(spec, DiskCache::try_put)
    }

    fn compile_with(
        &self,
        spec: &KernelSpec,
        store: impl FnOnce(&DiskCache, &CacheKey, &Binary) -> Result<()>,
    ) -> Result<(Binary, CompileOutcome)> {
        let source = render(spec)?;
        let (options, kind) = self.nvrtc.options(spec.arch());
        let key = DiskCache::key(&source, &options, spec.arch(), self.nvrtc.version());
        if let Some(bin) = self.cache.get(&key) {
            return Ok((bin, CompileOutcome::Cached));
        }
        let name = spec.name();
        let start = std::time::Instant::now();
        let bin = self.nvrtc.compile(&name, &source, &options, kind)?;
        tracing::debug!("compiled {name} in {:.1} ms", start.elapsed().as_secs_f64() * 1e3);
        store(&self.cache, &key, &bin)?;
        Ok((bin, CompileOutcome::Compiled))
    }
}
