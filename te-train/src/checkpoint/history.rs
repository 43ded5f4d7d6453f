//! A checkpoint's loss curve (`history.csv`) and atomic text files.

use crate::error::TrainError;
use crate::summary::Record;
use std::path::Path;
use te_nn::checkpoint::write_atomic;

/// Writes a loss curve as `step,train_loss,val_loss,step_ms` (atomically).
pub(super) fn write_history(path: &Path, records: &[Record]) -> Result<(), TrainError> {
    let mut text = String::from("step,train_loss,val_loss,step_ms\n");
    for r in records {
        let val = r.val_loss.map(|v| v.to_string()).unwrap_or_default();
        text.push_str(&format!("{},{},{val},{}\n", r.step, r.train_loss, r.step_ms));
    }
    write_text(path, &text)
}

/// Writes `text` to `path` atomically (a crash leaves the old file or the new one).
pub(super) fn write_text(path: &Path, text: &str) -> Result<(), TrainError> {
    write_atomic(path, |tmp| {
        std::fs::write(tmp, text)
            .map_err(|e| te_runtime::Error::Checkpoint { message: format!("{}: {e}", tmp.display()) })
    })?;
    Ok(())
}

/// Reads what [`write_history`] wrote (floats round-trip exactly through their shortest form).
pub(super) fn read_history(path: &Path) -> Result<Vec<Record>, TrainError> {
    let bad =
        |line: usize| TrainError::Resume { path: path.to_path_buf(), message: format!("line {line} is malformed") };
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Output { path: path.into(), source })?;
    text.lines()
        .enumerate()
        .skip(1)
        .map(|(i, line)| {
            let f: Vec<&str> = line.split(',').collect();
            let [step, train, val, ms] = f[..] else { return Err(bad(i + 1)) };
            Ok(Record {
                step: step.parse().map_err(|_| bad(i + 1))?,
                train_loss: train.parse().map_err(|_| bad(i + 1))?,
                val_loss: if val.is_empty() { None } else { Some(val.parse().map_err(|_| bad(i + 1))?) },
                step_ms: ms.parse().map_err(|_| bad(i + 1))?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_round_trips_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.csv");
        let records = vec![
            Record { step: 1, train_loss: 5.545_177_5, val_loss: None, step_ms: 12.345_678 },
            Record { step: 2, train_loss: 0.1 + 0.2, val_loss: Some(1.0 / 3.0), step_ms: 0.001 },
            Record { step: 3, train_loss: f32::NAN, val_loss: Some(f32::INFINITY), step_ms: 1.0 },
        ];
        write_history(&path, &records).unwrap();
        let back = read_history(&path).unwrap();
        assert_eq!(back[..2], records[..2]);
        assert!(back[2].train_loss.is_nan() && back[2].val_loss == Some(f32::INFINITY), "{back:?}");
        std::fs::write(&path, "step,train_loss,val_loss,step_ms\n1,2\n").unwrap();
        let e = read_history(&path).unwrap_err();
        assert!(e.to_string().contains("line 2 is malformed"), "{e}");
        let e = read_history(&dir.path().join("missing.csv")).unwrap_err();
        assert!(matches!(e, TrainError::Output { .. }), "{e}");
    }
}
