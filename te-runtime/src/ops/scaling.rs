//! Launchers of the scaling kernels (being written).
