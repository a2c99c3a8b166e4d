"""The kernel library: one module per kernel family, each with its host wrapper next to its kernels."""
