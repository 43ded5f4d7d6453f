//! GPU tests of the scaling kernels (being written).
