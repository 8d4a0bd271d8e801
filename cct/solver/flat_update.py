"""One fused update over the flat parameter buffers (:mod:`cct.net.flat_params`): clip scale, ``iter_size``
normalisation, L1/L2 regularisation (``weight_decay * decay_mult``), the solver's rule (``rate * lr_mult``)
and Net::Update's ``data -= diff``, for every parameter at once.

The values that change between iterations (the policy rate, Adam's bias correction, the clip scale) are
read from a small array of the buffers' dtype and array module, :class:`Scalars`, that the solver writes
between iterations (:meth:`FlatUpdate.write_scalars`); the pass itself (:meth:`FlatUpdate.run`) reads nothing
back to the host, so a captured CUDA graph replays it with the current iteration's values.

* CuPy: one ``cupy.ElementwiseKernel`` per rule and regularisation (:func:`cupy_kernel`). Each element finds
  its parameter by binary search in the segment table (no per-element multiplier arrays) and does the
  per-parameter path's arithmetic in the same order with round-to-nearest intrinsics (no FMA contraction).
  Gradient clipping computes the global L2 norm and the scale on the device (:meth:`FlatUpdate.clip_on_device`).
* numpy: :func:`numpy_update`, the same arithmetic as whole-buffer array operations with per-element
  ``lr_mult``/``decay`` arrays (allocated at setup): the same bits as the per-parameter path
  (:mod:`cct.solver.updates`). On the CPU the solver uses it only where it is faster than the per-parameter
  path (see :meth:`cct.solver.solver.Solver.flat_path`).

Rules and notation as :mod:`cct.solver.updates`; ``rule`` is one of :data:`RULES`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from ..errors import SolverError
from ..net.flat_params import FlatGroup, FlatParams
from .updates import adam_correction

log = logging.getLogger("cct")

#: the rules a flat update implements, and how many history buffers each keeps
RULES = {"sgd": 1, "nesterov": 1, "adagrad": 1, "rmsprop": 1, "adadelta": 2, "adam": 2}

# slots of the scalar array
RATE, MOMENTUM, MOMENTUM2, DELTA, CORRECTION, NORM, CLIP = range(7)
N_SCALARS = 8  # one spare: the array is 32 bytes in float32


@dataclass
class Hyper:
    """The solver parameters a rule needs (host values, fixed for a run). ``momentum`` is SGD's momentum,
    AdaDelta's decay and Adam's beta1; ``momentum2`` Adam's beta2 and RMSProp's ``rms_decay``."""

    momentum: float = 0.0
    momentum2: float = 0.0
    delta: float = 0.0
    iter_size: int = 1
    clip: float = -1.0
    regularization: str = "L2"


class FlatUpdate:
    """The fused update of one solver over a net's :class:`FlatParams`: per group its history buffers, its
    segment tables (CuPy) or per-element multipliers (numpy), its scalar array and its kernel.

    ``lr_mult``/``decay_mult`` are indexed by learnable param id; ``weight_decay`` is the solver's.
    ``history_buffers[k][g]``: history set k of group g (:meth:`FlatParams.histories`; the solver's
    per-parameter ``history`` arrays are views of them). Allocates at construction (setup)."""

    def __init__(self, flat: FlatParams, rule: str, hyper: Hyper, weight_decay: float,
                 lr_mult: list[float], decay_mult: list[float], history_buffers: list[list]):
        if rule not in RULES:
            raise SolverError(f"flat update: unknown rule '{rule}' (known: {', '.join(RULES)})")
        if hyper.regularization not in ("L1", "L2"):
            raise SolverError(f"solver: Unknown regularization type: \"{hyper.regularization}\" (use L2 or L1)")
        self.flat = flat
        self.rule = rule
        self.hyper = hyper
        if len(history_buffers) != RULES[rule]:
            raise SolverError(f"flat update: rule '{rule}' keeps {RULES[rule]} history set(s), "
                              f"{len(history_buffers)} given")
        self.history_buffers = history_buffers
        self.groups: list[_GroupState] = []
        for gi, g in enumerate(flat.groups):
            dt = g.dtype.type
            local_decay = [dt(weight_decay) * dt(m) for m in decay_mult]
            hist = [self.history_buffers[k][gi] for k in range(RULES[rule])]
            self.groups.append(_GroupState(g, hist, g.xp.zeros(N_SCALARS, dtype=g.dtype), lr_mult, local_decay,
                                           rule, hyper.regularization))
        device = [g.device.is_gpu for g in flat.groups]
        self.on_device = any(device)
        #: device clipping record: the last clipped iteration's norm and scale, and how many iterations were
        #: clipped since :meth:`clip_report` last read them (0-d arrays of the first group's dtype; None
        #: without clipping or on the CPU, where clipping logs as it happens)
        self.clip_norm = self.clip_scale = self.clip_count = None
        if hyper.clip >= 0 and self.on_device:
            g0 = self.groups[0]
            xp, dt = g0.group.xp, g0.group.dtype
            self.clip_norm, self.clip_scale = xp.zeros((), dt), xp.ones((), dt)
            self.clip_count = xp.zeros((), np.int64)
            self._sumsq = cupy_sumsq_kernel()

    # -- between iterations (host) -------------------------------------------------------------------
    def write_scalars(self, rate: float, it: int) -> None:
        """Write the iteration's scalars (host -> the small arrays; outside a captured graph): the policy
        ``rate``, the hyper-parameters and Adam's bias correction for iteration ``it``."""
        h = self.hyper
        for st in self.groups:
            dt = st.group.dtype.type
            values = np.zeros(N_SCALARS, dtype=st.group.dtype)
            values[RATE] = dt(rate)
            values[MOMENTUM] = dt(h.momentum)
            values[MOMENTUM2] = dt(h.momentum2)
            values[DELTA] = dt(h.delta)
            values[CORRECTION] = adam_correction(it, h.momentum, h.momentum2, dt) if self.rule == "adam" else 1
            values[NORM] = dt(dt(1) / dt(h.iter_size))
            values[CLIP] = 1
            st.group.device.upload(values, out=st.scalars)

    # -- the iteration's pass (no host read) --------------------------------------------------------------
    def clip_on_device(self) -> None:
        """Global L2 norm of the gradients and the clip scale, computed on the device into the scalar
        arrays' CLIP slot (Caffe's ClipGradients; the log line comes from :meth:`clip_report`)."""
        g0 = self.groups[0].group
        xp, dt = g0.xp, g0.dtype
        sumsq = None
        for st in self.groups:
            part = self._sumsq(st.group.diff)  # in double, without cuBLAS (capturable)
            sumsq = part if sumsq is None else sumsq + part
        norm = xp.sqrt(sumsq).astype(dt)
        clip = dt.type(self.hyper.clip)
        over = norm > clip
        scale = xp.where(over, clip / norm, dt.type(1)).astype(dt)
        self.clip_norm[...] = xp.where(over, norm, self.clip_norm)  # the last clipped iteration's
        self.clip_scale[...] = xp.where(over, scale, self.clip_scale)
        self.clip_count += over.astype(np.int64)
        for st in self.groups:
            st.scalars[CLIP] = scale.astype(st.group.dtype)

    def run(self, apply: bool = True) -> None:
        """The fused pass over every group: with ``apply`` also ``data -= update``. On the device with
        clipping on, first :meth:`clip_on_device`."""
        if self.clip_norm is not None:
            self.clip_on_device()
        for st in self.groups:
            st.run(self.hyper, apply)

    def clip_report(self) -> tuple[float, float, int] | None:
        """(norm, scale, iterations clipped) since the last call when clipping happened on the device, else
        None; resets the count. A host read: call it at a boundary."""
        if self.clip_count is None:
            return None
        count = int(self.clip_count)
        if not count:
            return None
        norm, scale = float(self.clip_norm), float(self.clip_scale)
        self.clip_count[...] = 0
        return norm, scale, count


