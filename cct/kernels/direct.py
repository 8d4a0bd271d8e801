"""numba kernels of direct convolution (ZNNi IV-A.1) on 3-D spatial blocks: forward, data and weight gradients.

Every geometry is handed over as three spatial axes (1-D and 2-D convolutions get leading unit
axes, see :mod:`cct.lowering.direct`) on a zero-padded input ``xp`` ``(N, C, D', H', W')``, so the
inner loops have no border tests:

* :func:`forward` -- ``y[n, m, o] += sum_{c, k} w[m, c, k] * xp[n, c, o * s + k * d]``. One task per
  (image, group, block of ``MB`` output channels, output row); the row's ``MB x OW`` accumulators
  (register blocking over output channels, vectorised over output positions) take each input
  value once per kernel tap for all ``MB`` channels. Weights come padded to whole blocks.
* :func:`backward_data` -- the transposed scatter into a padded gradient ``dxp``: one task per
  (image, input channel), so no two tasks write the same element.
* :func:`backward_weights` -- ``dw[m, c, k] = sum_{n, o} dy[n, m, o] * xp[n, c, o * s + k * d]``:
  one task per (output channel, input channel of its group), a dot product per kernel tap.

Summation order differs from the GEMM lowerings (results agree to float rounding).
"""
from __future__ import annotations

import numba as nb
import numpy as np

_OPTS = dict(nogil=True, cache=True, error_model="numpy", fastmath=False)
MB = 4  # output channels per register block


@nb.njit(parallel=True, **_OPTS)
def forward(xp, wb, y, group, sz, sy, sx, dz, dy_, dx):  # pragma: no cover (compiled)
    """``y += conv(xp, w)``; ``wb`` ``(G, NB * MB, Cg, KD, KH, KW)`` (zero rows past ``M / G``)."""
    n_img, c_all = xp.shape[0], xp.shape[1]
    m_all, od, oh, ow = y.shape[1], y.shape[2], y.shape[3], y.shape[4]
    cg = c_all // group
    mg = m_all // group
    nblk = wb.shape[1] // MB
    kd, kh, kw = wb.shape[3], wb.shape[4], wb.shape[5]
    tasks = n_img * group * nblk * od * oh
    for t in nb.prange(tasks):
        oy = t % oh
        r1 = t // oh
        oz = r1 % od
        r2 = r1 // od
        bi = r2 % nblk
        r3 = r2 // nblk
        g = r3 % group
        n = r3 // group
        acc = np.zeros((MB, ow), dtype=y.dtype)
        for c in range(cg):
            ci = g * cg + c
            for a in range(kd):
                iz = oz * sz + a * dz
                for b in range(kh):
                    row = xp[n, ci, iz, oy * sy + b * dy_]
                    for e in range(kw):
                        w0 = wb[g, bi * MB + 0, c, a, b, e]
                        w1 = wb[g, bi * MB + 1, c, a, b, e]
                        w2 = wb[g, bi * MB + 2, c, a, b, e]
                        w3 = wb[g, bi * MB + 3, c, a, b, e]
                        off = e * dx
                        for o in range(ow):
                            v = row[off + o * sx]
                            acc[0, o] += w0 * v
                            acc[1, o] += w1 * v
                            acc[2, o] += w2 * v
                            acc[3, o] += w3 * v
        m0 = bi * MB
        for j in range(MB):
            if m0 + j < mg:
                m = g * mg + m0 + j
                for o in range(ow):
                    y[n, m, oz, oy, o] += acc[j, o]


@nb.njit(parallel=True, **_OPTS)
def backward_data(dy, w, dxp, group, sz, sy, sx, dz, dy_, dx):  # pragma: no cover (compiled)
    """``dxp += conv^T(dy, w)`` into the zeroed padded gradient ``dxp`` ``(N, C, D', H', W')``."""
    n_img, m_all, od, oh, ow = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3], dy.shape[4]
    c_all = dxp.shape[1]
    cg = c_all // group
    mg = m_all // group
    kd, kh, kw = w.shape[2], w.shape[3], w.shape[4]
    for t in nb.prange(n_img * c_all):
        ci = t % c_all
        n = t // c_all
        g = ci // cg
        c = ci - g * cg
        for j in range(mg):
            m = g * mg + j
            for a in range(kd):
                for b in range(kh):
                    for e in range(kw):
                        wv = w[m, c, a, b, e]
                        off = e * dx
                        for oz in range(od):
                            iz = oz * sz + a * dz
                            for oy in range(oh):
                                dst = dxp[n, ci, iz, oy * sy + b * dy_]
                                src = dy[n, m, oz, oy]
                                for o in range(ow):
                                    dst[off + o * sx] += wv * src[o]


@nb.njit(parallel=True, **_OPTS)
def backward_weights(dy, xp, dw, group, sz, sy, sx, dz, dy_, dx):  # pragma: no cover (compiled)
    """``dw += dL/dw`` for ``dw`` ``(M, Cg, KD, KH, KW)``."""
    n_img, m_all, od, oh, ow = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3], dy.shape[4]
    cg = dw.shape[1]
    mg = m_all // group
    kd, kh, kw = dw.shape[2], dw.shape[3], dw.shape[4]
    for t in nb.prange(m_all * cg):
        c = t % cg
        m = t // cg
        ci = (m // mg) * cg + c
        for a in range(kd):
            for b in range(kh):
                for e in range(kw):
                    off = e * dx
                    s = 0.0
                    for n in range(n_img):
                        for oz in range(od):
                            iz = oz * sz + a * dz
                            for oy in range(oh):
                                row = xp[n, ci, iz, oy * sy + b * dy_]
                                src = dy[n, m, oz, oy]
                                for o in range(ow):
                                    s += src[o] * row[off + o * sx]
                    dw[m, c, a, b, e] += s


def blocked_weights(w: np.ndarray, group: int) -> np.ndarray:
    """``(M, Cg, KD, KH, KW)`` -> ``(G, NB * MB, Cg, KD, KH, KW)``, zero rows up to whole blocks."""
    m = w.shape[0]
    mg = m // group
    nblk = -(-mg // MB)
    out = np.zeros((group, nblk * MB) + w.shape[1:], dtype=w.dtype)
    out[:, :mg] = w.reshape((group, mg) + w.shape[1:])
    return out
