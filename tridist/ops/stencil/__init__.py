"""Stencils: kernels that relax a grid split across ranks, exchanging halos from inside the
kernels. `Jacobi2D` (`jacobi`) runs a 2D Jacobi solver by one of two methods, one launch per
iteration (`host_loop`) or one co-resident launch (`fused`), which share the layout and halo
protocol of `_halo`; its tile is chosen in `policy`. The ranks are the world's, or with `group=`
a process group's members (`Jacobi2D(rows, cols, group=g)`: the domain split over the members of
`g`, group rank r holding part r), each group solving its own domain."""
from .jacobi import Jacobi2D, jacobi_reference

__all__ = ["Jacobi2D", "jacobi_reference"]
