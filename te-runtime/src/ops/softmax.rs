//! Launchers of the softmax kernels (being written).
