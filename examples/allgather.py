"""A push all-gather written with tridist.language: run with `tridist run -n 4 examples/allgather.py`.

Every rank writes its shard into slot `rank` of every peer's output through `dl.symm_at`, then
raises its flag in the peer's signal array; each rank waits for all flags before reading. All ranks
must be on one node: `dl.symm_at` reaches no other (across nodes, kernels move data with
`dl.shmem.putmem`).
"""
import torch
import triton.language as tl

import tridist
import tridist.language as dl


@tridist.jit
def allgather_push(shard_ptr, out_ptr, flags_ptr, n, epoch, BLOCK: tl.constexpr):
    me = dl.rank()
    peer = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        mask = start + offsets < n
        data = tl.load(shard_ptr + start + offsets, mask=mask)
        tl.store(dl.symm_at(out_ptr + me * n + start + offsets, peer), data, mask=mask)
    dl.notify(flags_ptr + me, peer, signal=epoch, sig_op="set")
    if peer == me:
        dl.wait(flags_ptr, dl.num_ranks(), scope="sys", waitValue=epoch)  # raised by other GPUs


def main():
    w = tridist.init()
    n = 1000
    out = tridist.symm_empty((w.world_size, n), torch.float32)
    flags = tridist.signals(w.world_size)
    shard = torch.arange(n, dtype=torch.float32, device=w.device) + 1000 * w.rank
    for epoch in range(1, 4):
        out.fill_(float("nan"))
        tridist.barrier_all()
        allgather_push[(w.world_size,)](shard, out, flags, n, epoch, BLOCK=256)
        tridist.barrier_all()
        expected = torch.stack([torch.arange(n, dtype=torch.float32) + 1000 * r for r in range(w.world_size)])
        torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    print(f"rank {w.rank}/{w.world_size}: all-gather correct")
    tridist.finalize()


if __name__ == "__main__":
    main()
