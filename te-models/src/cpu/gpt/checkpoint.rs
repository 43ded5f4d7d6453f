//! Checkpoints of [`GptRef`] and [`GptAdamW`] in the device model's format
//! ([`te_nn::checkpoint`], [`te_train::optim::AdamW::save_state`]): the same tensor names, dtypes
//! (parameters in the config's `params_dtype`), FP8 scaling states and optimizer tensors, so
//! that a checkpoint of `te train` on the CPU loads into the GPU [`crate::gpt::Gpt`]
//! and a GPU run's checkpoint samples on the CPU.

use super::{GptAdamW, GptRef, MODEL};
use std::path::Path;
use te_nn::checkpoint::host::{load_host, save_host, Entry, HostParam};
use te_nn::checkpoint::optimizer_state::{read_state_file, write_state_file, HostParamState};
use te_nn::checkpoint::{LoadOptions, LoadReport, SaveOptions};
use te_nn::fp8::{Fp8Direction, ScalingSnapshot};
use te_runtime::{Error, Result};

/// Slots of the device model's forward scaling state of a GEMM (input, weight, output).
const FWD_SLOTS: usize = 3;

/// What precedes `fp8_fwd` / `fp8_bwd` in the paths of GEMM `g`'s scaling states (`4·l + {qkv,
/// proj, fc1, fc2}`, then the LM head) as the device model names them:
/// `layers.0.self_attention.layernorm_qkv.fp8_fwd`, `layers.0.layernorm_mlp.fc1_fp8_fwd`.
fn state_prefix(g: usize, num_layers: usize) -> String {
    if g == 4 * num_layers {
        return "lm_head.".into();
    }
    let l = g / 4;
    match g % 4 {
        0 => format!("layers.{l}.self_attention.layernorm_qkv."),
        1 => format!("layers.{l}.self_attention.proj."),
        2 => format!("layers.{l}.layernorm_mlp.fc1_"),
        _ => format!("layers.{l}.layernorm_mlp.fc2_"),
    }
}

impl GptRef {
    /// The dropout stream position: the masks drawn so far (two per training forward), the
    /// value the device model's `Gpt::dropout_offset` has after as many forwards.
    pub fn dropout_offset(&self) -> u64 {
        2 * self.forwards
    }

    /// Moves the dropout stream to `offset` (a checkpoint's [`GptRef::dropout_offset`]).
    ///
    /// # Errors
    /// [`Error::Argument`] for an odd offset (not one a run of this model reaches).
    pub fn set_dropout_offset(&mut self, offset: u64) -> Result<()> {
        if offset % 2 != 0 {
            return Err(Error::Argument {
                op: MODEL,
                message: format!("dropout offset {offset} is odd: each training forward draws two masks"),
            });
        }
        self.forwards = offset / 2;
        Ok(())
    }

    /// What the model holds, as the checkpoint loader lists it: every parameter (in
    /// `params_dtype`), the scaling states of every GEMM that can run in FP8 (the LM head's
    /// with `fp8_lm_head`), and the FP8 attention states of a device run under `fp8_dpa`
    /// (`core_attention.fp8_fwd`, `fp8_bwd`, `fp8_dp`), accepted and not used: attention runs
    /// in f32 here.
    fn entries(&self) -> Vec<Entry> {
        let dtype = self.cfg.params_dtype;
        let mut out: Vec<Entry> = self
            .params
            .iter()
            .map(|p| Entry::Param { path: p.name.clone(), dtype, shape: p.shape.clone(), fp8: false })
            .collect();
        let nl = self.cfg.num_layers;
        let state = |path: String, slots, direction| Entry::State { path, slots, direction };
        for g in 0..4 * nl + usize::from(self.cfg.fp8_lm_head) {
            let prefix = state_prefix(g, nl);
            out.push(state(format!("{prefix}fp8_fwd"), FWD_SLOTS, Fp8Direction::Forward));
            out.push(state(format!("{prefix}fp8_bwd"), 1, Fp8Direction::Backward));
        }
        for l in 0..nl {
            let prefix = format!("layers.{l}.self_attention.core_attention");
            out.push(state(format!("{prefix}.fp8_fwd"), FWD_SLOTS, Fp8Direction::Forward));
            out.push(state(format!("{prefix}.fp8_bwd"), 1, Fp8Direction::Backward));
            out.push(state(format!("{prefix}.fp8_dp"), 1, Fp8Direction::Backward));
        }
        out
    }

