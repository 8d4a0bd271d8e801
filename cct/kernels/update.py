"""numba kernel of the SGD solver's per-parameter update: L2 weight decay + momentum in one pass.

:func:`sgd_l2` replaces :func:`cct.solver.updates.regularize` (L2) followed by
:func:`cct.solver.updates.sgd`. The numpy path makes five sweeps over a parameter plus a
temporary as large as it (CaffeNet: 61 M parameters, ~240 ms an iteration on a 2-core box, most of
it page faults of the fresh temporaries); this makes one, which can also apply the update to the
data (Net::Update's sweep), with the same result bits (each product and sum is rounded to the
parameter dtype in the numpy path's order; no FMA contraction).
"""
from __future__ import annotations

import numba as nb
import numpy as np

from . import launch

_OPTS = dict(nogil=True, cache=True, error_model="numpy")
_CHUNK = 1 << 15  # elements per task


@nb.njit(**_OPTS)
def _sgd_l2(piece, pieces, w, d, h, decay, rate, momentum, has_decay, apply):  # pragma: no cover (compiled)
    n = w.size
    tasks = (n + _CHUNK - 1) // _CHUNK
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        lo = t * _CHUNK
        hi = min(n, lo + _CHUNK)
        ws, ds, hs = w[lo:hi], d[lo:hi], h[lo:hi]
        for i in range(ws.size):
            g = ds[i]
            if has_decay:
                g = g + decay * ws[i]  # diff += decay * data
            v = hs[i] * momentum + rate * g  # history *= momentum; history += rate * diff
            hs[i] = v
            ds[i] = v  # diff[...] = history
            if apply:
                ws[i] = ws[i] - v  # Net::Update: data -= diff


def sgd_l2(data: np.ndarray, diff: np.ndarray, history: np.ndarray, decay, rate, momentum,
           apply: bool = False) -> None:
    """In place: ``diff += decay * data`` (skipped when ``decay`` is 0), then
    ``history = momentum * history + rate * diff`` and ``diff = history``; with ``apply`` also
    ``data -= diff`` (Caffe's Net::Update, same bits) in the same pass. Scalars are rounded to the
    arrays' dtype first; arrays must be C-contiguous, of one float dtype and one size."""
    if not (data.flags.c_contiguous and diff.flags.c_contiguous and history.flags.c_contiguous):
        raise ValueError("sgd_l2 needs C-contiguous arrays")
    if not data.size == diff.size == history.size:
        raise ValueError(f"sgd_l2: sizes differ ({data.size}, {diff.size}, {history.size})")
    t = data.dtype.type
    launch(_sgd_l2, data.reshape(-1), diff.reshape(-1), history.reshape(-1), t(decay), t(rate), t(momentum),
           bool(t(decay) != 0), bool(apply), work=data.size)
