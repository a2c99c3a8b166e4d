"""NVSHMEM's comparison and signal-operation codes (from its headers, 3.4), as Triton constants."""
import triton.language as tl

CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_GT = tl.constexpr(2)
CMP_LE = tl.constexpr(3)
CMP_LT = tl.constexpr(4)
CMP_GE = tl.constexpr(5)
SIGNAL_SET = tl.constexpr(9)
SIGNAL_ADD = tl.constexpr(10)
