//! The next token from the logits: greedy, or sampled after temperature, top-k and top-p (nucleus)
//! filtering, with the semantics of Hugging Face `generate` (`TemperatureLogitsWarper`,
//! `TopKLogitsWarper`, `TopPLogitsWarper`, applied in that order).

use te_runtime::philox;
use te_runtime::{Error, Result};

const OP: &str = "sampling";

/// How the next token is chosen from a row of logits `[vocab]`.
///
/// - `temperature`: the logits are divided by it before the softmax; 0 means greedy (the
///   largest logit, the lowest id among equal ones), and then `top_k` / `top_p` do not matter.
/// - `top_k`: keep only the `k` largest logits (and those equal to the `k`-th, as Hugging Face
///   keeps ties); `None` keeps all.
/// - `top_p`: then keep the smallest set of the most probable tokens whose probabilities sum to
///   at least `p` (always one token at least); `None` (or 1) keeps all.
///
/// The draw is inverse-CDF over the kept tokens in order of decreasing probability (equal ones by
/// id) with one uniform number from block `row` of the Philox stream `(seed, step)` (the
/// generator of the dropout kernels, [`te_runtime::philox`]): the same `(seed, step, row)` gives the
/// same token, on any machine.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingConfig {
    /// Softmax temperature, ≥ 0 (0: greedy). Hugging Face's default 1.
    pub temperature: f32,
    /// Keep the `k` most likely tokens (≥ 1), or all.
    pub top_k: Option<usize>,
    /// Keep the most likely tokens up to this cumulative probability, in (0, 1], or all.
    pub top_p: Option<f32>,
}

impl Default for SamplingConfig {
    /// Sampling from the full softmax: temperature 1, no top-k, no top-p.
    fn default() -> Self {
        Self { temperature: 1.0, top_k: None, top_p: None }
    }
}

