"""The benchmark kernels, checked without timing (the timing needs GPUs), and `sleep_async`."""
import time

import pytest
import torch

import tridist
from tridist.bench import primitives


def _primitives(w):
    primitives.transfer_rows([4096, 40000], programs=3, timed=False)
    primitives.round_trip_rows(rounds=5, timed=False)


def test_primitive_kernels_move_the_right_data(world):
    if world.size % 2:
        return  # the benchmark pairs rank r with rank r ^ 1
    world.run(_primitives)


def _sleep_async(w):
    with pytest.raises(ValueError, match=">= 0"):
        tridist.sleep_async(-1)
    if w.backend == "emulator":
        tridist.sleep_async(1e6)  # a no-op: the emulator has no stream to keep busy
        return
    tridist.sleep_async(1)  # compiles the kernel (the same one for every duration)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begun = time.monotonic()
    start.record()
    tridist.sleep_async(2000)
    end.record()
    assert time.monotonic() - begun < 0.0015, "sleep_async must return before the GPU has slept"
    end.synchronize()
    assert 1500 <= start.elapsed_time(end) * 1000 <= 20000


def test_sleep_async(world):
    world.run(_sleep_async)
