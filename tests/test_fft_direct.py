"""FFT convolution's pruned transforms and weight-transform cache; the direct kernels' blocking edges."""
import numpy as np
import pytest
import scipy.fft as sfft

from cct.device.driver import cupy_available, to_host
from cct.lowering import ConvGeometry, get_strategy
from cct.lowering.budget import max_batch_partition
from cct.lowering.direct_layout import SharedScratch
from cct.lowering.fft import FFTConvolution, fft_shape, half_shape, inverse_spectrum, spectrum
from cct.proto import caffe_pb2


def _extended(a, points):
    """``a`` zero-extended along its last axis to ``points`` (how :func:`spectrum` takes it)."""
    out = np.zeros(a.shape[:-1] + (points,), dtype=a.dtype)
    out[..., :a.shape[-1]] = a
    return out


def test_pruned_transforms_equal_the_full_ones():
    """Stage by stage over only the non-zero lines, into a strided (frequency-major) destination, and
    back keeping a corner: the same as scipy's full transforms; the conjugate flag gives the conjugate
    spectrum and inverts one."""
    rng = np.random.default_rng(0)
    for shape, small in (((12,), (3,)), ((9, 10), (3, 2)), ((6, 8, 10), (3, 3, 3))):
        nd = len(shape)
        axes = tuple(range(2, 2 + nd))
        k = rng.standard_normal((2, 3) + small)
        want = sfft.rfftn(k, s=shape, axes=axes)
        for conjugate in (False, True):
            buf = np.empty(half_shape(shape) + (2, 3), dtype=np.complex128)
            out = buf.transpose((nd, nd + 1) + tuple(range(nd)))
            assert spectrum(_extended(k, shape[-1]), shape, out, conjugate=conjugate) is out
            np.testing.assert_allclose(out, np.conj(want) if conjugate else want, rtol=1e-12, atol=1e-12)
            keep = tuple(max(1, s - 2) for s in shape)
            back = inverse_spectrum(out, shape, keep, conjugate=conjugate)
            full = sfft.irfftn(want, s=shape, axes=axes)
            np.testing.assert_allclose(back, full[(slice(None),) * 2 + tuple(slice(0, q) for q in keep)],
                                       rtol=1e-12, atol=1e-12)


def test_spectrum_takes_the_last_axis_extended():
    with pytest.raises(ValueError, match="zero-extended to 12 points"):
        spectrum(np.zeros((2, 3, 5)), (12,), np.zeros((2, 3, 7), dtype=np.complex128))


def test_weight_transform_reused_from_forward_and_invalidated_by_an_update():
    g = ConvGeometry(3, 4, 1, (7, 7), (3, 3), (1, 1), (1, 1), (1, 1), (7, 7), True)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 7, 7))
    w = rng.standard_normal(g.weight_shape)
    dy = rng.standard_normal((2, 4, 7, 7))
    s = FFTConvolution()
    s.forward(x, w, None, g)
    first = s.kernel_transform(w, g)
    before = first.copy()
    assert s.kernel_transform(w, g) is first  # the backward pass of the same iteration reuses it
    w += 0.25  # the solver updates the weights in place
    again = s.kernel_transform(w, g)
    np.testing.assert_allclose(again, FFTConvolution().kernel_transform(w, g), rtol=1e-12, atol=1e-12)
    assert not np.allclose(again, before)
    np.testing.assert_allclose(s.backward_data(dy, w, g), get_strategy("type1").backward_data(dy, w, g),
                               rtol=1e-10, atol=1e-10)
    assert all(f >= e for f, e in zip(fft_shape(g), g.used_extent))  # no wrap-around on used positions


@pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")
def test_device_weight_transform_is_made_once_per_pass_without_comparing_the_weights():
    import cupy

    from cct.lowering.partition import BatchedLowering

    g = ConvGeometry(3, 4, 1, (7, 7), (3, 3), (1, 1), (1, 1), (1, 1), (7, 7), True)
    rng = np.random.default_rng(1)
    x, w, dy = (cupy.asarray(rng.standard_normal(s)) for s in ((2, 3, 7, 7), g.weight_shape, (2, 4, 7, 7)))
    s = FFTConvolution()
    s.prepare(w, g, "fwd")
    first = s.kernel_transform(w, g)  # the pass takes prepare's transform
    assert first is s._wcache[next(reversed(s._wcache))][1]
    second = s.kernel_transform(w, g)  # outside a pass: transformed again (nothing compared on the host)
    assert second is not first
    cupy.testing.assert_allclose(second, first, rtol=1e-12, atol=1e-12)
    w += 0.25  # the solver updates the weights in place: the next pass sees the new ones
    layer = BatchedLowering(s, batch_partition=2)
    ref = get_strategy("type1")
    np.testing.assert_allclose(to_host(layer.forward(x, w, None, g)), to_host(ref.forward(x, w, None, g)),
                               rtol=1e-10, atol=1e-10)
    w -= 0.5
    dx = cupy.empty_like(x)
    layer.backward_into(dy, x, w, g, dx=dx)
    np.testing.assert_allclose(to_host(dx), to_host(ref.backward_data(dy, w, g)), rtol=1e-10, atol=1e-10)
    w *= 2.0
    np.testing.assert_allclose(to_host(s.backward_data(dy, w, g)), to_host(ref.backward_data(dy, w, g)),
                               rtol=1e-10, atol=1e-10)


def test_fft_buffers_are_reused_and_results_stay_correct():
    """A second call with other data reuses every buffer (no buffer grows the scratch) and still
    matches type 1: what the first call left in the buffers never leaks into the second."""
    g = ConvGeometry(4, 6, 2, (9, 8), (3, 3), (1, 2), (2, 1), (1, 1), (5, 10), True)
    rng = np.random.default_rng(3)
    s, t = FFTConvolution(), get_strategy("type1")
    sizes = []
    for _ in range(2):
        x = rng.standard_normal((3, 4, 9, 8)).astype(np.float32)
        w = rng.standard_normal(g.weight_shape).astype(np.float32)
        b = rng.standard_normal(6).astype(np.float32)
        dy = rng.standard_normal((3, 6, 5, 10)).astype(np.float32)
        np.testing.assert_allclose(s.forward(x, w, b, g), t.forward(x, w, b, g), rtol=1e-4, atol=1e-4)
        dw, db = np.zeros(g.weight_shape, np.float32), np.zeros(6, np.float32)
        dx = np.full(x.shape, np.nan, np.float32)
        s.backward_into(dy, x, w, g, dw=dw, db=db, dx=dx)
        np.testing.assert_allclose(dx, t.backward_data(dy, w, g), rtol=1e-4, atol=1e-4)
        for a, r in zip((dw, db), t.backward_weights(dy, x, g)):
            np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4)
        sizes.append(len(s._scratch))
    assert sizes[0] == sizes[1] > 0


def _geometry(c, m, shape, k, stride=1, pad=0, dilation=1, group=1):
    p = caffe_pb2.ConvolutionParameter(num_output=m, group=group, kernel_size=[k], stride=[stride], pad=[pad],
                                       dilation=[dilation])
    return ConvGeometry.from_param(p, (2, c) + shape)