impl SamplingConfig {
    /// Greedy decoding (temperature 0).
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::Argument`] for a temperature that is negative or not finite, `top_k = 0`, or
    /// `top_p` outside (0, 1].
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Err(Error::Argument { op: OP, message });
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!("temperature must be finite and ≥ 0 (0: greedy), got {}", self.temperature));
        }
        if self.top_k == Some(0) {
            return bad("top_k must be ≥ 1 (or unset to keep every token)".into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return bad(format!("top_p must be in (0, 1] (or unset), got {p}"));
            }
        }
        Ok(())
    }

    /// The tokens that may be drawn from `logits` and their probabilities (summing to 1), most
    /// probable first, equal ones by id; greedy gives one token of probability 1.
    ///
    /// # Errors
    /// As [`SamplingConfig::validate`]; [`Error::Argument`] for empty logits, a NaN logit, or no
    /// logit above −inf.
    pub fn distribution(&self, logits: &[f32]) -> Result<Vec<(usize, f64)>> {
        self.validate()?;
        let bad = |message: String| Err(Error::Argument { op: OP, message });
        if logits.is_empty() {
            return bad("the logits are empty: the vocabulary has at least one token".into());
        }
        if let Some(i) = logits.iter().position(|x| x.is_nan()) {
            return bad(format!("logit {i} is NaN: the model's output is not finite"));
        }
        if logits.iter().all(|&x| x == f32::NEG_INFINITY) {
            return bad("every logit is −inf: no token can be drawn".into());
        }
        // Greedy: the largest logit, the lowest id of ties (one scan, no sort: a 262k vocabulary
        // is sampled every step).
        if self.temperature == 0.0 {
            let best =
                logits.iter().enumerate().fold(0, |b, (i, x)| if x.total_cmp(&logits[b]).is_gt() { i } else { b });
            return Ok(vec![(best, 1.0)]);
        }
        // Most likely first, equal logits by id. With top-k only the candidates at or above the
        // k-th largest logit are sorted (a selection finds it), which keeps the same order.
        let by_logit = |&a: &usize, &b: &usize| logits[b].total_cmp(&logits[a]).then(a.cmp(&b));
        let mut order: Vec<usize> = (0..logits.len()).collect();
        if let Some(k) = self.top_k.filter(|&k| k < logits.len()) {
            order.select_nth_unstable_by(k - 1, by_logit);
            let kth = logits[order[k - 1]];
            order = (0..logits.len()).filter(|&i| logits[i].total_cmp(&kth).is_ge()).collect();
        }
        order.sort_unstable_by(by_logit);
        // Top-k: the k largest and every logit equal to the k-th.
        let mut keep = order.len();
        if let Some(k) = self.top_k {
            let kth = logits[order[k.min(order.len()) - 1]];
            keep = order.iter().take_while(|&&i| logits[i] >= kth).count();
        }
        // Softmax of logits / temperature over the kept ones, in f64 (+inf logits share the mass).
        let scaled: Vec<f64> =
            order[..keep].iter().map(|&i| f64::from(logits[i]) / f64::from(self.temperature)).collect();
        let max = scaled[0];
        let weights: Vec<f64> = if max == f64::INFINITY {
            scaled.iter().map(|&x| if x == f64::INFINITY { 1.0 } else { 0.0 }).collect()
        } else {
            scaled.iter().map(|&x| (x - max).exp()).collect()
        };
        let total: f64 = weights.iter().sum();
        let mut dist: Vec<(usize, f64)> =
            order[..keep].iter().zip(&weights).map(|(&i, &w)| (i, w / total)).filter(|&(_, p)| p > 0.0).collect();
        // Top-p: the shortest prefix whose mass reaches p, then renormalized.
        if let Some(p) = self.top_p {
            let mut mass = 0.0;
            let cut = dist
                .iter()
                .position(|&(_, q)| {
                    mass += q;
                    mass >= f64::from(p)
                })
                .map_or(dist.len(), |i| i + 1);
            dist.truncate(cut.max(1));
            let kept: f64 = dist.iter().map(|&(_, q)| q).sum();
            dist.iter_mut().for_each(|(_, q)| *q /= kept);
        }
        Ok(dist)
    }

    /// The token drawn from `logits` for sequence `row` at decoding step `step` of the stream
    /// `seed` (see the type docs).
    ///
    /// # Errors
    /// As [`SamplingConfig::distribution`].
    pub fn sample(&self, logits: &[f32], seed: u64, step: u64, row: u64) -> Result<usize> {
        let dist = self.distribution(logits)?;
        let u = uniform(seed, step, row);
        let mut cum = 0.0;
        for &(i, p) in &dist {
            cum += p;
            if u < cum {
                return Ok(i);
            }
        }
        // Rounding left the sum a hair below 1: the last kept token.
        Ok(dist[dist.len() - 1].0)
    }
}

/// A uniform number in [0, 1) with 53 random bits: words 0 and 1 of Philox block `row` of the
/// stream `(seed, step)`.
fn uniform(seed: u64, step: u64, row: u64) -> f64 {
    let w = philox::block(seed, step, row);
    let bits = (u64::from(w[0]) << 32 | u64::from(w[1])) >> 11;
    bits as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn support(cfg: SamplingConfig, logits: &[f32]) -> Vec<usize> {
        cfg.distribution(logits).unwrap().into_iter().map(|(i, _)| i).collect()
    }

    /// The distribution as the full stable sort gives it (the definition the fast paths keep).
    fn by_full_sort(cfg: SamplingConfig, logits: &[f32]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if cfg.temperature == 0.0 {
            return vec![order[0]];
        }
        let keep = match cfg.top_k {
            Some(k) => {
                let kth = logits[order[k.min(order.len()) - 1]];
                order.iter().take_while(|&&i| logits[i] >= kth).count()
            }
            None => order.len(),
        };
        order.truncate(keep);
        order
    }

    #[test]
    fn the_fast_paths_keep_the_sorted_order() {
        // Logits with many ties (few distinct values), greedy and top-k of several sizes.
        for seed in 0..20u64 {
            let logits: Vec<f32> =
                (0..997).map(|i| (((i as u64 * 2654435761) ^ (seed * 97)) % 13) as f32 * 0.5).collect();
            let g = SamplingConfig::greedy();
            assert_eq!(support(g, &logits), by_full_sort(g, &logits), "greedy, seed {seed}");
            for k in [1, 2, 7, 100, 996, 997, 5000] {
                let cfg = SamplingConfig { temperature: 1.0, top_k: Some(k), top_p: None };
                let got = support(cfg, &logits);
                let want = by_full_sort(cfg, &logits);
                assert_eq!(got, want, "top_k {k}, seed {seed}");
            }
        }
    }

    #[test]
    fn greedy_takes_the_largest_logit_and_the_lowest_id_of_ties() {
        let g = SamplingConfig::greedy();
        assert_eq!(g.sample(&[0.1, 2.0, -1.0, 2.0], 7, 0, 0).unwrap(), 1);
        assert_eq!(g.sample(&[f32::NEG_INFINITY, -5.0], 7, 0, 0).unwrap(), 1);
        // top_k = 1 samples the same token.
        let k1 = SamplingConfig { top_k: Some(1), ..SamplingConfig::default() };
        for step in 0..20 {
            assert_eq!(k1.sample(&[0.1, 2.0, -1.0, 1.9], 3, step, 0).unwrap(), 1);
        }
    }

    #[test]
    fn temperature_top_k_and_top_p_keep_the_right_support() {
        let logits = [1.0f32, 3.0, 2.0, 0.0, 2.0];
        // Plain softmax: every token, most likely first, equal logits by id.
        let all = SamplingConfig::default().distribution(&logits).unwrap();
        assert_eq!(all.iter().map(|d| d.0).collect::<Vec<_>>(), [1, 2, 4, 0, 3]);
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for &(i, p) in &all {
            assert!((p - f64::from(logits[i]).exp() / z).abs() < 1e-12);
        }
        // Temperature 2 flattens: softmax(l / 2).
        let t2 = SamplingConfig { temperature: 2.0, ..SamplingConfig::default() }.distribution(&logits).unwrap();
        let z2: f64 = logits.iter().map(|&l| (f64::from(l) / 2.0).exp()).sum();
        assert!((t2[0].1 - (1.5f64).exp() / z2).abs() < 1e-12);
        // Top-k 2 keeps the tie at the 2nd logit (3, then 2 and 2).
        let k2 = SamplingConfig { top_k: Some(2), ..SamplingConfig::default() };
        assert_eq!(support(k2, &logits), [1, 2, 4]);
        // Top-p: probabilities 0.5, 0.3, 0.15, 0.05 (logits ln p).
        let logits: Vec<f32> = [0.05f32, 0.5, 0.15, 0.3].iter().map(|p| p.ln()).collect();
        let p = |top_p| SamplingConfig { top_p: Some(top_p), ..SamplingConfig::default() };
        assert_eq!(support(p(0.49), &logits), [1]);
        assert_eq!(support(p(0.79), &logits), [1, 3]);
        assert_eq!(support(p(0.81), &logits), [1, 3, 2]);
        assert_eq!(support(p(1.0), &logits), [1, 3, 2, 0]);
        assert_eq!(support(p(1e-6), &logits), [1], "at least one token");
        let d = p(0.79).distribution(&logits).unwrap();
        assert!((d[0].1 - 0.625).abs() < 1e-6 && (d[1].1 - 0.375).abs() < 1e-6, "{d:?}");
        // +inf logits share the mass.
        let inf = SamplingConfig::default().distribution(&[0.0, f32::INFINITY, f32::INFINITY]).unwrap();
        assert_eq!(inf, [(1, 0.5), (2, 0.5)]);
    }

    #[test]
    fn draws_follow_the_distribution_and_stay_in_its_support() {
        let logits = [0.0f32, 1.0, 2.0, -1.0, 0.5, 3.0];
        let cfg = SamplingConfig { temperature: 0.8, top_k: Some(4), top_p: Some(0.9) };
        let dist = cfg.distribution(&logits).unwrap();
        let n = 40_000;
        let mut counts = vec![0usize; logits.len()];
        for step in 0..n {
            counts[cfg.sample(&logits, 11, step, 3).unwrap()] += 1;
        }
        let kept: Vec<usize> = dist.iter().map(|d| d.0).collect();
        for (i, &c) in counts.iter().enumerate() {
            let p = dist.iter().find(|d| d.0 == i).map_or(0.0, |d| d.1);
            if !kept.contains(&i) {
                assert_eq!(c, 0, "token {i} is outside the support {kept:?}");
                continue;
            }
            // Within 5 standard deviations of the binomial count.
            let (mean, sd) = (n as f64 * p, (n as f64 * p * (1.0 - p)).sqrt());
            assert!((c as f64 - mean).abs() < 5.0 * sd + 1.0, "token {i}: {c} draws, expected {mean:.0}");
        }
        // The same (seed, step, row) gives the same token; other rows draw independently.
        assert_eq!(cfg.sample(&logits, 11, 5, 3).unwrap(), cfg.sample(&logits, 11, 5, 3).unwrap());
        let rows: std::collections::HashSet<usize> = (0..64).map(|r| cfg.sample(&logits, 11, 5, r).unwrap()).collect();
        assert!(rows.len() > 1, "64 rows drew one token: {rows:?}");
    }

    #[test]
    fn bad_settings_and_logits_are_typed_errors() {
        let err = |cfg: SamplingConfig, logits: &[f32]| match cfg.sample(logits, 0, 0, 0) {
            Err(Error::Argument { message, .. }) => message,
            other => panic!("expected an argument error, got {other:?}"),
        };
        let d = SamplingConfig::default();
        assert!(err(SamplingConfig { temperature: -1.0, ..d }, &[0.0]).contains("temperature"));
        assert!(err(SamplingConfig { temperature: f32::NAN, ..d }, &[0.0]).contains("temperature"));
        assert!(err(SamplingConfig { top_k: Some(0), ..d }, &[0.0]).contains("top_k"));
        assert!(err(SamplingConfig { top_p: Some(0.0), ..d }, &[0.0]).contains("top_p"));
        assert!(err(SamplingConfig { top_p: Some(1.5), ..d }, &[0.0]).contains("top_p"));
        assert!(err(d, &[]).contains("empty"));
        assert!(err(d, &[0.0, f32::NAN]).contains("logit 1 is NaN"));
        assert!(err(d, &[f32::NEG_INFINITY; 3]).contains("−inf"));
    }
}
