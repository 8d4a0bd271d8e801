"""Obviously-correct reference operations for tests (loops straight from the definitions)."""
from __future__ import annotations

import itertools

import numpy as np


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
