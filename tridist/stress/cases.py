"""What a stress run calls: the registry of op cases, the seeded plan, the inputs and the checks.

Registry. Each op of `tridist.ops` has an `OpCases` here, registered by its family's module (the
modules named in FAMILIES). An `OpCases` says how to draw a valid call of its op at random
(`draw`: method, dtype, sizes, in place or not, symmetric or not) and how to run one (`trial`:
buffers, fresh inputs with the expected result, the call through the function or through an
instance of the op's class); `forms_for` and `modes` narrow the forms and modes a call may take. A
new family adds a module beside `collectives.py` and `gemm.py` that registers its ops, and its name
to FAMILIES; the runner (`rank.py`) needs nothing else.

Plan. Every rank draws the same calls from the seed (Python's `random.Random`, the same on every
process), so no rank tells another what comes next. Draws that cannot run in this world (a
one-node method across nodes, LL packets for data that is not whole 4-byte words, a config the op
refuses) are drawn again, and the reason is counted in the plan's `skipped`: what a run did not
cover is listed, not hidden. Sizes are log-uniform from one element to `Limits`, which depend on
the backend (several MB per rank on GPUs, a few KB in the emulator); they stay far below the 2^31
elements the ops' 32-bit offsets reach.

Inputs and checks. Every rank makes every rank's inputs from the call's seed (on its own device),
so each checks its own result against a reference it built alone. Outputs are poisoned before the
call (NaN, or the bitwise complement of the expected data). Data movement must be exact (bits);
sums and products must be within the bounds of `sum_tolerance` and `gemm_tolerance`.
"""
import dataclasses
import importlib
import math
import random

import torch

# The modules of tridist.stress that register op cases; a new family adds its own here.
FAMILIES = ("collectives", "gemm", "alltoall", "moe_tp", "attention", "stencil")