class _GroupState:
    """One :class:`FlatGroup`'s update state: history buffers, scalars, multipliers and kernel."""

    def __init__(self, group: FlatGroup, history: list, scalars, lr_mult: list[float], local_decay: list,
                 rule: str, regularization: str):
        self.group = group
        self.history = history
        self.scalars = scalars
        self.rule = rule
        self.regularization = regularization
        self.has_decay = any(local_decay[p] != 0 for p in group.param_ids)
        if group.device.is_gpu:
            self.kernel = cupy_kernel(rule, regularization, group.dtype)
            self.starts, self.ends = group.segment_starts(), group.segment_ends()
            self.seg_lr = group.per_segment(lr_mult)
            self.seg_decay = group.per_segment(local_decay)
        else:
            self.kernel = None
            self.lr_mult = group.per_element(lr_mult)
            self.decay = group.per_element(local_decay) if self.has_decay else None
            self.decay_on = (self.decay != 0) if self.has_decay else None
            self.local_rate = np.empty_like(self.lr_mult)
            self.tmp = np.empty_like(self.lr_mult)

    def run(self, hyper: Hyper, apply: bool) -> None:
        g = self.group
        if self.kernel is not None:
            if g.size:
                self.kernel(self.scalars, self.starts, self.ends, self.seg_lr, self.seg_decay, len(g.param_ids),
                            int(hyper.iter_size != 1), int(hyper.clip >= 0), int(apply), g.data, g.diff,
                            *self.history)
            return
        numpy_update(self, hyper, apply)


