//! Family 11 reference: embedding lookup and its scatter-add backward.
//!
//! Mirrors `te-codegen/templates/embedding.cu.tera`: the forward copies rows (bit-exact), an id outside
//! `[0, vocab)` gives a zero row; the backward sums each table row's gradients over the tokens in
//! token order in f32 and adds the sum once to the gradient, rounded to its dtype (bit-exact
//! too: the kernel adds in the same order).

use te_codegen::DType;
use te_runtime::numerics::round_to;

/// Whether `id` indexes a row of a `vocab`-row table.
fn row(id: i32, vocab: usize) -> Option<usize> {
    usize::try_from(id).ok().filter(|&r| r < vocab)
}

/// `out[t, :] = table[ids[t], :]` (`table`: `[vocab, hidden]` row-major), zeros for ids outside
/// `[0, vocab)`; returns `[ids.len(), hidden]`.
///
/// # Panics
/// When `table.len()` is not a multiple of `hidden` (a caller bug).
pub fn forward(table: &[f32], hidden: usize, ids: &[i32]) -> Vec<f32> {
    assert_eq!(table.len() % hidden, 0, "table must be [vocab, hidden]");
    let vocab = table.len() / hidden;
    let mut out = vec![0.0; ids.len() * hidden];
    for (t, &id) in ids.iter().enumerate() {
        if let Some(r) = row(id, vocab) {
            out[t * hidden..(t + 1) * hidden].copy_from_slice(&table[r * hidden..(r + 1) * hidden]);
        }
    }
    out
}

/// `dtable[v, :] = round(dtable[v, :] + Σ_{t: ids[t] = v} dout[t, :])`, the sum in f32 in token
/// order, rounded to `grad_dtype` once per row touched; ids outside `[0, vocab)` are skipped.
///
/// # Panics
/// When the lengths do not fit `[vocab, hidden]` and `[ids.len(), hidden]` (a caller bug).
pub fn backward(dout: &[f32], ids: &[i32], dtable: &mut [f32], grad_dtype: DType, hidden: usize) {
    assert_eq!(dout.len(), ids.len() * hidden, "dout must be [tokens, hidden]");
    assert_eq!(dtable.len() % hidden, 0, "dtable must be [vocab, hidden]");
    let vocab = dtable.len() / hidden;
    let mut sums = vec![0.0f32; dtable.len()];
    let mut touched = vec![false; vocab];
    for (t, &id) in ids.iter().enumerate() {
        if let Some(r) = row(id, vocab) {
            touched[r] = true;
            for (s, &d) in sums[r * hidden..(r + 1) * hidden].iter_mut().zip(&dout[t * hidden..(t + 1) * hidden]) {
                *s += d;
            }
        }
    }
    for (r, _) in touched.iter().enumerate().filter(|(_, &t)| t) {
        for c in r * hidden..(r + 1) * hidden {
            dtable[c] = round_to(grad_dtype, dtable[c] + sums[c]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_copies_rows_and_zeroes_bad_ids() {
        let table = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(forward(&table, 2, &[2, 0, -1, 3, 2]), [5.0, 6.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 5.0, 6.0]);
    }

    #[test]
    fn backward_sums_repeated_ids_in_f32_and_rounds_once() {
        let mut dtable = vec![1.0f32; 6];
        let p = 2f32.powi(-8);
        // Row 1 gets p three times (3p, exact in f32) before one bf16 rounding: 1 + 3 * 2^-8 ties
        // to 1 + 2^-6 (even); rounding after each add would leave 1. Row 0 is untouched, row 2
        // gets one gradient, the bad ids nothing.
        let dout = [p, p, p, p, 0.5, -0.5, p, p, 9.0, 9.0, 9.0, 9.0];
        backward(&dout, &[1, 1, 2, 1, -1, 7], &mut dtable, DType::BF16, 2);
        let want = 1.0 + 2f32.powi(-6);
        assert_eq!(dtable, [1.0, 1.0, want, want, 1.5, 0.5]);
        // Accumulation over two backwards rounds after each.
        let mut acc = vec![0.0f32; 2];
        backward(&[0.1, 0.2], &[0], &mut acc, DType::F32, 2);
        backward(&[0.1, 0.2], &[0], &mut acc, DType::F32, 2);
        assert_eq!(acc, [0.1 + 0.1, 0.2 + 0.2]);
    }
}
