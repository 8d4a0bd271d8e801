"""Cost model of the convolution strategies, in predicted seconds.

The model knows no strategy by name: every registered strategy declares, per pass (``fwd``,
``bwd_data``, ``bwd_weights``) and batch chunk, the operations it runs (:meth:`pass_ops`, in the
vocabulary of :mod:`cct.lowering.gemm_ops`: GEMMs, complex GEMMs, element-wise sweeps, its own
lowering sweeps, direct-kernel multiply-adds, FFT flops) and its workspace; :func:`price` turns
operations into seconds with the measured constants of a :class:`Machine` (see
:mod:`cct.lowering.calibrate`). :func:`figure6` gives the CcT paper's analytic quantities of a
GEMM lowering.

GEMM throughput is not one number: it depends on the matrix aspect. A Machine holds GFLOPS
measured on two grids, "big N" (``(M, K)`` small/medium, N = the batch*pixel dimension,
forward and data-gradient GEMMs) and "big K" (``(M, N)`` grid, K = batch*pixels, the weight
gradient GEMM), interpolated bilinearly in log space, times a correction for a small "big"
dimension (Caffe-style ``b_p = 1`` GEMMs).

Batch chunks (:func:`chunked_seconds`, :func:`best_batch_partition`): a pass run as chunks of
``b_p`` images is priced chunk by chunk -- sweeps at the chunk's size (the calibrated curves are
per sweep size, so cache-resident sweeps are cheaper), GEMMs at ``N = b_p * P``, GEMM operands
beyond the cache share priced as DRAM streaming (:meth:`Machine.streaming_seconds`), plus a
per-chunk dispatch overhead. :class:`~cct.lowering.partition.BatchedLowering` and the optimizer
pick ``b_p`` (and the number of parallel partitions) by these predictions.
"""
from __future__ import annotations

import functools
import glob
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..config import current
from .base import get_strategy, registry_factory
from .gemm_ops import PASSES
from .geometry import ConvGeometry

# Rates assumed for the direct and FFT kernels until measured (fractions of the GEMM peak: cct's
# register-blocked direct kernels run near the GEMM peak on wide layers, FFT libraries at a few
# GFLOPS per core).
DIRECT_SHARE = 0.5
FFT_SHARE = 0.03
#: points per axis of the planes the two forward-transform rates are measured on (:mod:`.rates`)
FFT_POINTS, FFT_LARGE_POINTS = 18, 36
#: contiguous run length of the calibrated ``copy`` curve's windows (:func:`cct.lowering.calibrate.
#: measure_elementwise`)
WINDOW_RUN = 13


