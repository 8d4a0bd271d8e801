"""Convolution geometry, batched im2col/col2im and the Type 1 lowering (cct/lowering)."""
import itertools

import numpy as np
import pytest
from naive import naive_conv

from cct.errors import CctError
from cct.io.prototxt import parse_text
from cct.lowering import (
    ConvGeometry,
    LoweringStrategy,
    col2im,
    get_strategy,
    im2col,
    strategy_names,
)
from cct.proto import caffe_pb2


def conv_param(text: str) -> caffe_pb2.ConvolutionParameter:
    return parse_text(text, caffe_pb2.ConvolutionParameter())


def geom(text: str, shape, reverse=False) -> ConvGeometry:
    return ConvGeometry.from_param(conv_param(text), shape, reverse=reverse)


# -- naive references -------------------------------------------------------------------------
def naive_im2col(x, kernel, pad, stride, dil, out_shape):
    """Per image, Caffe's column buffer: (C * prod(k), prod(out)); returned for the batch."""
    n, c = x.shape[:2]
    sp = x.shape[2:]
    kp = int(np.prod(kernel))
    op = int(np.prod(out_shape))
    col = np.zeros((n, c * kp, op))
    for i in range(n):
        for ch in range(c):
            for ki, koff in enumerate(itertools.product(*(range(k) for k in kernel))):
                for oi, ooff in enumerate(itertools.product(*(range(o) for o in out_shape))):
                    pos = [o * s - p + k * d for o, s, p, k, d in zip(ooff, stride, pad, koff, dil)]
                    if all(0 <= q < size for q, size in zip(pos, sp)):
                        col[i, ch * kp + ki, oi] = x[(i, ch) + tuple(pos)]
    return col


# -- geometry ------------------------------------------------------------------------------------
def test_geometry_output_shape_and_fields():
    g = geom("num_output: 6 kernel_h: 3 kernel_w: 5 pad: 1 stride: 2 dilation: 2 group: 2", (2, 4, 13, 15))
    assert g.out_shape == (6, 5)  # (13 + 2 - 5)//2 + 1, (15 + 2 - 9)//2 + 1
    assert g.kernel == (3, 5) and g.pad == (1, 1) and g.stride == (2, 2) and g.dilation == (2, 2)
    assert g.weight_shape == (6, 2, 3, 5) and g.kernel_dim == 30 and not g.is_1x1
    g = geom("num_output: 4 kernel_size: 3 kernel_size: 1 pad_h: 1 pad_w: 0 stride_h: 1 stride_w: 2", (1, 3, 8, 11))
    assert g.kernel == (3, 1) and g.pad == (1, 0) and g.stride == (1, 2) and g.out_shape == (8, 6)
    assert geom("num_output: 2 kernel_size: 1", (1, 3, 4, 4)).is_1x1
    assert not geom("num_output: 2 kernel_size: 1 stride: 2", (1, 3, 4, 4)).is_1x1


def test_geometry_nd_and_axis():
    g = geom("num_output: 2 kernel_size: 2 kernel_size: 3 kernel_size: 1 pad: 1", (2, 3, 4, 5, 6))
    assert g.in_shape == (4, 5, 6) and g.out_shape == (5, 5, 8)
    g = geom("num_output: 2 kernel_size: 3 axis: 2", (2, 3, 4, 9))  # channels = 4, one spatial axis
    assert g.channels_in == 4 and g.in_shape == (9,) and g.out_shape == (7,)


def test_geometry_caffe_truncating_division():
    # (2 + 0 - 3) / 2 + 1 in C++ is 0 + 1 = 1 (Python floor would give 0)
    assert geom("num_output: 1 kernel_size: 3 stride: 2", (1, 1, 2, 5)).out_shape == (1, 2)


def test_deconv_geometry_reverses():
    g = geom("num_output: 4 kernel_size: 4 stride: 2 pad: 1", (2, 3, 5, 5), reverse=True)
    assert g.in_shape == (10, 10) and g.out_shape == (5, 5)  # 2*(5-1) + 4 - 2
    assert g.channels_in == 4 and g.channels_out == 3 and g.weight_shape == (3, 4, 4, 4)
    g = geom("num_output: 2 kernel_size: 3 stride: 2 dilation: 2", (1, 3, 4, 4), reverse=True)
    assert g.in_shape == (11, 11)  # 2*3 + 2*2 + 1


