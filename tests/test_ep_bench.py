"""`tridist bench ep|alltoall`: their checks on tiny shapes (the timing needs GPUs), and their parsers."""
import argparse

import pytest
import torch

from tridist.bench import ep as bench


def _bench(w):
    """Both modes (low-latency with its fp8 dispatch), 8 experts a rank, and both all-to-all layouts."""
    experts = 8 * w.world_size
    layers = bench.parse_layers(f"ll:6x256x2x{experts},normal:6x256x2x{experts}")
    assert bench.ep_rows(layers, timed=False) == []
    assert bench.alltoall_rows([5, 12], hidden=64, experts=3, timed=False) == []


@pytest.mark.worlds("1", "2")
def test_ep_bench_checks(world):
    world.run(_bench)


def test_ep_bench_layers():
    assert bench.parse_layers("mixtral, ll:16x256x2x8") == [("mixtral", "normal", 4096, 4096, 2, 8),
                                                            ("ll:16x256x2x8", "ll", 16, 256, 2, 8)]
    for spec, message in (("ll:16x256x2", "four positive integers"), ("fast:1x2x1x8", "MODE"),
                          ("normal:4x256x9x8", "top-9 of 8")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            bench.parse_layers(spec)
    assert bench.parse_sizes("128, 32768") == [128, 32768]
    with pytest.raises(argparse.ArgumentTypeError):
        bench.parse_sizes("128,0")


def test_random_splits_sum_to_the_rows():
    for rows, chunks in ((0, 3), (1, 8), (100, 1), (32768, 64)):
        splits = bench.random_splits(rows, chunks, seed=rows + chunks)
        assert splits.dtype == torch.int64 and splits.shape == (chunks,) and (splits >= 0).all()
        assert int(splits.sum()) == rows