    /// Writes the model to the safetensors file `path` as the device model's
    /// [`te_nn::checkpoint::save`] does: each parameter under its path in the config's
    /// `params_dtype` (rounded to nearest even: the device model's weights; the f32 master
    /// weights go to the optimizer's file), and under FP8 the delayed-scaling state of each
    /// GEMM (`….fp8_fwd` with the device model's three slots, the third, the output's, unused;
    /// `….fp8_bwd`).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a reserved metadata key or an I/O failure.
    pub fn save(&self, path: impl AsRef<Path>, options: &SaveOptions) -> Result<()> {
        let dtype = self.cfg.params_dtype;
        let params: Vec<HostParam<'_>> =
            self.params.iter().map(|p| HostParam { path: &p.name, dtype, shape: &p.shape, values: &p.value }).collect();
        let mut states: Vec<(String, ScalingSnapshot)> = Vec::new();
        for (g, s) in self.fp8.iter().enumerate() {
            let prefix = state_prefix(g, self.cfg.num_layers);
            let [fwd, bwd] = s.snapshots(FWD_SLOTS);
            states.push((format!("{prefix}fp8_fwd"), fwd));
            states.push((format!("{prefix}fp8_bwd"), bwd));
        }
        save_host(&params, &states, path.as_ref(), options)
    }

    /// Loads the safetensors file `path` (written by [`GptRef::save`] or by the device model's
    /// [`te_nn::checkpoint::save`] for the same config) into the model: the parameters, and
    /// under FP8 the GEMMs' scaling states (histories fitted to the recipe's length; a state
    /// the file lacks is reset to fresh, as on the device). With [`LoadOptions::strict`] any
    /// missing, unexpected or mismatched tensor fails the load before the model changes;
    /// otherwise what matches is loaded and the rest reported.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for an unreadable, truncated or corrupt file, a newer format, or
    /// (strict) a file of another architecture or `params_dtype`, naming the tensors.
    pub fn load(&mut self, path: impl AsRef<Path>, options: &LoadOptions) -> Result<LoadReport> {
        let mut ck = load_host(path.as_ref(), &self.entries(), options)?;
        for p in &mut self.params {
            if let Some(v) = ck.params.remove(&p.name) {
                p.value = v;
            }
        }
        let nl = self.cfg.num_layers;
        for (g, s) in self.fp8.iter_mut().enumerate() {
            let prefix = state_prefix(g, nl);
            for (direction, name) in ["fp8_fwd", "fp8_bwd"].into_iter().enumerate() {
                let path = format!("{prefix}{name}");
                match ck.states.get(&path) {
                    Some(snap) => s.restore(direction, Some(snap)),
                    None if ck.fresh.contains(&path) => s.restore(direction, None),
                    None => {}
                }
            }
        }
        Ok(ck.report)
    }

    /// The paths of the FP8 scaling states (as [`GptRef::save`] names them) holding a NaN or
    /// infinite amax, scale or scale_inv: what a checkpoint must not keep.
    pub fn nonfinite_fp8_states(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (g, s) in self.fp8.iter().enumerate() {
            let prefix = state_prefix(g, self.cfg.num_layers);
            for (name, snap) in ["fp8_fwd", "fp8_bwd"].into_iter().zip(s.snapshots(FWD_SLOTS)) {
                if !snap.amax_history.iter().chain(&snap.scale).chain(&snap.scale_inv).all(|x| x.is_finite()) {
                    out.push(format!("{prefix}{name}"));
                }
            }
        }
        out
    }
}

