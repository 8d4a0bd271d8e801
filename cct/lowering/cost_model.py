"""Cost model of the lowerings (CcT paper Figure 6), in predicted seconds.

:func:`figure6` gives the paper's analytic quantities for one convolution (lowered matrix
sizes, GEMM flops, lifting flops, RAM read by the lifting), generalized to padding, stride,
dilation, rectangular kernels, groups and batches. :func:`pass_ops` breaks one pass (``fwd``,
``bwd_data``, ``bwd_weights``) of a lowering into the primitive operations the
implementations actually run -- GEMMs of given ``(M, N, K)`` and element-wise copy / add /
zero-fill sweeps -- and :func:`predict_seconds` prices them with the measured constants of a
:class:`Machine` (see :mod:`cct.lowering.calibrate`).

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

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from .geometry import ConvGeometry

PASSES = ("fwd", "bwd_data", "bwd_weights")
KNOWN_TYPES = ("type1", "type2", "type3")


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
    chunk_overhead_s: float = 25e-6  # Python/numpy dispatch of one batch chunk (im2col, GEMMs, lifting calls)
    cache_bytes: int = 0  # last-level cache; 0: detect (sysfs) when pricing
    stream_ns_per_byte: float = 0.0  # extra cost of a byte streamed from DRAM; 0: derive from the copy curve
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

    def elem_seconds(self, kind: str, elems: float, lowering: str | None = None) -> float:
        """Predicted seconds of an element-wise sweep (``copy``, ``add``, ``zero``, or a
        lowering's own ``lower``/``unlower``, per lowered element)."""
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
            ns = {"copy": self.copy_ns, "add": self.add_ns, "zero": self.zero_ns}[kind]
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


_cache_size: int | None = None
# Fraction of the last-level cache one GEMM's operands may count on: the layer's input, output and
# gradient arrays, the other batch partitions and other processes share it (measured on a 2-core
# Zen 5 with 32 MiB L3: chunks of up to ~1/4 of it per partition ran fastest for cifar10_quick).
CACHE_SHARE = 0.5


def detect_cache_bytes() -> int:
    """Size of the last-level CPU cache (sysfs; 8 MiB if unknown)."""
    global _cache_size
    if _cache_size is None:
        best = 0
        import glob

        for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
            try:
                with open(path) as f:
                    txt = f.read().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
                best = max(best, int(txt.rstrip("KMG")) * mult)
            except (OSError, ValueError):
                continue
        _cache_size = best or (8 << 20)
    return _cache_size


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
def lowered_axes(name: str, geom: ConvGeometry) -> tuple[int, ...]:
    """Spatial axes a lowering replicates (type1: all, type2: the last, type3: none)."""
    nd = geom.num_spatial
    if name == "type1":
        return tuple(range(nd))
    if name == "type2":
        return (nd - 1,) if nd else ()
    if name == "type3":
        return ()
    from .base import get_strategy

    strat = get_strategy(name)
    if hasattr(strat, "lowered_axes"):
        return tuple(strat.lowered_axes(geom))
    raise KeyError(f"no cost model for lowering '{name}'")


def _shape_terms(name: str, geom: ConvGeometry, batch: int) -> dict:
    nd = geom.num_spatial
    low = set(lowered_axes(name, geom))
    ext = geom.used_extent
    if name == "type1":
        # type1 pads to max(in + 2p, ext) (im2col's padded copy)
        ext = tuple(max(i + 2 * p, e) for i, p, e in zip(geom.in_shape, geom.pad, ext))
    k_low = math.prod(geom.kernel[i] for i in range(nd) if i in low)
    k_lift = math.prod(geom.kernel[i] for i in range(nd) if i not in low)
    cols = batch * math.prod(geom.out_shape[i] if i in low else ext[i] for i in range(nd))
    return {"g": geom.group, "cg": geom.channels_in // geom.group, "mg": geom.channels_out // geom.group,
            "C": geom.channels_in, "M": geom.channels_out, "k_low": k_low, "k_lift": k_lift, "cols": cols,
            "E": batch * math.prod(ext), "P": batch * geom.out_size, "I": batch * geom.in_size,
            "lifted": len(low) < nd}


def figure6(name: str, geom: ConvGeometry, batch: int = 1) -> dict:
    """The paper's Figure 6 row for one lowering (per group sizes, totals over groups).

    Keys: ``lowered_data`` (rows, cols), ``lowered_kernel`` (rows, cols), ``gemm_output``
    (rows, cols), ``gemm_flops``, ``lifting_flops``, ``lifting_ram_read`` (elements),
    ``lowering_elems`` (elements written by the lowering).
    """
    t = _shape_terms(name, geom, batch)
    g, cg, mg, kl, kf, cols, P = t["g"], t["cg"], t["mg"], t["k_low"], t["k_lift"], t["cols"], t["P"]
    lifting = kf * geom.channels_out * P if t["lifted"] else 0  # the paper counts k (resp. k^2) adds per output
    return {
        "lowered_data": (cg * kl, cols),
        "lowered_kernel": (mg * kf, cg * kl),
        "gemm_output": (mg * kf, cols),
        "gemm_flops": 2 * g * mg * kf * cg * kl * cols,
        "lifting_flops": lifting,
        "lifting_ram_read": g * mg * kf * cols if t["lifted"] else geom.channels_out * P,
        "lowering_elems": t["C"] * kl * cols if kl > 1 or name == "type1" else 0,
    }


def pass_ops(name: str, geom: ConvGeometry, batch: int, pass_: str = "fwd") -> list[tuple]:
    """Primitive operations of one pass: ``("gemm", m, n, k, count)`` and ``(kind, elems)``.

    Kinds: ``copy``/``add``/``zero`` (generic sweeps) and ``lower``/``unlower`` (a lowering's
    own replication and its adjoint, per lowered element, priced from the per-type calibration
    when the Machine has it). Mirrors ``type1.py`` and ``type2.py`` (type 3 = no lowered axis).
    """
    t = _shape_terms(name, geom, batch)
    g, cg, mg, C, M = t["g"], t["cg"], t["mg"], t["C"], t["M"]
    kl, kf, cols, E, P, inp = t["k_low"], t["k_lift"], t["cols"], t["E"], t["P"], t["I"]
    type1 = name == "type1"
    lowered = kl > 1 or type1
    ops: list[tuple] = []

    def lower():
        if lowered:  # padding copy + k_low strided copies (or a compiled im2col), priced per lowered element
            ops.append(("lower", C * kl * cols))
        else:  # type 3: the padded, channel-major copy of the input is the lowered matrix
            ops.append(("copy", C * inp))
            if E != inp:
                ops.append(("zero", C * E))

    def scatter():  # adjoint of the lifting: dy into the (zeroed) GEMM-result layout
        if t["lifted"]:
            ops.append(("zero", g * mg * kf * cols))
            ops.append(("copy", kf * M * P))
        elif batch > 1:
            ops.append(("copy", M * P))  # type 1: dy to group-major (one image's dy already is)

    if pass_ == "fwd":
        lower()
        ops.append(("gemm", mg * kf, cols, cg * kl, g))
        if t["lifted"]:
            ops.append(("copy", M * P))  # first shifted slice (+ bias, fused)
            ops.append(("add", (kf - 1) * M * P))
        else:
            ops.append(("add", M * P))  # type 1: bias add doubles as the transposing lift
    elif pass_ == "bwd_data":
        scatter()
        ops.append(("gemm", cg * kl, cols, mg * kf, g))
        if lowered:
            ops.append(("unlower", C * kl * cols))  # col2im-style accumulation (+ its zeroed buffer)
        if not type1:
            ops.append(("copy", C * inp))  # crop + transpose back to (N, C, ...)
    elif pass_ == "bwd_weights":
        lower()
        scatter()
        ops.append(("gemm", mg * kf, cg * kl, cols, g))
        ops.append(("add", M * P))  # bias reduction
    else:
        raise ValueError(f"unknown pass {pass_!r}: expected one of {PASSES} or 'total'")
    return ops


def predict_breakdown(name: str, geom: ConvGeometry, batch: int, machine: Machine | None = None,
                      pass_: str = "fwd") -> dict:
    """Predicted seconds of one pass split into ``gemm``, ``lowering``/``lifting`` (element-wise)."""
    if machine is None:
        from .calibrate import load_machine

        machine = load_machine(measure_if_missing=False)
    passes = PASSES if pass_ == "total" else (pass_,)
    gemm = elem = 0.0
    stream = getattr(machine, "streaming_seconds", None)
    for p in passes:
        for op in pass_ops(name, geom, batch, p):
            if op[0] == "gemm":
                _, m, n, k, count = op
                gemm += count * machine.gemm_seconds(m, n, k)
                if stream is not None:  # operands bigger than the cache stream from DRAM
                    gemm += stream(4.0 * count * (m * k + k * n + m * n))
            else:
                elem += machine.elem_seconds(op[0], op[1], name)
    return {"gemm": gemm, "elementwise": elem, "total": gemm + elem}


def predict_seconds(name: str, geom: ConvGeometry, batch: int, machine: Machine | None = None,
                    pass_: str = "fwd") -> float:
    """Predicted seconds of ``pass_`` (``fwd``/``bwd_data``/``bwd_weights``/``total``) of a lowering."""
    return predict_breakdown(name, geom, batch, machine, pass_)["total"]


def chunked_seconds(name: str, geom: ConvGeometry, batch: int, bp: int, machine: Machine,
                    pass_: str = "total") -> float:
    """Predicted seconds of ``pass_`` on ``batch`` images run as chunks of ``bp`` images.

    Each chunk is priced at its own size: the element-wise sweeps by the calibrated per-size
    curves (a chunk whose lowered matrix stays in cache sweeps faster than a whole-batch one that
    streams through DRAM), the GEMMs at ``N = bp * P`` (thin GEMMs are slower), plus
    ``machine.chunk_overhead_s`` of dispatch per chunk.
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


def best_batch_partition(name: str, geom: ConvGeometry, batch: int, machine: Machine, pass_: str = "total",
                         max_bp: int | None = None) -> tuple[int, float]:
    """``(b_p, seconds)``: the chunk size with the least predicted time (ties: the larger chunk)."""
    best = None
    for bp in batch_partition_candidates(batch, max_bp):
        t = chunked_seconds(name, geom, batch, bp, machine, pass_)
        if best is None or t <= best[1] * (1 - 1e-9) or (abs(t - best[1]) <= 1e-12 and bp > best[0]):
            best = (bp, t)
    return best if best is not None else (1, 0.0)


def workspace_bytes(name: str, geom: ConvGeometry, batch: int, itemsize: int = 4) -> int:
    """Peak temporary memory (bytes) of one pass of a lowering on ``batch`` images.

    Counted: padded input, lowered data (all groups), one group's GEMM output, and for the
    backward passes the scattered gradient; it grows linearly with ``batch``.
    """
    t = _shape_terms(name, geom, batch)
    lowered = t["C"] * t["k_low"] * t["cols"] if (t["k_low"] > 1 or name == "type1") else 0
    result = t["mg"] * t["k_lift"] * t["cols"]
    return int(itemsize * (t["C"] * t["E"] + lowered + 2 * result + t["M"] * t["P"]))


def describe_ops(name: str, geom: ConvGeometry, batch: int, pass_: str = "fwd") -> str:
    """Human-readable list of the primitive operations (debugging aid)."""
    parts = []
    for op in pass_ops(name, geom, batch, pass_):
        if op[0] == "gemm":
            parts.append(f"{op[4]}x gemm({op[1]}x{op[3]} @ {op[3]}x{op[2]})")
        else:
            parts.append(f"{op[0]} {op[1]:.3g}")
    return "; ".join(parts)


def as_dict(machine: Machine | Any) -> dict:
    """Machine -> dict (for benchmark JSON)."""
    return machine.to_json() if isinstance(machine, Machine) else dict(machine)
