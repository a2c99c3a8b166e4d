"""The op instances that the functions of `tridist.ops` keep: one per shape, dtype, options and
stream, built at the first call (a collective: it allocates symmetric memory)."""
import torch

from . import checks


_instances: dict = {}


def instance(build, *key, device: torch.device):
    """The op instance for `key` on the current stream, made once by `build()`. The functions of
    `tridist.ops` keep one per shape and stream, since an instance must not serve two streams at once."""
    key = (*key, torch.cuda.current_stream() if device.type == "cuda" else None)
    if key not in _instances:
        _instances[key] = build()
    return _instances[key]


def free_instances() -> int:
    """Free every op instance that the functions of `tridist.ops` keep (`instance`), so that a
    program moving on to other shapes gets its symmetric heap back; the next call of a function
    builds a new one. A collective: every rank calls it at the same point, once no call of those
    instances is in flight on any rank (after `tridist.barrier_all()`). Returns how many it freed."""
    freed = len(_instances)
    for op in _instances.values():  # in the order they were built: the same on every rank
        op.free()
    _instances.clear()
    checks.forget_agreements()  # their shapes are checked together again at their next first call
    return freed