impl GptAdamW {
    /// Writes the optimizer's state to `path` in the device optimizer's format
    /// (`te_train::optim::AdamW::save_state`): per parameter of `model` its f32 master weight
    /// (the model's values), the two moments and its step count.
    ///
    /// # Errors
    /// [`Error::Config`] when the moments were made for another model; [`Error::Checkpoint`]
    /// for an I/O failure.
    pub fn save_state(&self, model: &GptRef, path: impl AsRef<Path>) -> Result<()> {
        self.check_model(model)?;
        let states: Vec<HostParamState<'_>> = model
            .params
            .iter()
            .zip(self.exp_avg.iter().zip(&self.exp_avg_sq))
            .map(|(p, (m, v))| HostParamState {
                path: &p.name,
                shape: &p.shape,
                tensors: [&p.value, m, v],
                step: self.step,
            })
            .collect();
        write_state_file(path.as_ref(), self.step, &states)
    }

    /// Replaces the optimizer's state and `model`'s parameters (by their f32 master weights) by
    /// what [`GptAdamW::save_state`] or the device optimizer wrote to `path` for a model of the
    /// same layout. Nothing changes unless every tensor fits.
    ///
    /// # Errors
    /// [`Error::Config`] when the moments were made for another model; [`Error::Checkpoint`]
    /// for a missing, corrupt or foreign file and tensors that are missing or mis-shaped.
    pub fn load_state(&mut self, model: &mut GptRef, path: impl AsRef<Path>) -> Result<()> {
        self.check_model(model)?;
        let wanted: Vec<(&str, &[usize])> =
            model.params.iter().map(|p| (p.name.as_str(), p.shape.as_slice())).collect();
        let (step, found) = read_state_file(path.as_ref(), &wanted)?;
        for (((p, m), v), state) in model.params.iter_mut().zip(&mut self.exp_avg).zip(&mut self.exp_avg_sq).zip(found)
        {
            let [master, exp_avg, exp_avg_sq] = state.tensors;
            (p.value, *m, *v) = (master, exp_avg, exp_avg_sq);
        }
        self.step = step;
        Ok(())
    }

