"""The vector width and tile shapes of the direct-convolution micro-kernels on this CPU.

:mod:`cct.kernels.conv_simd` keeps its accumulators in vector registers for a whole reduction, so its
tiles must fit the register file: 24 accumulators of 64 bytes on AVX-512 (32 ``zmm`` registers), 12
of 32 bytes on AVX2 and older (16 ``ymm`` registers; 64-byte vectors there are split in two by LLVM and
the 24 accumulators spill: the forward kernel ran at 48 GFLOPS against 150 for a GEMM on a 2-core Zen 3).
The width follows the CPU that LLVM (numba) compiles for. Read by the kernels and, without importing
numba, by the cost model's tile arithmetic (:mod:`cct.lowering.direct_layout`).
"""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def host_vector_bytes() -> int:
    """64 where the host CPU has AVX-512F, else 32."""
    try:
        from llvmlite import binding as llvm

        return 64 if llvm.get_host_cpu_features().get("avx512f") else 32
    except Exception:  # noqa: BLE001 -- no llvmlite (no numba): the kernels do not run at all
        return 32


def forward_rows(vector_bytes: int) -> dict[int, int]:
    """Forward tiles: output channels -> position vectors (``J * rows`` accumulators)."""
    return {8: 3, 4: 6, 2: 12} if vector_bytes >= 64 else {4: 3, 2: 6, 1: 12}


def wgrad_channels(vector_bytes: int) -> dict[int, int]:
    """Weight-gradient tiles: kernel columns -> input channels (``WGRAD_VECTORS * channels * columns``
    accumulators)."""
    acc = accumulators(vector_bytes) // WGRAD_VECTORS
    return {cols: max(1, acc // cols) for cols in range(1, WGRAD_COLUMNS + 1)}


def accumulators(vector_bytes: int) -> int:
    """Accumulator registers a tile may hold."""
    return 24 if vector_bytes >= 64 else 12


#: output-channel vectors per weight-gradient tile
WGRAD_VECTORS = 2
#: the widest kernel-column chunk of a weight-gradient tile
WGRAD_COLUMNS = 6
