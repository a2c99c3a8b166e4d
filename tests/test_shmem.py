"""`dl.shmem` (OpenSHMEM-style puts, gets, signals, atomics) and `dl.ll` packets, on every world."""
import os

import pytest
import torch
import triton.language as tl

import tridist
import tridist.language as dl

PUT_SIGNAL_VARIANTS = ["putmem_signal", "putmem_signal_nbi", "putmem_signal_block", "putmem_signal_nbi_block"]
COPY_VARIANTS = ["", "_nbi", "_warp", "_nbi_warp", "_block", "_nbi_block"]


# ---- ring put with signal ---------------------------------------------------------------------------


@tridist.jit
def ring_put_signal_kernel(src_ptr, dst_ptr, signal_ptr, nbytes, epoch, VARIANT: tl.constexpr):
    right = (dl.rank() + 1) % dl.num_ranks()
    if VARIANT == 0:
        dl.shmem.putmem_signal(dst_ptr, src_ptr, nbytes, signal_ptr, epoch, dl.shmem.SIGNAL_SET, right)
    elif VARIANT == 1:
        dl.shmem.putmem_signal_nbi(dst_ptr, src_ptr, nbytes, signal_ptr, epoch, dl.shmem.SIGNAL_SET, right)
        dl.shmem.quiet()
    elif VARIANT == 2:
        dl.shmem.putmem_signal_block(dst_ptr, src_ptr, nbytes, signal_ptr, epoch, dl.shmem.SIGNAL_SET, right)
    else:
        dl.shmem.putmem_signal_nbi_block(dst_ptr, src_ptr, nbytes, signal_ptr, epoch, dl.shmem.SIGNAL_SET, right)
        dl.shmem.quiet()
    dl.shmem.signal_wait_until(signal_ptr, dl.shmem.CMP_EQ, epoch)


def _ring_put_signal(w, n, variant):
    src = tridist.symm_empty((n,), torch.float32)
    dst = tridist.symm_zeros((n,), torch.float32)
    signal = tridist.signals(1)
    left = (w.rank - 1) % w.world_size
    for epoch in range(1, 4):
        everyone = torch.randn(w.world_size, n, generator=torch.Generator().manual_seed(epoch))
        src.copy_(everyone[w.rank])
        ring_put_signal_kernel[(1,)](src, dst, signal, n * 4, epoch, VARIANT=variant)
        assert torch.equal(dst.cpu(), everyone[left])
        tridist.barrier_all()
    for t in (signal, dst, src):
        tridist.symm_free(t)


def test_ring_put_with_signal(world):
    for variant in range(len(PUT_SIGNAL_VARIANTS)):
        world.run(_ring_put_signal, n=333, variant=variant)


# ---- putmem_signal_block all-gather ------------------------------------------------------------------


@tridist.jit
def putmem_signal_allgather_kernel(shard_ptr, out_ptr, flags_ptr, n, epoch):
    """Program p puts this rank's shard into slot `rank` on rank p and raises p's flag `rank`."""
    me = dl.rank()
    peer = tl.program_id(0)
    dl.shmem.putmem_signal_block(out_ptr + me * n, shard_ptr, n * 4, flags_ptr + me, epoch, dl.shmem.SIGNAL_SET, peer)
    if peer == me:
        for source in range(dl.num_ranks()):
            dl.shmem.signal_wait_until(flags_ptr + source, dl.shmem.CMP_EQ, epoch)


def _putmem_signal_allgather(w, n):
    shard = tridist.symm_empty((n,), torch.float32)
    out = tridist.symm_empty((w.world_size, n), torch.float32)
    flags = tridist.signals(w.world_size)
    for epoch in range(1, 4):
        everyone = torch.randn(w.world_size, n, generator=torch.Generator().manual_seed(10 + epoch))
        shard.copy_(everyone[w.rank])
        out.fill_(float("nan"))
        tridist.barrier_all()
        putmem_signal_allgather_kernel[(w.world_size,)](shard, out, flags, n, epoch)
        assert torch.equal(out.cpu(), everyone)
        tridist.barrier_all()
    for t in (flags, out, shard):
        tridist.symm_free(t)


