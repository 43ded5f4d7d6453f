//! Shared helpers of the GPU tests.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::{Arc, OnceLock};
use te_runtime::device::gpu_available;
use te_runtime::numerics::round_to;
use te_runtime::{DType, Device, Tensor};

/// The GPU, or `None` (test skips) when there is none and `TE_REQUIRE_GPU` is not `1`.
///
/// # Panics
/// When `TE_REQUIRE_GPU=1` and no GPU can be opened: a GPU test must never pass without running.
pub fn device() -> Option<Arc<Device>> {
    static DEV: OnceLock<Option<Arc<Device>>> = OnceLock::new();
    DEV.get_or_init(|| {
        let required = std::env::var("TE_REQUIRE_GPU").is_ok_and(|v| v == "1");
        if !gpu_available() {
            assert!(!required, "TE_REQUIRE_GPU=1 but no CUDA GPU is available");
            eprintln!("no GPU: skipping GPU test");
            return None;
        }
        match Device::new(0) {
            Ok(d) => Some(d),
            Err(e) => panic!("a GPU is present but could not be opened: {e}"),
        }
    })
    .clone()
}

/// Whether `world` GPUs and NCCL are here for the multi-process test `test`; `false` (the test
/// skips, saying so) without them.
///
/// # Panics
/// When `TE_REQUIRE_MULTI_GPU=1` and they are not: such a test must never pass without running.
pub fn multi_gpu(test: &str, world: usize) -> bool {
    let required = std::env::var("TE_REQUIRE_MULTI_GPU").is_ok_and(|v| v == "1");
    let gpus = te_runtime::device::device_count();
    let nccl = te_runtime::dist::nccl_available();
    if gpus < world || nccl.is_err() {
        assert!(!required, "TE_REQUIRE_MULTI_GPU=1 but {gpus} GPUs (NCCL: {:?})", nccl.err());
        eprintln!("skipping {test}: {world} GPUs and NCCL needed, {gpus} GPUs here");
        return false;
    }
    true
}

/// The environment of `rank` of `world` ranks on this host, one GPU each, meeting at
/// `127.0.0.1:port`.
pub fn local_rank_env(rank: usize, world: usize, port: u16) -> te_runtime::dist::DistEnv {
    te_runtime::dist::DistEnv {
        rank,
        world_size: world,
        local_rank: rank,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

/// This test binary re-run as one rank of the multi-process test `test` (`--exact`, one
/// thread, output captured through pipes): the rank's environment, NVLink multicast off,
/// `TE_DIST_TIMEOUT_S = timeout_s`. The caller adds what marks the child and spawns it.
pub fn rank_command(test: &str, env: &te_runtime::dist::DistEnv, timeout_s: u64) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap_or_default());
    cmd.args(["--exact", test, "--test-threads=1", "--nocapture"])
        .envs(env.vars())
        .env("NCCL_NVLS_ENABLE", "0")
        .env("TE_DIST_TIMEOUT_S", timeout_s.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

/// A free local port for a rendezvous, below Linux's ephemeral range (`ip_local_port_range`
/// starts at 32 768): a port the kernel hands out for `bind(0)` is an ephemeral one, and between
/// this check and the rank's `listen` an outgoing connection (NCCL's, a killed run's survivor's)
/// may take it as its source port (`rank_death::` saw "Address already in use"). Ports here are
/// only taken by an explicit bind. Random per call (pid, time, counter), checked by a bind.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let mut x =
        nanos ^ (u64::from(std::process::id()) << 32) ^ CALLS.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9);
    for _ in 0..200 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let port = 20_000 + ((x >> 33) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).unwrap_or(29_500)
}

/// `n` values `~ N(0, std)` (Box-Muller) from a fixed seed.
pub fn randn(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let u1: f32 = rng.random::<f32>().max(1e-7);
            let u2: f32 = rng.random::<f32>();
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect()
}

/// Asserts `|got - want| <= atol + rtol * |want|` elementwise (NaN only matches NaN).
pub fn assert_close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut bad = 0;
    let mut first = None;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() { g.is_nan() } else { g == w || (g - w).abs() <= atol + rtol * w.abs() };
        if !ok {
            bad += 1;
            first.get_or_insert((i, g, w));
        }
    }
    assert!(
        bad == 0,
        "{what}: {bad}/{} elements differ; first at {:?} (index, got, want); rtol {rtol} atol {atol}",
        got.len(),
        first.unwrap()
    );
}

/// Asserts two byte buffers are identical, reporting the first difference.
pub fn assert_bits_eq(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!("{what}: {bad}/{} bytes differ; first at {i}: got {:#04x}, want {:#04x}", got.len(), got[i], want[i]);
    }
}

/// A visitor that collects the FP8 scaling states of a model by path.
#[derive(Default)]
pub struct Fp8States(pub Vec<(String, Arc<te_nn::fp8::ScalingState>)>);

impl te_nn::modules::ModuleVisitor for Fp8States {
    fn param(
        &mut self,
        _: &str,
        _: te_nn::modules::ParamKind,
        _: &dyn te_nn::modules::Param,
    ) -> te_runtime::Result<()> {
        Ok(())
    }

    fn fp8_state(&mut self, path: &str, state: &Arc<te_nn::fp8::ScalingState>) -> te_runtime::Result<()> {
        self.0.push((path.to_owned(), state.clone()));
        Ok(())
    }
}

/// `v` rounded to bf16 (what a bf16 tensor of it holds).
pub fn bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| round_to(DType::BF16, x)).collect()
}

/// A bf16 tensor of `shape` holding `v`.
pub fn upload(dev: &Device, v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_f32(dev, DType::BF16, shape, v).unwrap()
}

/// The host values of a tensor that must be there (a gradient after a backward).
pub fn host(dev: &Device, t: Option<&Tensor>) -> Vec<f32> {
    t.unwrap().to_f32(dev).unwrap()
}

/// The largest `|x|` of `v`.
pub fn amax(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |a, x| a.max(x.abs()))
}
