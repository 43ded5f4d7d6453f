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
        self.check(logits)?;
        Ok(self.checked_distribution(logits))
    }

    /// The token drawn from `logits` for sequence `row` at decoding step `step` of the stream
    /// `seed` (see the type docs).
    ///
    /// With a temperature and no top-k the whole row is not sorted: a 262,144-token vocabulary
    /// (Gemma 3's) took ~10–20 ms a token to sort on the host, against ~1 ms for the GPU's
    /// decoding step. One pass sums the softmax's normalizer over every token, then only the
    /// first 256 tokens of the distribution's order are selected, sorted and walked: the
    /// cumulative probability passes the uniform number (with top-p: reaches `p`) among them
    /// unless the distribution is flat, and otherwise the next tokens follow in bands 8 times
    /// larger (a flat row ends up sorted in bands, which costs about what the full sort did).
    /// The token is the one [`SamplingConfig::distribution`] gives for the same uniform number,
    /// up to the last bits of the normalizer (summed in id order, not in probability order).
    ///
    /// # Errors
    /// As [`SamplingConfig::distribution`].
    pub fn sample(&self, logits: &[f32], seed: u64, step: u64, row: u64) -> Result<usize> {
        self.check(logits)?;
        let u = uniform(seed, step, row);
        if self.temperature > 0.0 && self.top_k.is_none() {
            if let Some(token) = self.draw_in_bands(logits, u, FIRST_BAND) {
                return Ok(token);
            }
        }
        Ok(draw(&self.checked_distribution(logits), u))
    }

    /// The errors of [`SamplingConfig::distribution`].
    fn check(&self, logits: &[f32]) -> Result<()> {
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
        Ok(())
    }

    /// [`SamplingConfig::distribution`] of logits that passed [`SamplingConfig::check`].
    fn checked_distribution(&self, logits: &[f32]) -> Vec<(usize, f64)> {
        // Greedy: the largest logit, the lowest id of ties (one scan, no sort: a 262k vocabulary
        // is sampled every step).
        if self.temperature == 0.0 {
            let best =
                logits.iter().enumerate().fold(0, |b, (i, x)| if x.total_cmp(&logits[b]).is_gt() { i } else { b });
            return vec![(best, 1.0)];
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
        let t = self.temperature;
        let max = f64::from(logits[order[0]]) / f64::from(t);
        let weights: Vec<f64> = order[..keep].iter().map(|&i| weight(logits[i], t, max)).collect();
        let total: f64 = weights.iter().sum();
        let mut dist: Vec<(usize, f64)> =
            order[..keep].iter().zip(&weights).map(|(&i, &w)| (i, w / total)).filter(|&(_, p)| p > 0.0).collect();
        // Top-p: the shortest prefix whose mass reaches p, then renormalized.
        if let Some(p) = self.top_p {
            let cut = nucleus(&dist, p).unwrap_or(dist.len());
            renormalize_prefix(&mut dist, cut);
        }
        dist
    }

    /// The fast path of [`SamplingConfig::sample`] (a temperature, no top-k): the token that the
    /// distribution gives for the uniform number `u`, walking its order in bands of `first`
    /// tokens, then `8 × first`, … (each band selected, then sorted); `None` where the whole
    /// row's cumulative probability stays at or below `u` (rounding), or for a row too long.
    fn draw_in_bands(&self, logits: &[f32], u: f64, first: usize) -> Option<usize> {
        let (n, t) = (logits.len(), self.temperature);
        // Token ids go in the low half of a u64 key below.
        if u32::try_from(n).is_err() {
            return None;
        }
        // The normalizer over every token, as the full distribution's (summed in another order;
        // `f32::max` may pick −0 for +0 or back, which gives the same weights).
        let max = f64::from(logits.iter().copied().fold(f32::NEG_INFINITY, f32::max)) / f64::from(t);
        let total: f64 = logits.iter().map(|&x| weight(x, t, max)).sum();
        // top_p = 1 keeps every token: what rounding cuts off the tail is never drawn (the
        // cumulative sum already passed every u < 1 there), only the normalizer moves by a bit.
        let top_p = self.top_p.filter(|&p| p < 1.0);
        // The distribution's order as integers: the logit's bits mapped to be ascending where
        // `total_cmp` descends (high half), then the id (low half). Ascending keys are the full
        // order, so each band (the next keys by a selection, then sorted) continues it.
        let mut keys: Vec<u64> = logits
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let b = x.to_bits();
                let ascending = if b >> 31 == 1 { !b } else { b | 1 << 31 };
                u64::from(!ascending) << 32 | i as u64
            })
            .collect();
        let mut dist: Vec<(usize, f64)> = Vec::new();
        let (mut start, mut end) = (0, first.clamp(1, n));
        while start < n {
            if end < n {
                keys[start..].select_nth_unstable(end - start);
            }
            let band = &mut keys[start..end];
            band.sort_unstable();
            let token = |&key: &u64| (key & u64::from(u32::MAX)) as usize;
            dist.extend(band.iter().map(token).map(|i| (i, weight(logits[i], t, max) / total)).filter(|d| d.1 > 0.0));
            match top_p {
                None => {
                    if let Some(token) = first_past(&dist, u) {
                        return Some(token);
                    }
                }
                // The nucleus lies among these tokens once their mass reaches p.
                Some(p) => {
                    if let Some(cut) = nucleus(&dist, p) {
                        renormalize_prefix(&mut dist, cut);
                        return Some(draw(&dist, u));
                    }
                }
            }
            (start, end) = (end, end.saturating_mul(GROWTH).min(n));
        }
        None
    }
}

