"""Method "two_shot" (any topology; prefill sizes on many ranks): the all-reduce's two-shot on an fp32
copy of x, then the local method's kernel on the sums: three kernels (the copy, the all-reduce, the
norm).

Each rank receives 2 (n-1)/n of the fp32 sums' bytes where "one_shot" receives (n-1) copies of x:
fewer from 3 ranks in fp32 and from 5 in 16-bit data (`policy.choose_all_reduce_rms_norm`). The sums
are exact copies of x widened to fp32, summed in rank order by the two-shot (`collectives.allreduce.
two_shot`), so every rank adds the residual to the same fp32 sum as the fused methods do, rounding
once. One difference: the two-shot's sum starts from +0, so where every rank's x and the residual
are -0 the new residual is +0 (the fused methods give -0).
"""
import torch

from ..collectives import AllReduce
from ..method import Method
from .local import launch_local


class TwoShot(Method):
    """The two-shot all-reduce of fp32 sums among `ranks` (an `ops.ranks.Ranks`) on at most
    `programs` programs, then the local norm (`block`: its chunk), for `tokens` rows of `hidden`
    elements of `dtype`."""

    name = "two_shot"

    def __init__(self, tokens: int, hidden: int, dtype: torch.dtype, block: int | None, programs: int, ranks):
        super().__init__()
        self.block = block
        self.sums = torch.empty((tokens, hidden), dtype=torch.float32, device=ranks.device)
        self.all_reduce = self.own(AllReduce(tokens * hidden, torch.float32, "two_shot", programs=programs,
                                             group=ranks.group))

    def launch(self, x, residual, weight, eps, y, new_residual) -> None:
        self.sums.copy_(x)
        self.all_reduce(self.sums, self.sums)
        launch_local(self.sums, residual, weight, eps, y, new_residual, self.block)
