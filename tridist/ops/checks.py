"""How the ops check their arguments: on this rank before any launch, and together with every rank
(`agree`), so that a bad argument on one rank raises the same error on all of them and never leaves
a peer waiting. Every check raises ValueError (TypeError for a non-tensor) with a message that says
what to change.
"""
import torch
import triton.language as tl

import tridist
from tridist.runtime import config
from tridist.runtime.backend import is_emulator
from tridist.runtime.tensors import check_tensor
from tridist.runtime.world import heap

from . import call_order
from .ranks import ranks_of


SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def check_input(x: torch.Tensor, name: str, dtypes=SUPPORTED) -> None:
    """`x` is a contiguous tensor on this rank's device with one of `dtypes` (it may be empty)."""
    check_tensor(x, name)
    if x.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {x.dtype}; supported: {', '.join(str(d) for d in dtypes)}")


def check_build(op: str, numel: int, dtype: torch.dtype, dtypes=SUPPORTED) -> None:
    """What an op instance for `numel` elements of `dtype` per rank needs before it allocates anything."""
    if dtype not in dtypes:
        raise ValueError(f"{op} takes {', '.join(str(d) for d in dtypes)}; got {dtype}")
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"{op} needs a non-negative int number of elements per rank, got {numel!r}")


def check_same(x: torch.Tensor, numel: int, dtype: torch.dtype, op: str, dtypes=SUPPORTED) -> None:
    """x is what an op instance built for `numel` elements of `dtype` takes."""
    check_input(x, "x", dtypes)
    if x.numel() != numel or x.dtype != dtype:
        raise ValueError(f"this {op} was built for {numel} {dtype} elements per rank; x has {x.numel()} {x.dtype}: "
                         "build another instance, or call the op's function in tridist.ops, which keeps one per shape")


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (never in the emulator)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def host_reads(t: torch.Tensor) -> bool:
    """Whether a check may read the values of `t` on the host: always for CPU tensors (the
    emulator), for GPU tensors only with TRIDIST_DEBUG=1 (each read is a device synchronisation),
    and never while a CUDA graph is captured (the read would end the capture). What the checks that
    read values leave to the device elsewhere, each op's docstring says."""
    if capturing():
        return False
    return t.device.type == "cpu" or config.debug()


_agreed: set = set()  # the (op, values) whose first call every rank checked together


def agree(op: str, local=None, same: dict | None = None, group=None):
    """The checks of one call of the collective `op`, with an outcome every rank shares: the one
    way the ops check their arguments, so that a bad argument on one rank never leaves the others
    waiting for it.

    `local()` runs this rank's checks of its own arguments, raising ValueError or TypeError with a
    message for the user; `same` maps what every rank must pass alike (e.g. "shape of x") to this
    rank's value (ints, strings, tuples of them). Every rank gathers every rank's outcome and
    values (a host collective) and raises the same error: each failing rank's message, prefixed
    with its rank, or the values that differ, rank by rank.

    The gather runs in the emulator and with TRIDIST_DEBUG=1 at every call, and otherwise (GPUs) at
    the first call with each new `same` (the call that builds an instance and allocates collectively
    anyway), so that later calls cost no host round trip. Never while a CUDA graph is captured (a
    host collective would end the capture): there, and on later GPU calls, a local error is raised
    on this rank alone. Returns what `local()` returned.

    With `group` (a process group or `tridist.Group`: the op's `group=`), the members gather among
    themselves, and their group is one of the values that must be the same; errors name world ranks.
    A rank outside the group gets its ValueError alone, before anything is gathered. With
    `ranks.ALONE` nothing is gathered: the checks are this rank's alone.

    Once the checks pass, the call takes its turn among this process's ops (`call_order`): an op
    called on another stream than the previous one starts on the GPU after it."""
    same = same or {}
    error = result = None
    try:
        if local is not None:
            result = local()
    except (ValueError, TypeError) as raised:
        error = raised
    ranks = ranks_of(group)  # raises on a rank outside the group: it has nobody to gather with
    same = {**same, "group (world ranks)": ranks.ranks}
    key = (op, tuple(same.items()))
    alone = ranks.key[0] == "alone"  # no peer to agree with
    if alone or capturing() or not (config.debug() or is_emulator() or key not in _agreed):
        if error is not None:
            raise error
        call_order.take_turn()
        return result
    mine = (None if error is None else (type(error).__name__, str(error)), tuple(same.values()))
    everyone = ranks.allgather_objects(mine)
    failed = [(ranks.ranks[rank], outcome) for rank, (outcome, _) in enumerate(everyone) if outcome is not None]
    if failed:
        kinds = {kind for _, (kind, _) in failed}
        kind = TypeError if kinds == {"TypeError"} else ValueError
        messages = {}
        for rank, (_, message) in failed:
            messages.setdefault(message, []).append(rank)
        raise kind(f"{op}: " + "; ".join(f"{_ranks(ranks)}: {message}" for message, ranks in messages.items()))
    for index, what in enumerate(same):
        values = [values[index] for _, values in everyone]
        if len(set(values)) > 1:
            listed = ", ".join(f"rank {ranks.ranks[rank]}: {value}" for rank, value in enumerate(values))
            raise ValueError(f"{op}: ranks passed different {what} ({listed}); every rank must pass the same")
    _agreed.add(key)
    call_order.take_turn()
    return result