    fn check_model(&self, model: &GptRef) -> Result<()> {
        let fits = self.exp_avg.len() == model.params.len()
            && model.params.iter().zip(&self.exp_avg).all(|(p, m)| m.len() == p.value.len());
        if fits {
            Ok(())
        } else {
            Err(Error::Config { module: "GptAdamW", message: "the moments were made for another model".into() })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::gpt::{GemmPrecision, GptAdamWConfig};
    use crate::gpt::GptConfig;
    use te_codegen::DType;
    use te_nn::fp8::DelayedScaling;

    fn cfg(params_dtype: DType) -> GptConfig {
        GptConfig {
            num_layers: 2,
            hidden_size: 32,
            num_attention_heads: 2,
            ffn_hidden_size: 64,
            seq_length: 16,
            params_dtype,
            seed: 3,
            ..GptConfig::tiny()
        }
    }

    fn batch(c: &GptConfig, s: usize, b: usize, seed: i32) -> (Vec<i32>, Vec<i32>) {
        let v = c.vocab_size as i32;
        let ids = (0..(s * b) as i32).map(|i| (i * 7 + seed * 13) % v).collect();
        let targets = (0..(s * b) as i32).map(|i| (i * 11 + seed * 5 + 1) % v).collect();
        (ids, targets)
    }

    fn adamw() -> GptAdamWConfig {
        GptAdamWConfig {
            betas: (0.9, 0.95),
            eps: 1e-8,
            weight_decay: 0.1,
            max_grad_norm: Some(1.0),
            skip_nonfinite: false,
        }
    }

    /// Trains `model` for `steps` steps from step `from`.
    fn train(model: &mut GptRef, opt: &mut GptAdamW, from: i32, steps: i32) -> Vec<f32> {
        let c = model.config().clone();
        (from..from + steps)
            .map(|k| {
                let (ids, targets) = batch(&c, 8, 2, k);
                let (loss, ctx) = model.forward_loss(&ids, &targets, 8, 2).unwrap();
                let grads = model.backward(ctx).unwrap();
                opt.step(model, &grads, 1e-2).unwrap();
                loss
            })
            .collect()
    }

    /// A run saved after 3 steps (model, FP8 state, dropout stream, optimizer) and resumed in a
    /// fresh model continues bit for bit as the run that never stopped (FP8 and BF16 emulation,
    /// dropout on, bf16 stored weights: the master weights come from the optimizer's file).
    #[test]
    fn save_load_resume_is_bit_exact() {
        let dir = tempfile::tempdir().unwrap();
        for precision in [
            GemmPrecision::Fp8(DelayedScaling { amax_history_len: 4, ..Default::default() }.into()),
            GemmPrecision::Bf16,
        ] {
            let c = cfg(DType::BF16);
            let mut a = GptRef::new(&c).unwrap();
            a.set_precision(precision).unwrap();
            let mut opt_a = GptAdamW::new(&a, adamw());
            train(&mut a, &mut opt_a, 0, 3);
            let (m, o) = (dir.path().join("model.safetensors"), dir.path().join("optimizer.safetensors"));
            a.save(&m, &SaveOptions::default()).unwrap();
            opt_a.save_state(&a, &o).unwrap();
            let offset = a.dropout_offset();
            let straight = train(&mut a, &mut opt_a, 3, 3);

            // The same config (its seed is the dropout stream's), other weights.
            let mut b = GptRef::new(&c).unwrap();
            b.params.iter_mut().for_each(|p| p.value.fill(0.5));
            b.set_precision(precision).unwrap();
            let mut opt_b = GptAdamW::new(&b, adamw());
            assert!(b.load(&m, &LoadOptions::default()).unwrap().is_clean());
            opt_b.load_state(&mut b, &o).unwrap();
            b.set_dropout_offset(offset).unwrap();
            assert_eq!(opt_b.step_count(), 3);
            let resumed = train(&mut b, &mut opt_b, 3, 3);
            assert_eq!(straight, resumed, "{precision:?}");
            assert_eq!(a.params, b.params, "{precision:?}");
        }
    }

    /// The stored weights are the config's dtype, rounded; a model of another architecture or
    /// dtype is refused naming the tensors; odd dropout offsets are refused.
    #[test]
    fn checkpoints_of_another_model_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let model = GptRef::new(&cfg(DType::BF16)).unwrap();
        model.save(&path, &SaveOptions::default()).unwrap();
        let mut wider = GptRef::new(&GptConfig { hidden_size: 64, ..cfg(DType::BF16) }).unwrap();
        let e = wider.load(&path, &LoadOptions::default()).unwrap_err().to_string();
        assert!(e.contains("does not match the model") && e.contains("mismatched: embedding.weight"), "{e}");
        let mut f32_model = GptRef::new(&cfg(DType::F32)).unwrap();
        let e = f32_model.load(&path, &LoadOptions::default()).unwrap_err().to_string();
        assert!(e.contains("BF16") && e.contains("F32"), "{e}");
        let mut deeper = GptRef::new(&GptConfig { num_layers: 3, ..cfg(DType::BF16) }).unwrap();
        let e = deeper.load(&path, &LoadOptions::default()).unwrap_err().to_string();
        assert!(e.contains("missing: layers.2."), "{e}");
        let mut same = GptRef::new(&GptConfig { seed: 5, ..cfg(DType::BF16) }).unwrap();
        assert!(same.load(&path, &LoadOptions::default()).unwrap().is_clean());
        let rounded: Vec<f32> = model.params[0].value.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
        assert_eq!(same.params[0].value, rounded);
        assert!(same.set_dropout_offset(3).is_err());
    }
}
