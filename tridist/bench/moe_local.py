"""`tridist bench moe_local [--sweep]`: the local MoE (`tridist.ops.moe_local`: an MoE layer's experts
on one rank, a gate/up kernel and a down kernel) on one GPU, against the experts as transformers runs
them, in the same run.

Layer: Qwen3-30B-A3B's experts, 128 of hidden 2048 and inner 768, top-8 (`--layer E x H x I x K` for
another), at `--tokens` 1, 8 and 64 (decode batches: the dense rows) and 4096 (a prefill: the sorted
rows). The routing is `ops.moe_route` of random logits, drawn ROUTINGS times and taken in turn call
after call, so that a decode call reads other experts than the one before it, as the next layer
would, and L2 does not hold them. Per T:
- tridist: `moe_local`, checked against `moe_local_reference` (TOLERANCE) and for the same bits on a
  second call, then timed (`timing.op_us`: in a CUDA graph where a call is short);
- torch: the experts as transformers' `grouped_mm` implementation runs them (the pairs sorted by
  expert, gathered, `torch._grouped_mm` for gate and up, SiLU * up, `torch._grouped_mm` for down,
  weighted, summed per token), checked against the same reference, timed alike;
- `GB/s`, `of copy`: the weights of the experts the routing touches, each read once, over the time,
  against a device-to-device copy's rate in the same run (read + written): a decode call's bound;
- `TFLOP/s`, `of cuBLAS`: 2 x pairs x 3 x H x I over the time, against cuBLAS's bf16 rate in the
  same run: a prefill's measure.
`--sweep` times instead the candidate tile pairs of `SWEEP` (the dense rows' at decode sizes, the
sorted rows' at a prefill's), each checked first, and prints the best per T beside the policy's
pick, so that one GPU call can set `tridist.ops.moe.local.policy`. In the emulator (CPU) both check
a small layer and time nothing.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
from triton.errors import TritonError

import tridist
from tridist import ops
from tridist.ops.moe.local import moe_local_reference, policy

from .results import error_line, print_row, relative_error, save, table
from .timing import copy_rate, gemm_rate, one_gpu, op_us, time_us

LAYER = (128, 2048, 768, 8)  # experts, hidden, inner, top-k: Qwen3-30B-A3B's
EMULATOR_LAYER = (8, 64, 32, 2)
TOKENS = [1, 8, 64, 4096]
EMULATOR_TOKENS = [1, 5, 70]
ROUTINGS = 16  # routings a timed graph takes in turn: 16 x 8 experts of 128 at batch 1
TOLERANCE = 2 ** -6  # relative to the largest value: bf16 outputs (tests/test_moe_local.py)


def _tiles(block_m, block_n, block_k, warps, stages) -> dict:
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1 if block_m is None else 8,
                num_warps=warps, num_stages=stages)


# --sweep's (gate/up, down) tiles: BLOCK_M None takes the dense rows' (every token, `policy.dense_rows`)
SWEEP = {
    "dense": [(_tiles(None, up, k, 4, stages), _tiles(None, down, k, 4, stages))
              for up, down in ((16, 32), (32, 64), (64, 128), (32, 128)) for k, stages in ((128, 4), (256, 3), (64, 6))],
    "sorted": [(_tiles(128, 128, 64, 8, 3), _tiles(128, 128, 64, 8, 3)),  # the policy's (SORTED_UP, SORTED_DOWN)
               (_tiles(128, 128, 64, 8, 3), _tiles(128, 128, 64, 8, 4)),  # one down program an SM
               (_tiles(128, 128, 64, 8, 4), _tiles(128, 128, 64, 8, 3)),
               (_tiles(128, 128, 64, 8, 3), _tiles(128, 64, 64, 4, 4)),
               (_tiles(128, 128, 64, 8, 3), _tiles(64, 128, 64, 4, 4)),
               (_tiles(128, 128, 64, 8, 3), _tiles(128, 256, 64, 8, 3)),
               (_tiles(64, 128, 64, 4, 4), _tiles(64, 128, 64, 4, 4))],
}
EMULATOR_SWEEP = {"dense": [(_tiles(None, 32, 16, 4, 1), _tiles(None, 16, 32, 4, 1))],
                  "sorted": [(_tiles(16, 32, 16, 4, 1), _tiles(32, 16, 16, 4, 1))]}


class Layer:
    """One layer's expert weights (w_gate_up `[E, H, 2I]`, w_down `[E, I, H]`, bf16) and, per token
    count, ROUTINGS routings (on a GPU; one in the emulator) of x through `ops.moe_route`."""

    def __init__(self, experts: int, hidden: int, inner: int, top_k: int, device: torch.device):
        g = torch.Generator(device=device).manual_seed(0)
        self.w_gate_up = (torch.randn(experts, hidden, 2 * inner, generator=g, device=device) / hidden ** 0.5).to(
            torch.bfloat16)
        self.w_down = (torch.randn(experts, inner, hidden, generator=g, device=device) / inner ** 0.5).to(torch.bfloat16)
        self.experts, self.hidden, self.inner, self.top_k, self.device, self.g = experts, hidden, inner, top_k, device, g

    def inputs(self, tokens: int) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        x = torch.randn(tokens, self.hidden, generator=self.g, device=self.device).to(torch.bfloat16)
        draws = ROUTINGS if self.device.type == "cuda" else 1
        return x, [ops.moe_route(torch.randn(tokens, self.experts, generator=self.g, device=self.device), self.top_k)
                   for _ in range(draws)]

    def touched_bytes(self, routings) -> float:
        """The weight bytes a call reads on average: each expert its routing touches, once."""
        per_expert = 3 * self.hidden * self.inner * 2
        return sum(idx.unique().numel() for idx, _ in routings) / len(routings) * per_expert

    def tridist(self, x, idx, weights, config=None):
        return ops.moe_local(x, idx, weights, self.w_gate_up, self.w_down, config=config)

    def torch(self, x, idx, weights):
        """transformers' `grouped_mm` experts: sort, gather, two grouped GEMMs, weight, sum per token."""
        pairs = idx.reshape(-1)
        order = torch.argsort(pairs, stable=True)
        offs = torch.histc(pairs.int(), bins=self.experts, min=0, max=self.experts - 1).cumsum(0).to(torch.int32)
        tokens = order // self.top_k
        gate, up = torch._grouped_mm(x[tokens], self.w_gate_up, offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_down, offs=offs) * weights.reshape(-1)[order, None]
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, y.float()).to(x.dtype)


