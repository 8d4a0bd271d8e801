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

from . import launch
from .conv_simd import unravel_task

_OPTS = dict(nogil=True, cache=True, error_model="numpy", fastmath=False)
MB = 4  # output channels per register block


@nb.njit(**_OPTS)
def _forward(piece, pieces, xp, wb, y, group, sz, sy, sx, dz, dy_, dx):  # pragma: no cover (compiled)
    """``y += conv(xp, w)``; ``wb`` ``(G, NB * MB, Cg, KD, KH, KW)`` (zero rows past ``M / G``)."""
    n_img, c_all = xp.shape[0], xp.shape[1]
    m_all, od, oh, ow = y.shape[1], y.shape[2], y.shape[3], y.shape[4]
    cg = c_all // group
    mg = m_all // group
    nblk = wb.shape[1] // MB
    kd, kh, kw = wb.shape[3], wb.shape[4], wb.shape[5]
    tasks = n_img * group * nblk * od * oh
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        _, oy, oz, bi, g, n = unravel_task(t, 1, oh, od, nblk, group)
        a0 = np.zeros(ow, dtype=y.dtype)
        a1 = np.zeros(ow, dtype=y.dtype)
        a2 = np.zeros(ow, dtype=y.dtype)
        a3 = np.zeros(ow, dtype=y.dtype)
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
                        if sx == 1:
                            _row4(a0, a1, a2, a3, row[e * dx:e * dx + ow], w0, w1, w2, w3)
                        else:
                            _row4(a0, a1, a2, a3, row[e * dx:e * dx + (ow - 1) * sx + 1:sx], w0, w1, w2, w3)
        m0 = bi * MB
        for j in range(MB):
            if m0 + j < mg:
                acc = a0 if j == 0 else a1 if j == 1 else a2 if j == 2 else a3
                dst = y[n, g * mg + m0 + j, oz, oy]
                for o in range(ow):
                    dst[o] += acc[o]


@nb.njit(inline="always", **_OPTS)
def _row4(a0, a1, a2, a3, v, w0, w1, w2, w3):  # pragma: no cover (compiled)
    """Four accumulator rows += four weights times one input row (one load of ``v`` per position)."""
    for o in range(v.shape[0]):
        x = v[o]
        a0[o] += w0 * x
        a1[o] += w1 * x
        a2[o] += w2 * x
        a3[o] += w3 * x