FORMS = ("function", "class")
MODES = ("eager", "graph", "streams")


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a stress run.

    op, method, dtype: what is called (`method` None for ops without one).
    shape: the op's sizes, as its `OpCases` reads them (elements per rank; m, k, n of a GEMM).
    config: a GEMM config (a dict as `tridist.ops.gemm.configs` lists), None for the default.
    form: "function" (`tridist.ops.all_gather(...)`, whose instances the ops keep per shape) or
        "class" (an instance built for this call and freed after it).
    in_place, symmetric: the op's own meaning (`OpCases.draw`).
    mode: "eager"; "graph": captured in a CUDA graph and replayed with new inputs (GPUs); "streams":
        two instances on two side streams, with nothing between them but the ops' own ordering
        (`ops.call_order`; in the emulator, which has no streams, one after the other).
    repeats: calls back to back with no host synchronisation (eager, streams), or graph replays.
    """

    index: int
    op: str
    method: str | None
    dtype: torch.dtype
    shape: tuple
    config: dict | None = None
    form: str = "function"
    in_place: bool = False
    symmetric: bool = False
    mode: str = "eager"
    repeats: int = 1

    def describe(self) -> str:
        what = [self.op]
        if self.method is not None:
            what.append(f"method={self.method}")
        what += [f"dtype={str(self.dtype).removeprefix('torch.')}", "size=" + "x".join(map(str, self.shape))]
        if self.config is not None:
            what.append("config=" + "/".join(f"{v}" for v in self.config.values()))
        flags = [self.form, self.mode, f"x{self.repeats}"]
        flags += ["in place"] * self.in_place + ["symmetric"] * self.symmetric
        return f"{' '.join(what)} ({', '.join(flags)})"


class Invalid(Exception):
    """A drawn call this world cannot run; the message, a reason without sizes, is counted."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """The largest sizes drawn: bytes of a collective's input per rank; a GEMM's rows (of A, or of
    all shards for ag_gemm), K and N. The other families take theirs from these (e.g. an MoE op's
    pairs of all ranks from `rows`, a KV cache's and a Jacobi domain's bytes from `nbytes`)."""

    nbytes: int
    rows: int
    k: int
    n: int


GPU_LIMITS = Limits(nbytes=8 << 20, rows=2048, k=4096, n=2048)
EMULATOR_LIMITS = Limits(nbytes=4 << 10, rows=32, k=48, n=32)


def limits_for(world) -> Limits:
    return GPU_LIMITS if world.device.type == "cuda" else EMULATOR_LIMITS


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    """An int in [low, high], log-uniform: small sizes are as likely as large ones, decade by decade."""
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def draw_method(rng: random.Random, op: str, methods, world, one_node=(), kind: str = "method") -> str:
    """One of `methods` (a method, or a comm: `kind`); `Invalid` for one of `one_node`, those that
    reach peers through pointers or copy engines, in a world of several nodes."""
    method = rng.choice(methods)
    if method in one_node and world.nnodes > 1:
        raise Invalid(f"{op} {kind} {method!r}: one node only")
    return method


def count_with_edges(rng: random.Random, most: int) -> int:
    """A count in [0, most] whose edges come up often: none, all, or any number between."""
    roll = rng.random()
    return 0 if roll < 0.1 else most if roll < 0.3 else rng.randint(0, most)


def composition(rng: random.Random, total: int, parts: int) -> list[int]:
    """`total` cut into `parts` counts: all in one part, in a random few, or spread over all."""
    counts = [0] * parts
    style = rng.random()
    if style < 0.2:
        counts[rng.randrange(parts)] = total
        return counts
    chosen = [p for p in range(parts) if rng.random() < 0.5] if style < 0.5 else list(range(parts))
    chosen = chosen or [rng.randrange(parts)]
    cuts = sorted(rng.randint(0, total) for _ in range(len(chosen) - 1))
    for part, low, high in zip(chosen, [0] + cuts, cuts + [total]):
        counts[part] = high - low
    return counts


class OpCases:
    """How a stress run calls one op. Subclasses set `name` (the op's), `family` (its module in
    tridist.ops) and `forms` (those it has), and implement `draw` and `trial`. A family's module,
    e.g. `tridist/stress/moe.py` (with "moe" added to FAMILIES):

        class DispatchCases(OpCases):
            name, family = "moe_dispatch", "moe"

            def draw(self, rng, world, limits):  # raise Invalid("...") for what this world cannot run
                return dict(method=rng.choice(METHODS), dtype=torch.bfloat16, shape=(tokens, hidden))

            def trial(self, call, world):
                return DispatchTrial(call, world)  # a `Trial`: buffers, fill, build, call, free

        register(DispatchCases())
    """

    name: str
    family: str
    forms: tuple = FORMS
    modes: tuple = MODES  # those it can run in (an op whose calls synchronise on the host is not captured)

    def draw(self, rng: random.Random, world, limits: Limits) -> dict:
        """Call fields for a random valid call: method, dtype, shape, and as the op takes them
        config, in_place, symmetric. Raises `Invalid` for a draw this world cannot run."""
        raise NotImplementedError

    def forms_for(self, fields: dict) -> tuple:
        """The forms that can make the call `fields` describes (e.g. only the class takes a config)."""
        return self.forms

    def trial(self, call: Call, world) -> "Trial":
        """Buffers for one call of `call` (one per repeat, and per stream)."""
        raise NotImplementedError


class Trial:
    """One call's buffers. The runner calls `fill` (new inputs; returns the `Expected` result of
    the call that follows), `build` (class form), `call`, and finally `free`."""

    def fill(self, seed: int) -> "Expected":
        raise NotImplementedError

    def build(self):
        """The op's class instance for this call (class form)."""
        raise NotImplementedError

    def call(self, op):
        """Call the op: through `op` (from `build`) or, where op is None, the function; returns its output."""
        raise NotImplementedError

    def free(self) -> None:
        """Give back symmetric buffers (every rank in the same order)."""


