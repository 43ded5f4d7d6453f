//! Launchers of the norm kernels (being written).
