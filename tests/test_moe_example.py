"""examples/moe_layer.py, as users run it: one MoE block expert parallel (normal and low-latency
dispatch/combine around grouped GEMMs) and tensor parallel (ag_moe, moe_rs), each against the
block computed in one process. Run as with `python -W error::RuntimeWarning`: no kernel multiplies
rows past a group's count (garbage there made numpy warn of overflows and invalid values)."""
import warnings

import pytest

from .test_language import load_example


def _moe_layer(w):
    example = load_example("moe_layer")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        errors = example.moe_block(w)
    assert set(errors) == set(example.WAYS)
    assert max(errors.values()) < example.TOLERANCE, f"rank {w.rank}: relative errors {errors}"


# One rank (every expert local), two, and two nodes of two (the dispatch's puts to another node).
@pytest.mark.worlds("1", "2", "2x2")
def test_moe_layer_example(world):
    world.run(_moe_layer)
