"""MKL's packed float32 product, from the MKL that torch itself carries: a weight packed once
(``cblas_sgemm_pack``) and multiplied at any row count (``cblas_sgemm_compute``).

Why.  Stock float32 ``nn.Linear`` on a CPU goes to MKL's ``sgemm``, which repacks the whole weight
at every call of two rows or more: held to AVX2, a 2-row product of SmolLM2's layers costs twice a
1-row one, which is what keeps tree verification from paying on processors without bf16 units.
A weight packed once removes that.  torch exposes MKL's packing only as
``torch.ops.mkl._mkl_linear``, which takes a weight packed for one row count and falls back to the
stock product at every other, so one packed copy per row count would be needed (5 copies of the
model for 5 widths).  Called directly, one copy serves every row count: packed for
:data:`PACK_ROWS` rows, it multiplies 1 to 64 rows as fast as a copy packed for each (measured on a
Xeon, free and held to AVX2).  MKL documents the packed format for the dimensions it was packed
with; every product computed with it here is checked bit for bit against the one-row product, at
every width a call can have, before it is used (:func:`probe_mtp.kernels.choose_row_plan`), so a
library where another row count computed differently would be refused, not trusted.

Loaded with ``ctypes`` from torch's own ``libtorch_cpu`` (MKL is linked into it on x86 Linux and
Windows builds, with the same thread count as torch); where the library or its symbols are
absent (macOS, ARM, a torch built without MKL) :func:`available` is False and float32 layers keep
oneDNN's packing or the stock product.
"""

from __future__ import annotations

import ctypes
import glob
import os
from functools import lru_cache
from typing import NamedTuple

import torch

# the row count a weight is packed for: products of 1 to 64 rows with a copy packed for 64 ran as
# fast as with a copy packed for their own count (a copy packed for 2 ran 1.7x slower at 64 rows)
PACK_ROWS = 64

# CBLAS enumerations
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162


class _Functions(NamedTuple):
    get_size: ctypes._CFuncPtr
    pack: ctypes._CFuncPtr
    compute: ctypes._CFuncPtr


def _library_paths() -> list[str]:
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    names = ("libtorch_cpu.so", "libtorch_cpu.dylib", "torch_cpu.dll")
    return [path for name in names for path in glob.glob(os.path.join(folder, name))]


@lru_cache(maxsize=1)
def _functions() -> _Functions | None:
    """The three CBLAS functions from torch's MKL, or None where they cannot be found."""
    if not torch.backends.mkl.is_available():
        return None
    for path in _library_paths():
        try:
            library = ctypes.CDLL(path)
            get_size, pack, compute = (library.cblas_sgemm_pack_get_size, library.cblas_sgemm_pack,
                                       library.cblas_sgemm_compute)
        except (OSError, AttributeError):
            continue
        integer, pointer = ctypes.c_int, ctypes.c_void_p
        get_size.restype, get_size.argtypes = ctypes.c_size_t, [integer] * 4
        pack.restype = None
        pack.argtypes = [integer] * 6 + [ctypes.c_float, pointer, integer, pointer]
        compute.restype = None
        compute.argtypes = [integer] * 6 + [pointer, integer, pointer, integer, ctypes.c_float, pointer, integer]
        return _Functions(get_size, pack, compute)
    return None


def available() -> bool:
    """Whether MKL's packed float32 product can be called here."""
    return _functions() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (float32 ``[out, in]`` on the CPU) packed by MKL: an opaque byte buffer, valid
    only at the address it was written to (never copy it: pack the weight again instead)."""
    functions = _functions()
    if functions is None:
        raise RuntimeError("MKL's packed product is not available in this torch")
    weight = weight.detach().contiguous()
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"MKL packs float32 [out, in] weights on the CPU, not {weight.dtype} {tuple(weight.shape)} "
                         f"on {weight.device}")
    out_features, in_features = weight.shape
    size = functions.get_size(_B_MATRIX, PACK_ROWS, out_features, in_features)
    packed = torch.empty(size, dtype=torch.uint8, device=weight.device)
    functions.pack(_ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS, out_features, in_features, 1.0, weight.data_ptr(),
                   in_features, packed.data_ptr())
    return packed


def product(x2d: torch.Tensor, packed: torch.Tensor, out_features: int,
            bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x2d @ weight.T (+ bias)`` for float32 rows ``x2d`` (``[M, in]``, contiguous) and a weight
    packed by :func:`pack`; the bias is added after the product, row by row."""
    rows, in_features = x2d.shape
    if x2d.dtype != torch.float32 or x2d.device.type != "cpu" or not x2d.is_contiguous():
        raise ValueError(f"MKL multiplies contiguous float32 rows on the CPU, not {x2d.dtype} on {x2d.device}")
    out = torch.empty(rows, out_features, dtype=torch.float32, device=x2d.device)
    if rows:
        _functions().compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, out_features, in_features, x2d.data_ptr(),
                             in_features, packed.data_ptr(), in_features, 0.0, out.data_ptr(), out_features)
    return out if bias is None else out.add_(bias)