def forget_agreements() -> None:
    """Check every (op, values) together again at its next call (after the instances were freed)."""
    _agreed.clear()


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def shape_of(t) -> tuple | str:
    """What `agree` compares for a tensor argument: its shape and dtype (or what else it is)."""
    return (*t.shape, str(t.dtype).removeprefix("torch.")) if isinstance(t, torch.Tensor) else type(t).__name__


def symmetric_identity(t: torch.Tensor | None) -> str:
    """What `agree` compares for an argument that may be a symmetric tensor: where it lies in the
    heap (the same on every rank for the same tensor), or "not symmetric" (a regular tensor, None)."""
    if not isinstance(t, torch.Tensor) or not tridist.is_symmetric(t):
        return "not symmetric"
    return f"symmetric, {t.numel() * t.element_size()} bytes at heap offset {heap().offset_of(t)}"


INDEX_LIMIT = 1 << 31  # the kernels index rows of x, out and staging with 32-bit offsets


def check_offsets(op: str, elements: int) -> None:
    """`elements`: the furthest element (of x, out or staging) the op's kernels index from a base
    pointer. Past 2^31 the 32-bit offsets would wrap, so refuse the size instead."""
    if elements >= INDEX_LIMIT:
        raise ValueError(f"{op} indexes its buffers with 32-bit offsets and would reach element {elements} here "
                         f"(at most {INDEX_LIMIT - 1}): split the call into smaller ones")


def check_output(out: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    check_tensor(out, "out")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ValueError(f"out must be {dtype} of shape {tuple(shape)}, got {out.dtype} of shape {tuple(out.shape)}")


def method_error(op: str, method: str, methods) -> ValueError:
    return ValueError(f"{op}: unknown method {method!r}; choose one of {', '.join(methods)}")


def require_one_node(what: str, instead: str, ranks=None) -> None:
    """`what` (e.g. "all_gather method 'll'") reaches its peers through `symm_at` or the copy
    engines, which reach the ranks of this node only; `ranks` (an `ops.ranks.Ranks`, default the
    world) are the ranks it would run among."""
    nnodes = (ranks or tridist.world()).nnodes
    if nnodes > 1:
        where = "this world has" if ranks is None or ranks.group is None else "this group spans"
        raise ValueError(f"{what} works within one node; {where} {nnodes} nodes: use {instead}")


def check_programs(programs, name: str = "programs", meaning: str = "the most blocks a call launches") -> None:
    if not isinstance(programs, int) or programs < 1:
        raise ValueError(f"{name} must be a positive int ({meaning}), got {programs!r}")
