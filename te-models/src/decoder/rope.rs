//! Rotary position embeddings of the decoder family: [`RopeConfig`] (the base θ and the frequency
//! scaling of one kind of layer) and the angles `position · inv_freq` the rotation uses, as
//! transformers computes them (`modeling_rope_utils.py`: `_compute_default_rope_parameters`,
//! `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`), in f32 with the same
//! operations.
//!
//! The layout is the standard non-interleaved one (transformers' `rotate_half`, TE's default):
//! channel `c < d/2` of a head pairs with channel `c + d/2`, both rotated by the angle of
//! frequency `c`; [`te_reference::rope::forward`] applies it.

use super::{DecoderError, DecoderResult};

/// Frequency scaling of RoPE (transformers' `rope_scaling` / `rope_parameters.rope_type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `rope_type = "default"`: `inv_freq[j] = θ^(−2j/d)`.
    None,
    /// `rope_type = "linear"`: every frequency divided by `factor` (positions interpolated).
    Linear {
        /// `factor` (> 0).
        factor: f32,
    },
    /// `rope_type = "llama3"` (Llama 3.1+): low frequencies (wavelength above
    /// `original_max_position_embeddings / low_freq_factor`) divided by `factor`, high ones
    /// (wavelength below `original_max_position_embeddings / high_freq_factor`) kept, the band
    /// between interpolated smoothly.
    Llama3 {
        /// `factor` (> 0).
        factor: f32,
        /// `low_freq_factor`.
        low_freq_factor: f32,
        /// `high_freq_factor` (> `low_freq_factor`).
        high_freq_factor: f32,
        /// `original_max_position_embeddings` (the context the model was pretrained with).
        original_max_position_embeddings: usize,
    },
}

/// RoPE of one kind of layer: base `theta` and [`RopeScaling`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    /// The base θ (transformers `rope_theta`; Gemma 3's local layers `rope_local_base_freq`).
    pub theta: f32,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// θ with no scaling.
    pub fn new(theta: f32) -> Self {
        Self { theta, scaling: RopeScaling::None }
    }

    /// Checks θ and the scaling's factors; `field` names the configuration entry in errors.
    ///
    /// # Errors
    /// [`DecoderError::Config`] for θ or a factor that is not finite and > 0, a Llama-3 band whose
    /// `high_freq_factor` is not above `low_freq_factor`, or an `original_max_position_embeddings`
    /// of 0.
    pub fn validate(&self, field: &str) -> DecoderResult<()> {
        let bad = |what: &str, message: String| Err(DecoderError::config(format!("{field}.{what}"), message));
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if !positive(self.theta) {
            return bad("rope_theta", format!("{}; must be a finite number > 0", self.theta));
        }
        match self.scaling {
            RopeScaling::None => Ok(()),
            RopeScaling::Linear { factor } if positive(factor) => Ok(()),
            RopeScaling::Linear { factor } => bad("factor", format!("{factor}; must be a finite number > 0")),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                if !positive(factor) {
                    return bad("factor", format!("{factor}; must be a finite number > 0"));
                }
                if !(positive(low_freq_factor) && positive(high_freq_factor) && high_freq_factor > low_freq_factor) {
                    return bad(
                        "high_freq_factor",
                        format!(
                            "low_freq_factor {low_freq_factor} and high_freq_factor {high_freq_factor}: both must be \
                             > 0 and high_freq_factor > low_freq_factor"
                        ),
                    );
                }
                if original_max_position_embeddings == 0 {
                    return bad("original_max_position_embeddings", "0; must be ≥ 1".into());
                }
                Ok(())
            }
        }
    }

    /// The inverse frequencies `[head_dim / 2]` (transformers' `inv_freq`, f32): `1 / θ^(2j/d)`,
    /// then scaled.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let d = head_dim as f32;
        let base: Vec<f32> = (0..head_dim / 2).map(|j| 1.0 / self.theta.powf((2 * j) as f32 / d)).collect();
        match self.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let old = original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_wavelen { f / factor } else { f };
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                        if medium {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }

    /// The angles of `positions` as [`te_reference::rope::forward`] takes them: `[positions,
    /// head_dim]` row-major, `position · inv_freq[j]` (f32) in channel `j` and again in `j + d/2`
    /// (transformers' `emb = cat(freqs, freqs)`).
    pub fn angles(&self, head_dim: usize, positions: impl IntoIterator<Item = usize>) -> Vec<f32> {
        let inv = self.inv_freq(head_dim);
        positions
            .into_iter()
            .flat_map(|p| {
                let row: Vec<f32> = inv.iter().map(|&f| p as f32 * f).collect();
                row.clone().into_iter().chain(row)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_frequencies_and_angles() {
        let r = RopeConfig::new(10000.0);
        let f = r.inv_freq(8);
        let want = [1.0, 0.1, 0.01, 0.001];
        for (g, w) in f.iter().zip(want) {
            assert!((g - w).abs() <= 1e-6 * w, "{f:?}");
        }
        let a = r.angles(8, [0, 3]);
        assert_eq!(a.len(), 16);
        assert!(a[..8].iter().all(|&x| x == 0.0));
        assert_eq!(a[8], 3.0);
        assert_eq!(a[8 + 4], 3.0, "both halves share the frequency");
        assert_eq!(a[9], a[13]);
    }

    #[test]
    fn linear_and_llama3_scaling() {
        let lin = RopeConfig { theta: 10000.0, scaling: RopeScaling::Linear { factor: 4.0 } };
        assert_eq!(lin.inv_freq(8)[1], RopeConfig::new(10000.0).inv_freq(8)[1] / 4.0);
        // Llama 3.1's constants on a head of 128: high frequencies kept, low ones divided by 8,
        // the band between in between.
        let l3 = RopeConfig {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
        };
        let (base, scaled) = (RopeConfig::new(500000.0).inv_freq(128), l3.inv_freq(128));
        assert_eq!(scaled[0], base[0]);
        assert_eq!(scaled[63], base[63] / 8.0);
        let mid = (0..64).filter(|&j| scaled[j] < base[j] && scaled[j] > base[j] / 8.0).count();
        assert!(mid > 0, "some frequencies lie in the smoothed band");
        l3.validate("rope").unwrap();
    }

    #[test]
    fn bad_parameters_name_the_field() {
        let e = RopeConfig::new(0.0).validate("rope").unwrap_err().to_string();
        assert!(e.contains("rope.rope_theta"), "{e}");
        let bad = RopeConfig {
            theta: 1.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 4.0,
                high_freq_factor: 1.0,
                original_max_position_embeddings: 8192,
            },
        };
        assert!(bad.validate("rope").unwrap_err().to_string().contains("high_freq_factor"));
        let lin = RopeConfig { theta: 1.0, scaling: RopeScaling::Linear { factor: f32::NAN } };
        assert!(lin.validate("rope").unwrap_err().to_string().contains("rope.factor"));
    }
}