/// The fast path's first band: the distribution's first 256 tokens.
const FIRST_BAND: usize = 256;
/// Each band of the fast path is this many times the tokens before it.
const GROWTH: usize = 8;

/// The softmax weight of a logit at temperature `t` against the largest scaled logit `max`:
/// `exp(x / t − max)` in f64; where `max` is +inf, 1 for the +inf logits and 0 for the others.
fn weight(x: f32, t: f32, max: f64) -> f64 {
    let x = f64::from(x) / f64::from(t);
    if max == f64::INFINITY {
        if x == f64::INFINITY {
            1.0
        } else {
            0.0
        }
    } else {
        (x - max).exp()
    }
}

/// Top-p: the length of the shortest prefix of `dist` whose mass reaches `p`, if one does.
fn nucleus(dist: &[(usize, f64)], p: f32) -> Option<usize> {
    let mut mass = 0.0;
    dist.iter()
        .position(|&(_, q)| {
            mass += q;
            mass >= f64::from(p)
        })
        .map(|i| i + 1)
}

/// Keeps the first `cut` tokens of `dist` (one at least) and renormalizes their probabilities.
fn renormalize_prefix(dist: &mut Vec<(usize, f64)>, cut: usize) {
    dist.truncate(cut.max(1));
    let kept: f64 = dist.iter().map(|&(_, q)| q).sum();
    dist.iter_mut().for_each(|(_, q)| *q /= kept);
}

/// The first token of `dist` whose cumulative probability passes `u`.
fn first_past(dist: &[(usize, f64)], u: f64) -> Option<usize> {
    let mut cum = 0.0;
    dist.iter()
        .find(|&&(_, p)| {
            cum += p;
            u < cum
        })
        .map(|&(i, _)| i)
}

