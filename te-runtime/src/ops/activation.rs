//! Launchers of the activation kernels (being written).