@pytest.mark.parametrize("text,shape,msg", [
    ("num_output: 2 kernel_size: 3 kernel_h: 3 kernel_w: 3", (1, 1, 5, 5), "not both"),
    ("num_output: 2 kernel_h: 3 kernel_w: 3", (1, 1, 5, 5, 5), "2D convolution"),
    ("num_output: 2 kernel_size: 3 kernel_size: 3", (1, 1, 5, 5, 5), "kernel_size must be specified once"),
    ("num_output: 2", (1, 1, 5, 5), "kernel_size must be specified once"),
    ("num_output: 2 kernel_size: 0", (1, 1, 5, 5), "nonzero"),
    ("num_output: 2 kernel_size: 3 stride: 0", (1, 1, 5, 5), "nonzero"),
    ("num_output: 2 kernel_size: 3 stride: 1 stride_h: 2 stride_w: 2", (1, 1, 5, 5), "not both"),
    ("num_output: 2 kernel_size: 3 pad: 1 pad_h: 1", (1, 1, 5, 5), "not both"),
    ("num_output: 2 kernel_size: 3 pad: 1 pad: 1 pad: 1", (1, 1, 5, 5), "pad must be specified once"),
    ("num_output: 2 kernel_size: 3 dilation: 1 dilation: 1 dilation: 1", (1, 1, 5, 5), "dilation must"),
    ("num_output: 3 kernel_size: 3 group: 2", (1, 4, 5, 5), "multiples of group"),
    ("num_output: 2 kernel_size: 3 group: 2", (1, 3, 5, 5), "multiple of group"),
    ("num_output: 0 kernel_size: 3", (1, 3, 5, 5), "num_output"),
    ("num_output: 2 kernel_size: 9", (1, 3, 5, 5), "negative output"),
])
def test_geometry_errors(text, shape, msg):
    with pytest.raises(CctError, match=msg):
        geom(text, shape)


# -- im2col / col2im -------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,kernel,pad,stride,dil", [
    ((2, 3, 7, 8), (3, 2), (1, 0), (2, 1), (1, 2)),
    ((1, 2, 5, 5), (3, 3), (2, 2), (3, 3), (1, 1)),
    ((2, 2, 4, 3, 5), (2, 1, 3), (1, 0, 1), (1, 2, 2), (2, 1, 1)),
    ((2, 3, 9), (4,), (1,), (2,), (2,)),
])
def test_im2col_matches_naive_and_col2im_is_adjoint(shape, kernel, pad, stride, dil):
    r = np.random.default_rng(0)
    x = r.standard_normal(shape)
    out_shape = tuple((i + 2 * p - (d * (k - 1) + 1)) // s + 1
                      for i, k, p, s, d in zip(shape[2:], kernel, pad, stride, dil))
    col = im2col(x, kernel, pad, stride, dil)
    assert col.shape == shape[:2] + kernel + out_shape
    ref = naive_im2col(x, kernel, pad, stride, dil, out_shape)
    np.testing.assert_allclose(col.reshape(ref.shape), ref, rtol=0, atol=0)
    # col2im is the adjoint: <im2col(x), c> == <x, col2im(c)>
    c = r.standard_normal(col.shape)
    back = col2im(c, shape[2:], kernel, pad, stride, dil)
    assert back.shape == shape
    np.testing.assert_allclose(np.sum(col * c), np.sum(x * back), rtol=1e-12)
    # and equals the naive scatter-add
    ref_back = np.zeros(shape)
    cflat = c.reshape(ref.shape)
    kp = int(np.prod(kernel))
    for i in range(shape[0]):
        for ch in range(shape[1]):
            for ki, koff in enumerate(itertools.product(*(range(k) for k in kernel))):
                for oi, ooff in enumerate(itertools.product(*(range(o) for o in out_shape))):
                    pos = [o * s - p + k * d for o, s, p, k, d in zip(ooff, stride, pad, koff, dil)]
                    if all(0 <= q < size for q, size in zip(pos, shape[2:])):
                        ref_back[(i, ch) + tuple(pos)] += cflat[i, ch * kp + ki, oi]
    np.testing.assert_allclose(back, ref_back, rtol=1e-12, atol=1e-12)


def test_im2col_out_view_and_float32():
    x = np.arange(2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
    buf = np.zeros((3, 2, 2, 2, 3, 3), dtype=np.float32)  # (C, kh, kw, N, OH, OW)
    view = buf.transpose(3, 0, 1, 2, 4, 5)
    im2col(x, (2, 2), (0, 0), (1, 1), (1, 1), out=view)
    np.testing.assert_array_equal(view, im2col(x, (2, 2), (0, 0), (1, 1), (1, 1)))
    assert view.dtype == np.float32


# -- Type 1 lowering -------------------------------------------------------------------------
CASES = [
    # text, bottom shape
    ("num_output: 6 kernel_h: 3 kernel_w: 5 pad: 1 stride: 2 dilation: 2 group: 2", (2, 4, 13, 15)),
    ("num_output: 4 kernel_size: 3 pad: 1 dilation: 2", (2, 3, 9, 9)),
    ("num_output: 6 kernel_size: 3 pad: 1 stride: 2 group: 3", (3, 6, 7, 6)),
    ("num_output: 4 kernel_h: 3 kernel_w: 5 pad_h: 1 pad_w: 2 stride_h: 1 stride_w: 2", (2, 3, 8, 11)),
    ("num_output: 3 kernel_size: 1", (2, 5, 4, 3)),
    ("num_output: 4 kernel_size: 1 group: 2", (2, 4, 3, 3)),
    ("num_output: 2 kernel_size: 1 stride: 2", (2, 3, 5, 5)),
]


def _rand_conv(text, shape, seed=0, dtype=np.float64):
    g = geom(text, shape)
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape).astype(dtype)
    w = r.standard_normal(g.weight_shape).astype(dtype)
    b = r.standard_normal(g.channels_out).astype(dtype)
    return g, x, w, b


