//! A rank that dies mid-run (the reliability issue): the survivors' collective watchdog
//! (`te_runtime::dist::watchdog`) ends them within `TE_DIST_TIMEOUT_S` and its grace, with a
//! message that names the timeout and says to restart, instead of a hang in NCCL.
//!
//! The test re-runs this binary as two ranks on two GPUs (as `multi_gpu` does); rank 1 kills
//! itself with SIGKILL after a first all-reduce, rank 0 issues the next one. Skips with fewer
//! than two GPUs or without NCCL, unless `TE_REQUIRE_MULTI_GPU=1`.

use std::time::{Duration, Instant};
use te_runtime::dist::watchdog::{DIST_TIMEOUT_EXIT, EXIT_GRACE};
use te_runtime::dist::{DistEnv, ProcessGroup, ReduceOp};
use te_runtime::Device;

/// The variable that marks a child process.
const CHILD: &str = "TE_DIST_FAILURE_TEST";
/// The survivors' timeout (seconds).
const TIMEOUT_S: u64 = 5;
/// The status a survivor exits with when its own call returned the watchdog's error.
const RETURNED: i32 = 3;

/// One rank: a first all-reduce completes; rank 1 then dies, rank 0 waits in the next one.
fn rank() {
    let env = DistEnv::from_env().unwrap().expect("a rank has WORLD_SIZE");
    let dev = Device::new(env.local_rank).unwrap();
    let group = ProcessGroup::init(&dev, &env).unwrap();
    let mut x = dev.stream().alloc_zeros::<f32>(1 << 20).unwrap();
    group.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    dev.synchronize().unwrap();
    if env.rank == 1 {
        eprintln!("rank 1: dying");
        // SAFETY: kill(2) of this process with a valid signal: it ends here, as SIGKILL from
        // outside would end it.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
    let waited = Instant::now();
    let r = group
        .all_reduce(&mut x, ReduceOp::Sum)
        .and_then(|()| dev.synchronize())
        .and_then(|()| group.all_reduce(&mut x, ReduceOp::Sum));
    let e = r.expect_err("a collective with a dead peer must fail");
    eprintln!("rank 0: returned after {:.1} s: {e}", waited.elapsed().as_secs_f64());
    assert!(e.to_string().contains("TE_DIST_TIMEOUT_S"), "{e}");
    std::process::exit(RETURNED);
}

#[test]
fn a_rank_that_dies_ends_the_others_within_the_timeout() {
    let test = "dist_failure::a_rank_that_dies_ends_the_others_within_the_timeout";
    if std::env::var(CHILD).is_ok() {
        return rank();
    }
    if !crate::common::multi_gpu(test, 2) {
        return;
    }
    let port = crate::common::free_port();
    let mut children = Vec::new();
    for rank in 0..2 {
        let env = crate::common::local_rank_env(rank, 2, port);
        let child = crate::common::rank_command(test, &env, TIMEOUT_S).env(CHILD, "1").spawn().unwrap();
        children.push(child);
    }
    // Start-up (the CUDA context, NCCL's init), the timeout, the grace, and slack.
    let bound = Duration::from_secs(30 + TIMEOUT_S) + EXIT_GRACE;
    let start = Instant::now();
    let mut outs = Vec::new();
    for mut child in children {
        while child.try_wait().unwrap().is_none() && start.elapsed() < bound {
            std::thread::sleep(Duration::from_millis(50));
        }
        let hung = child.try_wait().unwrap().is_none();
        if hung {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!hung, "a rank still ran {:.0} s after the start:\n{text}", bound.as_secs_f64());
        outs.push((out.status, text));
    }
    use std::os::unix::process::ExitStatusExt;
    let (dead, text1) = &outs[1];
    assert_eq!(dead.signal(), Some(libc::SIGKILL), "rank 1 died by SIGKILL:\n{text1}");
    let (survivor, text0) = &outs[0];
    assert!(
        matches!(survivor.code(), Some(c) if c == RETURNED || c == DIST_TIMEOUT_EXIT),
        "rank 0 ended by the watchdog's error or exit ({survivor}):\n{text0}"
    );
    assert!(text0.contains(&format!("TE_DIST_TIMEOUT_S = {TIMEOUT_S} s")), "rank 0 says why:\n{text0}");
    eprintln!("rank 0 ({survivor}) after {:.1} s in all:\n{text0}", start.elapsed().as_secs_f64());
}
