//! A rank SIGKILLed at random points of a data-parallel training run (the reliability issue):
//! `#[ignore]`d (minutes on two GPUs), run with `gpu-test --ignored rank_death:: --test-threads=1`
//! and `TE_REQUIRE_MULTI_GPU=1`.
//!
//! The test re-runs this binary as two ranks of `te train`'s data-parallel loop (the tiny GPT in
//! FP8, its amaxes all-reduced in every forward and its gradients in every backward, a checkpoint
//! after every step). For each of [`KILLS`] trials it SIGKILLs one rank, chosen at random, at a
//! random moment after the run's first step: inside a forward, a backward's all-reduce, the
//! optimizer or a checkpoint write, wherever the moment falls. It then checks that the survivor
//! ends with a failure status within `TE_DIST_TIMEOUT_S` + 10 s (no hang; the bound), and that
//! `--resume` from what is on disk finishes the run bit for bit as a run that never died (every
//! step's loss and every evaluation): the newest complete checkpoint is intact and a half-written
//! one is never taken.

use crate::train::{config, corpus, train, CheckpointOptions, Precision, TrainConfig};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use te_nn::parallel::Parallel;
use te_runtime::dist::{DistEnv, ProcessGroup};
use te_runtime::Device;

const TEST: &str = "rank_death::a_rank_killed_at_random_points_never_hangs_the_others_and_resume_is_exact";
/// The variable that marks a rank, and the run's checkpoint directory and mode.
const CHILD: &str = "TE_RANK_DEATH_TEST";
const DIR: &str = "TE_RANK_DEATH_DIR";
const RESUME: &str = "TE_RANK_DEATH_RESUME";
/// Trials with a kill.
const KILLS: usize = 20;
/// The survivors' collective timeout (seconds).
const TIMEOUT_S: u64 = 5;
/// Steps of a run.
const STEPS: u64 = 40;

fn run_config() -> TrainConfig {
    TrainConfig { eval_interval: 10, ..config(STEPS) }
}

/// One rank: the run (resumed when asked), printing each step and, at the end, its loss curve
/// as bits; a run error is printed and the process exits with status 3.
fn rank() {
    let env = DistEnv::from_env().unwrap().expect("a rank has WORLD_SIZE");
    let dev = Device::new(env.local_rank).unwrap();
    let group = Arc::new(ProcessGroup::init(&dev, &env).unwrap());
    let mut dp = Parallel::data_parallel(group).unwrap();
    let dir = std::env::var(DIR).unwrap();
    let resume = std::env::var(RESUME).is_ok_and(|v| v == "1");
    let ckpt = CheckpointOptions { dir: Some(dir.into()), interval: 1, resume, ..Default::default() };
    let run = train(&dev, &corpus(), &run_config(), Precision::Fp8, &ckpt, &mut dp, |step, _| {
        println!("STEP {step}");
    });
    match run {
        Ok(r) => {
            let bits: Vec<String> = crate::train::losses(&r.records)
                .iter()
                .map(|(s, l, v)| format!("{s}:{l}:{}", v.map_or(String::from("-"), |v| v.to_string())))
                .collect();
            println!("LOSSES {}", bits.join(","));
        }
        Err(e) => {
            eprintln!("RANK {} ERROR: {e}", env.rank);
            std::process::exit(3);
        }
    }
}

/// A spawned rank with its output collected as it comes.
struct Rank {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Rank {
    fn spawn(rank: usize, port: u16, dir: &Path, resume: bool) -> Rank {
        let env = crate::common::local_rank_env(rank, 2, port);
        let mut child = crate::common::rank_command(TEST, &env, TIMEOUT_S)
            .arg("--ignored")
            .env(CHILD, "1")
            .env(DIR, dir)
            .env(RESUME, if resume { "1" } else { "0" })
            .spawn()
            .unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let lines = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    lines.lock().unwrap().push(line);
                }
            });
        }
        Rank { child, lines }
    }

    /// Whether a line holds `what` (the harness prints a test's first line after its own
    /// `test NAME ... `, so the rank's lines are searched, not matched at their start).
    fn has(&self, what: &str) -> bool {
        self.lines.lock().unwrap().iter().any(|l| l.contains(what))
    }

    fn text(&self) -> String {
        self.lines.lock().unwrap().join("\n")
    }

    /// The exit status once the process ended, waiting at most `limit`.
    fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                // The readers drain the pipes: give them a moment.
                std::thread::sleep(Duration::from_millis(100));
                return Some(s);
            }
            if start.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn losses(&self) -> Option<String> {
        self.lines.lock().unwrap().iter().find_map(|l| l.find("LOSSES ").map(|i| l[i + "LOSSES ".len()..].to_owned()))
    }
}

/// Where each thread of process `pid` waits (its name, state and kernel wait channel, and the
/// kernel stack where readable): what a hung survivor is stuck in.
fn threads(pid: u32) -> String {
    let mut out = format!("threads of {pid}:");
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out + " gone" };
    for t in tasks.flatten() {
        let p = t.path();
        let read = |f: &str| std::fs::read_to_string(p.join(f)).unwrap_or_default();
        let state = read("status").lines().find(|l| l.starts_with("State:")).unwrap_or_default().to_owned();
        let stack: Vec<String> = read("stack").lines().take(6).map(str::to_owned).collect();
        out += &format!(
            "\n  {} {} [{state}] wchan {} {}",
            t.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan"),
            stack.join(" | ")
        );
    }
    out
}

