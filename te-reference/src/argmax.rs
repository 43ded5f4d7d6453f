//! Family 21 reference: the row-wise argmax of `ops::argmax` (the lowest index of ties, `-1` for
//! a row with a NaN), on values widened to f32 as the kernel compares them.

/// Each row's argmax of `x: [rows, cols]`.
///
/// # Panics
/// If `cols` is 0 or does not divide `x.len()` (caller bugs).
pub fn argmax(x: &[f32], cols: usize) -> Vec<i32> {
    assert!(cols > 0 && x.len() % cols == 0, "x is not [rows, {cols}]");
    x.chunks_exact(cols)
        .map(|row| {
            if row.iter().any(|v| v.is_nan()) {
                return -1;
            }
            row.iter().enumerate().fold(0, |b, (i, &v)| if v > row[b] { i } else { b }) as i32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ties_take_the_lowest_index_and_nan_rows_are_flagged() {
        let x = [1.0, 3.0, 3.0, -1.0, f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, f32::NAN, 5.0];
        assert_eq!(super::argmax(&x, 3), [1, 0, -1]);
    }
}
