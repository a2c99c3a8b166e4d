"""A copy torch has no call for: a strided 2-D copy on the copy engines.

torch copies a strided view with a kernel on the SMs. ag_gemm sends a shard to its peers column
block by column block while its GEMM holds every SM, so it asks the CUDA driver for one
cuMemcpy2DAsync per block instead: a copy engine walks the rows.
"""
import ctypes
import functools

import torch

_MEMORY_DEVICE = 2  # CU_MEMORYTYPE_DEVICE


class _Copy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (v2) of cuda.h."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


@functools.cache
def _memcpy_2d_async():
    function = ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2
    function.argtypes = [ctypes.POINTER(_Copy2D), ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


def copy_2d(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for 2-D tensors of one shape and dtype whose rows are contiguous (rows may be
    any distance apart), queued on the current stream (captured into a CUDA graph like any copy).
    On GPUs the copy engines do it, also into a peer's memory (`tridist.peer_tensor`)."""
    if dst.dim() != 2 or dst.shape != src.shape or dst.dtype != src.dtype or \
            (dst.numel() and (dst.stride(1) != 1 or src.stride(1) != 1)):
        raise ValueError(f"copy_2d takes 2-D tensors of one shape and dtype with contiguous rows; got {src.dtype} "
                         f"{tuple(src.shape)} strides {src.stride()} -> {dst.dtype} {tuple(dst.shape)} strides {dst.stride()}")
    if not dst.is_cuda:
        dst.copy_(src)
        return
    if dst.numel() == 0:
        return
    itemsize = dst.element_size()
    copy = _Copy2D(srcMemoryType=_MEMORY_DEVICE, srcDevice=src.data_ptr(), srcPitch=src.stride(0) * itemsize,
                   dstMemoryType=_MEMORY_DEVICE, dstDevice=dst.data_ptr(), dstPitch=dst.stride(0) * itemsize,
                   WidthInBytes=dst.shape[1] * itemsize, Height=dst.shape[0])
    result = _memcpy_2d_async()(ctypes.byref(copy), ctypes.c_void_p(torch.cuda.current_stream(dst.device).cuda_stream))
    if result != 0:
        raise RuntimeError(f"cuMemcpy2DAsync failed (CUresult {result}) copying {tuple(src.shape)} {src.dtype}")
