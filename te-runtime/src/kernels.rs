//! In-process kernel cache: spec → loaded module, compiled once even when many threads ask at
//! once (a per-spec lock), through the disk cache of [`te_codegen::KernelCompiler`].

use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use te_codegen::{BinaryKind, KernelCompiler, KernelSpec};

type Slot = Arc<Mutex<Option<Arc<Vec<CudaFunction>>>>>;

/// Loaded kernel modules of one device.
#[derive(Debug)]
pub struct KernelCache {
    compiler: KernelCompiler,
    modules: Mutex<HashMap<KernelSpec, Slot>>,
    loads: AtomicUsize,
}

impl KernelCache {
    /// An empty cache compiling through `compiler`.
    pub fn new(compiler: KernelCompiler) -> Self {
        Self { compiler, modules: Mutex::new(HashMap::new()), loads: AtomicUsize::new(0) }
    }

    /// The compiler (and through it the disk cache).
    pub fn compiler(&self) -> &KernelCompiler {
        &self.compiler
    }

    /// Number of modules loaded.
    pub fn len(&self) -> usize {
        self.modules.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// How many modules were compiled-or-read and loaded so far (each spec counts once).
    pub fn loads(&self) -> usize {
        self.loads.load(Ordering::Relaxed)
    }

    /// The specs loaded so far, sorted: what a run used (a prediction such as
    /// `te_nn::Module::kernel_specs_for` must contain them all).
    pub fn loaded_specs(&self) -> Vec<KernelSpec> {
        let map = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let mut specs: Vec<KernelSpec> = map
            .iter()
            .filter(|(_, slot)| slot.lock().map(|s| s.is_some()).unwrap_or(false))
            .map(|(spec, _)| spec.clone())
            .collect();
        specs.sort();
        specs
    }

    /// True when nothing is loaded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entry point `entry` of `spec` when its module is loaded already (`None` otherwise): what a
    /// CUDA graph capture may use.
    pub fn loaded_function(&self, spec: &KernelSpec, entry: usize) -> Option<Result<CudaFunction>> {
        let slot = self.modules.lock().unwrap_or_else(|p| p.into_inner()).get(spec)?.clone();
        let guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        let funcs = guard.as_ref()?;
        Some(funcs.get(entry).cloned().ok_or_else(|| {
            Error::internal(
                "KernelCache::loaded_function",
                format!("{} has {} entry points, asked for #{entry}", spec.name(), funcs.len()),
            )
        }))
    }

    /// Entry point `entry` of `spec`, compiling (or reading the disk cache) and loading it into
    /// `ctx` on first use. Failures are not cached: a later call tries again.
    ///
    /// # Errors
    /// Compile and module-load failures.
    pub fn function(&self, ctx: &Arc<CudaContext>, spec: &KernelSpec, entry: usize) -> Result<CudaFunction> {
        let slot = {
            let mut map = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            map.entry(spec.clone()).or_default().clone()
        };
        let mut guard = slot.lock().unwrap_or_else(|p| p.into_inner());
        if guard.is_none() {
            let (bin, _) = self.compiler.compile(spec)?;
            let image = match bin.kind {
                BinaryKind::Cubin => Ptx::from_binary(bin.bytes),
                BinaryKind::Ptx => {
                    Ptx::from_src(String::from_utf8_lossy(&bin.bytes).trim_end_matches('\0').to_string())
                }
            };
            let module = ctx.load_module(image)?;
            let funcs = spec.entry_points().iter().map(|e| module.load_function(e)).collect::<Result<Vec<_>, _>>()?;
            *guard = Some(Arc::new(funcs));
            self.loads.fetch_add(1, Ordering::Relaxed);
        }
        let funcs =
            guard.as_ref().ok_or_else(|| Error::internal("KernelCache::function", "a slot empty after load"))?;
        funcs.get(entry).cloned().ok_or_else(|| {
            Error::internal(
                "KernelCache::function",
                format!("{} has {} entry points, asked for #{entry}", spec.name(), funcs.len()),
            )
        })
    }
}