def test_layers_sharing_one_scratch_by_role_hold_what_forward_buffers_says():
    """Dense inference's FFT layers take their buffers from one SharedScratch by role: taking turns, each still
    equals type 1 (a buffer another layer left data in is zeroed again), and the scratch ends holding, per role,
    the largest of the layers' :meth:`forward_buffers` (so the planner's prediction is the bytes held)."""
    rng = np.random.default_rng(4)
    t = get_strategy("type1")
    for geoms in ([_geometry(3, 4, (11,), 3), _geometry(4, 2, (14,), 2, 2, 1)],
                  [_geometry(4, 6, (9, 10), 3, 2, 1), _geometry(6, 4, (12, 7), 2, 1, 0, 2, 2)],
                  [_geometry(6, 4, (7, 8, 9), 3, 1, 0, 2, 2), _geometry(2, 5, (6, 6, 6), 2, 2, 1)]):
        shared = SharedScratch()
        layers = [FFTConvolution() for _ in geoms]
        for layer, g in zip(layers, geoms):
            layer.share_scratch(shared)
            per_map = 8 * g.channels_in * int(np.prod(half_shape(fft_shape(g))))  # complex64 spectra of one map
            layer.WEIGHT_STAGE_BYTES = 2 * per_map  # the weights transformed two output maps at a time (a tail of 1)
            assert layer.weight_block(g, 4) == 2
        want: dict = {}
        for layer, g, n in zip(layers, geoms, (3, 2)):
            for role, nbytes in layer.forward_buffers(g, n, 4).items():
                want[role] = max(want.get(role, 0), nbytes)
        for _ in range(2):
            for layer, g, n in zip(layers, geoms, (3, 2)):
                x = rng.standard_normal((n, g.channels_in) + g.in_shape).astype(np.float32)
                w = rng.standard_normal(g.weight_shape).astype(np.float32)
                out = np.full((n, g.channels_out) + tuple(g.out_shape), np.nan, np.float32)
                layer.forward_into(x, w, None, g, out)
                np.testing.assert_allclose(out, t.forward(x, w, None, g), rtol=1e-4, atol=1e-4)
            dy = rng.standard_normal(out.shape).astype(np.float32)  # the blocked spectrum serves the gradient too
            dx = np.full(x.shape, np.nan, np.float32)
            layer.backward_into(dy, x, w, g, dx=dx)
            np.testing.assert_allclose(dx, t.backward_data(dy, w, g), rtol=1e-4, atol=1e-4)
        shared = SharedScratch()  # forward only: what the shared scratch holds is the prediction
        for layer in layers:
            layer.share_scratch(shared)
        for layer, g, n in zip(layers, geoms, (3, 2)):
            x = rng.standard_normal((n, g.channels_in) + g.in_shape).astype(np.float32)
            w = rng.standard_normal(g.weight_shape).astype(np.float32)
            out = np.empty((n, g.channels_out) + tuple(g.out_shape), np.float32)
            layer.forward_into(x, w, None, g, out)
            np.testing.assert_allclose(out, t.forward(x, w, None, g), rtol=1e-4, atol=1e-4)
        assert shared.sizes() == sorted(want.items())
        cg = geoms[0].channels_in // geoms[0].group
        spectrum_bytes = 8 * geoms[0].channels_out * cg * int(np.prod(half_shape(fft_shape(geoms[0]))))
        assert layers[0].kernel_bytes(geoms[0], 4) == spectrum_bytes + 4 * int(np.prod(geoms[0].weight_shape))


def test_a_forward_only_layer_is_chunked_by_its_forward_buffers():
    """A TEST net's FFT layer holds its forward buffers and weights' spectrum, not the training pass's spectra: its
    chunks are sized by that (larger chunks, fewer thin per-frequency products) under the same budget."""
    g = _geometry(16, 16, (12, 12, 12), 3)
    f = FFTConvolution()
    fwd = f.pass_workspace_bytes(g, 8, ("fwd",), 4)
    assert fwd == sum(f.forward_buffers(g, 8, 4).values()) + f.kernel_bytes(g, 4)
    assert f.pass_workspace_bytes(g, 8, ("fwd", "bwd_data", "bwd_weights"), 4) == f.workspace_bytes(g, 8, 4) > fwd
    assert max_batch_partition(f, g, 32, 4, fwd, ("fwd",)) == 8 > max_batch_partition(f, g, 32, 4, fwd)


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


def test_transforms_on_several_threads_equal_one_call():
    """With several BLAS threads the transforms use as many scipy workers; the result is the same as
    one single-threaded scipy call."""
    from cct import blas

    rng = np.random.default_rng(2)
    a = rng.standard_normal((5, 3, 9, 10)).astype(np.float32)
    want = sfft.rfftn(a, s=(12, 12), axes=(2, 3))
    with blas.blas_threads(2):
        out = np.empty((5, 3, 12, 7), dtype=np.complex64)
        np.testing.assert_allclose(spectrum(_extended(a, 12), (12, 12), out), want, rtol=1e-5, atol=1e-4)
        back = inverse_spectrum(want, (12, 12), (9, 10))
    np.testing.assert_allclose(back, a, rtol=1e-4, atol=1e-4)


