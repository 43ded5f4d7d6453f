//! The `fp8_autocast` and `fp8_model_init` scopes (TE `pytorch/fp8.py`: `fp8_autocast`,
//! `FP8GlobalStateManager`, `fp8_model_init`).
//!
//! Scopes are per thread and nest. Modules ask [`fp8_mode`] whether to run their GEMMs in FP8.
//! Under delayed scaling every module that ran inside registers its forward scaling state with
//! the outermost scope; when that scope exits, one bulk kernel updates the scales of all of
//! them. Each forward context made under the scope holds a ticket of the scope's backward
//! group; when the last ticket is used (or dropped), one bulk kernel updates the backward
//! scaling state of all those modules. Backward runs with the recipe its forward saw, wherever
//! it is called.
//!
//! With an amax reduction group (TE's `fp8_group`, [`Fp8Autocast::fp8_group`]) and
//! `DelayedScaling::reduce_amax`, both updates first take the maximum of every amax over the
//! group, so every rank derives the same scales (TE `reduce_and_update_fp8_tensors`).

use super::{Recipe, ScalingState};
use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::ops::scaling::{delayed_scaling_update, ScalingGroup};
use te_runtime::{Error, Result};

/// The settings of one `fp8_autocast` scope.
#[derive(Debug, Clone)]
pub struct Fp8Autocast {
    /// Run GEMMs in FP8 (TE `enabled`).
    pub enabled: bool,
    /// With `enabled = false`: run in high precision but record amaxes into the delayed-scaling
    /// histories, to get scales for later FP8 inference (TE `calibrating`).
    pub calibrating: bool,
    /// The recipe (TE `fp8_recipe`; default `DelayedScaling()`).
    pub recipe: Recipe,
    /// The amax reduction group (TE `fp8_group`; default `None`: no reduction): with a delayed
    /// scaling recipe whose `reduce_amax` is set, the outermost scope's exit and the backward
    /// update of its modules all-reduce (max) their amax histories over this group before
    /// computing scales, so every rank casts with the same scales. Every rank of the group must
    /// run the same modules under the scope (the reductions are collectives); the modules'
    /// states must live on the group's GPU. The data-parallel group in data-parallel training
    /// (the data- and tensor-parallel ranks together under tensor parallelism, as TE).
    pub fp8_group: Option<Arc<ProcessGroup>>,
}

impl Default for Fp8Autocast {
    fn default() -> Self {
        Self { enabled: true, calibrating: false, recipe: Recipe::default(), fp8_group: None }
    }
}

impl PartialEq for Fp8Autocast {
    /// Equal settings and the same group (the same `Arc`), or both without one.
    fn eq(&self, other: &Self) -> bool {
        let same_group = match (&self.fp8_group, &other.fp8_group) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        self.enabled == other.enabled
            && self.calibrating == other.calibrating
            && self.recipe == other.recipe
            && same_group
    }
}

/// What the innermost scope asks of modules.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fp8Mode {
    /// No scope, or a disabled one: GEMMs in the parameters' precision.
    HighPrecision,
    /// GEMMs in FP8 with this recipe.
    Fp8(Recipe),
    /// High-precision GEMMs, amaxes recorded for this (delayed-scaling) recipe.
    Calibrating(Recipe),
}

struct Scope {
    frames: Vec<Fp8Autocast>,
    forward_states: Vec<Arc<ScalingState>>,
    backward: Option<Arc<BackwardGroup>>,
}

thread_local! {
    static SCOPE: RefCell<Scope> = const { RefCell::new(Scope { frames: Vec::new(), forward_states: Vec::new(), backward: None }) };
    static MODEL_INIT: Cell<bool> = const { Cell::new(false) };
}

impl Fp8Autocast {
    /// An enabled scope with `recipe`.
    pub fn new(recipe: impl Into<Recipe>) -> Self {
        Self { recipe: recipe.into(), ..Self::default() }
    }

    /// A calibration scope: high precision, amaxes recorded for `recipe`.
    pub fn calibrating(recipe: impl Into<Recipe>) -> Self {
        Self { enabled: false, calibrating: true, recipe: recipe.into(), fp8_group: None }
    }

    /// This scope with the amax reduction group `group` (see [`Fp8Autocast::fp8_group`]).
    pub fn with_group(self, group: Option<Arc<ProcessGroup>>) -> Self {
        Self { fp8_group: group, ..self }
    }

