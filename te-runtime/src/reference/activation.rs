//! CPU reference of the activation kernels (being written).
