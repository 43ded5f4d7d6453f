//! Multi-process runs of `te train`, as `torchrun` launches PyTorch's: one process a GPU.
//!
//! - `te train --nproc-per-node N` starts N copies of itself on this node, each with `torchrun`'s
//!   variables (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!   `MASTER_PORT`), and waits for them ([`launch`]). A process that finds `WORLD_SIZE` set is a
//!   rank (whoever started it: this launcher, `torchrun`, Slurm with the variables exported) and
//!   never launches.
//! - Several nodes: the same command on each node with `--nnodes M --node-rank R --master-addr
//!   <node 0's address>`; ranks are `R × N + local rank`. No other code differs between one node
//!   and several.
//! - When a rank fails, the launcher stops the others (they would wait for it in a collective
//!   for ever): SIGTERM, then SIGKILL after [`GRACE`]. SIGTERM and SIGINT to the launcher reach
//!   every rank, which finish their step together, checkpoint and exit with 75.
//!
//! The processes of a rank find each other through [`te_runtime::dist::ProcessGroup::init`].

use clap::Args;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use te_runtime::dist::DistEnv;

/// How long the ranks left have after one failed, between SIGTERM and SIGKILL.
pub const GRACE: Duration = Duration::from_secs(10);

/// The launcher's options (`torchrun`'s names).
#[derive(Args, Debug, Clone, PartialEq, Eq)]
pub struct LaunchArgs {
    /// Processes (GPUs) on this node: data-parallel ranks, each on GPU `LOCAL_RANK`. 1 (the
    /// default): no launch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub nproc_per_node: u16,
    /// Nodes in the run (each runs the same command with its own --node-rank).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..))]
    pub nnodes: u16,
    /// This node's index, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    pub node_rank: u16,
    /// Address of node 0, where rank 0 hands the NCCL id to the others.
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of that rendezvous on node 0.
    #[arg(long, default_value_t = 29500, value_parser = clap::value_parser!(u16).range(1..))]
    pub master_port: u16,
}

impl LaunchArgs {
    /// Whether this process is to start the ranks: more than one process in the run, and no
    /// `WORLD_SIZE` in `env` (a rank has one).
    pub fn launches(&self, env: impl Fn(&str) -> Option<String>) -> bool {
        (self.nproc_per_node > 1 || self.nnodes > 1) && env("WORLD_SIZE").is_none()
    }

    /// The variables of local rank `local_rank` of this node.
    ///
    /// # Errors
    /// A message for a node rank not below `--nnodes`, or a world size past `u16` ranks.
    pub fn rank_env(&self, local_rank: usize) -> Result<DistEnv, String> {
        let (nproc, nnodes, node) =
            (usize::from(self.nproc_per_node), usize::from(self.nnodes), usize::from(self.node_rank));
        if node >= nnodes {
            return Err(format!("--node-rank {node} is not below --nnodes {nnodes}: nodes are numbered 0..{nnodes}"));
        }
        Ok(DistEnv {
            rank: node * nproc + local_rank,
            world_size: nproc * nnodes,
            local_rank,
            local_world_size: nproc,
            master_addr: self.master_addr.clone(),
            master_port: self.master_port,
        })
    }
}

/// Starts this node's ranks (this executable, with this process's arguments and each rank's
/// variables; `NCCL_NVLS_ENABLE=0` unless set) and waits for them. Returns the exit status of
/// the run: 0 when every rank succeeded, 75 when they stopped on request, else the first
/// failing rank's (after stopping the others). `stop` is the launcher's SIGTERM/SIGINT flag: it
/// is passed on to the ranks as SIGTERM.
///
/// # Errors
/// A message when a rank cannot be started (the ranks started are stopped).
pub fn launch(args: &LaunchArgs, stop: &Arc<AtomicBool>) -> Result<u8, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this executable to start the ranks: {e}"))?;
    let argv: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let mut children: Vec<(usize, Child)> = Vec::new();
    for local in 0..usize::from(args.nproc_per_node) {
        let env = args.rank_env(local)?;
        let mut cmd = Command::new(&exe);
        cmd.args(&argv).envs(env.vars());
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            cmd.env("NCCL_NVLS_ENABLE", "0");
        }
        match cmd.spawn() {
            Ok(child) => children.push((env.rank, child)),
            Err(e) => {
                terminate(&mut children);
                return Err(format!("cannot start rank {}: {e}", env.rank));
            }
        }
    }
    Ok(wait_all(children, stop))
}

