//! Launchers of the cast_transpose kernels (being written).