def numpy_update(st: _GroupState, hyper: Hyper, apply: bool) -> None:
    """The fused update of one group with numpy whole-buffer operations, in the per-parameter path's
    order (same bits); clipping was applied to the diffs before (host path)."""
    g = st.group
    w, d, s, tmp = g.data, g.diff, st.scalars, st.tmp
    if hyper.iter_size != 1:
        d *= s[NORM]
    if st.has_decay:
        if hyper.regularization == "L2":
            np.multiply(st.decay, w, out=tmp)
        else:
            np.sign(w, out=tmp)
            tmp *= st.decay
        np.add(d, tmp, out=d, where=st.decay_on)
    lr = np.multiply(st.lr_mult, s[RATE], out=st.local_rate)
    _NUMPY_RULES[st.rule](d, st.history, lr, s, tmp)
    if apply:
        w -= d


def _np_sgd(d, hist, lr, s, tmp) -> None:
    h = hist[0]
    h *= s[MOMENTUM]
    np.multiply(lr, d, out=tmp)
    h += tmp
    d[...] = h


def _np_nesterov(d, hist, lr, s, tmp) -> None:
    h = hist[0]
    mom = s[MOMENTUM]
    previous = h.copy()
    h *= mom
    np.multiply(lr, d, out=tmp)
    h += tmp
    np.multiply(s.dtype.type(1) + mom, h, out=d)
    previous *= mom
    d -= previous


def _np_adagrad(d, hist, lr, s, tmp) -> None:
    h = hist[0]
    np.multiply(d, d, out=tmp)
    h += tmp
    _np_over_root(d, h, lr, s, tmp)


def _np_over_root(d, h, lr, s, tmp) -> None:
    """AdaGrad's and RMSProp's step: ``d = d / (sqrt(h) + delta) * lr``."""
    np.sqrt(h, out=tmp)
    tmp += s[DELTA]
    d /= tmp
    d *= lr


def _np_rmsprop(d, hist, lr, s, tmp) -> None:
    h = hist[0]
    decay = s[MOMENTUM2]
    h *= decay
    np.multiply(d, d, out=tmp)
    tmp *= s.dtype.type(1) - decay
    h += tmp
    _np_over_root(d, h, lr, s, tmp)


def _np_adadelta(d, hist, lr, s, tmp) -> None:
    h, hu = hist
    mom = s[MOMENTUM]
    one_minus = s.dtype.type(1) - mom
    delta = s[DELTA]
    h *= mom
    np.multiply(d, d, out=tmp)
    tmp *= one_minus
    h += tmp
    ratio = hu + delta
    np.add(h, delta, out=tmp)
    ratio /= tmp
    np.sqrt(ratio, out=ratio)
    d *= ratio
    hu *= mom
    np.multiply(d, d, out=tmp)
    tmp *= one_minus
    hu += tmp
    d *= lr


def _np_adam(d, hist, lr, s, tmp) -> None:
    m, v = hist
    b1, b2 = s[MOMENTUM], s[MOMENTUM2]
    one = s.dtype.type(1)
    m *= b1
    np.multiply(one - b1, d, out=tmp)
    m += tmp
    v *= b2
    np.multiply(d, d, out=tmp)
    tmp *= one - b2
    v += tmp
    np.sqrt(v, out=tmp)
    tmp += s[DELTA]
    np.divide(m, tmp, out=d)
    lr *= s[CORRECTION]
    d *= lr


_NUMPY_RULES = {"sgd": _np_sgd, "nesterov": _np_nesterov, "adagrad": _np_adagrad, "rmsprop": _np_rmsprop,
                "adadelta": _np_adadelta, "adam": _np_adam}


