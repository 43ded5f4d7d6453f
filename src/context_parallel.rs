//! `te train --context-parallel N`: which runs split their sequences over N GPUs (the decoder
//! family, windows, no tensor parallelism) and the line the run's summary shows.

use crate::train::TrainArgs;

/// The context-parallel size `--context-parallel` asks for, for a run of `world` ranks whose
/// windows are `seq` tokens (`None` for the GPT presets, which take --seq-length from the
/// preset), checked before any rank builds its groups.
///
/// # Errors
/// A message naming the flag to change: 0; above the world size or not dividing it with
/// `--tensor-parallel`; with `--tensor-parallel` above 1, `--pack thd` or a GPT preset (not
/// built); a `--seq-length` that is not a multiple of `2 × N`.
pub fn context_parallel(a: &TrainArgs, world: usize, seq: Option<usize>) -> Result<usize, String> {
    let cp = a.context_parallel;
    if cp == 0 {
        return Err("--context-parallel 0: give the number of GPUs each sequence is split over (1: none)".into());
    }
    if cp == 1 {
        return Ok(1);
    }
    if a.model.is_none() {
        return Err(format!(
            "--context-parallel {cp} splits the sequences of the decoder family (--model PATH); the byte-level GPT \
             presets are not split: drop --context-parallel or train a --model"
        ));
    }
    if a.tensor_parallel > 1 {
        return Err(format!(
            "--context-parallel {cp} with --tensor-parallel {} is not built yet: use one of them",
            a.tensor_parallel
        ));
    }
    if a.pack == "thd" {
        return Err(format!(
            "--context-parallel {cp} with --pack thd is not built (packed documents are not split over ranks yet): \
             use --pack blocks"
        ));
    }
    if world % cp != 0 {
        return Err(format!(
            "--context-parallel {cp} does not divide the {world} ranks of this run: start a multiple of {cp} ranks \
             (--nproc-per-node {cp})"
        ));
    }
    if let Some(seq) = seq {
        te_train::check_context_seq(seq, cp).map_err(|e| e.to_string())?;
    }
    Ok(cp)
}

/// How the run is split, for its first line and summary: `data parallel`, `tensor parallel 2 ×
/// data parallel 2`, `context parallel 2 (p2p)`, `context parallel 2 (all_gather) × data
/// parallel 2`, … (`cp_comm_type`: `--cp-comm-type`).
pub fn describe_split(tp: usize, cp: usize, dp: usize, sequence_parallel: bool, cp_comm_type: &str) -> String {
    let mut parts = Vec::new();
    if tp > 1 {
        let sp = if sequence_parallel { " + sequence parallel" } else { "" };
        parts.push(if cp == 1 && dp == 1 {
            format!("tensor parallel{sp}")
        } else {
            format!("tensor parallel {tp}{sp}")
        });
    }
    if cp > 1 {
        parts.push(format!("context parallel {cp} ({cp_comm_type})"));
    }
    if dp > 1 {
        parts.push(if parts.is_empty() { "data parallel".to_string() } else { format!("data parallel {dp}") });
    }
    if parts.is_empty() {
        "data parallel".to_string()
    } else {
        parts.join(" × ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::tests::{args, Cli};
    use clap::Parser;

    /// The flag's refusals name what to change; a run it fits gets its size.
    #[test]
    fn the_flag_refuses_what_is_not_built() {
        let model = ["--model", "m"];
        assert_eq!(context_parallel(&args(&[]), 4, None), Ok(1));
        let ok = args(&[&model[..], &["--context-parallel", "2"]].concat());
        assert_eq!(context_parallel(&ok, 4, Some(1024)), Ok(2));
        let e = context_parallel(&args(&["--context-parallel", "0"]), 2, None).unwrap_err();
        assert!(e.contains("--context-parallel 0"), "{e}");
        let e = context_parallel(&args(&["--context-parallel", "2"]), 2, None).unwrap_err();
        assert!(e.contains("GPT") && e.contains("--model"), "{e}");
        let tp = args(&[&model[..], &["--context-parallel", "2", "--tensor-parallel", "2"]].concat());
        let e = context_parallel(&tp, 4, Some(1024)).unwrap_err();
        assert!(e.contains("with --tensor-parallel 2 is not built"), "{e}");
        let thd = args(&[&model[..], &["--context-parallel", "2", "--pack", "thd"]].concat());
        assert!(context_parallel(&thd, 2, Some(1024)).unwrap_err().contains("--pack thd"));
        let e = context_parallel(&ok, 3, Some(1024)).unwrap_err();
        assert!(e.contains("does not divide the 3 ranks"), "{e}");
        let e = context_parallel(&ok, 2, Some(1022)).unwrap_err();
        assert!(e.contains("--seq-length 1022") && e.contains("multiple of 2 · 2 = 4"), "{e}");
    }

    /// `--cp-comm-type` takes TE's names, the ring by default, and parses to the library's type.
    #[test]
    fn the_exchange_flag_takes_te_names() {
        use te_nn::parallel::CpCommType;
        assert_eq!(args(&[]).cp_comm_type.parse::<CpCommType>().unwrap(), CpCommType::P2p);
        let gather = args(&["--cp-comm-type", "all_gather"]);
        assert_eq!(gather.cp_comm_type.parse::<CpCommType>().unwrap(), CpCommType::AllGather);
        let bad = Cli::try_parse_from(["te-train", "--cp-comm-type", "a2a"]);
        assert!(bad.is_err(), "a2a is not built");
    }

    #[test]
    fn the_summary_names_the_split() {
        assert_eq!(describe_split(1, 1, 4, false, "p2p"), "data parallel");
        assert_eq!(describe_split(2, 1, 1, true, "p2p"), "tensor parallel + sequence parallel");
        assert_eq!(describe_split(2, 1, 2, false, "p2p"), "tensor parallel 2 × data parallel 2");
        assert_eq!(describe_split(1, 2, 1, false, "p2p"), "context parallel 2 (p2p)");
        assert_eq!(describe_split(1, 2, 2, false, "all_gather"), "context parallel 2 (all_gather) × data parallel 2");
    }
}