# ----------------------------------------------------------------------------------------------
# machine constants
# ----------------------------------------------------------------------------------------------
@dataclass
class Machine:
    """Measured constants of one machine/BLAS setup (see :mod:`cct.lowering.calibrate`).

    ``grid_dims``: the small dimensions of the GEMM grids; ``gemm_bign[i][j]`` is GFLOPS of
    ``(M=grid_dims[i], K=grid_dims[j])`` with a large N; ``gemm_bigk[i][j]`` of ``(M, N) =
    (grid_dims[i], grid_dims[j])`` with a large K. ``big_curve``: ``[(big, factor)]``, the
    throughput of a ``(256, big, 256)`` GEMM relative to the grid's big size.
    ``*_ns``: nanoseconds per element of the element-wise sweeps (float32).
    """

    grid_dims: list[int]
    gemm_bign: list[list[float]]
    gemm_bigk: list[list[float]]
    big_curve: list[tuple[int, float]] = field(default_factory=list)
    copy_ns: float = 1.0
    add_ns: float = 1.5
    zero_ns: float = 0.3
    elem_curves: dict = field(default_factory=dict)  # kind -> [(elements, ns/element)], by sweep size
    lowering_curves: dict = field(default_factory=dict)  # lowering -> {"lower"|"unlower": [(elements, ns)]}
    gemm_overhead_s: float = 5e-6
    # BatchedLowering's dispatch of one batch chunk beyond the strategy's own call (measured: a few us)
    chunk_overhead_s: float = 25e-6
    partition_overhead_s: float = 30e-6  # handing one batch partition to a worker thread and joining it
    # strategy -> {pass: seconds}: one call of the strategy on a trivial layer (its fixed Python, allocation
    # and kernel-launch cost, which a thin or tiny layer cannot hide); missing: 0
    call_overhead_s: dict = field(default_factory=dict)
    cache_bytes: int = 0  # last-level cache; 0: detect (sysfs) when pricing
    stream_ns_per_byte: float = 0.0  # extra cost of a byte streamed from DRAM; 0: derive from the copy curve
    direct_gflops: float = 0.0  # direct-convolution kernel (2 flops per multiply-add); 0: DIRECT_SHARE of peak
    direct_k3_gflops: float = 0.0  # the same kernel on 3x3 layers (direct_gflops: 5x5); 0: no kernel-width term
    direct_wgrad_gflops: float = 0.0  # its weight-gradient kernel; 0: as direct_gflops
    fft_gflops: float = 0.0  # FFT flops (2.5 n log2 n per complex line); 0: FFT_SHARE of peak
    ifft_gflops: float = 0.0  # the same for the (pruned) inverse transforms; 0: as fft_gflops
    fft_large_gflops: float = 0.0  # forward transforms of FFT_LARGE_POINTS-point planes; 0: as fft_gflops
    threads: int = 1
    backend: str = "openblas"
    kernel: str = ""
    key: str = ""
    nominal: bool = False
    info: dict = field(default_factory=dict)

    # -- GEMM ---------------------------------------------------------------------------
    def gemm_gflops(self, m: int, n: int, k: int) -> float:
        """Predicted GFLOPS of one ``(m, k) @ (k, n)`` GEMM."""
        gn = _interp2(self.grid_dims, self.gemm_bign, m, k) * _interp1(self.big_curve, n)
        gk = _interp2(self.grid_dims, self.gemm_bigk, m, n) * _interp1(self.big_curve, k)
        # n >> k: the "big N" grid describes the shape; k >> n: "big K"; in between (both large)
        # blend the two geometrically (the grids agree there up to measurement noise).
        t = min(1.0, max(0.0, 0.5 + math.log(max(n, 1) / max(k, 1)) / (2 * math.log(8.0))))
        return math.exp(t * math.log(max(gn, 1e-9)) + (1 - t) * math.log(max(gk, 1e-9)))

    def gemm_seconds(self, m: int, n: int, k: int) -> float:
        """Predicted seconds of one GEMM (flops / interpolated throughput + call overhead)."""
        if m <= 0 or n <= 0 or k <= 0:
            return self.gemm_overhead_s
        return 2.0 * m * n * k / (self.gemm_gflops(m, n, k) * 1e9) + self.gemm_overhead_s

    def peak_gflops(self) -> float:
        """The best GEMM throughput of the grids."""
        return max(max(max(r) for r in self.gemm_bign), max(max(r) for r in self.gemm_bigk))

    def direct_seconds(self, macs: float, kernel_width: int | None = None) -> float:
        """Predicted seconds of ``macs`` multiply-adds of the direct-convolution kernels, for a kernel
        ``kernel_width`` taps wide when given: the forward tile's innermost loop runs over a kernel row,
        so its per-row cost is spread over ``kernel_width`` taps. Seconds per multiply-add are
        ``a + b / kernel_width``, fitted through the rates measured on 5x5 (``direct_gflops``) and 3x3
        (``direct_k3_gflops``) layers (a 2-core Zen 3: 1x1 2.5-3.2x and 11x11 0.7x the 5x5 cost)."""
        rate = self.direct_gflops or DIRECT_SHARE * self.peak_gflops()
        per_mac = 2.0 / (rate * 1e9)
        if kernel_width and self.direct_gflops and self.direct_k3_gflops:
            k3 = 2.0 / (self.direct_k3_gflops * 1e9)
            b = (k3 - per_mac) / (1.0 / 3.0 - 1.0 / 5.0)
            per_mac = max(0.25 * per_mac, per_mac + b * (1.0 / min(16, max(1, kernel_width)) - 0.2))
        return float(macs) * per_mac + (self.gemm_overhead_s if macs else 0.0)

    def fft_seconds(self, flops: float, inverse: bool = False, points: int | None = None) -> float:
        """Predicted seconds of FFT work of ``flops`` (nominal ``2.5 n log2 n`` per line); ``inverse``: of
        inverse transforms, at their own rate when measured. Forward transforms of ``points`` points per
        axis run at a rate interpolated in ``log(points)`` between ``fft_gflops`` (FFT_POINTS) and
        ``fft_large_gflops`` (FFT_LARGE_POINTS), held outside (a 2-core Zen 3: 2.9-3.1 GFLOPS at 18
        points, 4.0-4.5 at 36 and 64: small transforms pay more per line)."""
        rate = (inverse and self.ifft_gflops) or self.fft_gflops or FFT_SHARE * self.peak_gflops()
        if not inverse and points and self.fft_gflops and self.fft_large_gflops:
            t = min(1.0, max(0.0, math.log(points / FFT_POINTS) / math.log(FFT_LARGE_POINTS / FFT_POINTS)))
            rate = math.exp((1 - t) * math.log(self.fft_gflops) + t * math.log(self.fft_large_gflops))
        return float(flops) / (rate * 1e9) + (self.gemm_overhead_s if flops else 0.0)

    def cgemm_seconds(self, m: int, n: int, k: int, count: int) -> float:
        """Predicted seconds of ``count`` complex GEMMs ``(m, k) @ (k, n)`` (one stacked matmul on operands
        laid out for BLAS): each the work of one real GEMM ``(m, 2k) @ (2k, 2n)`` (a complex element is a
        2x2 real block; the same ``8 m n k`` flops), at the grids' rate for that shape. (Priced as four
        separate ``(m, k) @ (k, n)`` GEMMs they came out twice the measured time: the complex kernel
        runs them as one.)"""
        if count <= 0 or m <= 0 or n <= 0 or k <= 0:
            return 0.0
        return count * (self.gemm_seconds(m, 2 * n, 2 * k) - self.gemm_overhead_s) + self.gemm_overhead_s

    def elem_seconds(self, kind: str, elems: float, lowering: str | None = None, run: int = 0) -> float:
        """Predicted seconds of an element-wise sweep (``copy``, ``add``, ``zero``, or a
        lowering's own ``lower``/``unlower``, per lowered element).

        ``run``: for a ``copy``, the length of its contiguous runs, when the strategy knows it. The
        ``copy`` curve is measured on :data:`WINDOW_RUN`-element runs and the ``stream`` curve on
        long ones; a run of ``L`` pays the stream rate plus the window's per-run excess scaled by
        ``WINDOW_RUN / L``. Without a run (or a stream curve) the window curve prices it."""
        if kind == "copy" and run and self.elem_curves.get("stream") and self.elem_curves.get("copy"):
            x = max(float(elems), 1.0)
            stream = _interp1(self.elem_curves["stream"], x)
            window = _interp1(self.elem_curves["copy"], x)
            return elems * (stream + max(window - stream, 0.0) * WINDOW_RUN / max(run, 1)) * 1e-9
        if kind in ("lower", "unlower"):
            curve = self.lowering_curves.get(lowering or "", {}).get(kind)
            if curve:
                return elems * _interp1(curve, max(float(elems), 1.0)) * 1e-9
            if kind == "lower":  # generic: one strided copy per lowered element
                return self.elem_seconds("copy", elems)
            return self.elem_seconds("add", elems) + self.elem_seconds("zero", elems)
        curve = self.elem_curves.get(kind)
        if curve:
            ns = _interp1(curve, max(float(elems), 1.0))
        else:
            ns = {"add": self.add_ns, "zero": self.zero_ns}.get(kind, self.copy_ns)
        return elems * ns * 1e-9

    def streaming_seconds(self, working_set_bytes: float) -> float:
        """Extra seconds of a GEMM whose operands (``working_set_bytes``) exceed the cache.

        The GEMM grids are measured on operands that stay cache-resident between repeats; a
        whole-batch lowered matrix larger than the last-level cache is streamed from DRAM once
        more by the GEMM. Priced per byte beyond the cache at the DRAM streaming rate.
        """
        cache = (self.cache_bytes or detect_cache_bytes()) * CACHE_SHARE
        over = float(working_set_bytes) - cache
        if over <= 0:
            return 0.0
        ns = self.stream_ns_per_byte or _stream_ns_from_curves(self)
        return over * ns * 1e-9

    # -- persistence ----------------------------------------------------------------------
    def to_json(self) -> dict:
        """JSON-serializable dict (inverse of :meth:`from_json`)."""
        d = asdict(self)
        d["big_curve"] = [list(p) for p in self.big_curve]
        d["elem_curves"] = {k: [list(p) for p in v] for k, v in self.elem_curves.items()}
        d["lowering_curves"] = {n: {k: [list(p) for p in v] for k, v in c.items()}
                                for n, c in self.lowering_curves.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> Machine:
        """Rebuild a Machine from :meth:`to_json` output."""
        d = dict(d)
        d["big_curve"] = [tuple(p) for p in d.get("big_curve", [])]
        d["elem_curves"] = {k: [tuple(p) for p in v] for k, v in d.get("elem_curves", {}).items()}
        d["lowering_curves"] = {n: {k: [tuple(p) for p in v] for k, v in c.items()}
                                for n, c in d.get("lowering_curves", {}).items()}
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


# Fraction of the last-level cache one GEMM's operands may count on: the layer's input, output and
# gradient arrays, the other batch partitions and other processes share it (measured on a 2-core
# Zen 5 with 32 MiB L3: chunks of up to ~1/4 of it per partition ran fastest for cifar10_quick).
CACHE_SHARE = 0.5


@functools.cache
def detect_cache_bytes() -> int:
    """Size of the last-level CPU cache (sysfs; 8 MiB if unknown): a fact about the machine, read once per
    process."""
    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                txt = f.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
        except (OSError, ValueError):
            continue
    return best or (8 << 20)


def _stream_ns_from_curves(machine: Machine) -> float:
    """ns per byte of DRAM streaming: the copy curve's rise from cache-sized to DRAM-sized sweeps
    (a copy moves 8 bytes per float32 element); 0.03 ns/byte (~33 GB/s) without curves."""
    curve = sorted(machine.elem_curves.get("copy") or [])
    if len(curve) >= 2:
        return max(0.0, (curve[-1][1] - min(v for _, v in curve)) / 8.0) or 0.01
    return 0.03


def nominal_machine(gflops: float = 100.0) -> Machine:
    """An unmeasured machine: flat GEMM throughput, with the usual small-dimension falloff."""
    dims = [4, 16, 64, 256, 1024, 4096]

    def eff(a: int) -> float:
        return a / (a + 24.0)

    bign = [[gflops * eff(m) * eff(k) for k in dims] for m in dims]
    return Machine(grid_dims=dims, gemm_bign=bign, gemm_bigk=[row[:] for row in bign],
                   big_curve=[(16, 0.3), (128, 0.7), (1024, 0.95), (8192, 1.0)], nominal=True)


def _interp1(curve, x: float) -> float:
    if not curve:
        return 1.0
    pts = sorted(curve)
    if x <= pts[0][0]:
        return float(pts[0][1])
    if x >= pts[-1][0]:
        return float(pts[-1][1])
    lx = math.log(x)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            t = (lx - math.log(x0)) / (math.log(x1) - math.log(x0))
            return math.exp((1 - t) * math.log(y0) + t * math.log(y1))
    return float(pts[-1][1])  # pragma: no cover


def _axis_pos(dims, v: float) -> tuple[int, int, float]:
    lv = math.log(max(v, 1e-9))
    if v <= dims[0]:
        return 0, 0, 0.0
    if v >= dims[-1]:
        n = len(dims) - 1
        return n, n, 0.0
    for i in range(len(dims) - 1):
        if dims[i] <= v <= dims[i + 1]:
            t = (lv - math.log(dims[i])) / (math.log(dims[i + 1]) - math.log(dims[i]))
            return i, i + 1, t
    return len(dims) - 1, len(dims) - 1, 0.0  # pragma: no cover


def _interp2(dims, grid, a: float, b: float) -> float:
    """Bilinear interpolation of ``log(grid)`` over ``(log a, log b)``, clamped at the edges."""
    i0, i1, ta = _axis_pos(dims, a)
    j0, j1, tb = _axis_pos(dims, b)

    def lg(i, j):
        return math.log(max(grid[i][j], 1e-6))

    v = ((1 - ta) * (1 - tb) * lg(i0, j0) + ta * (1 - tb) * lg(i1, j0)
         + (1 - ta) * tb * lg(i0, j1) + ta * tb * lg(i1, j1))
    return math.exp(v)


# ----------------------------------------------------------------------------------------------
# analytic model
# ----------------------------------------------------------------------------------------------
def strategy(name: str) -> Any:
    """The registered strategy ``name`` (one shared instance per name, for pricing only)."""
    factory = registry_factory(name)
    priced = current().caches.priced
    hit = priced.get(name)
    if hit is None or hit[0] is not factory:
        hit = priced[name] = (factory, get_strategy(name))
    return hit[1]




def lowered_axes(name: str, geom: ConvGeometry) -> tuple[int, ...]:
    """Spatial axes a GEMM lowering replicates (type1: all, type2: the last, type3: none)."""
    strat = strategy(name)
    if not hasattr(strat, "lowered_axes"):
        raise KeyError(f"'{name}' is not a GEMM lowering")
    return tuple(strat.lowered_axes(geom))


def figure6(name: str, geom: ConvGeometry, batch: int = 1) -> dict:
    """The paper's Figure 6 row of a GEMM lowering (:meth:`cct.lowering.gemm_ops.LoweringShape.figure6`)."""
    strat = strategy(name)
    if not hasattr(strat, "shape"):
        raise KeyError(f"'{name}' is not a GEMM lowering")
    return strat.shape(geom, batch).figure6()


def pass_ops(name: str, geom: ConvGeometry, batch: int, pass_: str = "fwd") -> list[tuple]:
    """The operations strategy ``name`` declares for one pass on ``batch`` images (its ``pass_ops``)."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}: expected one of {PASSES} or 'total'")
    return strategy(name).pass_ops(geom, batch, pass_)


def price(ops: list[tuple], machine: Machine, lowering: str | None = None) -> dict:
    """Seconds of a list of operations on ``machine``: ``{"gemm", "elementwise", "direct", "fft", "total"}``.

    GEMMs by the interpolated grids (plus DRAM streaming of operands beyond the cache), complex
    GEMMs by their measured rate, sweeps by the calibrated curves (``lower``/``unlower`` by
    ``lowering``'s own), direct-kernel multiply-adds and FFT flops by their calibrated rates.
    """
    out = {"gemm": 0.0, "elementwise": 0.0, "direct": 0.0, "fft": 0.0}
    stream = getattr(machine, "streaming_seconds", None)
    for op in ops:
        kind = op[0]
        if kind == "gemm":
            _, m, n, k, count = op
            if count <= 0:
                continue
            out["gemm"] += count * machine.gemm_seconds(m, n, k)
            if stream is not None:  # operands bigger than the cache stream from DRAM
                out["gemm"] += stream(4.0 * count * (m * k + k * n + m * n))
        elif kind == "cgemm":
            _, m, n, k, count = op
            out["gemm"] += machine.cgemm_seconds(m, n, k, count)
            if stream is not None:
                out["gemm"] += stream(8.0 * count * (m * k + k * n + m * n))
        elif kind == "direct":  # ("direct", multiply-adds[, kernel width])
            out["direct"] += machine.direct_seconds(op[1], op[2] if len(op) > 2 else None)
        elif kind == "direct_wgrad":
            rate = machine.direct_wgrad_gflops
            out["direct"] += 2.0 * op[1] / (rate * 1e9) if rate else machine.direct_seconds(op[1])
        elif kind in ("fft", "ifft"):
            out["fft"] += machine.fft_seconds(op[1], inverse=kind == "ifft", points=op[2] if len(op) > 2 else None)
        else:
            out["elementwise"] += machine.elem_seconds(kind, op[1], lowering, *op[2:])
    out["total"] = sum(out.values())
    return out


def predict_breakdown(name: str, geom: ConvGeometry, batch: int, machine: Machine, pass_: str = "fwd") -> dict:
    """Predicted seconds of one pass (or ``total``) of strategy ``name`` on ``machine``, split as
    :func:`price` does."""
    passes = PASSES if pass_ == "total" else (pass_,)
    parts = [price(pass_ops(name, geom, batch, p), machine, name) for p in passes]
    out = {k: sum(p[k] for p in parts) for k in parts[0]}
    fixed = getattr(machine, "call_overhead_s", None) or {}
    out["overhead"] = sum(fixed.get(name, {}).get(p, 0.0) for p in passes)
    out["total"] += out["overhead"]
    return out


def predict_seconds(name: str | Mapping[str, str], geom: ConvGeometry, batch: int, machine: Machine,
                    pass_: str = "fwd") -> float:
    """Predicted seconds of ``pass_`` (``fwd``/``bwd_data``/``bwd_weights``/``total``) of a strategy, or of
    a per-pass mapping ``{pass: name}`` (``total`` then sums each pass's own strategy, over the passes
    the mapping names)."""
    if isinstance(name, Mapping):  # a mapping may name only the passes a layer runs
        passes = [p for p in PASSES if p in name] if pass_ == "total" else (pass_,)
        return sum(predict_breakdown(name[p], geom, batch, machine, p)["total"] for p in passes)
    return predict_breakdown(name, geom, batch, machine, pass_)["total"]


def chunked_seconds(name: str | Mapping[str, str], geom: ConvGeometry, batch: int, bp: int, machine: Machine,
                    pass_: str = "total") -> float:
    """Predicted seconds of ``pass_`` on ``batch`` images run as chunks of ``bp`` images.

    Each chunk is priced at its own size: the element-wise sweeps by the calibrated per-size
    curves (a chunk whose lowered matrix stays in cache sweeps faster than a whole-batch one that
    streams through DRAM), the GEMMs at ``N = bp * P`` (thin GEMMs are slower), plus
    ``machine.chunk_overhead_s`` of dispatch per chunk. ``name``: a strategy or ``{pass: name}``.
    """
    bp = max(1, min(int(bp), max(int(batch), 1)))
    full, rem = divmod(max(int(batch), 0), bp)
    over = getattr(machine, "chunk_overhead_s", 0.0)
    t = full * (predict_seconds(name, geom, bp, machine, pass_) + over) if full else 0.0
    if rem:
        t += predict_seconds(name, geom, rem, machine, pass_) + over
    return t


def batch_partition_candidates(batch: int, max_bp: int | None = None) -> list[int]:
    """The ``b_p`` values worth pricing: powers of two, ``ceil(batch / k)`` for small k, and ``max_bp``."""
    top = max(1, min(int(max_bp) if max_bp else int(batch), int(batch) if batch else 1))
    cands = {top}
    v = 1
    while v < top:
        cands.add(v)
        v *= 2
    for k in range(1, 9):
        c = -(-int(batch) // k) if batch else 1
        if 1 <= c <= top:
            cands.add(c)
    return sorted(cands)


def best_batch_partition(name: str | Mapping[str, str], geom: ConvGeometry, batch: int, machine: Machine,
                         pass_: str = "total", max_bp: int | None = None) -> tuple[int, float]:
    """``(b_p, seconds)``: the chunk size with the least predicted time (ties: the larger chunk). The one
    chooser of ``b_p``: the optimizer and :class:`~cct.lowering.partition.BatchedLowering` both call it."""
    best = None
    for bp in batch_partition_candidates(batch, max_bp):
        t = chunked_seconds(name, geom, batch, bp, machine, pass_)
        if best is None or t <= best[1] * (1 + 1e-12):  # candidates ascend: a tie goes to the larger chunk
            best = (bp, t)
    return best if best is not None else (1, 0.0)


def workspace_bytes(name: str, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
    """Peak temporary bytes of one pass of strategy ``name`` on ``batch`` images (its ``workspace_bytes``)."""
    return int(strategy(name).workspace_bytes(geom, batch, itemsize))


def as_dict(machine: Machine | Any) -> dict:
    """Machine -> dict (for benchmark JSON)."""
    return machine.to_json() if isinstance(machine, Machine) else dict(machine)
