//! Benchmarks of the cast_transpose kernels (being written).

use crate::harness::Bench;

pub fn run(_b: &mut Bench) {}
