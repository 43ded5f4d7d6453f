//! CPU reference of the norm kernels (being written).
