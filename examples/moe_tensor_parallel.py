"""A tensor-parallel MoE layer with the overlapped MoE ops: `tridist run -n 4 examples/moe_tensor_parallel.py`.

The tokens are split by rows over the ranks (sequence parallel); each rank routes its own tokens
to their top-k experts. Every rank holds every expert, split tensor-parallel: its columns of the
up projection, its rows of the down projection. `ag_moe` gathers every rank's tokens while it
multiplies each (token, expert) pair by this rank's columns of that expert; after the activation,
`moe_rs` multiplies by this rank's rows of the down projection, sums each token's top-k results
with its routing weights and the partial sums over the ranks, handing each rank back its own
tokens. The check is the whole layer computed in one process from the same seeded weights.
"""
import torch

import tridist
from tridist import ops


def moe_block(w):
    tokens, hidden, inner, experts, topk = 4 * w.world_size, 32, 16 * w.world_size, 8, 2
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors, then keeps its part
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate = torch.randn(hidden, experts, generator=g)
    w_up = (torch.randn(experts, hidden, inner, generator=g) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(experts, inner, hidden, generator=g) / inner ** 0.5).to(dtype)
    scores, topk_idx = (x.float() @ gate).topk(topk, dim=1)
    topk_weights = scores.softmax(dim=1)
    rows = slice(w.rank * tokens // w.world_size, (w.rank + 1) * tokens // w.world_size)
    columns = slice(w.rank * inner // w.world_size, (w.rank + 1) * inner // w.world_size)

    def mine(t, *index):
        return t[index].contiguous().to(w.device)

    h, handle = ops.ag_moe(mine(x, rows), mine(topk_idx, rows), mine(w_up, slice(None), slice(None), columns))
    y = ops.moe_rs(torch.nn.functional.silu(h), mine(w_down, slice(None), columns), handle, mine(topk_weights, rows))

    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for k in range(topk):
            e = int(topk_idx[t, k])
            expected[t] += topk_weights[t, k] * (torch.nn.functional.silu(x[t].float() @ w_up[e].float())
                                                 @ w_down[e].float())
    error = ((y.float().cpu() - expected[rows]).abs().max() / expected.abs().max()).item()
    assert error < 3e-2, f"rank {w.rank}: relative error {error:.2e}"
    return tokens, error


def main():
    w = tridist.init()
    tokens, error = moe_block(w)
    print(f"rank {w.rank}: MoE layer of {tokens} tokens on {w.world_size} ranks ok (relative error {error:.1e})")
    tridist.finalize()


if __name__ == "__main__":
    main()
