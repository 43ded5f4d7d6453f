//! GPU tests of the softmax kernels (being written).
