"""Host API: symmetric allocation and its checks, peer tensors, argument checks, errors."""
import os

import pytest
import torch
import triton.language as tl

import tridist
from tridist.runtime import sharing
from tridist.runtime.tensors import check_tensor


def _allocate_and_free(w):
    a = tridist.symm_empty((3, 5), torch.float32)
    b = tridist.symm_zeros((7,), torch.bfloat16)
    assert tridist.is_symmetric(a) and tridist.is_symmetric(b)
    assert not tridist.is_symmetric(torch.zeros(3, device=w.device))
    assert a.shape == (3, 5) and a.dtype == torch.float32 and a.device == w.device
    assert (b == 0).all()
    tridist.symm_free(a)
    c = tridist.symm_empty((3, 5), torch.float32)
    assert c.data_ptr() == a.data_ptr(), "first fit reuses the freed block"
    for t in (c, b):
        tridist.symm_free(t)
    return a.data_ptr() - tridist.runtime.world.heap().base_ptr


def test_allocate_free_reuse(world):
    offsets = world.run(_allocate_and_free)
    assert len(set(offsets)) == 1, "every rank gets the same offset"


def _peer_tensors(w):
    t = tridist.symm_empty((4, 8), torch.int64)
    t.copy_(torch.arange(32).view(4, 8) + 1000 * w.rank)
    tridist.barrier_all()
    for peer in range(w.world_size):
        if w.same_node(peer):
            view = tridist.peer_tensor(t[1:3], peer)
            assert torch.equal(view.cpu(), torch.arange(8, 24).view(2, 8) + 1000 * peer)
        else:
            with pytest.raises(ValueError, match="not load/store reachable"):
                tridist.peer_tensor(t, peer)
    tridist.barrier_all()
    with pytest.raises(ValueError, match="symmetric tensor"):
        tridist.peer_tensor(torch.zeros(2, device=w.device), 0)
    with pytest.raises(ValueError, match="outside the world"):
        tridist.peer_tensor(t, w.world_size)
    tridist.symm_free(t)


def test_peer_tensor(world):
    world.run(_peer_tensors)


def _mismatched_allocation(w):
    with pytest.raises(tridist.SymmetricAllocationError, match="differ between ranks") as error:
        tridist.symm_empty((16 * (1 + w.rank % 2),), torch.float32)
    assert "rank 0: allocation" in str(error.value) and "float32[16]" in str(error.value)
    t = tridist.symm_empty((4,), torch.float32)  # the heap stays usable and consistent
    tridist.symm_free(t)


def test_mismatched_allocation_fails_on_every_rank(world):
    if world.size == 1:
        pytest.skip("needs a peer to disagree with")
    if world.backend != "emulator" and os.environ.get("TRIDIST_DEBUG") != "1":
        pytest.skip("on GPUs allocations are compared with TRIDIST_DEBUG=1 only")
    world.run(_mismatched_allocation)


def _heap_exhausted(w):
    heap = tridist.runtime.world.heap()
    with pytest.raises(tridist.SymmetricAllocationError, match="TRIDIST_HEAP_SIZE"):
        tridist.symm_empty((heap.nbytes + 1,), torch.uint8)


def test_heap_exhausted(world):
    world.run(_heap_exhausted)


