"""NVSHMEM's comparison and signal-operation codes (from its headers, 3.4), as Triton constants;
and the memory-order arguments each lowering accepts."""
import triton.language as tl

CMP_EQ = tl.constexpr(0)
"""`signal_wait_until` comparison: the word equals the value."""
CMP_NE = tl.constexpr(1)
"""`signal_wait_until` comparison: the word differs from the value."""
CMP_GT = tl.constexpr(2)
"""`signal_wait_until` comparison: the word is greater than the value."""
CMP_LE = tl.constexpr(3)
"""`signal_wait_until` comparison: the word is at most the value."""
CMP_LT = tl.constexpr(4)
"""`signal_wait_until` comparison: the word is less than the value."""
CMP_GE = tl.constexpr(5)
"""`signal_wait_until` comparison: the word is at least the value (for signals that only grow:
"this call or a later one")."""
SIGNAL_SET = tl.constexpr(9)
"""Signal operation of `putmem_signal` and `signal_op`: set the word to the value."""
SIGNAL_ADD = tl.constexpr(10)
"""Signal operation of `putmem_signal` and `signal_op`: add the value to the word."""

# What PTX allows on each kind of access: a load cannot release and a store cannot acquire;
# atomics take any of the four. PTX has narrower scopes ("cta", "cluster") too, but a signal
# between ranks needs at least "gpu". `_gpu._check_order` spells out the same sets.
SCOPES = ("gpu", "sys")
SEMANTICS = {"load": ("relaxed", "acquire"), "store": ("relaxed", "release"),
             "atomic": ("relaxed", "acquire", "release", "acq_rel")}
