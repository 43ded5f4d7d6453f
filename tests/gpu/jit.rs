//! The in-process kernel cache on the GPU: many threads asking for one new kernel at once
//! compile and load it once, and every thread gets a working function.

use crate::common::device;
use te_codegen::spec::CastSpec;
use te_codegen::{DType, KernelSpec};

#[test]
fn concurrent_first_use_loads_once() {
    let Some(dev) = device() else { return };
    // A tuning no op uses, so this test is its first user.
    let mut spec = CastSpec::amax(DType::F16, dev.arch());
    spec.threads = 96;
    let spec = KernelSpec::Cast(spec);
    let before = dev.kernels().loads();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| dev.function(&spec, 0).expect("compile and load"));
        }
    });
    assert_eq!(dev.kernels().loads(), before + 1, "eight concurrent first uses load the module once");
}