# -- CuPy ------------------------------------------------------------------------------------------------
_PREAMBLE = {
    "float": "#define MUL __fmul_rn\n#define ADD __fadd_rn\n#define SUB __fsub_rn\n#define DIV __fdiv_rn\n"
             "#define SQRT __fsqrt_rn\n",
    "double": "#define MUL __dmul_rn\n#define ADD __dadd_rn\n#define SUB __dsub_rn\n#define DIV __ddiv_rn\n"
              "#define SQRT __dsqrt_rn\n",
}

_HEAD = """
long long lo = 0, hi = nseg - 1;
while (lo < hi) { long long mid = (lo + hi) >> 1; if ((long long)i < ends[mid]) hi = mid; else lo = mid + 1; }
if ((long long)i >= starts[lo]) {
const T lr = MUL(s[0], seg_lr[lo]);
const T decay = seg_decay[lo];
const T one = 1;
T g = d;
if (clip) g = MUL(g, s[6]);
if (norm) g = MUL(g, s[5]);
if (decay != 0) g = ADD(g, MUL(decay, REG));
T upd;
"""

_RULE_CODE = {
    "sgd": "T hn = ADD(MUL(h, s[1]), MUL(lr, g)); h = hn; upd = hn;",
    "nesterov": "T hp = h; T hn = ADD(MUL(h, s[1]), MUL(lr, g)); h = hn;"
                " upd = SUB(MUL(ADD(one, s[1]), hn), MUL(s[1], hp));",
    "adagrad": "T hn = ADD(h, MUL(g, g)); h = hn; upd = MUL(DIV(g, ADD(SQRT(hn), s[3])), lr);",
    "rmsprop": "T hn = ADD(MUL(h, s[2]), MUL(SUB(one, s[2]), MUL(g, g))); h = hn;"
               " upd = MUL(DIV(g, ADD(SQRT(hn), s[3])), lr);",
    "adadelta": "const T om = SUB(one, s[1]); T hn = ADD(MUL(h, s[1]), MUL(om, MUL(g, g))); h = hn;"
                " T u = MUL(g, SQRT(DIV(ADD(h2, s[3]), ADD(hn, s[3]))));"
                " h2 = ADD(MUL(h2, s[1]), MUL(om, MUL(u, u))); upd = MUL(u, lr);",
    "adam": "T mn = ADD(MUL(h, s[1]), MUL(SUB(one, s[1]), g)); h = mn;"
            " T vn = ADD(MUL(h2, s[2]), MUL(SUB(one, s[2]), MUL(g, g))); h2 = vn;"
            " upd = MUL(DIV(mn, ADD(SQRT(vn), s[3])), MUL(lr, s[4]));",
}

_REG = {"L2": "w", "L1": "(w > 0 ? one : (w < 0 ? -one : (w == w ? (T)0 : w)))"}


def cupy_kernel_source(rule: str, regularization: str) -> str:
    """The CUDA body of the fused update for ``rule`` and ``regularization`` (see :func:`cupy_kernel`)."""
    return (_HEAD.replace("REG", _REG[regularization]) + _RULE_CODE[rule]
            + "\nd = upd;\nif (apply) w = SUB(w, upd);\n}\n")


def cupy_sumsq_kernel():
    """A ``cupy.ReductionKernel``: the sum of squares of an array, accumulated in double."""
    import cupy

    return cupy.ReductionKernel("T x", "float64 y", "(double)x * (double)x", "a + b", "y = a", "0", "cct_sumsq")


def cupy_kernel(rule: str, regularization: str, dtype):
    """The ``cupy.ElementwiseKernel`` of ``rule``: inputs ``(scalars, starts, ends, seg_lr, seg_decay, nseg,
    norm, clip, apply)``, in-out ``(w, d, h)`` plus ``h2`` for the two-history rules (AdaDelta, Adam); an
    element in no segment (an alignment gap) is left alone."""
    import cupy

    ctype = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}.get(np.dtype(dtype))
    if ctype is None:
        raise SolverError(f"flat update: no device kernel for parameters of dtype {np.dtype(dtype)}")
    return cupy.ElementwiseKernel(
        "raw T s, raw int64 starts, raw int64 ends, raw T seg_lr, raw T seg_decay, int64 nseg, int32 norm, "
        "int32 clip, int32 apply",
        "T w, T d, T h" + (", T h2" if RULES[rule] == 2 else ""),
        cupy_kernel_source(rule, regularization),
        f"cct_flat_{rule}_{regularization.lower()}_{ctype}",
        preamble=_PREAMBLE[ctype])