def _check(what: str, out: torch.Tensor, expected: torch.Tensor) -> float:
    error = relative_error(out, expected)
    if not error <= TOLERANCE:
        raise AssertionError(f"moe_local {what}: relative error {error:.2e} against moe_local_reference")
    return error


def _rotating(fn, x, routings):
    turn = itertools.cycle(routings)
    return lambda: fn(x, *next(turn))


def run(layer: Layer, token_counts: list[int], timed: bool) -> list[dict]:
    """A row per T: tridist and torch checked against the reference, then (if `timed`) timed."""
    rates = (copy_rate(layer.device), gemm_rate(layer.device)) if timed else None
    rows = []
    for tokens in token_counts:
        x, routings = layer.inputs(tokens)
        expected = moe_local_reference(x, *routings[0], layer.w_gate_up, layer.w_down)
        out = layer.tridist(x, *routings[0])
        up, down = policy.configs(layer.device, tokens, layer.top_k, layer.experts, layer.inner, layer.hidden)
        row = {"T": tokens, "rows": "dense" if policy.dense(tokens) else "sorted",
               "config": f"up {_name(up)}, down {_name(down)}", "rel err": _check(f"T={tokens}", out, expected),
               "same bits": torch.equal(layer.tridist(x, *routings[0]), out)}
        if timed:
            copy, gemm = rates
            row["torch rel err"] = _check(f"T={tokens} torch", layer.torch(x, *routings[0]), expected)
            us = op_us(_rotating(layer.tridist, x, routings))
            torch_us = op_us(_rotating(layer.torch, x, routings))
            nbytes = layer.touched_bytes(routings)
            flops = 2 * tokens * layer.top_k * 3 * layer.hidden * layer.inner
            row.update({"us": us, "torch us": torch_us, "vs torch": torch_us / us, "GB/s": nbytes / us / 1e3,
                        "of copy": nbytes / us / copy, "TFLOP/s": flops / us / 1e6, "of cuBLAS": flops / us / gemm,
                        "copy GB/s": copy / 1e3, "cuBLAS TFLOP/s": gemm / 1e6})
        rows.append(row)
        print_row(row)
    return rows