@nb.njit(**_OPTS)
def _backward_data(piece, pieces, dy, w, dxp, group, sz, sy, sx, dz, dy_, dx):  # pragma: no cover (compiled)
    """``dxp += conv^T(dy, w)`` into the zeroed padded gradient ``dxp`` ``(N, C, D', H', W')``: per
    (image, input channel) task, each gradient row takes four output channels' rows per pass."""
    n_img, m_all, od, oh, ow = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3], dy.shape[4]
    c_all = dxp.shape[1]
    cg = c_all // group
    mg = m_all // group
    kd, kh, kw = w.shape[2], w.shape[3], w.shape[4]
    span = (ow - 1) * sx + 1
    for t in range(n_img * c_all * piece // pieces, n_img * c_all * (piece + 1) // pieces):
        ci = t % c_all
        n = t // c_all
        g = ci // cg
        c = ci - g * cg
        for j0 in range(0, mg, MB):
            m = g * mg + j0
            four = j0 + MB <= mg
            for a in range(kd):
                for b in range(kh):
                    for e in range(kw):
                        for oz in range(od):
                            iz = oz * sz + a * dz
                            for oy in range(oh):
                                drow = dxp[n, ci, iz, oy * sy + b * dy_]
                                if four and sx == 1:  # contiguous rows: the loop vectorises
                                    _axpy4(drow[e * dx:e * dx + ow], dy[n, m, oz, oy], dy[n, m + 1, oz, oy],
                                           dy[n, m + 2, oz, oy], dy[n, m + 3, oz, oy], w[m, c, a, b, e],
                                           w[m + 1, c, a, b, e], w[m + 2, c, a, b, e], w[m + 3, c, a, b, e])
                                    continue
                                dst = drow[e * dx:e * dx + span:sx]
                                if four:
                                    _axpy4(dst, dy[n, m, oz, oy], dy[n, m + 1, oz, oy], dy[n, m + 2, oz, oy],
                                           dy[n, m + 3, oz, oy], w[m, c, a, b, e], w[m + 1, c, a, b, e],
                                           w[m + 2, c, a, b, e], w[m + 3, c, a, b, e])
                                else:
                                    for jj in range(mg - j0):
                                        _axpy(dst, dy[n, m + jj, oz, oy], w[m + jj, c, a, b, e])


@nb.njit(inline="always", **_OPTS)
def _axpy4(dst, s0, s1, s2, s3, w0, w1, w2, w3):  # pragma: no cover (compiled)
    for o in range(s0.shape[0]):
        dst[o] += w0 * s0[o] + w1 * s1[o] + w2 * s2[o] + w3 * s3[o]


@nb.njit(inline="always", **_OPTS)
def _axpy(dst, src, wv):  # pragma: no cover (compiled)
    for o in range(src.shape[0]):
        dst[o] += wv * src[o]


@nb.njit(**_OPTS)
def _backward_weights(piece, pieces, dy, xp, dw, group, sz, sy, sx, dz, dy_, dx):  # pragma: no cover (compiled)
    """``dw += dL/dw`` for ``dw`` ``(M, Cg, KD, KH, KW)``: per (output channel, input channel) task,
    one accumulator row per kernel column, vectorised over output positions, summed at the end."""
    n_img, m_all, od, oh, ow = dy.shape[0], dy.shape[1], dy.shape[2], dy.shape[3], dy.shape[4]
    cg = dw.shape[1]
    mg = m_all // group
    kd, kh, kw = dw.shape[2], dw.shape[3], dw.shape[4]
    span = (ow - 1) * sx + 1
    for t in range(m_all * cg * piece // pieces, m_all * cg * (piece + 1) // pieces):
        c = t % cg
        m = t // cg
        ci = (m // mg) * cg + c
        acc = np.zeros((kw, ow), dtype=dw.dtype)
        for a in range(kd):
            for b in range(kh):
                acc[:] = 0
                for n in range(n_img):
                    for oz in range(od):
                        iz = oz * sz + a * dz
                        for oy in range(oh):
                            row = xp[n, ci, iz, oy * sy + b * dy_]
                            src = dy[n, m, oz, oy]
                            if sx == 1:  # contiguous rows: the loop vectorises
                                for e in range(kw):
                                    _fma(acc[e], src, row[e * dx:e * dx + ow])
                            else:
                                for e in range(kw):
                                    _fma(acc[e], src, row[e * dx:e * dx + span:sx])
                for e in range(kw):
                    s = 0.0
                    for o in range(ow):
                        s += acc[e, o]
                    dw[m, c, a, b, e] += s


@nb.njit(inline="always", **_OPTS)
def _fma(acc, a, b):  # pragma: no cover (compiled)
    for o in range(acc.shape[0]):
        acc[o] += a[o] * b[o]


def forward(xp: np.ndarray, wb: np.ndarray, y: np.ndarray, group: int, *steps: int) -> None:
    """``y += conv(xp, w)`` (see :func:`_forward`; ``steps``: strides then dilations, depth, height, width),
    in pieces over (image, group, channel block, output row) on the calling thread's kernel threads."""
    launch(_forward, xp, wb, y, group, *steps)


def backward_data(dy: np.ndarray, w: np.ndarray, dxp: np.ndarray, group: int, *steps: int) -> None:
    """``dxp += conv^T(dy, w)`` (see :func:`_backward_data`), in pieces over (image, input channel)."""
    launch(_backward_data, dy, w, dxp, group, *steps)


def backward_weights(dy: np.ndarray, xp: np.ndarray, dw: np.ndarray, group: int, *steps: int) -> None:
    """``dw += dL/dw`` (see :func:`_backward_weights`), in pieces over (output channel, input channel)."""
    launch(_backward_weights, dy, xp, dw, group, *steps)


def blocked_weights(w: np.ndarray, group: int) -> np.ndarray:
    """``(M, Cg, KD, KH, KW)`` -> ``(G, NB * MB, Cg, KD, KH, KW)``, zero rows up to whole blocks."""
    m = w.shape[0]
    mg = m // group
    nblk = -(-mg // MB)
    out = np.zeros((group, nblk * MB) + w.shape[1:], dtype=w.dtype)
    out[:, :mg] = w.reshape((group, mg) + w.shape[1:])
    return out