/// Waits for every rank; the first failure (or a stop request) stops the others.
fn wait_all(mut children: Vec<(usize, Child)>, stop: &Arc<AtomicBool>) -> u8 {
    let mut status: Option<u8> = None;
    let mut forwarded = false;
    let mut failed_at: Option<Instant> = None;
    while !children.is_empty() {
        if stop.load(Ordering::Relaxed) && !forwarded {
            forwarded = true;
            signal(&children, Signal::Term);
        }
        let mut i = 0;
        while i < children.len() {
            match children[i].1.try_wait() {
                Ok(Some(exit)) => {
                    let (rank, _) = children.remove(i);
                    let code = exit_code(&exit);
                    if code != 0 && code != crate::EXIT_INTERRUPTED && status.is_none() {
                        eprintln!("te train: rank {rank} failed ({exit}); stopping the other ranks");
                        status = Some(code);
                        failed_at = Some(Instant::now());
                        signal(&children, Signal::Term);
                    } else if code == crate::EXIT_INTERRUPTED && status.is_none() {
                        status = Some(code);
                    }
                }
                Ok(None) => i += 1,
                Err(e) => {
                    eprintln!("te train: cannot wait for rank {}: {e}", children[i].0);
                    i += 1;
                }
            }
        }
        if failed_at.is_some_and(|t| t.elapsed() > GRACE) {
            signal(&children, Signal::Kill);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    status.unwrap_or(0)
}

/// The status a shell reports for `exit`: its code, or 128 + the signal that ended it.
fn exit_code(exit: &std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (exit.code(), exit.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1),
        (None, Some(s)) => u8::try_from(128 + s).unwrap_or(1),
        (None, None) => 1,
    }
}

#[derive(Clone, Copy)]
enum Signal {
    Term,
    Kill,
}

/// Sends `sig` to every rank still running.
fn signal(children: &[(usize, Child)], sig: Signal) {
    let sig = match sig {
        Signal::Term => libc::SIGTERM,
        Signal::Kill => libc::SIGKILL,
    };
    for (_, child) in children {
        if let Ok(pid) = libc::pid_t::try_from(child.id()) {
            // SAFETY: kill(2) with a child's pid (not yet reaped, so not reused) and a valid
            // signal has no memory effects.
            unsafe { libc::kill(pid, sig) };
        }
    }
}

/// Kills and reaps the ranks started so far.
fn terminate(children: &mut [(usize, Child)]) {
    for (_, child) in children.iter_mut() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        launch: LaunchArgs,
    }

    fn parse(args: &[&str]) -> Result<LaunchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("te").chain(args.iter().copied())).map(|c| c.launch)
    }

    #[test]
    fn ranks_get_torchrun_variables_over_nodes() {
        let one = parse(&["--nproc-per-node", "2"]).unwrap();
        assert!(one.launches(|_| None));
        assert!(!one.launches(|k| (k == "WORLD_SIZE").then(|| "2".into())), "a rank never launches");
        assert!(!parse(&[]).unwrap().launches(|_| None), "one process: no launch");
        let e = one.rank_env(1).unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (1, 2, 1, 2));
        // The variables a rank gets parse back into the same place.
        let map: std::collections::HashMap<_, _> = e.vars().into_iter().collect();
        assert_eq!(DistEnv::from_vars(|k| map.get(k).cloned()).unwrap(), Some(e));
        let node = parse(&[
            "--nproc-per-node",
            "4",
            "--nnodes",
            "3",
            "--node-rank",
            "2",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "6000",
        ])
        .unwrap();
        assert!(node.launches(|_| None));
        let e = node.rank_env(3).unwrap();
        assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (11, 12, 3, 4));
        assert_eq!((e.master_addr.as_str(), e.master_port), ("10.0.0.1", 6000));
    }

    #[test]
    fn bad_launch_options_are_refused_with_the_reason() {
        let e = parse(&["--nnodes", "2", "--node-rank", "2"]).unwrap().rank_env(0).unwrap_err();
        assert!(e.contains("not below --nnodes 2"), "{e}");
        for bad in [&["--nproc-per-node", "0"][..], &["--nnodes", "0"], &["--master-port", "0"], &["--node-rank", "-1"]]
        {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn exit_codes_are_as_a_shell_reports_them() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(exit_code(&std::process::ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(&std::process::ExitStatus::from_raw(75 << 8)), 75);
        assert_eq!(exit_code(&std::process::ExitStatus::from_raw(libc::SIGKILL)), 137);
    }

    #[test]
    fn a_failing_rank_stops_the_others() {
        // Two "ranks": one fails at once, the other would sleep for a minute.
        let fail = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let sleep = Command::new("sleep").arg("60").spawn().unwrap();
        let start = Instant::now();
        let status = wait_all(vec![(0, fail), (1, sleep)], &Arc::new(AtomicBool::new(false)));
        assert_eq!(status, 3, "the failing rank's status");
        assert!(start.elapsed() < Duration::from_secs(30), "the sleeping rank was stopped");
        let ok = Command::new("true").spawn().unwrap();
        let stopped = Command::new("sh").args(["-c", "exit 75"]).spawn().unwrap();
        assert_eq!(wait_all(vec![(0, ok), (1, stopped)], &Arc::new(AtomicBool::new(false))), 75);
    }
}
