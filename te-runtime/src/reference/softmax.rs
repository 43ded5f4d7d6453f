//! CPU reference of the softmax kernels (being written).