/// The inverse-CDF draw of `u` from a distribution (not empty).
fn draw(dist: &[(usize, f64)], u: f64) -> usize {
    // Rounding left the sum a hair below 1: the last kept token.
    first_past(dist, u).unwrap_or_else(|| dist.last().map_or(0, |d| d.0))
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

    /// A seeded stream of uniform numbers in [0, 1) (a 64-bit LCG).
    struct Lcg(u64);

    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 11) as f64 / (1u64 << 53) as f64
        }

        /// Logits like a language model's: a normal-ish tail and a few large ones.
        fn peaked(&mut self, n: usize) -> Vec<f32> {
            let mut row: Vec<f32> =
                (0..n).map(|_| ((self.next() + self.next() + self.next() - 1.5) * 4.0) as f32).collect();
            for _ in 0..12 {
                row[(self.next() * n as f64) as usize] = (8.0 + 12.0 * self.next()) as f32;
            }
            row
        }
    }

    /// The draw from the full distribution with the uniform number of `(seed, step, row)`: the
    /// body of `sample` before its fast path (the definition the fast path keeps).
    fn reference(dist: &[(usize, f64)], seed: u64, step: u64, row: u64) -> usize {
        let u = uniform(seed, step, row);
        let mut cum = 0.0;
        for &(i, p) in dist {
            cum += p;
            if u < cum {
                return i;
            }
        }
        dist[dist.len() - 1].0
    }

    /// Draws of the fast path (from bands of `first` tokens) against the reference on `rows`, for
    /// every temperature and top-p, and some of `sample`; how many tokens drawn lay beyond the
    /// first band.
    fn check_draws(rows: &[(&str, Vec<f32>)], first: usize, draws: u64) -> usize {
        let mut deep = 0;
        for (name, logits) in rows {
            for temperature in [0.3, 0.8, 1.5] {
                for top_p in [None, Some(0.5), Some(0.9), Some(0.999), Some(1.0)] {
                    let cfg = SamplingConfig { temperature, top_k: None, top_p };
                    let dist = cfg.distribution(logits).unwrap();
                    for draw in 0..draws {
                        let (seed, step, row) = (draw * 7919 + 1, draw / 3, draw % 3);
                        let want = reference(&dist, seed, step, row);
                        let u = uniform(seed, step, row);
                        let got = cfg.draw_in_bands(logits, u, first);
                        assert_eq!(got, Some(want), "{name}, {cfg:?}, draw {draw}, u {u}");
                        deep += usize::from(dist.iter().position(|d| d.0 == want).unwrap() >= first);
                        if draw % 4 == 0 {
                            assert_eq!(cfg.sample(logits, seed, step, row).unwrap(), want, "{name}, {cfg:?}");
                        }
                    }
                }
            }
        }
        deep
    }

    #[test]
    fn the_fast_path_draws_the_tokens_of_the_full_sort() {
        // Rows of Gemma 3's vocabulary (a smaller one unoptimized, where the full sorts are slow).
        let n = if cfg!(debug_assertions) { 1 << 14 } else { 262_144 };
        let mut rng = Lcg(5);
        let peaked = rng.peaked(n);
        // bf16-rounded (many ties) with every 5th token masked to −inf.
        let mut masked = rng.peaked(n);
        for (i, x) in masked.iter_mut().enumerate() {
            *x = if i % 5 == 2 { f32::NEG_INFINITY } else { f32::from_bits(x.to_bits() & 0xffff_0000) };
        }
        // More +inf logits than the first band (they share all the mass).
        let mut infinite = rng.peaked(n);
        for _ in 0..300 {
            infinite[(rng.next() * n as f64) as usize] = f32::INFINITY;
        }
        // Nearly flat and flat: the first band holds little mass, the bands grow to the whole row.
        let near_flat: Vec<f32> = (0..n).map(|_| (rng.next() * 0.01) as f32).collect();
        let rows = [
            ("peaked", peaked),
            ("masked", masked),
            ("+inf", infinite),
            ("near flat", near_flat),
            ("flat", vec![0.5; n]),
        ];
        let deep = check_draws(&rows, FIRST_BAND, 12);
        assert!(deep > 100, "{deep} tokens drawn beyond the first band");
    }

    #[test]
    fn the_fast_path_grows_its_bands() {
        // Small rows from a band of one token (1, 8, 64, 512, …), with ties, ±0 and ±inf.
        let mut rng = Lcg(9);
        let mut rows = Vec::new();
        for n in [1, 2, 3, 100, 1000] {
            let mut row = rng.peaked(n.max(12));
            row.truncate(n);
            rows.push(("peaked", row.clone()));
            let ties: Vec<f32> = row.iter().map(|x| x.round()).collect();
            rows.push(("ties", ties.clone()));
            let inf: Vec<f32> = ties
                .iter()
                .enumerate()
                .map(|(i, &x)| match i % 9 {
                    4 => f32::INFINITY,
                    0 | 7 => f32::NEG_INFINITY,
                    _ => x,
                })
                .collect();
            if inf.iter().any(|&x| x > f32::NEG_INFINITY) {
                rows.push(("±inf", inf));
            }
        }
        let deep = check_draws(&rows, 1, 24);
        assert!(deep > 100, "{deep} tokens drawn beyond the first band");
    }

    /// Time per draw on a 262,144-token row, the full sort against the fast path:
    /// `cargo test --release -p te-models sampling::tests::timing -- --ignored --nocapture`.
    #[test]
    #[ignore = "a timing print"]
    fn timing() {
        let mut rng = Lcg(5);
        let peaked = rng.peaked(262_144);
        let near_flat: Vec<f32> = (0..262_144).map(|_| (rng.next() * 0.01) as f32).collect();
        for (name, logits) in [("peaked", &peaked), ("near flat", &near_flat)] {
            for (temperature, top_p) in [(0.8, None), (0.8, Some(0.9)), (1.5, None), (1.5, Some(0.999))] {
                let cfg = SamplingConfig { temperature, top_k: None, top_p };
                let time = |draw: &dyn Fn(u64) -> usize| {
                    let start = std::time::Instant::now();
                    let tokens: Vec<usize> = (0..20).map(draw).collect();
                    (start.elapsed().as_secs_f64() * 1e3 / 20.0, tokens)
                };
                let (full, want) = time(&|step| reference(&cfg.distribution(logits).unwrap(), 7, step, 0));
                let (fast, got) = time(&|step| cfg.sample(logits, 7, step, 0).unwrap());
                assert_eq!(got, want);
                println!(
                    "{name}, T {temperature}, top_p {top_p:?}: full sort {full:.2} ms, fast path {fast:.2} ms a draw"
                );
            }
        }
    }
}