def _argument_checks(w):
    with pytest.raises(ValueError, match="contiguous"):
        check_tensor(torch.zeros(4, 4, device=w.device).t(), "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        check_tensor([1, 2], "x")
    with pytest.raises(ValueError, match="symm_free"):
        tridist.symm_free(torch.zeros(2, device=w.device))
    with pytest.raises(ValueError, match="non-negative"):
        tridist.symm_empty((-1,), torch.float32)
    with pytest.raises(ValueError, match="symmetric tensors take one of"):
        tridist.symm_empty((2,), torch.complex64)
    assert tridist.init() is w, "init is idempotent"
    with pytest.raises(tridist.TridistError, match="already initialised"):
        tridist.init(nnodes=w.nnodes + 1)


def test_argument_checks(world):
    world.run(_argument_checks)


def _emulated_kernel_rejects_cuda(w):
    from tests.test_language import identity_kernel

    meta = torch.empty(4, device="meta")
    with pytest.raises(ValueError, match="the emulator runs on CPU tensors"):
        identity_kernel[(1,)](meta)


def test_emulator_rejects_device_tensors(world):
    if world.backend != "emulator":
        pytest.skip("an emulator check: GPU kernels take device tensors")
    world.run(_emulated_kernel_rejects_cuda)


def test_use_before_init():
    with pytest.raises(tridist.NotInitializedError, match=r"tridist.init\(\)"):
        tridist.world()
    with pytest.raises(tridist.NotInitializedError):
        tridist.symm_empty((4,), torch.float32)


def test_ranks_that_count_different_sms_are_refused():
    """At init on GPUs every rank's SM count is gathered: the ops lay out their exchanges by it."""
    from tridist.runtime.world import same_sms

    same_sms([132, 132, 132])
    with pytest.raises(tridist.TridistError, match=r"different numbers of SMs \(rank 0: 132, rank 1: 66\)"):
        same_sms([132, 66])


@pytest.mark.parametrize("name, value, expected", [
    ("TRIDIST_HEAP_SIZE", "lots", "TRIDIST_HEAP_SIZE='lots': expected bytes"),
    ("TRIDIST_NNODES", "two", "TRIDIST_NNODES='two': expected a positive integer"),
    ("TRIDIST_NNODES", "0", "TRIDIST_NNODES='0'"),
    ("TRIDIST_WAIT_TIMEOUT", "-1", "TRIDIST_WAIT_TIMEOUT='-1': expected a number of seconds"),
    ("TRIDIST_EMU_THREADS", "many", "TRIDIST_EMU_THREADS='many'"),
    ("TRIDIST_EMU_CORESIDENT", "0", "TRIDIST_EMU_CORESIDENT='0'"),
])
def test_bad_settings_name_the_variable(monkeypatch, name, value, expected):
    from tridist.runtime import config

    monkeypatch.setenv(name, value)
    read = {"TRIDIST_HEAP_SIZE": lambda: config.heap_bytes("emulator"), "TRIDIST_NNODES": config.virtual_nodes,
            "TRIDIST_WAIT_TIMEOUT": config.wait_timeout_s, "TRIDIST_EMU_THREADS": config.emulator_threads,
            "TRIDIST_EMU_CORESIDENT": config.emulator_coresident}[name]
    with pytest.raises(ValueError, match=expected):
        read()


def test_bad_launcher_setting_names_the_variable(monkeypatch):
    from tridist.runtime import world

    monkeypatch.setenv("RANK", "first")
    with pytest.raises(tridist.TridistError, match="RANK='first': expected an integer"):
        world._layout(None)


# ---- occupancy: how many programs a co-resident launch may have ------------------------------------


@pytest.mark.parametrize("registers, shared, warps, blocks, limit", [
    (255, 0, 4, 2, "registers"),          # 8192 registers a warp: 2 warps in each quarter of the file
    (168, 180 << 10, 8, 1, "registers"),  # a GEMM: 5376 a warp, 3 a quarter, 12 warps an SM
    (32, 0, 4, 16, "threads"),
    (40, 0, 1, 32, "blocks"),
    (33, 0, 4, 12, "registers"),          # 33 x 32 = 1056, rounded up to 1280 a warp: 12 a quarter
    (64, 100 << 10, 2, 2, "shared"),      # 100 KB + the driver's 1 KB, twice in 228 KB
    (32, (113 << 10) + 512, 4, 1, "shared"),  # 113.5 KB fits twice in 228 KB, but not with the 1 KB reserve
    (255, 0, 32, 0, "more than a block"),  # 1024 threads of 255 registers: no block fits at all
    (32, 228 << 10, 4, 0, "more than a block"),
])
def test_blocks_per_sm_rounds_as_cuda_does(registers, shared, warps, blocks, limit):
    from tridist.runtime.occupancy import blocks_per_sm

    counted, why = blocks_per_sm(registers, shared, warps)
    assert (counted, limit in why) == (blocks, True), why


@tridist.jit
def occupancy_probe_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr, DOT: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    if DOT:
        tile = offsets[:, None] * BLOCK + offsets[None, :]
        a = tl.load(x_ptr + tile)
        tl.store(out_ptr + tile, tl.dot(a, a).to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * 2)


def _occupancy_against_driver(w):
    """Our count of blocks per SM agrees with the driver's for kernels limited by threads, registers
    and shared memory (GPUs)."""
    from tridist.runtime import occupancy

    x = torch.zeros(256 * 256, dtype=torch.float16, device=w.device)
    rows = []
    for block, dot, warps in ((128, False, 4), (128, False, 1), (128, False, 16), (8192, False, 1), (64, True, 4),
                              (128, True, 8), (128, True, 4)):
        compiled = occupancy_probe_kernel.run(x, x, BLOCK=block, DOT=dot, num_warps=warps, grid=(1,), warmup=True,
                                              coresident=True)
        compiled._init_handles()  # loads the module: registers are known from then on
        counted, why = occupancy.blocks_per_sm(compiled.n_regs, compiled.metadata.shared, warps)
        driver = occupancy._driver_blocks_per_sm(compiled)
        rows.append((block, dot, warps, compiled.n_regs, compiled.metadata.shared, counted, driver, why))
    print("\n".join(map(str, rows)))
    assert all(row[5] == row[6] for row in rows), rows
    sms, where = occupancy.available_sms(w.device)
    print(f"SMs this process may use: {sms} ({where})")
    assert 0 < sms <= torch.cuda.get_device_properties(w.device).multi_processor_count
    per_sm = 1 if sharing.ranks_per_gpu_here() > 1 else rows[0][6]  # ranks sharing a GPU: one an SM
    assert tridist.coresident_programs(occupancy_probe_kernel, x, x, BLOCK=128, DOT=False, num_warps=4) == per_sm * sms


def test_occupancy_against_the_driver(world):
    if world.backend == "emulator":
        pytest.skip("the driver's occupancy answer needs a GPU")
    world.run(_occupancy_against_driver)
