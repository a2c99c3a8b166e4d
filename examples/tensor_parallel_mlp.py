"""A tensor-parallel MLP block with the overlapped GEMMs: `tridist run -n 2 examples/tensor_parallel_mlp.py`.

The tokens are split by rows over the ranks (sequence parallel). The up projection is
column-parallel: `ag_gemm` gathers every rank's tokens while it multiplies them by this rank's
columns of W_up. The down projection is row-parallel: `gemm_rs` multiplies by this rank's rows of
W_down and sums the partial products over the ranks, handing each rank back its own tokens.
"""
import torch

import tridist
from tridist import ops


def mlp_block(w):
    tokens, hidden, inner = 32 * w.world_size, 64, 128 * w.world_size
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors, then keeps its part
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w_up = (torch.randn(hidden, inner, generator=g) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(inner, hidden, generator=g) / inner ** 0.5).to(dtype)
    rows = slice(w.rank * tokens // w.world_size, (w.rank + 1) * tokens // w.world_size)
    columns = slice(w.rank * inner // w.world_size, (w.rank + 1) * inner // w.world_size)

    h = ops.ag_gemm(x[rows].contiguous().to(w.device), w_up[:, columns].contiguous().to(w.device))
    y = ops.gemm_rs(torch.relu(h), w_down[columns].contiguous().to(w.device))

    expected = torch.relu(x.float() @ w_up.float()) @ w_down.float()
    error = ((y.float().cpu() - expected[rows]).abs().max() / expected.abs().max()).item()
    assert error < 3e-2, f"rank {w.rank}: relative error {error:.2e}"
    return tokens, error


def main():
    w = tridist.init()
    tokens, error = mlp_block(w)
    print(f"rank {w.rank}: MLP block of {tokens} tokens on {w.world_size} ranks ok (relative error {error:.1e})")
    tridist.finalize()


if __name__ == "__main__":
    main()
