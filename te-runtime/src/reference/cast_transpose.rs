//! CPU reference of the cast_transpose kernels (being written).