def test_putmem_signal_block_allgather(world):
    world.run(_putmem_signal_allgather, n=257)


# ---- putmem / getmem in every form -------------------------------------------------------------------


@tridist.jit
def put_get_kernel(src_ptr, put_dst_ptr, get_dst_ptr, nbytes, VARIANT: tl.constexpr):
    right = (dl.rank() + 1) % dl.num_ranks()
    left = (dl.rank() + dl.num_ranks() - 1) % dl.num_ranks()
    if VARIANT == 0:
        dl.shmem.putmem(put_dst_ptr, src_ptr, nbytes, right)
        dl.shmem.getmem(get_dst_ptr, src_ptr, nbytes, left)
    elif VARIANT == 1:
        dl.shmem.putmem_nbi(put_dst_ptr, src_ptr, nbytes, right)
        dl.shmem.getmem_nbi(get_dst_ptr, src_ptr, nbytes, left)
    elif VARIANT == 2:
        dl.shmem.putmem_warp(put_dst_ptr, src_ptr, nbytes, right)
        dl.shmem.getmem_warp(get_dst_ptr, src_ptr, nbytes, left)
    elif VARIANT == 3:
        dl.shmem.putmem_nbi_warp(put_dst_ptr, src_ptr, nbytes, right)
        dl.shmem.getmem_nbi_warp(get_dst_ptr, src_ptr, nbytes, left)
    elif VARIANT == 4:
        dl.shmem.putmem_block(put_dst_ptr, src_ptr, nbytes, right)
        dl.shmem.getmem_block(get_dst_ptr, src_ptr, nbytes, left)
    else:
        dl.shmem.putmem_nbi_block(put_dst_ptr, src_ptr, nbytes, right)
        dl.shmem.getmem_nbi_block(get_dst_ptr, src_ptr, nbytes, left)
    dl.shmem.quiet()
    dl.shmem.barrier_all()


def _put_get(w, n, variant):
    src = tridist.symm_empty((n,), torch.int32)
    put_dst = tridist.symm_empty((n,), torch.int32)
    get_dst = tridist.symm_empty((n,), torch.int32)
    everyone = torch.randint(-2**31, 2**31 - 1, (w.world_size, n), dtype=torch.int32,
                             generator=torch.Generator().manual_seed(variant))
    src.copy_(everyone[w.rank])
    put_dst.fill_(-7)
    get_dst.fill_(-7)
    tridist.barrier_all()
    put_get_kernel[(1,)](src, put_dst, get_dst, n * 4, VARIANT=variant)
    assert torch.equal(put_dst.cpu(), everyone[(w.rank - 1) % w.world_size])
    assert torch.equal(get_dst.cpu(), everyone[(w.rank - 1) % w.world_size])
    tridist.barrier_all()
    for t in (get_dst, put_dst, src):
        tridist.symm_free(t)


def test_put_get_every_form(world):
    for variant in range(len(COPY_VARIANTS)):
        world.run(_put_get, n=100, variant=variant)


# ---- typed single elements, remote atomics, shmem.ptr ---------------------------------------------------


@tridist.jit
def typed_p_g_kernel(i32_ptr, i64_ptr, f32_ptr, out_ptr):
    right = (dl.rank() + 1) % dl.num_ranks()
    me = dl.rank()
    dl.shmem.p(i32_ptr, me + 100, right)
    dl.shmem.p(i64_ptr, me.to(tl.int64) + (1 << 40), right)
    dl.shmem.p(f32_ptr, me.to(tl.float32) + 0.5, right)
    dl.shmem.quiet()
    dl.shmem.barrier_all()
    tl.store(out_ptr, dl.shmem.g(i32_ptr, right).to(tl.float64))
    tl.store(out_ptr + 1, dl.shmem.g(i64_ptr, right).to(tl.float64))
    tl.store(out_ptr + 2, dl.shmem.g(f32_ptr, right).to(tl.float64))


