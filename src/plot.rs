//! The loss-curve plot of `te train`: training loss (thin) and validation loss (thick, at the
//! evaluation steps) of each run against the optimizer step, as a PNG drawn with `plotters`.
//! Text is set in DejaVu Sans, embedded in the binary (assets/, Bitstream Vera license), so the
//! plot needs no system fonts.

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::path::Path;
use std::sync::Once;
use te_train::{Precision, RunSummary};

/// The embedded font's family name, as `plotters` looks it up.
const FONT: &str = "sans-serif";

/// A drawing failure (the message of `plotters`).
#[derive(Debug, thiserror::Error)]
#[error("cannot draw {path}: {message}")]
pub struct PlotError {
    /// The PNG file.
    pub path: String,
    /// What failed.
    pub message: String,
}

fn register_embedded_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a valid TrueType font (checked by the test below); a failure would only
        // make text fail to draw, which `plot_losses` reports.
        let _ = register_font(FONT, FontStyle::Normal, include_bytes!("../assets/DejaVuSans.ttf"));
    });
}

fn color(p: Precision) -> RGBColor {
    match p {
        Precision::Fp8 => RGBColor(214, 39, 40),
        Precision::Bf16 => RGBColor(31, 119, 180),
    }
}

/// Draws the loss curves of `runs` into the PNG `path` (1200 × 700 pixels) titled `title`.
///
/// # Errors
/// [`PlotError`] when a run has no records or the file cannot be drawn or written.
pub fn plot_losses(path: &Path, title: &str, runs: &[RunSummary]) -> Result<(), PlotError> {
    let err = |message: String| PlotError { path: path.display().to_string(), message };
    register_embedded_font();
    let points = runs.iter().flat_map(|r| r.records.iter());
    let (mut lo, mut hi, mut last) = (f32::INFINITY, f32::NEG_INFINITY, 1u64);
    for r in points {
        for v in std::iter::once(r.train_loss).chain(r.val_loss).filter(|v| v.is_finite()) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        last = last.max(r.step);
    }
    if !lo.is_finite() {
        return Err(err("no finite losses to plot".into()));
    }
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0u64..last, (lo - pad)..(hi + pad))
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("optimizer step")
        .y_desc("cross-entropy (nats/byte)")
        .label_style((FONT, 16))
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for run in runs {
        let c = color(run.precision);
        let name = run.precision.name();
        chart
            .draw_series(LineSeries::new(run.records.iter().map(|r| (r.step, r.train_loss)), c.mix(0.35)))
            .map_err(|e| err(e.to_string()))?
            .label(format!("{name} train"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.mix(0.35)));
        let val = run.records.iter().filter_map(|r| r.val_loss.map(|v| (r.step, v)));
        chart
            .draw_series(LineSeries::new(val, c.stroke_width(3)))
            .map_err(|e| err(e.to_string()))?
            .label(format!("{name} validation"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
    }
    chart
        .configure_series_labels()
        .label_font((FONT, 18))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_train::Record;

    fn run(precision: Precision, offset: f32) -> RunSummary {
        let records = (1..=50)
            .map(|step| Record {
                step,
                train_loss: 3.0 / (step as f32).sqrt() + offset,
                val_loss: (step % 10 == 0).then(|| 3.1 / (step as f32).sqrt() + offset),
                step_ms: 1.0,
            })
            .collect();
        RunSummary { precision, records, tokens_per_s: 1.0, ranks: 1, peak_memory: 0, parameters: 1, graphed_steps: 0 }
    }

    #[test]
    fn draws_a_png_with_text() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("loss.png");
        plot_losses(&path, "tiny: FP8 vs BF16", &[run(Precision::Fp8, 0.01), run(Precision::Bf16, 0.0)]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 10_000, "a plot with curves and labels, got {} bytes", bytes.len());
    }

    #[test]
    fn refuses_runs_without_losses() {
        let dir = tempfile::tempdir().unwrap();
        let empty = RunSummary { records: vec![], ..run(Precision::Fp8, 0.0) };
        let e = plot_losses(&dir.path().join("x.png"), "t", &[empty]).unwrap_err();
        assert!(e.to_string().contains("no finite losses"), "{e}");
    }
}