/// Both ranks of a run to the end: rank 0's loss curve, and the time from rank 0's first step
/// to the end.
fn full_run(dir: &Path, resume: bool, what: &str) -> (String, Duration) {
    let p = crate::common::free_port();
    let mut ranks = [Rank::spawn(0, p, dir, resume), Rank::spawn(1, p, dir, resume)];
    let start = Instant::now();
    while !ranks[0].has("STEP ") && ranks[0].child.try_wait().unwrap().is_none() {
        assert!(start.elapsed() < Duration::from_secs(120), "{what}: no first step:\n{}", ranks[0].text());
        std::thread::sleep(Duration::from_millis(2));
    }
    let first = Instant::now();
    for (i, r) in ranks.iter_mut().enumerate() {
        let status = r.wait(Duration::from_secs(180));
        assert!(status.is_some_and(|s| s.success()), "{what}: rank {i} ended {status:?}:\n{}", r.text());
    }
    let steps = first.elapsed();
    let losses = ranks[0].losses().unwrap_or_else(|| panic!("{what}: no loss curve:\n{}", ranks[0].text()));
    (losses, steps)
}

#[test]
#[ignore = "minutes on two GPUs: gpu-test --ignored rank_death::"]
fn a_rank_killed_at_random_points_never_hangs_the_others_and_resume_is_exact() {
    if std::env::var(CHILD).is_ok() {
        return rank();
    }
    if !crate::common::multi_gpu(TEST, 2) {
        return;
    }
    let root = tempfile::tempdir().unwrap();
    // The run that never dies, and how long its steps take. The first run also compiles kernels
    // that the first step does not use (the kill trials find them cached), so the window for the
    // kills is the second run's; both runs must draw the same loss curve.
    let (first, _) = full_run(&root.path().join("warm-up"), false, "the warm-up run");
    let (reference, span) = full_run(&root.path().join("reference"), false, "the reference run");
    assert_eq!(first, reference, "two runs that never die differ");
    eprintln!("reference run: {:.2} s from its first step to its end", span.as_secs_f64());
    let mut rng = StdRng::seed_from_u64(17);
    let (mut kills, mut trial, mut slowest) = (0, 0, 0.0f64);
    while kills < KILLS {
        trial += 1;
        assert!(trial < 3 * KILLS, "too many trials ended before their kill: shorten the delays");
        let dir = root.path().join(format!("trial-{trial}"));
        let p = crate::common::free_port();
        let mut ranks = [Rank::spawn(0, p, &dir, false), Rank::spawn(1, p, &dir, false)];
        let victim = rng.random_range(0..2usize);
        let started = Instant::now();
        let mut up = true;
        while !ranks[victim].has("STEP 1") {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "trial {trial}: no first step:\n{}",
                ranks[victim].text()
            );
            if ranks[victim].child.try_wait().unwrap().is_some() {
                // A start-up that failed on its own (the rendezvous waits TE_DIST_TIMEOUT_S, and
                // the driver may still be tearing down the last trial's killed process): not a
                // kill; the trial runs again.
                eprintln!("trial {trial}: a rank ended before its first step; again:\n{}", ranks[victim].text());
                up = false;
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        if !up {
            for r in &mut ranks {
                let _ = r.child.kill();
                r.wait(Duration::from_secs(30));
            }
            std::thread::sleep(Duration::from_secs(2));
            continue;
        }
        // A moment within the run's steps (the reference's took `span`).
        let delay = Duration::from_secs_f64(rng.random_range(0.0..0.9) * span.as_secs_f64());
        std::thread::sleep(delay);
        if ranks[victim].child.try_wait().unwrap().is_some() {
            eprintln!("trial {trial}: the run ended before the kill; again");
            for r in &mut ranks {
                let _ = r.child.kill();
                r.wait(Duration::from_secs(30));
            }
            continue;
        }
        let steps_done = ranks[victim].lines.lock().unwrap().iter().filter(|l| l.contains("STEP ")).count();
        ranks[victim].child.kill().unwrap();
        let killed = Instant::now();
        let survivor = 1 - victim;
        let limit = Duration::from_secs(TIMEOUT_S + 10);
        let status = ranks[survivor].wait(limit + Duration::from_secs(20));
        let took = killed.elapsed().as_secs_f64();
        let Some(status) = status else {
            eprintln!("{}", threads(ranks[survivor].child.id()));
            let _ = ranks[survivor].child.kill();
            panic!(
                "trial {trial}: rank {survivor} still runs {took:.1} s after rank {victim} died:\n{}",
                ranks[survivor].text()
            );
        };
        ranks[victim].wait(Duration::from_secs(10));
        kills += 1;
        slowest = slowest.max(took);
        eprintln!(
            "kill {kills}: rank {victim} after {steps_done} steps (+{:.0} ms); rank {survivor} ended {status} after {took:.1} s",
            delay.as_secs_f64() * 1e3
        );
        // A survivor that finished its run before noticing (the victim died after its last
        // collective) succeeded; any other must have failed.
        let finished = ranks[survivor].losses().is_some();
        assert!(finished || !status.success(), "trial {trial}: rank {survivor} ended {status} without finishing");
        assert!(
            took <= limit.as_secs_f64(),
            "trial {trial}: rank {survivor} took {took:.1} s to end:\n{}",
            ranks[survivor].text()
        );
        // Resume from what is on disk: the run finishes as the reference did.
        let (resumed, _) = full_run(&dir, true, &format!("trial {trial}'s resume"));
        assert_eq!(resumed, reference, "trial {trial}: the resumed run differs from the reference");
        // The driver finishes tearing down the killed process before the next trial starts.
        std::thread::sleep(Duration::from_secs(1));
    }
    eprintln!("{kills} kills in {trial} trials: every survivor ended within {slowest:.1} s; every resume was exact");
}
