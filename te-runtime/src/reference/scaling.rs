//! CPU reference of the scaling kernels (being written).
