"""Obviously-correct reference operations for tests (loops straight from the definitions)."""
from __future__ import annotations

import itertools

import numpy as np

from cct.lowering import ConvGeometry


def naive_conv(x, w, b, pad, stride, dil, group):
    """2-D convolution by definition (Caffe's cross-correlation with zero padding)."""
    n, c, h, wd = x.shape
    m, cg, kh, kw = w.shape
    (ph, pw), (sh, sw), (dh, dw) = pad, stride, dil
    oh = (h + 2 * ph - (dh * (kh - 1) + 1)) // sh + 1
    ow = (wd + 2 * pw - (dw * (kw - 1) + 1)) // sw + 1
    y = np.zeros((n, m, oh, ow))
    mg = m // group
    for i, o, a, bb in itertools.product(range(n), range(m), range(oh), range(ow)):
        g = o // mg
        s = 0.0
        for ci, p, q in itertools.product(range(cg), range(kh), range(kw)):
            r, col = a * sh - ph + p * dh, bb * sw - pw + q * dw
            if 0 <= r < h and 0 <= col < wd:
                s += x[i, g * cg + ci, r, col] * w[o, ci, p, q]
        y[i, o, a, bb] = s + (0.0 if b is None else b[o])
    return y


# -- N-d convolution (1-3 spatial axes, groups, pad, stride, dilation), one kernel tap at a time ------
def c_div(a, b):
    """C/C++ integer division (truncates toward zero), as Caffe's shape arithmetic does."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


def make_geom(cin, cout, group, in_shape, kernel, pad, stride, dil, bias=True):
    """A :class:`~cct.lowering.ConvGeometry` with Caffe's output shape."""
    out = tuple(c_div(i + 2 * p - (d * (k - 1) + 1), s) + 1
                for i, k, p, s, d in zip(in_shape, kernel, pad, stride, dil))
    return ConvGeometry(channels_in=cin, channels_out=cout, group=group, in_shape=tuple(in_shape),
                        kernel=tuple(kernel), pad=tuple(pad), stride=tuple(stride), dilation=tuple(dil),
                        out_shape=out, bias_term=bias)


def _tap_windows(g):
    """Yield ``(kernel offset, slices into the zero-padded input)``: the input element each output position
    reads through that tap (``o * stride + k * dilation`` in padded coordinates)."""
    for k in itertools.product(*(range(v) for v in g.kernel)):
        yield k, tuple(slice(kk * d, kk * d + (o - 1) * s + 1, s)
                       for kk, d, o, s in zip(k, g.dilation, g.out_shape, g.stride))


def _padded_extent(g):
    """Padded input extent, grown where the last window overhangs (never read: zero padding)."""
    return tuple(max(i + 2 * p, (o - 1) * s + (k - 1) * d + 1)
                 for i, p, o, s, k, d in zip(g.in_shape, g.pad, g.out_shape, g.stride, g.kernel, g.dilation))


def _inner(g):
    """Slices of the unpadded input inside the padded buffer."""
    return (slice(None), slice(None)) + tuple(slice(p, p + i) for p, i in zip(g.pad, g.in_shape))


def ref_forward(x, w, b, g):
    """``conv(x, w) + b`` in float64, by definition: every kernel tap adds ``w[:, :, tap]`` times the input
    the tap reads, group by group."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    n, cg, mg = x.shape[0], g.channels_in // g.group, g.channels_out // g.group
    y = np.zeros((n, g.channels_out) + tuple(g.out_shape))
    if g.out_size:
        xpad = np.zeros((n, g.channels_in) + _padded_extent(g))
        xpad[_inner(g)] = x
        for k, win in _tap_windows(g):
            for gi in range(g.group):
                xs = xpad[(slice(None), slice(gi * cg, (gi + 1) * cg)) + win]
                ws = w[(slice(gi * mg, (gi + 1) * mg), slice(None)) + k]
                y[:, gi * mg:(gi + 1) * mg] += np.einsum("nc...,mc->nm...", xs, ws)
    if b is not None:
        y += np.asarray(b, np.float64).reshape((1, -1) + (1,) * g.num_spatial)
    return y


def ref_backward(dy, x, w, g):
    """``(dx, dw, db)`` of :func:`ref_forward` in float64 (``x`` may be None: ``dw`` is then None)."""
    dy, w = np.asarray(dy, np.float64), np.asarray(w, np.float64)
    n, cg, mg = dy.shape[0], g.channels_in // g.group, g.channels_out // g.group
    dxpad = np.zeros((n, g.channels_in) + _padded_extent(g))
    dw = None if x is None else np.zeros(w.shape)
    if x is not None:
        xpad = np.zeros(dxpad.shape)
        xpad[_inner(g)] = np.asarray(x, np.float64)
    if g.out_size:
        for k, win in _tap_windows(g):
            for gi in range(g.group):
                cs, ms = slice(gi * cg, (gi + 1) * cg), slice(gi * mg, (gi + 1) * mg)
                dys = dy[:, ms]
                dxpad[(slice(None), cs) + win] += np.einsum("nm...,mc->nc...", dys, w[(ms, slice(None)) + k])
                if x is not None:
                    xs = xpad[(slice(None), cs) + win]
                    dw[(ms, slice(None)) + k] += np.einsum("nmp,ncp->mc", dys.reshape(n, mg, -1), xs.reshape(n, cg, -1))
    db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))
    return dxpad[_inner(g)].copy(), dw, db


def random_conv_inputs(g, batch, rng):
    """Standard-normal float64 ``(x, w, b, dy)`` for a convolution of geometry ``g`` (``b`` None without bias)."""
    x = rng.standard_normal((batch, g.channels_in) + tuple(g.in_shape))
    w = rng.standard_normal(g.weight_shape)
    b = rng.standard_normal(g.channels_out) if g.bias_term else None
    dy = rng.standard_normal((batch, g.channels_out) + tuple(g.out_shape))
    return x, w, b, dy