@pytest.mark.parametrize("text,shape", CASES)
def test_type1_forward_matches_naive(text, shape):
    g, x, w, b = _rand_conv(text, shape)
    y = get_strategy("type1").forward(x, w, b, g)
    ref = naive_conv(x, w, b, g.pad, g.stride, g.dilation, g.group)
    assert y.shape == ref.shape == (shape[0], g.channels_out) + g.out_shape
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("text,shape", CASES)
def test_type1_backward_is_adjoint(text, shape):
    g, x, w, b = _rand_conv(text, shape, seed=1)
    low = get_strategy("type1")
    r = np.random.default_rng(2)
    dy = r.standard_normal((shape[0], g.channels_out) + g.out_shape)
    f = np.sum(low.forward(x, w, None, g) * dy)  # bilinear in (x, w)
    dx = low.backward_data(dy, w, g)
    dw, db = low.backward_weights(dy, x, g)
    assert dx.shape == x.shape and dw.shape == w.shape
    np.testing.assert_allclose(np.sum(x * dx), f, rtol=1e-10)
    np.testing.assert_allclose(np.sum(w * dw), f, rtol=1e-10)
    np.testing.assert_allclose(db, dy.sum(axis=(0, 2, 3)), rtol=1e-12)
    # exact element values against the naive conv's linearity: dx[e] = <conv(e_i), dy>
    idx = (0, 0, 1, 2)
    e = np.zeros_like(x)
    e[idx] = 1.0
    np.testing.assert_allclose(dx[idx], np.sum(naive_conv(e, w, None, g.pad, g.stride, g.dilation, g.group) * dy),
                               rtol=1e-10, atol=1e-12)


def test_type1_no_bias_and_3d():
    g = geom("num_output: 4 kernel_size: 2 pad: 1 stride: 2 group: 2 bias_term: false", (2, 2, 3, 4, 5))
    r = np.random.default_rng(3)
    x = r.standard_normal((2, 2, 3, 4, 5))
    w = r.standard_normal(g.weight_shape)
    low = get_strategy("type1")
    y = low.forward(x, w, None, g)
    # reference: 3-D conv by explicit sums
    ref = np.zeros(y.shape)
    for o in range(4):
        gi = o // 2
        for pos in itertools.product(*(range(s) for s in g.out_shape)):
            for koff in itertools.product(range(2), range(2), range(2)):
                q = [p * 2 - 1 + k for p, k in zip(pos, koff)]
                if all(0 <= a < s for a, s in zip(q, (3, 4, 5))):
                    ref[(slice(None), o) + pos] += x[(slice(None), gi) + tuple(q)] * w[(o, 0) + koff]
    np.testing.assert_allclose(y, ref, rtol=1e-10, atol=1e-12)
    dw, db = low.backward_weights(r.standard_normal(y.shape), x, g)
    assert db is None and dw.shape == w.shape


def test_type1_float32():
    g, x, w, b = _rand_conv(*CASES[0], dtype=np.float32)
    low = get_strategy("type1")
    y = low.forward(x, w, b, g)
    assert y.dtype == np.float32
    ref = naive_conv(x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), g.pad, g.stride,
                       g.dilation, g.group)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    assert low.backward_data(y, w, g).dtype == np.float32


def test_registry_and_cost():
    assert "type1" in strategy_names()
    s = get_strategy("type1")
    assert isinstance(s, LoweringStrategy) and s.name == "type1"
    assert get_strategy("type1") is not s
    with pytest.raises(KeyError, match="type1"):
        get_strategy("no_such_lowering")
    g = geom(*CASES[1])
    gemms = [op for op in s.pass_ops(g, 2, "fwd") if op[0] == "gemm"]
    assert [2 * m * n * k * c for _, m, n, k, c in gemms] == [2 * 2 * 4 * 27 * 49]  # 2 N M K P flops