def _typed_p_g(w):
    i32, i64, f32 = (tridist.symm_zeros((1,), dtype) for dtype in (torch.int32, torch.int64, torch.float32))
    out = torch.zeros(3, dtype=torch.float64, device=w.device)
    typed_p_g_kernel[(1,)](i32, i64, f32, out)
    left = (w.rank - 1) % w.world_size
    assert (int(i32.item()), int(i64.item()), float(f32.item())) == (left + 100, left + (1 << 40), left + 0.5)
    assert out.tolist() == [float(w.rank + 100), float(w.rank + (1 << 40)), w.rank + 0.5]
    tridist.barrier_all()
    for t in (f32, i64, i32):
        tridist.symm_free(t)


def test_typed_put_get(world):
    world.run(_typed_p_g)


@tridist.jit
def remote_atomics_kernel(counter_ptr, word_ptr, flag_ptr, out_ptr):
    me = dl.rank()
    old = dl.shmem.atomic_fetch_add(counter_ptr, 1, 0)
    won = dl.shmem.atomic_compare_swap(word_ptr, 0, me + 1, 0)
    dl.shmem.atomic_inc(counter_ptr + 1, 0)
    dl.shmem.atomic_set(flag_ptr + me, me + 5, 0)
    tl.store(out_ptr, old)
    tl.store(out_ptr + 1, won)


def _remote_atomics(w):
    counters = tridist.symm_zeros((2,), torch.int64)
    word = tridist.symm_zeros((1,), torch.int64)
    flags = tridist.symm_zeros((w.world_size,), torch.int64)
    out = torch.full((2,), -1, dtype=torch.int64, device=w.device)
    remote_atomics_kernel[(1,)](counters, word, flags, out)
    tridist.barrier_all()
    state = (counters.tolist(), int(word.item()), flags.tolist()) if w.rank == 0 else None
    result = out.tolist()
    tridist.barrier_all()
    for t in (flags, word, counters):
        tridist.symm_free(t)
    return result, state


def test_remote_atomics(world):
    results = world.run(_remote_atomics)
    n = len(results)
    olds = sorted(r[0][0] for r in results)
    assert olds == list(range(n))
    counters, word, flags = results[0][1]
    assert counters == [n, n]
    assert 1 <= word <= n
    winners = [rank for rank, r in enumerate(results) if r[0][1] == 0]
    assert winners == [word - 1], (winners, word)
    assert flags == [rank + 5 for rank in range(n)]


@tridist.jit
def shmem_ptr_kernel(buf_ptr, out_ptr):
    for peer in range(dl.num_ranks()):
        tl.store(out_ptr + peer, (dl.shmem.ptr(buf_ptr, peer).to(tl.int64) != 0).to(tl.int32))


def _shmem_ptr(w):
    buf = tridist.symm_zeros((4,), torch.int32)
    out = torch.full((w.world_size,), -1, dtype=torch.int32, device=w.device)
    shmem_ptr_kernel[(1,)](buf, out)
    tridist.symm_free(buf)
    return out.tolist()


