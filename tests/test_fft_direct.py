"""FFT convolution's pruned transforms and weight-transform cache; the direct kernels' blocking edges."""
import numpy as np
import scipy.fft as sfft

from cct.lowering import ConvGeometry, get_strategy
from cct.lowering.fft import FFTConvolution, fft_shape, pruned_irfftn, pruned_rfftn


def test_pruned_transforms_equal_the_full_ones():
    rng = np.random.default_rng(0)
    for shape, small in (((12,), (3,)), ((9, 10), (3, 2)), ((6, 8, 10), (3, 3, 3))):
        k = rng.standard_normal((2, 3) + small)
        np.testing.assert_allclose(pruned_rfftn(k, shape), sfft.rfftn(k, s=shape, axes=tuple(range(2, 2 + len(shape)))),
                                   rtol=1e-12, atol=1e-12)
        spec = sfft.rfftn(rng.standard_normal((2,) + shape), axes=tuple(range(1, 1 + len(shape))))
        full = sfft.irfftn(spec, s=shape, axes=tuple(range(1, 1 + len(shape))))
        keep = tuple(max(1, s - 2) for s in shape)
        want = full[(slice(None),) + tuple(slice(0, q) for q in keep)]
        np.testing.assert_allclose(pruned_irfftn(spec, shape, keep), want, rtol=1e-12, atol=1e-12)


def test_weight_transform_reused_from_forward_and_invalidated_by_an_update():
    g = ConvGeometry(3, 4, 1, (7, 7), (3, 3), (1, 1), (1, 1), (1, 1), (7, 7), True)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 7, 7))
    w = rng.standard_normal(g.weight_shape)
    dy = rng.standard_normal((2, 4, 7, 7))
    s = FFTConvolution()
    s.forward(x, w, None, g)
    first = s.kernel_transform(w, g)
    assert s.kernel_transform(w, g) is first  # the backward pass of the same iteration reuses it
    w += 0.25  # the solver updates the weights in place
    assert s.kernel_transform(w, g) is not first
    np.testing.assert_allclose(s.backward_data(dy, w, g), get_strategy("type1").backward_data(dy, w, g),
                               rtol=1e-10, atol=1e-10)
    assert all(f >= e for f, e in zip(fft_shape(g), g.used_extent))  # no wrap-around on used positions


def test_direct_output_channel_blocks_with_a_tail():
    """Output channels per group not a multiple of the register block (4): the padded weight rows
    never leak into the output."""
    for m, group in ((5, 1), (6, 2), (3, 3)):
        g = ConvGeometry(6, m, group, (6, 5), (3, 2), (1, 0), (2, 1), (1, 2), (3, 3), True)
        rng = np.random.default_rng(m)
        x = rng.standard_normal((3, 6, 6, 5)).astype(np.float32)
        w = rng.standard_normal(g.weight_shape).astype(np.float32)
        b = rng.standard_normal(m).astype(np.float32)
        dy = rng.standard_normal((3, m, 3, 3)).astype(np.float32)
        d, t = get_strategy("direct"), get_strategy("type1")
        np.testing.assert_allclose(d.forward(x, w, b, g), t.forward(x, w, b, g), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(d.backward_data(dy, w, g), t.backward_data(dy, w, g), rtol=1e-4, atol=1e-4)
        for a, r in zip(d.backward_weights(dy, x, g), t.backward_weights(dy, x, g)):
            np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)