    /// Enters the scope until the guard exits (or drops).
    ///
    /// # Errors
    /// [`Error::Recipe`] for an invalid recipe; calibrating with a current or blockwise
    /// scaling recipe (which keep no amax to calibrate).
    pub fn enter(self) -> Result<Fp8AutocastGuard> {
        self.recipe.validate()?;
        if self.calibrating && !self.enabled && !self.recipe.calibrates() {
            return Err(Error::Recipe {
                message: "calibration records amax histories, which only DelayedScaling keeps; calibrate with a \
                          DelayedScaling recipe (Float8CurrentScaling and Float8BlockScaling need no calibration)"
                    .into(),
            });
        }
        let depth = SCOPE.with_borrow_mut(|s| {
            s.frames.push(self);
            s.frames.len()
        });
        Ok(Fp8AutocastGuard { depth, exited: false, _per_thread: PhantomData })
    }

    /// Runs `f` inside the scope; the outermost scope's exit runs the scale update, whose error
    /// is returned if `f` succeeded.
    ///
    /// # Errors
    /// Those of [`Fp8Autocast::enter`], of `f`, and of the scale update.
    pub fn run<T>(self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let guard = self.enter()?;
        let out = f();
        let exit = guard.exit();
        let v = out?;
        exit.map(|()| v)
    }
}

/// TE's `with fp8_autocast(enabled, fp8_recipe=recipe):` as a closure.
///
/// # Errors
/// As [`Fp8Autocast::run`].
pub fn fp8_autocast<T>(enabled: bool, recipe: impl Into<Recipe>, f: impl FnOnce() -> Result<T>) -> Result<T> {
    Fp8Autocast { enabled, calibrating: false, recipe: recipe.into(), fp8_group: None }.run(f)
}

/// An entered [`Fp8Autocast`] scope. Exit it with [`Fp8AutocastGuard::exit`] to see errors of
/// the scale update; dropping it exits too, logging such errors (`tracing`). Guards of one
/// thread must exit innermost first.
#[derive(Debug)]
pub struct Fp8AutocastGuard {
    depth: usize,
    exited: bool,
    // Scopes are per thread: the guard must not move to another thread.
    _per_thread: PhantomData<*const ()>,
}

impl Fp8AutocastGuard {
    /// Leaves the scope; leaving the outermost one updates the forward scaling state of every
    /// module that ran in it (one bulk kernel per device).
    ///
    /// # Errors
    /// [`Error::Autocast`] when an inner scope is still open; errors of the update.
    pub fn exit(mut self) -> Result<()> {
        self.exited = true;
        self.leave()
    }

    fn leave(&self) -> Result<()> {
        let states = SCOPE.with_borrow_mut(|s| {
            if s.frames.len() != self.depth {
                return Err(Error::Autocast {
                    message: format!(
                        "an fp8_autocast scope at depth {} was exited while {} scope(s) are open; exit the inner \
                         scopes first",
                        self.depth,
                        s.frames.len()
                    ),
                });
            }
            let frame = s.frames.pop();
            if !s.frames.is_empty() {
                return Ok((Vec::new(), None));
            }
            s.backward = None;
            Ok((std::mem::take(&mut s.forward_states), frame.and_then(|f| reduction_group(&f))))
        })?;
        let (states, group) = states;
        update(&states, group.as_deref())
    }
}

impl Drop for Fp8AutocastGuard {
    fn drop(&mut self) {
        if !self.exited {
            if let Err(e) = self.leave() {
                tracing::error!("fp8_autocast exit: {e}");
            }
        }
    }
}

/// The mode modules run in here: the innermost scope's settings.
pub fn fp8_mode() -> Fp8Mode {
    SCOPE.with_borrow(|s| match s.frames.last() {
        Some(f) if f.enabled => Fp8Mode::Fp8(f.recipe),
        Some(f) if f.calibrating => Fp8Mode::Calibrating(f.recipe),
        _ => Fp8Mode::HighPrecision,
    })
}

/// The group a scope's amaxes are reduced over: its `fp8_group` under delayed scaling with
/// `reduce_amax`, when the group has more than one rank.
fn reduction_group(frame: &Fp8Autocast) -> Option<Arc<ProcessGroup>> {
    frame.recipe.reduces_amax().then(|| frame.fp8_group.clone().filter(|g| g.size() > 1)).flatten()
}

/// Whether the current scope's amaxes are reduced over a group holding every rank of `group`
/// (delayed scaling with `reduce_amax` and an `fp8_group` that contains them): then the ranks of
/// `group` cast with the same scales, and the FP8 codes they exchange mean the same values
/// (TE's FP8 all-gather under sequence parallelism relies on it).
pub(crate) fn scales_shared_over(group: &ProcessGroup) -> bool {
    SCOPE.with_borrow(|s| {
        s.frames
            .first()
            .and_then(reduction_group)
            .is_some_and(|r| group.ranks().iter().all(|rank| r.ranks().contains(rank)))
    })
}

