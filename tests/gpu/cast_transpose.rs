//! GPU tests of the cast_transpose kernels (being written).
