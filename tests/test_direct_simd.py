"""The register-blocked direct kernels (cct/kernels/conv_simd.py, cct/lowering/direct_layout.py):
every pass against type 1 on geometries that exercise both buffer layouts, every output-channel
block, the weight gradient's column chunks and channel tails, image blocks across chunks, and the
fallback to the plain kernels where the register-blocked ones cannot run."""
import numpy as np
import pytest

from cct import kernels
from cct.kernels import simd_tiles
from cct.lowering import ConvGeometry, get_strategy
from cct.lowering import direct_layout as dl

pytestmark = pytest.mark.skipif(kernels.get("conv_simd") is None, reason="numba kernels unavailable")


def geom(c, m, g, ins, k, p, s, d, bias=True):
    out = tuple((i + 2 * pp - ((kk - 1) * dd + 1)) // ss + 1 for i, kk, pp, ss, dd in zip(ins, k, p, s, d))
    return ConvGeometry(c, m, g, tuple(ins), tuple(k), tuple(p), tuple(s), tuple(d), out, bias)


CASES = {
    "rows, wide output": geom(3, 32, 1, (32, 32), (5, 5), (2, 2), (1, 1), (1, 1)),
    "flat, narrow output": geom(8, 12, 1, (8, 8), (5, 5), (2, 2), (1, 1), (1, 1)),
    "rows, vertical stride": geom(6, 10, 2, (9, 11), (3, 2), (1, 0), (2, 1), (1, 2)),
    "1-D dilated": geom(4, 7, 1, (13,), (3,), (1,), (1,), (2,)),
    "3-D": geom(4, 9, 1, (5, 6, 7), (3, 3, 3), (1, 1, 1), (1, 1, 1), (1, 1, 1)),
    "3-D strided depth": geom(4, 9, 1, (5, 6, 7), (2, 3, 3), (0, 1, 1), (2, 2, 1), (1, 1, 2)),
    "1x1 grouped": geom(16, 20, 4, (7, 7), (1, 1), (0, 0), (1, 1), (1, 1)),
    "two output channels": geom(5, 2, 1, (6, 6), (3, 3), (1, 1), (1, 1), (1, 1)),
    "k=7 (two column chunks)": geom(5, 6, 1, (10, 10), (7, 7), (3, 3), (1, 1), (1, 1)),
    "k=13 (the generic tap loop)": geom(3, 5, 1, (12, 12), (13, 13), (6, 6), (1, 1), (1, 1)),
    "k=11 stride 4 (stride phases)": geom(3, 5, 1, (23, 23), (11, 11), (2, 2), (4, 4), (1, 1)),
    "3-D stride 2 grouped (stride phases)": geom(4, 6, 2, (7, 8, 9), (3, 3, 3), (1, 1, 1), (2, 1, 2), (1, 1, 1)),
    "strided and dilated (fallback forward and data)": geom(4, 6, 1, (11, 12), (3, 3), (1, 1), (2, 2), (2, 1)),
    "pad past the kernel's reach (fallback data)": geom(5, 6, 1, (10, 10), (3, 3), (4, 4), (1, 1), (1, 1)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_every_pass_matches_type1(name, dtype):
    g = CASES[name]
    rng = np.random.default_rng(len(name))
    n = 11  # more than one image block (8) and an uneven split over two chunks
    x = rng.standard_normal((n, g.channels_in) + g.in_shape).astype(dtype)
    w = rng.standard_normal(g.weight_shape).astype(dtype)
    b = rng.standard_normal(g.channels_out).astype(dtype)
    dy = rng.standard_normal((n, g.channels_out) + g.out_shape).astype(dtype)
    d, t = get_strategy("direct"), get_strategy("type1")
    tol = 1e-4 if dtype == np.float32 else 1e-11
    got = [d.forward(x, w, b, g), d.backward_data(dy, w, g), *d.backward_weights(dy, x, g)]
    want = [t.forward(x, w, b, g), t.backward_data(dy, w, g), *t.backward_weights(dy, x, g)]
    for a, r in zip(got, want):
        assert a.shape == r.shape and a.dtype == r.dtype
        np.testing.assert_allclose(a, r, rtol=tol, atol=tol * np.abs(r).max())
    if dl.plan_layout(g, dl.priced_lanes()) is not None:  # the forward ran its width's driver (or the generic one)
        width = g.kernel[-1] if g.kernel[-1] in kernels.get("conv_simd").UNROLLED_WIDTHS else 0
        assert width in {kw for _, kw in kernels.get("conv_simd").FORWARD_DRIVERS}


def test_layouts_and_blocks():
    """Wide rows keep the rows layout (no dropped positions); narrow ones read the plane flat; the
    channel block wastes the fewest lanes."""
    wide = dl.plan_layout(CASES["rows, wide output"], 16)
    assert not wide.flat and wide.efficiency == 1.0 and wide.ncol == 2
    narrow = dl.plan_layout(CASES["flat, narrow output"], 16)
    assert narrow.flat and narrow.efficiency == pytest.approx(64 / 96)  # 8 rows of 12 in 6 vectors
    assert not dl.plan_layout(CASES["rows, vertical stride"], 16).flat
    assert dl.plan_layout(CASES["k=11 stride 4 (stride phases)"], 16) is None
    p = dl.phase_geometry(CASES["k=11 stride 4 (stride phases)"])  # 16 phase planes of 7 x 7, 3 x 3 taps
    got = (p.channels_in, p.in_shape, p.kernel, p.stride, p.pad, p.out_shape)
    assert got == (48, (7, 7), (3, 3), (1, 1), (0, 0), (5, 5))
    assert dl.phase_geometry(CASES["rows, wide output"]) is None
    assert dl.phase_geometry(CASES["strided and dilated (fallback forward and data)"]) is None
    # 32 channels over 16 rows: 8 x 3 tiles; 3 channels: one 4 x 6 tile; LeNet's conv2 (50 channels,
    # 6 vectors): 4 x 6 tiles (52 channels) beat 8 x 3 ones (56)
    # (AVX-512 tiles: 24 accumulators of 16 floats)
    wide = simd_tiles.forward_rows(64)
    assert dl.forward_blocking(32, 16, wide) == (8, pytest.approx(4 * (5 * 24 + 9) / (32 * 16)))
    assert dl.forward_blocking(3, 32, wide)[0] == 4 and dl.forward_blocking(50, 6, wide)[0] == 4
    assert dl.forward_blocking(1, 40, wide)[0] == 2
    # AVX2 tiles: 12 accumulators of 8 floats; 32 channels over 16 rows in 4 x 3 tiles
    narrow = simd_tiles.forward_rows(32)
    assert max(j * r for j, r in narrow.items()) == 12
    assert dl.forward_blocking(32, 16, narrow) == (4, pytest.approx(8 * (5 * 12 + 5) / (32 * 16)))
    km = kernels.get("conv_simd")
    assert km.FORWARD_ROWS == dl.forward_tiles() and km.WGRAD_CHANNELS == dl.wgrad_table()
    assert km.lanes(np.float32) * 4 == simd_tiles.host_vector_bytes()
    # 11 columns run as tiles of 5 and 6: priced with the 6-column tile's input channels
    wide_w, narrow_w = simd_tiles.wgrad_channels(64), simd_tiles.wgrad_channels(32)
    assert [dl.wgrad_channels(k, wide_w) for k in (1, 3, 5, 7, 11)] == [12, 4, 2, 3, 2]
    assert [dl.wgrad_channels(k, narrow_w) for k in (1, 3, 5, 7, 11)] == [6, 2, 1, 1, 1]


@pytest.mark.parametrize("band", [0, 1 << 40])
def test_forward_tile_orders_agree(monkeypatch, band):
    """Channel blocks innermost (an image's input beyond BAND_BYTES) or rows innermost: the same output."""
    km = kernels.get("conv_simd")
    monkeypatch.setattr(km, "BAND_BYTES", band)
    g = CASES["rows, wide output"]  # the input (3 x 36 x 44) outweighs the weights (32 x 3 x 25)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, g.channels_in) + g.in_shape).astype(np.float32)
    w = rng.standard_normal(g.weight_shape).astype(np.float32)
    got, want = get_strategy("direct").forward(x, w, None, g), get_strategy("type1").forward(x, w, None, g)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_fast_kernels_run_where_they_apply(monkeypatch):
    """The register-blocked kernels take the unit-stride passes; the plain kernels the others."""
    km, plain = kernels.get("conv_simd"), kernels.get("direct")
    calls = []
    for mod, name in ((km, "forward"), (km, "weight_grad"), (plain, "forward"), (plain, "backward_data")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=f"{mod.__name__[12:]}.{name}": calls.append(_n) or _r(*a))
    rng = np.random.default_rng(0)
    d = get_strategy("direct")
    for key in ("rows, wide output", "k=11 stride 4 (stride phases)",
                "strided and dilated (fallback forward and data)"):
        g = CASES[key]
        x = rng.standard_normal((2, g.channels_in) + g.in_shape).astype(np.float32)
        w = rng.standard_normal(g.weight_shape).astype(np.float32)
        dy = rng.standard_normal((2, g.channels_out) + g.out_shape).astype(np.float32)
        d.forward(x, w, None, g)
        d.backward_data(dy, w, g)
        d.backward_weights(dy, x, g)
    assert calls == ["conv_simd.forward", "conv_simd.forward", "conv_simd.weight_grad"] * 2 + [
        "direct.forward", "direct.backward_data", "conv_simd.weight_grad"]


def test_fallback_passes_are_priced_as_slow():
    """A pass only the plain kernels run is priced FALLBACK_SLOWDOWN times its multiply-adds."""
    from cct.lowering.direct import FALLBACK_SLOWDOWN

    d = get_strategy("direct")
    g = CASES["strided and dilated (fallback forward and data)"]
    macs = 4 * g.channels_out * g.channels_in * g.kernel_size * g.out_size
    for p in ("fwd", "bwd_data"):
        assert ("direct", macs * FALLBACK_SLOWDOWN) in d.pass_ops(g, 4, p)
    # the weight gradient runs on the fast kernel: 6 output channels in a block of two vectors (32 lanes
    # with AVX-512, 16 without), 4 input channels in whole tiles (3 columns: tiles of 4, or 2)
    assert 4 % dl.wgrad_channels(3) == 0
    assert ("direct_wgrad", pytest.approx(macs * 2 * dl.priced_lanes() / 6)) in d.pass_ops(g, 4, "bwd_weights")
    # a strided layer is priced as its stride-phase convolution
    s4 = CASES["k=11 stride 4 (stride phases)"]
    assert d.pass_ops(dl.phase_geometry(s4), 4, "fwd")[0] in d.pass_ops(s4, 4, "fwd")


@pytest.mark.parametrize("key", ["k=11 stride 4 (stride phases)", "3-D stride 2 grouped (stride phases)"])
def test_stride_phase_split_and_merge(key):
    """The compiled phase split equals the numpy one and the merge inverts it on the input's elements."""
    g = CASES[key]
    p = dl.phase_geometry(g)
    km = kernels.get("conv_simd")
    x = np.random.default_rng(3).standard_normal((3, g.channels_in) + g.in_shape).astype(np.float32)
    planes = dl.phase_input(x, g, p, km)
    np.testing.assert_array_equal(planes, dl.phase_input(x, g, p))
    assert planes.shape == (3, p.channels_in) + p.in_shape
    for k in (km, None):
        back = np.full_like(x, np.nan)
        dl.unphase_input_grad(planes, g, p, back, k)
        np.testing.assert_array_equal(back, x)
    w = np.random.default_rng(4).standard_normal(g.weight_shape).astype(np.float32)
    np.testing.assert_array_equal(dl.unphase_weights(dl.phase_weights(w, g, p), g, p), w)


def test_forward_driver_made_once_under_concurrent_first_use(monkeypatch):
    """Batch partitions that reach a new kernel width together share one driver (one compile)."""
    import threading

    km = kernels.get("conv_simd")
    monkeypatch.setattr(km, "FORWARD_DRIVERS", {})
    jb = next(iter(km.FORWARD_ROWS))
    got, start = [], threading.Barrier(4)

    def first_use():
        start.wait()
        got.append(km.forward_driver(jb, 9))

    threads = [threading.Thread(target=first_use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(d is got[0] for d in got) and list(km.FORWARD_DRIVERS) == [(jb, 9)]
    assert km.forward_driver(jb, 13) is km.FORWARD_DRIVERS[(jb, 0)]  # wider than UNROLLED_WIDTHS: the generic loop