/// Registers a module's forward state for the update at the outermost scope's exit.
pub(crate) fn register_forward(state: &Arc<ScalingState>) {
    SCOPE.with_borrow_mut(|s| {
        if !s.frames.is_empty() && !s.forward_states.iter().any(|x| Arc::ptr_eq(x, state)) {
            s.forward_states.push(state.clone());
        }
    });
}

/// A ticket of the current scope's backward group for a module's backward state.
pub(crate) fn backward_ticket(state: &Arc<ScalingState>) -> BackwardTicket {
    let group = SCOPE.with_borrow_mut(|s| {
        let reduce = s.frames.first().and_then(reduction_group);
        s.backward.get_or_insert_with(|| Arc::new(BackwardGroup { reduce, inner: Mutex::default() })).clone()
    });
    {
        let mut g = group.lock();
        g.pending += 1;
        if !g.states.iter().any(|x| Arc::ptr_eq(x, state)) {
            g.states.push(state.clone());
        }
    }
    BackwardTicket { group, live: true }
}

/// The backward scaling states of the modules that ran forward in one outermost scope, and how
/// many of their forward contexts have not run backward yet.
#[derive(Debug)]
pub(crate) struct BackwardGroup {
    /// The scope's amax reduction group ([`reduction_group`]).
    reduce: Option<Arc<ProcessGroup>>,
    inner: Mutex<GroupInner>,
}

#[derive(Debug, Default)]
struct GroupInner {
    states: Vec<Arc<ScalingState>>,
    pending: usize,
}

impl BackwardGroup {
    fn lock(&self) -> std::sync::MutexGuard<'_, GroupInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn finish_one(&self) -> Result<()> {
        let states = {
            let mut g = self.lock();
            g.pending = g.pending.saturating_sub(1);
            if g.pending > 0 {
                return Ok(());
            }
            g.states.clone()
        };
        update(&states, self.reduce.as_deref())
    }
}

/// Held by a forward context: its backward calls [`BackwardTicket::finish`]; a context dropped
/// without backward gives its ticket back on drop.
#[derive(Debug)]
pub(crate) struct BackwardTicket {
    group: Arc<BackwardGroup>,
    live: bool,
}

impl BackwardTicket {
    /// Marks this context's backward done; the last one updates the group's scales.
    pub(crate) fn finish(mut self) -> Result<()> {
        self.live = false;
        self.group.finish_one()
    }
}

impl Drop for BackwardTicket {
    fn drop(&mut self) {
        if self.live {
            if let Err(e) = self.group.finish_one() {
                tracing::error!("backward scale update: {e}");
            }
        }
    }
}

/// One bulk delayed-scaling update per (device, amax algorithm) over `states`. States are
/// locked in address order so concurrent updates of overlapping sets cannot deadlock.
///
/// With `reduce`, the amax histories are first all-reduced (max) over the group in one NCCL
/// group call. The whole history is reduced, not only its newest entry: the older entries are
/// the reductions of earlier updates, equal on every rank already, so the maximum leaves them
/// as they are (a few kB per module, against gathering the newest entries into one buffer and
/// scattering them back). Ranks reduce the states in the order their modules first ran in the
/// scope, which every rank shares, not by address, which differs between processes.
fn update(states: &[Arc<ScalingState>], reduce: Option<&ProcessGroup>) -> Result<()> {
    let mut states: Vec<&Arc<ScalingState>> = states.iter().collect();
    if let Some(group) = reduce {
        reduce_amaxes(group, &states)?;
    }
    states.sort_by_key(|s| Arc::as_ptr(s) as usize);
    let mut guards: Vec<_> = states.iter().map(|s| (s.device().clone(), s.lock())).collect();
    while let Some((dev, first)) = guards.first() {
        let (dev, algo) = (dev.clone(), first.algo);
        let (now, later): (Vec<_>, Vec<_>) =
            guards.into_iter().partition(|(d, b)| Arc::ptr_eq(d, &dev) && b.algo == algo);
        guards = later;
        let mut now = now;
        let mut groups: Vec<ScalingGroup<'_>> = now
            .iter_mut()
            .map(|(_, b)| {
                let b = &mut **b;
                ScalingGroup {
                    amax_history: &mut b.amax_history,
                    scale: &mut b.scale,
                    scale_inv: &mut b.scale_inv,
                    history_len: b.history_len,
                    fp8_max: b.dtype.fp8_max().unwrap_or(1.0),
                    margin: b.margin,
                }
            })
            .collect();
        delayed_scaling_update(&dev, &mut groups, algo)?;
    }
    Ok(())
}

