//! The bookkeeping of [`super::ParamShards`]' ring of buffer sets, apart from the device work
//! so the host tests run it: which group each slot holds, and the gather into a slot the
//! device's stream has not waited for yet (a gather into a slot first waits for the slot's
//! earlier one; see the `param_shards` module docs).

use te_runtime::{Error, Result};

const MODULE: &str = "ParamShards";

/// The ring's bookkeeping, apart from the device work ([`super::ParamShards`] runs it with the side
/// stream's [`SideMark`]s; the host tests with numbers): which group each slot holds, and the
/// gather into it the device's stream has not waited for yet.
#[derive(Debug)]
pub(super) struct Ring<M> {
    pub(super) slots: Vec<RingSlot<M>>,
}

/// One slot of a [`Ring`].
#[derive(Debug)]
pub(super) struct RingSlot<M> {
    /// The group gathered (or being gathered) into it; `None` once released.
    pub(super) group: Option<usize>,
    /// The point after the slot's last gather, until the device's stream waited for it. Kept
    /// when the slot is released: a later gather into the slot waits for it first.
    pending: Option<M>,
}

impl<M> Ring<M> {
    /// A ring of `n` slots (at least 1), all free.
    pub(super) fn new(n: usize) -> Self {
        Self { slots: (0..n.max(1)).map(|_| RingSlot { group: None, pending: None }).collect() }
    }

    /// Whether group `g`'s slot holds it (gathered, or on its way).
    pub(super) fn holds(&self, g: usize) -> bool {
        self.slots[self.slot_of(g)].group == Some(g)
    }

    /// The slot group `g` is gathered into.
    pub(super) fn slot_of(&self, g: usize) -> usize {
        g % self.slots.len()
    }

    /// Starts gathering group `g` unless its slot holds it already (gathered, or on its way):
    /// `wait` makes the device's stream wait for a mark (first the slot's earlier gather the
    /// device's stream never waited for, so its broadcasts are done before the slot is
    /// written again), `issue` gathers into a slot and returns the mark after its broadcasts.
    ///
    /// # Errors
    /// [`Error::Argument`] when the slot holds another group not released yet (its layer still
    /// reads the buffers); `wait`'s and `issue`'s errors (the slot is free afterwards).
    pub(super) fn prefetch(
        &mut self,
        g: usize,
        wait: &mut dyn FnMut(M) -> Result<()>,
        issue: &mut dyn FnMut(usize) -> Result<M>,
    ) -> Result<()> {
        let at = self.slot_of(g);
        let slot = &mut self.slots[at];
        match slot.group {
            Some(held) if held == g => return Ok(()),
            Some(held) => {
                return Err(Error::Argument {
                    op: MODULE,
                    message: format!(
                        "group {g} into slot {at}, which group {held} still uses: release group {held} first (a ring \
                         of {} slots holds the groups g, g + 1, ... at once)",
                        self.slots.len()
                    ),
                })
            }
            None => {}
        }
        if let Some(stale) = slot.pending.take() {
            wait(stale)?;
        }
        let mark = issue(at)?;
        slot.group = Some(g);
        slot.pending = Some(mark);
        Ok(())
    }

    /// Group `g` gathered ([`Ring::prefetch`]) and the device's stream made to wait for its
    /// gather (once): the slot it is in.
    ///
    /// # Errors
    /// As [`Ring::prefetch`].
    pub(super) fn gather(
        &mut self,
        g: usize,
        wait: &mut dyn FnMut(M) -> Result<()>,
        issue: &mut dyn FnMut(usize) -> Result<M>,
    ) -> Result<usize> {
        self.prefetch(g, wait, issue)?;
        let at = self.slot_of(g);
        if let Some(mark) = self.slots[at].pending.take() {
            wait(mark)?;
        }
        Ok(at)
    }

    /// Frees group `g`'s slot (nothing when the slot holds another group).
    pub(super) fn release(&mut self, g: usize) {
        let at = self.slot_of(g);
        if let Some(slot) = self.slots.get_mut(at).filter(|s| s.group == Some(g)) {
            slot.group = None;
        }
    }

