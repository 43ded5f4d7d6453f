//! GPU tests of the norm kernels (being written).
