"""tridist: program a box or a cluster of GPUs as one machine, with Triton kernels that talk to
each other's memory.

This package is the host side: joining the world, process groups, symmetric tensors, the kernel
decorator, barriers, autotuning and the errors tridist raises. The device API is
[`tridist.language`][tridist.language], the kernel library [`tridist.ops`][tridist.ops].
"""
from .runtime.backend import BACKEND
from .runtime.errors import (DeviceCheckError, NotInitializedError, PeerFailedError, SymmetricAllocationError,
                             TridistError, WaitTimeoutError)
from .runtime.groups import Group, group
from .runtime.jit import coresident_programs, jit
from .runtime.tensors import (SIGNAL_DTYPE, barrier_all, is_symmetric, peer_tensor, signals, symm_empty, symm_free,
                              symm_zeros)
from .runtime.tune import tune
from .runtime.world import World, finalize, init, world
from .ops.sync import barrier_all_on_stream, sleep_async

__version__ = "0.1.0"

__all__ = ["BACKEND", "World", "init", "finalize", "world", "Group", "group", "jit", "symm_empty", "symm_zeros",
           "symm_free", "signals", "peer_tensor", "is_symmetric", "SIGNAL_DTYPE", "barrier_all",
           "barrier_all_on_stream", "sleep_async", "tune", "TridistError", "NotInitializedError", "WaitTimeoutError",
           "PeerFailedError", "SymmetricAllocationError", "DeviceCheckError", "coresident_programs"]