REGISTRY: dict[str, OpCases] = {}


def register(cases: OpCases) -> OpCases:
    if cases.name in REGISTRY:
        raise ValueError(f"stress cases for {cases.name!r} are registered twice")
    REGISTRY[cases.name] = cases
    return cases


def registry() -> dict[str, OpCases]:
    """Every registered op's cases, by op name, in the order of FAMILIES (then as each module
    registers them), however the modules came to be imported: the plan a seed draws depends on it."""
    modules = [f"{__package__}.{family}" for family in FAMILIES]
    for module in modules:
        importlib.import_module(module)
    return dict(sorted(REGISTRY.items(), key=lambda item: modules.index(type(item[1]).__module__)))


def select(names: str | None) -> list[str]:
    """Op names from --ops: a comma-separated list of ops and families; None for all."""
    ops = registry()
    if not names:
        return list(ops)
    chosen = []
    for name in (part.strip() for part in names.split(",") if part.strip()):
        matched = [op for op, cases in ops.items() if name in (op, cases.family)]
        if not matched:
            families = sorted({cases.family for cases in ops.values()})
            raise ValueError(f"--ops: unknown op or family {name!r}; choose from {', '.join(ops)} or "
                             f"{', '.join(families)}")
        chosen += [op for op in matched if op not in chosen]
    return chosen


@dataclasses.dataclass
class Plan:
    calls: list[Call]
    skipped: dict[str, int]  # reason -> draws refused


_ATTEMPTS = 1000  # draws per call before an op is declared impossible in this world


def plan(seed: int, count: int, world, ops: list[str]) -> Plan:
    """`count` calls drawn from `seed` for this world (the same on every rank). A call picks a family,
    then one of its ops (so that each family gets its share however many ops it has), or, half the
    time, takes the op and sizes of one of the last 8 calls, so that the instances the functions
    keep are called again, at later epochs and in the other slot. Modes, of those the op can run in:
    eager half the time (GPUs: graph and streams a quarter each; the emulator: streams a quarter); 1
    call (half the time), 2 or 3. Forms: those that can make the call (`OpCases.forms_for`)."""
    rng = random.Random(seed)
    cases = registry()
    limits = limits_for(world)
    modes = ("eager", "eager", "graph", "streams") if world.device.type == "cuda" else ("eager",) * 3 + ("streams",)
    families = {}
    for op in ops:
        families.setdefault(cases[op].family, []).append(op)
    calls, skipped, recent = [], {}, []
    for index in range(count):
        for _ in range(_ATTEMPTS):
            if recent and rng.random() < 0.5:
                fields = dict(rng.choice(recent))
            else:
                op = rng.choice(families[rng.choice(list(families))])
                try:
                    fields = {"op": op, **cases[op].draw(rng, world, limits)}
                except Invalid as reason:
                    skipped[str(reason)] = skipped.get(str(reason), 0) + 1
                    continue
            op_cases = cases[fields["op"]]
            mode = rng.choice([m for m in modes if m in op_cases.modes])
            repeats = rng.choice((1, 1, 2, 3)) if mode != "graph" else rng.choice((2, 3))
            call = Call(index, **fields, form=rng.choice(op_cases.forms_for(fields)), mode=mode, repeats=repeats)
            break
        else:
            raise ValueError(f"stress: no valid call found in {_ATTEMPTS} draws among {', '.join(ops)} in this world "
                             f"({world.world_size} ranks, {world.nnodes} nodes); skipped: {skipped}")
        calls.append(call)
        recent = (recent + [{f.name: getattr(call, f.name) for f in dataclasses.fields(call)
                             if f.name not in ("index", "form", "mode", "repeats")}])[-8:]
    return Plan(calls, skipped)


def seed_of(*parts: int) -> int:
    """A seed for torch from a run's seed and indices (a call, a lane, a repeat, a rank)."""
    return random.Random(":".join(map(str, parts))).getrandbits(62)


