"""NVSHMEM's comparison and signal-operation codes (from its headers, 3.4), as Triton constants;
and the memory-order arguments each lowering accepts."""
import triton.language as tl

CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_GT = tl.constexpr(2)
CMP_LE = tl.constexpr(3)
CMP_LT = tl.constexpr(4)
CMP_GE = tl.constexpr(5)
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)

# What PTX allows on each kind of access: a load cannot release and a store cannot acquire;
# atomics take any of the four. PTX has narrower scopes ("cta", "cluster") too, but a signal
# between ranks needs at least "gpu". `_gpu._check_order` spells out the same sets.
SCOPES = ("gpu", "sys")
SEMANTICS = {"load": ("relaxed", "acquire"), "store": ("relaxed", "release"),
             "atomic": ("relaxed", "acquire", "release", "acq_rel")}