def test_type2_on_a_1x1_convolution_runs_type3():
    """Lowering a kernel-1, stride-1 axis copies the input unchanged: type 2 lifts it instead, so on a
    1x1 convolution it runs (and is priced as) type 3."""
    g = ConvGeometry(8, 4, 1, (5, 6), (1, 1), (0, 0), (1, 1), (1, 1), (5, 6), True)
    t2, t3 = get_strategy("type2"), get_strategy("type3")
    assert t2._layout(g)[1] == () == t3._layout(g)[1]
    from cct.lowering import cost_model as cm

    for p in ("fwd", "bwd_data", "bwd_weights"):
        assert cm.pass_ops("type2", g, 3, p) == cm.pass_ops("type3", g, 3, p)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((3, 8, 5, 6)), rng.standard_normal(g.weight_shape)
    np.testing.assert_allclose(t2.forward(x, w, None, g), get_strategy("type1").forward(x, w, None, g), rtol=1e-12)


def test_weight_spectrum_computed_once_per_pass_for_all_partitions(monkeypatch):
    """BatchedLowering prepares the weights' spectrum once, before its chunks and partitions; every
    chunk (on every partition thread) reuses it, and an update of the weights computes it once more."""
    from cct.lowering import fft as fft_mod
    from cct.lowering.partition import BatchedLowering

    calls = []
    real = fft_mod.spectrum
    monkeypatch.setattr(fft_mod, "spectrum", lambda *a, **k: calls.append(k.get("tag")) or real(*a, **k))
    g = ConvGeometry(4, 6, 1, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1), (8, 8), True)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 4, 8, 8)).astype(np.float32)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    dy = rng.standard_normal((6, 6, 8, 8)).astype(np.float32)
    run = BatchedLowering(FFTConvolution(), batch_partition=1, partitions=2)
    want = get_strategy("type1")
    np.testing.assert_allclose(run.forward(x, w, None, g), want.forward(x, w, None, g), rtol=1e-4, atol=1e-4)
    dx = np.empty_like(x)
    run.backward_into(dy, x, w, g, dx=dx)
    np.testing.assert_allclose(dx, want.backward_data(dy, w, g), rtol=1e-4, atol=1e-4)
    weight_calls = [t for t in calls if t[0] == "w"]
    assert len(weight_calls) == 1 and len(calls) == 1 + 2 * 6  # one per chunk for x and dy
    w += 1.0
    run.forward(x, w, None, g)
    assert len([t for t in calls if t[0] == "w"]) == 2


def test_fft_without_the_pocketfft_binding_takes_the_array_module_path(monkeypatch):
    """Without scipy's binding (and on cupy) the same stages run through ``xp.fft``, results copied into
    place: the convolution still matches type 1 in every pass (dilated, strided, grouped)."""
    from cct.lowering import fft as fft_mod

    monkeypatch.setattr(fft_mod, "pocketfft_binding", lambda: None)
    g = ConvGeometry(4, 6, 2, (9, 8), (3, 2), (1, 0), (2, 1), (1, 2), (5, 6), True)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 9, 8))
    w = rng.standard_normal(g.weight_shape)
    b = rng.standard_normal(6)
    dy = rng.standard_normal((3, 6, 5, 6))
    s, t = FFTConvolution(), get_strategy("type1")
    np.testing.assert_allclose(s.forward(x, w, b, g), t.forward(x, w, b, g), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(s.backward_data(dy, w, g), t.backward_data(dy, w, g), rtol=1e-10, atol=1e-10)
    for a, r in zip(s.backward_weights(dy, x, g), t.backward_weights(dy, x, g)):
        np.testing.assert_allclose(a, r, rtol=1e-10, atol=1e-10)