def random_tensor(shape, dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    """Floats: normal values (finite, so that their bits survive any copy); others: random bits."""
    g = torch.Generator(device).manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, device=device).to(dtype)
    numel = math.prod(shape)
    bits = torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8, device=device)
    return bits.view(dtype).view(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as integers of the same width (to compare and complement them)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def poison(out: torch.Tensor, expected: "Expected") -> None:
    """Fill `out` with what the call must overwrite: NaN for a result within a tolerance, the
    bitwise complement of the expected data for exact data movement (so no element can be right
    by chance)."""
    if expected.tolerance is None:
        bits(out).copy_(~bits(expected.reference))
    else:
        out.fill_(float("nan"))


@dataclasses.dataclass
class Expected:
    """What a call must give: `reference`, exact in bits (tolerance None) or within `tolerance`
    (a tensor of per-element bounds, or a number) of it. `where(i)` names element i of the output
    in the op's terms (e.g. which rank's shard it came from)."""

    reference: torch.Tensor
    tolerance: torch.Tensor | float | None = None
    where: object = None


_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def sum_tolerance(inputs: list[torch.Tensor], reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound for a sum over ranks accumulated in fp32 and rounded once to `dtype` (what
    every reduce-scatter and all-reduce method does): |out - sum| <= u |sum| + (W - 1) 2^-24 sum_r
    |x_r|, with u the unit roundoff of `dtype`, W the number of terms, plus the smallest subnormal
    of `dtype` (results near zero). Twice that is allowed: bf16 gets about 0.8% of the value."""
    magnitude = sum(x.double().abs() for x in inputs)
    bound = (_UNIT_ROUNDOFF[dtype] * reference.abs() + (len(inputs) - 1) * 2.0 ** -24 * magnitude
             + torch.finfo(dtype).tiny * torch.finfo(dtype).eps)
    return 2 * bound


def gemm_tolerance(reference: torch.Tensor, out_dtype: torch.dtype, partials: int) -> float:
    """Bound for a GEMM whose output rounds to `out_dtype` once and whose `partials` partial
    products (gemm_rs, gemm_ar: one per rank) were rounded to it before they were summed, relative to
    the largest |reference|: (4 + partials) u. The fp32 accumulation over K errs far less (fp8
    included: Hopper's fp8 tensor cores keep about 14 bits of a running sum), so a missing or
    misplaced tile, which errs by the values themselves, is always found."""
    return (4 + partials) * _UNIT_ROUNDOFF[out_dtype] * reference.abs().max().item()


def mismatch(actual: torch.Tensor, expected: Expected) -> str | None:
    """None if `actual` is what `expected` says; else the first wrong element and how many are wrong."""
    actual, reference, tolerance = actual.reshape(-1), expected.reference.reshape(-1), expected.tolerance
    if isinstance(tolerance, torch.Tensor):
        tolerance = tolerance.reshape(-1)
    if tolerance is None:
        wrong = bits(actual) != bits(reference)
    else:
        wrong = ~((actual.double() - reference.double()).abs() <= tolerance)  # NaN is wrong
    count = int(wrong.sum().item())
    if count == 0:
        return None
    i = int(wrong.nonzero()[0].item())
    where = f" ({expected.where(i)})" if expected.where else ""
    if tolerance is None:
        width = 2 * actual.element_size()
        mask = (1 << (4 * width)) - 1
        shown = [f"{t[i].item()} (0x{int(bits(t)[i].item()) & mask:0{width}x})" for t in (reference, actual)]
        return f"element {i}{where}: expected {shown[0]}, got {shown[1]}; {count} of {actual.numel()} elements differ"
    bound = tolerance[i].item() if isinstance(tolerance, torch.Tensor) else tolerance
    return (f"element {i}{where}: expected {reference[i].item():.6g} +- {bound:.2g}, got {actual[i].item():.6g}; "
            f"{count} of {actual.numel()} elements off")