def test_shmem_ptr_reachability(world):
    results = world.run(_shmem_ptr)
    if world.backend == "emulator":  # virtual nodes on a GPU box are still P2P reachable to NVSHMEM
        size, nnodes = len(results), world.nnodes or 1
        per_node = size // nnodes
        for rank, row in enumerate(results):
            assert row == [int(p // per_node == rank // per_node) for p in range(size)]
    else:
        assert all(all(row) for row in results)


# ---- registered memory only (TRIDIST_REGISTERED_ONLY) ------------------------------------------------


@tridist.jit
def put_to_next_node_kernel(dst_ptr, src_ptr, nbytes, peer):
    dl.shmem.putmem(dst_ptr, src_ptr, nbytes, peer)


def _put_from(w, symmetric_source):
    """A put to the same local rank of the next node, from a symmetric or a regular tensor: the
    emulator checks what a network transport would, that its local side is registered memory
    (TRIDIST_REGISTERED_ONLY, on unless set to 0)."""
    peer = (w.rank + w.world_size // w.nnodes) % w.world_size
    dst = tridist.symm_zeros((64,), torch.int32)
    src = tridist.symm_empty((64,), torch.int32) if symmetric_source else torch.empty(64, dtype=torch.int32)
    src.copy_(torch.arange(64, dtype=torch.int32) + 1000 * w.rank)
    if symmetric_source:
        put_to_next_node_kernel[(1,)](dst, src, 256, peer)
    else:
        with pytest.raises(ValueError, match=f"putmem with rank {peer} on node .* outside the symmetric heap"):
            put_to_next_node_kernel[(1,)](dst, src, 256, peer)
        os.environ["TRIDIST_REGISTERED_ONLY"] = "0"  # as NVLink between virtual nodes allows
        try:
            put_to_next_node_kernel[(1,)](dst, src, 256, peer)
        finally:
            del os.environ["TRIDIST_REGISTERED_ONLY"]
    tridist.barrier_all()
    sender = (w.rank - w.world_size // w.nnodes) % w.world_size
    assert torch.equal(dst.cpu(), torch.arange(64, dtype=torch.int32) + 1000 * sender)
    for t in (dst, src) if symmetric_source else (dst,):
        tridist.symm_free(t)


@pytest.mark.worlds("2x2")
def test_registered_only_refuses_unregistered_sources_across_nodes(world):
    if world.backend != "emulator":
        pytest.skip("an emulator check: NVSHMEM's own transport refuses such a put on a real network")
    for symmetric_source in (True, False):
        world.run(_put_from, symmetric_source=symmetric_source)


# ---- low-latency packets -------------------------------------------------------------------------------


@tridist.jit
def ll_ping_pong_kernel(packets_ptr, src_ptr, out_ptr, peer, rounds, initiator, n, BLOCK: tl.constexpr):
    """The initiator sends `data + round` to its peer's ping half; the peer doubles it and sends it
    back to the initiator's pong half. Each round's flag is its number, so no buffer is reset."""
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    data = tl.load(src_ptr + offsets, mask=mask)
    for r in range(1, rounds + 1):
        if initiator:
            dl.ll.send(dl.symm_at(packets_ptr + offsets, peer), data + r, r, mask)
            echoed = dl.ll.recv(packets_ptr + BLOCK + offsets, r, mask)
            tl.store(out_ptr + (r - 1) * n + offsets, echoed, mask=mask)
        else:
            received = dl.ll.recv(packets_ptr + offsets, r, mask)
            dl.ll.send(dl.symm_at(packets_ptr + BLOCK + offsets, peer), received * 2, r, mask)


def _ll_ping_pong(w, n, rounds):
    block = 1 << (n - 1).bit_length()
    packets = tridist.symm_zeros((2 * block,), torch.int64)
    data = torch.randint(-2**20, 2**20, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(w.rank))
    out = torch.full((rounds, n), -1, dtype=torch.int32, device=w.device)
    partner = w.local_rank ^ 1
    if partner < w.local_world_size:
        peer = w.node * w.local_world_size + partner
        ll_ping_pong_kernel[(1,)](packets, data.to(w.device), out, peer, rounds, int(w.local_rank % 2 == 0), n,
                                  BLOCK=block)
        if w.local_rank % 2 == 0:
            expected = torch.stack([(data + r) * 2 for r in range(1, rounds + 1)])
            assert torch.equal(out.cpu(), expected)
    tridist.barrier_all()
    tridist.symm_free(packets)


def test_ll_round_trips(world):
    world.run(_ll_ping_pong, n=100, rounds=10)
