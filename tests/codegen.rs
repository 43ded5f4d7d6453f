//! Every kernel the project can produce renders and compiles with NVRTC to an sm_90a (and
//! sm_89) CUBIN, with no GPU. NVRTC missing is a failure here, not a skip.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use te_codegen::catalog::spec_catalog;
use te_codegen::prewarm::prewarm;
use te_codegen::spec::{CastSpec, KernelSpec};
use te_codegen::{Arch, BinaryKind, CompileOutcome, DType, DiskCache, KernelCompiler};
use te_nn::prewarm::ModelConfig;

fn compiler(cache: DiskCache) -> KernelCompiler {
    KernelCompiler::new(cache)
        .expect("NVRTC must be loadable in CI: run the tests through scripts/test, which installs it")
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn compile_all(arch: Arch) {
    let specs = spec_catalog(arch);
    // A cache of this run only: the entry-point checks below read the CUBINs the prewarm
    // compiled instead of compiling a seventh of the catalog twice.
    let dir = tempfile::tempdir().unwrap();
    let c = compiler(DiskCache::at(dir.path()));
    let start = std::time::Instant::now();
    let failures = std::sync::Mutex::new(Vec::new());
    prewarm(&c, &specs, 2, |_, _| {}).unwrap_or_else(|e| {
        failures.lock().unwrap().push(e.to_string());
        Default::default()
    });
    assert!(failures.lock().unwrap().is_empty(), "{:?}", failures.lock().unwrap());
    // Each CUBIN defines every entry point of its spec.
    for spec in specs.iter().step_by(7) {
        let (bin, outcome) = c.compile(spec).unwrap();
        assert_eq!(outcome, CompileOutcome::Cached, "{} was not cached by the prewarm", spec.name());
        assert_eq!(bin.kind, BinaryKind::Cubin);
        assert_eq!(&bin.bytes[..4], b"\x7fELF", "{} is not an ELF CUBIN", spec.name());
        for e in spec.entry_points() {
            assert!(contains(&bin.bytes, e.as_bytes()), "{} lacks entry point {e}", spec.name());
        }
    }
    eprintln!("{} {arch} kernels compiled in {:.1} s", specs.len(), start.elapsed().as_secs_f64());
}

#[test]
fn every_spec_compiles_for_sm90a() {
    compile_all(Arch::Sm90a);
}

#[test]
fn every_spec_compiles_for_sm89() {
    compile_all(Arch::Sm89);
}

#[test]
fn names_and_hashes_are_deterministic_and_distinct() {
    let specs = spec_catalog(Arch::Sm90a);
    let mut names: Vec<String> = specs.iter().map(KernelSpec::name).collect();
    let mut hashes: Vec<String> = specs.iter().map(KernelSpec::hash).collect();
    assert_eq!(names, spec_catalog(Arch::Sm90a).iter().map(KernelSpec::name).collect::<Vec<_>>());
    for n in &names {
        assert!(n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "{n} is not a C identifier");
    }
    names.sort();
    names.dedup();
    hashes.sort();
    hashes.dedup();
    assert_eq!(names.len(), specs.len());
    assert_eq!(hashes.len(), specs.len());
}

#[test]
fn disk_cache_hits_after_first_compile() {
    let dir = tempfile::tempdir().unwrap();
    let spec: KernelSpec = CastSpec::quantize(DType::BF16, DType::E4M3, Arch::Sm90a).into();
    let (first, o1) = compiler(DiskCache::at(dir.path())).compile(&spec).unwrap();
    let (second, o2) = compiler(DiskCache::at(dir.path())).compile(&spec).unwrap();
    assert_eq!((o1, o2), (CompileOutcome::Compiled, CompileOutcome::Cached));
    assert_eq!(first, second);
}

#[test]
fn model_prewarm_counts_compiled_and_cached() {
    let dir = tempfile::tempdir().unwrap();
    let specs = ModelConfig::new(1024, 4096, 16).kernel_specs(Arch::Sm90a);
    let c = compiler(DiskCache::at(dir.path()));
    let first = prewarm(&c, &specs, 2, |_, _| {}).unwrap();
    assert_eq!((first.compiled, first.cached), (specs.len(), 0));
    let second = prewarm(&c, &specs, 2, |_, _| {}).unwrap();
    assert_eq!((second.compiled, second.cached), (0, specs.len()));
}

#[test]
fn invalid_specs_are_typed_errors() {
    let bad: KernelSpec = CastSpec::quantize(DType::E4M3, DType::BF16, Arch::Sm90a).into();
    let err = compiler(DiskCache::disabled()).compile(&bad).unwrap_err();
    assert!(matches!(err, te_codegen::Error::InvalidSpec { .. }), "{err}");
    assert!(err.to_string().contains("quantize goes from"), "{err}");
}

#[test]
fn compile_errors_name_kernel_options_log_and_source() {
    let nvrtc = te_codegen::Nvrtc::load().unwrap();
    let (opts, kind) = nvrtc.options(Arch::Sm90a);
    let err = nvrtc
        .compile("te_broken", "extern \"C\" __global__ void te_broken() { undefined_thing; }", &opts, kind)
        .unwrap_err();
    let te_codegen::Error::Compile { kernel, options, log, source_path } = &err else { panic!("{err}") };
    assert_eq!(kernel, "te_broken");
    assert_eq!(options, &opts);
    assert!(log.contains("undefined_thing"), "{log}");
    assert!(std::fs::read_to_string(source_path).unwrap().contains("undefined_thing"));
}

#[test]
fn grouped_gemm_compiles_on_hopper_and_is_refused_elsewhere() {
    use te_codegen::spec::{GroupedGemmSpec, GroupedSplit};
    let c = compiler(DiskCache::disabled());
    let grouped: Vec<KernelSpec> =
        spec_catalog(Arch::Sm90a).into_iter().filter(|s| matches!(s, KernelSpec::GroupedGemm(_))).collect();
    assert!(grouped.len() >= 20, "{} grouped specs", grouped.len());
    for spec in &grouped {
        let (bin, _) = c.compile(spec).unwrap_or_else(|e| panic!("{}: {e}", spec.name()));
        for e in spec.entry_points() {
            assert!(contains(&bin.bytes, e.as_bytes()), "{} lacks {e}", spec.name());
        }
    }
    // Ada has no wgmma; 8-bit operands are K-major only; two E5M2 operands are not an FP8 pair.
    let bad = [
        GroupedGemmSpec::new(GroupedSplit::Rows, DType::BF16, DType::BF16, DType::BF16, Arch::Sm89),
        GroupedGemmSpec::new(GroupedSplit::Rows, DType::E4M3, DType::E4M3, DType::BF16, Arch::Sm90a)
            .with_major(true, false),
        GroupedGemmSpec::new(GroupedSplit::Rows, DType::BF16, DType::E4M3, DType::BF16, Arch::Sm90a),
        GroupedGemmSpec::new(GroupedSplit::Rows, DType::E5M2, DType::E5M2, DType::BF16, Arch::Sm90a),
    ];
    for spec in bad {
        let err = c.compile(&spec.into()).unwrap_err();
        assert!(matches!(err, te_codegen::Error::InvalidSpec { .. }), "{err}");
    }
}
