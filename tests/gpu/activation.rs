//! GPU tests of the activation kernels (being written).