def sweep(layer: Layer, token_counts: list[int], timed: bool) -> tuple[list[dict], list[dict]]:
    """Every candidate of SWEEP for each T's rows and the policy's pick: checked, then (if `timed`)
    timed. Returns (every row, the best per T with the policy's pick beside it). A candidate this GPU
    cannot compile or launch is a row with its error."""
    every, best = [], []
    for tokens in token_counts:
        x, routings = layer.inputs(tokens)
        expected = moe_local_reference(x, *routings[0], layer.w_gate_up, layer.w_down)
        picked = policy.configs(layer.device, tokens, layer.top_k, layer.experts, layer.inner, layer.hidden)
        dense = policy.dense(tokens)
        candidates = [picked] + [tuple({**c, "BLOCK_M": c["BLOCK_M"] or policy.dense_rows(tokens)} for c in pair)
                                 for pair in (SWEEP if timed else EMULATOR_SWEEP)["dense" if dense else "sorted"]]
        rows = []
        for index, config in enumerate(candidates):
            row = {"T": tokens, "config": f"up {_name(config[0])}, down {_name(config[1])}", "policy": index == 0}
            try:
                row["rel err"] = _check(f"T={tokens} {row['config']}", layer.tridist(x, *routings[0], config), expected)
                if timed:
                    row["us"] = time_us(_rotating(lambda x, i, w: layer.tridist(x, i, w, config), x, routings),
                                        inner=20, repetitions=5, warmup=2, graph=True)
            except (AssertionError, RuntimeError, TritonError) as error:  # a config this GPU cannot run
                row["error"] = error_line(error)
            rows.append(row)
            print_row(row)
        every += rows
        ran = [row for row in rows if "error" not in row]
        if ran:
            top = min(ran, key=lambda row: row.get("us", 0.0))
            best.append({**top, "policy config": rows[0]["config"], "policy us": rows[0].get("us")})
    return every, best


def _name(config: dict) -> str:
    return f"{config['BLOCK_M']}x{config['BLOCK_N']}x{config['BLOCK_K']} w{config['num_warps']} s{config['num_stages']}"


def parse_layer(text: str) -> tuple[int, int, int, int]:
    """'128x2048x768x8' -> (experts, hidden, inner, top_k); an argparse `type`."""
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"--layer {text!r}: experts x hidden x inner x top-k as four positive "
                                         "integers, e.g. 128x2048x768x8")
    experts, hidden, inner, top_k = (int(p) for p in parts)
    if top_k > experts or hidden % 8 or inner % 8:
        raise argparse.ArgumentTypeError(f"--layer {text!r}: top-k at most the experts, hidden and inner multiples of 8")
    return experts, hidden, inner, top_k


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tridist bench moe_local")
    parser.add_argument("--sweep", action="store_true", help="time SWEEP's tiles per T (see the module)")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="T values, comma separated "
                        "(default %(default)s)")
    parser.add_argument("--layer", type=parse_layer, default=LAYER,
                        help="experts x hidden x inner x top-k (default Qwen3-30B-A3B's, 128x2048x768x8)")
    parser.add_argument("--out", default="benchmarks/results", help="folder for JSON results (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        token_counts = [0]
    if any(t < 1 for t in token_counts):
        parser.error(f"--tokens {args.tokens!r}: positive integers, comma separated, e.g. 1,8,64,4096")
    w = one_gpu("moe_local")
    timed = w.device.type == "cuda"
    layer = Layer(*(args.layer if timed else EMULATOR_LAYER), w.device)
    token_counts = token_counts if timed else EMULATOR_TOKENS
    extra = {"layer (experts, hidden, inner, top-k)": [layer.experts, layer.hidden, layer.inner, layer.top_k],
             "routings rotated": ROUTINGS}
    if args.sweep:
        every, results = sweep(layer, token_counts, timed)
        columns = ["T", "config", "us", "policy config", "policy us"]
        extra["best"] = results
    else:
        every = results = run(layer, token_counts, timed)
        columns = ["T", "rows", "config", "us", "torch us", "vs torch", "GB/s", "of copy", "TFLOP/s", "of cuBLAS",
                   "rel err", "same bits"]
    print(table(results, columns))
    if timed:
        print("saved", save("moe-local-sweep" if args.sweep else "moe-local", every, args.out, extra))
    tridist.finalize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
