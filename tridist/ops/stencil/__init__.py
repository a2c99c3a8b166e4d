"""Stencils: kernels that relax a grid split across ranks, exchanging halos from inside the
kernels. `Jacobi2D` runs a 2D Jacobi solver one launch per iteration or in one co-resident launch."""
from .jacobi import Jacobi2D, jacobi_reference

__all__ = ["Jacobi2D", "jacobi_reference"]
