//! Family 12 reference: softmax cross-entropy with integer targets and an ignore index.
//!
//! Mirrors `te-codegen/templates/cross_entropy.cu.tera` in f64 (the kernel sums exponentials in f32 in a
//! thread-dependent order, so the GPU matches within float rounding, not bit for bit):
//! `loss[t] = logsumexp(x[t]) - x[t, target]`, `dlogits = (softmax - onehot) * grad_scale`
//! (unrounded; the kernel rounds it to the logits' dtype). An ignored target gives loss 0 and a
//! zero gradient row; another target outside `[0, vocab)` gives a NaN loss and a zero row.

/// Per-token losses `[tokens]` and `dlogits` `[tokens, vocab]` of `logits` (`[tokens, vocab]`
/// row-major) against `targets` (`[tokens]`).
///
/// # Panics
/// When `logits.len() != targets.len() * vocab` (a caller bug).
pub fn cross_entropy(
    logits: &[f32],
    vocab: usize,
    targets: &[i32],
    ignore_index: i32,
    grad_scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(logits.len(), targets.len() * vocab, "logits must be [tokens, vocab]");
    let mut loss = vec![0.0f32; targets.len()];
    let mut grad = vec![0.0f32; logits.len()];
    for (t, &target) in targets.iter().enumerate() {
        if target == ignore_index {
            continue;
        }
        let Some(tgt) = usize::try_from(target).ok().filter(|&c| c < vocab) else {
            loss[t] = f32::NAN;
            continue;
        };
        let x = &logits[t * vocab..(t + 1) * vocab];
        let m = x.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
        let s: f64 = x.iter().map(|&v| (f64::from(v) - m).exp()).sum();
        loss[t] = (m + s.ln() - f64::from(x[tgt])) as f32;
        for (c, (g, &v)) in grad[t * vocab..(t + 1) * vocab].iter_mut().zip(x).enumerate() {
            let p = (f64::from(v) - m).exp() / s;
            *g = ((p - if c == tgt { 1.0 } else { 0.0 }) * f64::from(grad_scale)) as f32;
        }
    }
    (loss, grad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_logits_cost_log_vocab_and_gradients_sum_to_zero() {
        let (loss, grad) = cross_entropy(&[0.5; 8], 4, &[3, 0], -1, 0.5);
        for l in loss {
            assert!((l - 4f32.ln()).abs() < 1e-6);
        }
        assert_eq!(grad[..4], [0.125, 0.125, 0.125, -0.375]);
        assert!(grad.iter().sum::<f32>().abs() < 1e-6);
    }

    #[test]
    fn ignored_and_bad_targets() {
        let logits = [1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0];
        let (loss, grad) = cross_entropy(&logits, 3, &[-100, 5, 2], -100, 1.0);
        assert_eq!(loss[0], 0.0);
        assert!(loss[1].is_nan());
        let lse = (1f64.exp() + 2f64.exp() + 3f64.exp()).ln();
        assert!((f64::from(loss[2]) - (lse - 3.0)).abs() < 1e-6);
        assert!(grad[..6].iter().all(|&g| g == 0.0));
        assert!(grad[8] < 0.0 && grad[6] > 0.0);
    }

    #[test]
    fn large_logits_do_not_overflow() {
        let (loss, grad) = cross_entropy(&[1000.0, 0.0], 2, &[0], -1, 1.0);
        assert!(loss[0].abs() < 1e-6 && grad[0].abs() < 1e-6 && grad[1].abs() < 1e-6);
    }
}