    /// Frees every slot (their gathers not waited for stay pending).
    pub(super) fn release_all(&mut self) {
        for slot in &mut self.slots {
            slot.group = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::{Cell, RefCell};

    /// One rank's streams as the ring sees them: the side stream runs the gathers in the order
    /// issued (mark `k` is the `k`-th), the device's stream has waited for those up to
    /// `waited`, and `into[slot]` lists the gathers issued into each slot.
    struct Streams {
        ring: Ring<usize>,
        issued: Cell<usize>,
        waited: Cell<Option<usize>>,
        into: RefCell<Vec<Vec<usize>>>,
    }

    impl Streams {
        fn new(slots: usize) -> Self {
            Self {
                ring: Ring::new(slots),
                issued: Cell::new(0),
                waited: Cell::new(None),
                into: RefCell::new(vec![Vec::new(); slots]),
            }
        }

        fn done(&self, mark: usize) -> bool {
            self.waited.get().is_some_and(|w| mark <= w)
        }

        /// The ring's `prefetch` (`gather` when `take`) of group `g`, checking that the device's
        /// stream writes a slot (this rank's pieces) only after every gather into it is done,
        /// and reads a group only after its own gather is.
        fn run(&mut self, g: usize, take: bool) {
            let (issued, waited, into) = (&self.issued, &self.waited, &self.into);
            let mut wait = |m: usize| {
                waited.set(Some(waited.get().map_or(m, |w| w.max(m))));
                Ok(())
            };
            let mut issue = |at: usize| {
                let earlier = into.borrow()[at].clone();
                let unfinished: Vec<usize> =
                    earlier.into_iter().filter(|&m| waited.get().is_none_or(|w| m > w)).collect();
                assert!(unfinished.is_empty(), "group {g} written into slot {at} while gathers {unfinished:?} run");
                let mark = issued.get();
                issued.set(mark + 1);
                into.borrow_mut()[at].push(mark);
                Ok(mark)
            };
            if take {
                let at = self.ring.gather(g, &mut wait, &mut issue).unwrap();
                let last = *self.into.borrow()[at].last().unwrap();
                assert!(self.done(last), "group {g} read before its gather (mark {last}) is done");
            } else {
                self.ring.prefetch(g, &mut wait, &mut issue).unwrap();
            }
        }
    }

    /// The decoder's schedule (`DecoderLm`'s ZeRO-3: `set_zero3`, a forward's enter/leave of
    /// each layer with the next one prefetched and the last one prefetched for the backward,
    /// the backward's in reverse) over a ring of 2 slots, with forwards no backward follows
    /// (evaluations) in between: no slot is written while a gather into it runs, no group is
    /// read before its gather is done, and the gather a forward left behind is waited for
    /// before its slot takes another layer.
    #[test]
    fn the_ring_waits_for_a_gather_left_behind_before_reusing_its_slot() {
        for layers in [1usize, 2, 3, 4, 5, 12] {
            let mut s = Streams::new(2);
            let forward = |s: &mut Streams| {
                s.ring.release_all();
                for l in 0..layers {
                    s.run(l, true);
                    if l + 1 < layers {
                        s.run(l + 1, false);
                    }
                    s.ring.release(l);
                }
                s.run(layers - 1, false);
            };
            let backward = |s: &mut Streams| {
                for l in (0..layers).rev() {
                    s.run(l, true);
                    if let Some(prev) = l.checked_sub(1) {
                        s.run(prev, false);
                    }
                    s.ring.release(l);
                }
            };
            for l in 0..layers {
                s.run(l, true);
                s.ring.release(l);
            }
            forward(&mut s);
            backward(&mut s);
            // Two evaluation forwards, then a training step.
            forward(&mut s);
            forward(&mut s);
            forward(&mut s);
            backward(&mut s);
            forward(&mut s);
            backward(&mut s);
            assert!(s.issued.get() > 0);
        }
        // The evaluation's left-behind gather of the last layer of 3 (slot 0) is waited for by
        // the next forward's gather of layer 0 (slot 0): the stale wait happens.
        let mut s = Streams::new(2);
        s.run(2, false);
        s.ring.release_all();
        let before = s.waited.get();
        s.run(0, false);
        assert_ne!(s.waited.get(), before, "the gather of layer 2 was waited for before slot 0 took layer 0");
        assert_eq!(s.waited.get(), Some(0));
    }

    /// A gather into a slot another group still uses is refused (its layer reads the buffers);
    /// once released it goes ahead.
    #[test]
    fn the_ring_refuses_a_slot_in_use() {
        let mut ring = Ring::<usize>::new(2);
        let mut next = 0usize;
        let mut issue = |_: usize| {
            next += 1;
            Ok(next)
        };
        ring.gather(0, &mut |_| Ok(()), &mut issue).unwrap();
        let e = ring.prefetch(2, &mut |_| Ok(()), &mut issue).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("release group 0"), "{e}");
        ring.prefetch(0, &mut |_| panic!("group 0 is there"), &mut |_| panic!("no gather")).unwrap();
        ring.release(0);
        ring.prefetch(2, &mut |_| Ok(()), &mut issue).unwrap();
        assert_eq!(ring.slots[0].group, Some(2));
        assert_eq!(ring.slot_of(3), 1);
    }
}
