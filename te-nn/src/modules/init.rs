//! Parameter initialization (TE `init_method_normal`, `pytorch/utils.py`).

use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

/// `n` values `~ N(0, std)` from `seed` (TE's default weight init is `N(0, 0.023)`).
pub(crate) fn normal(n: usize, std: f32, seed: u64) -> Vec<f32> {
    // std = 0 is zeros (torch.nn.init.normal_(std=0)) without drawing n samples: a model that
    // loads its weights asks for no init (a 262k-row LM head draws 168 M samples otherwise).
    if std == 0.0 {
        return vec![0.0; n];
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    match Normal::new(0.0f32, std) {
        Ok(d) => (0..n).map(|_| d.sample(&mut rng)).collect(),
        // A zero or non-finite std: constant zeros, as torch.nn.init.normal_(std=0).
        Err(_) => vec![0.0; n],
    }
}