/// The maximum of every state's amax history over `group`, in place, in `states`' order (the
/// order the modules registered in: the same on every rank). The states stay locked while the
/// collectives are issued (locked in address order, as [`update`] locks them, so that concurrent
/// updates cannot deadlock); the collective is ordered on the device's stream before the update
/// kernel (a side-stream group is waited for).
fn reduce_amaxes(group: &ProcessGroup, states: &[&Arc<ScalingState>]) -> Result<()> {
    for s in states {
        if !Arc::ptr_eq(s.device(), group.device()) {
            return Err(Error::Autocast {
                message: format!(
                    "a module's FP8 scaling state lives on GPU {}, the amax reduction group (fp8_group) on GPU {}: \
                     run the modules on the group's GPU",
                    s.device().context().ordinal(),
                    group.device().context().ordinal()
                ),
            });
        }
    }
    let mut by_address: Vec<usize> = (0..states.len()).collect();
    by_address.sort_by_key(|&i| Arc::as_ptr(states[i]) as usize);
    let mut guards: Vec<Option<_>> = (0..states.len()).map(|_| None).collect();
    for i in by_address {
        guards[i] = Some(states[i].lock());
    }
    let mut histories: Vec<&mut cudarc::driver::CudaSlice<f32>> =
        guards.iter_mut().flatten().map(|g| &mut g.amax_history).collect();
    group.all_reduce_many(&mut histories, ReduceOp::Max)?;
    drop(histories);
    group.wait()
}

/// TE's `with fp8_model_init(enabled):` as a closure: modules created inside keep their weights
/// only in FP8 (no high-precision copy); inference through them takes 1 byte per parameter.
pub fn fp8_model_init<T>(enabled: bool, f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            MODEL_INIT.set(self.0);
        }
    }
    let _restore = Restore(MODEL_INIT.replace(enabled));
    f()
}

/// Whether modules created here keep FP8-only weights.
pub fn is_fp8_model_init() -> bool {
    MODEL_INIT.get()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::{DelayedScaling, Float8CurrentScaling};

    #[test]
    fn scopes_nest_and_the_innermost_wins() {
        assert_eq!(fp8_mode(), Fp8Mode::HighPrecision);
        let cur = Recipe::from(Float8CurrentScaling::default());
        fp8_autocast(true, DelayedScaling::default(), || {
            assert_eq!(fp8_mode(), Fp8Mode::Fp8(Recipe::default()));
            fp8_autocast(true, cur, || {
                assert_eq!(fp8_mode(), Fp8Mode::Fp8(cur));
                fp8_autocast(false, cur, || {
                    assert_eq!(fp8_mode(), Fp8Mode::HighPrecision);
                    Ok(())
                })
            })?;
            assert_eq!(fp8_mode(), Fp8Mode::Fp8(Recipe::default()));
            Ok(())
        })
        .unwrap();
        assert_eq!(fp8_mode(), Fp8Mode::HighPrecision);
        Fp8Autocast::calibrating(DelayedScaling::default())
            .run(|| {
                assert_eq!(fp8_mode(), Fp8Mode::Calibrating(Recipe::default()));
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn errors_and_panics_leave_no_scope_open() {
        let r: Result<()> = fp8_autocast(true, Recipe::default(), || Err(Error::Recipe { message: "x".into() }));
        assert!(r.is_err());
        assert_eq!(fp8_mode(), Fp8Mode::HighPrecision);
        let caught = std::panic::catch_unwind(|| {
            let _g = Fp8Autocast::default().enter().unwrap();
            panic!("inside");
        });
        assert!(caught.is_err());
        assert_eq!(fp8_mode(), Fp8Mode::HighPrecision);
    }

    #[test]
    fn out_of_order_exit_is_an_error() {
        let outer = Fp8Autocast::default().enter().unwrap();
        let inner = Fp8Autocast::default().enter().unwrap();
        let e = outer.exit().unwrap_err();
        assert!(e.to_string().contains("exit the inner scopes first"), "{e}");
        inner.exit().unwrap();
        SCOPE.with_borrow_mut(|s| s.frames.clear());
    }

    #[test]
    fn bad_recipes_are_refused() {
        let bad = DelayedScaling { amax_history_len: 0, ..Default::default() };
        assert!(fp8_autocast(true, bad, || Ok(())).is_err());
        assert!(Fp8Autocast::calibrating(Float8CurrentScaling::default()).enter().is_err());
        assert!(Fp8Autocast::calibrating(super::super::Float8BlockScaling::default()).enter().is_err());
        assert_eq!(fp8_mode(), Fp8Mode::HighPrecision);
    }

    #[test]
    fn model_init_scope_restores() {
        assert!(!is_fp8_model_init());
        fp8_model_init(true, || {
            assert!(is_fp8_model_init());
            fp8_model_init(false, || assert!(!is_fp8_model_init()));
            assert!(is_fp8_model_init());
        });
        assert!(!is_fp8_model_init());
    }
}
