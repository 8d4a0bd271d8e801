"""Dense inference, part 2: overlap-save tiling, valid/same modes, file I/O, resume, errors, the planner."""
from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from cct.config import current
from cct.errors import CctError, MemoryBudgetError
from cct.infer.geometry import analyze
from cct.infer.naive import naive_dense
from cct.infer.pipeline import DenseInference
from cct.infer.plan import layer_growth, predict
from cct.infer.tiling import Tiling
from cct.lowering.calibrate import load_machine
from cct.lowering.cost_model import price
from cct.lowering.cost_model import strategy as priced_strategy
from cct.lowering.geometry import ConvGeometry
from cct.lowering.optimizer import predictions, priced_chunk
from cct.lowering.partition import memory_budget
from tests.infer_nets import TXT2, TXT3, random_net

_net = random_net


@pytest.fixture(scope="module")
def net2():
    return _net(TXT2)


@pytest.fixture(scope="module")
def ref2():
    net = _net(TXT2)
    return net, analyze(net)


def test_geometry_of_the_test_nets(net2):
    g = analyze(net2)
    assert g.field_of_view == (11, 11) and g.stride == (4, 4)


def test_tiles_cover_every_output_voxel_once():
    t = Tiling((50, 37), (13, 13), (28, 24), (16, 12), (1, 1))
    hits = np.zeros(t.output, dtype=int)
    for tile in t:
        hits[tuple(slice(s, s + n) for s, n in zip(tile.start, tile.size))] += 1
    assert t.output == (38, 25) and (hits == 1).all() and len(t) == 3 * 3


@pytest.mark.parametrize("patch", [(20, 20), (24, 28), (36, 20), (100, 100)])
def test_tiled_equals_one_shot_and_naive(net2, ref2, patch):
    vol = np.random.default_rng(1).standard_normal((31, 26))
    one_shot = DenseInference(net2, patch=(100, 100))(vol).copy()
    tiled = DenseInference(net2, patch=patch)(vol)
    assert tiled.shape == (3, 21, 16)
    np.testing.assert_allclose(tiled, one_shot, rtol=1e-10, atol=1e-12)
    if patch == (24, 28):  # ragged borders on both axes: compare with the definition too
        np.testing.assert_allclose(tiled, naive_dense(*ref2, vol[None], batch=512), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("padding,np_mode", [("zero", "constant"), ("mirror", "reflect")])
def test_same_mode_pads_as_stated(net2, ref2, padding, np_mode):
    vol = np.random.default_rng(2).standard_normal((17, 22))
    got = DenseInference(net2, patch=(20, 24), mode="same", padding=padding)(vol)
    assert got.shape == (3, 17, 22)
    want = naive_dense(*ref2, np.pad(vol, ((5, 5), (5, 5)), mode=np_mode)[None], batch=512)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_strided_method_tiles_the_nets_own_output(net2):
    vol = np.random.default_rng(3).standard_normal((41, 29))
    dense = DenseInference(net2, patch=(100, 100))(vol)
    strided = DenseInference(net2, patch=(21, 17), method="strided")(vol)
    np.testing.assert_allclose(strided, dense[:, ::4, ::4], rtol=1e-10, atol=1e-12)


def test_3d_tiled_equals_one_shot_with_every_method():
    net = _net(TXT3)
    vol = np.random.default_rng(4).standard_normal((2, 13, 17, 14))[:1]  # one channel, given with its axis
    want = DenseInference(net, patch=(64, 64, 64))(vol).copy()
    for method, patch in [("mpf", (14, 18, 14)), ("shift", (13, 14, 16))]:
        got = DenseInference(net, patch=patch, method=method)(vol)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


# -- files, resume, errors ------------------------------------------------------------------
@pytest.fixture()
def files(tmp_path):
    vol = np.random.default_rng(5).standard_normal((33, 30)).astype(np.float32)
    with h5py.File(tmp_path / "vol.h5", "w") as f:
        f.create_dataset("raw", data=vol, chunks=(8, 8))
        f.create_dataset("other", data=np.zeros(3))
    np.save(tmp_path / "vol.npy", vol)
    return tmp_path, vol


def test_h5_and_npy_files_stream_tile_by_tile(files, monkeypatch):
    tmp, vol = files
    net = _net(TXT2, dtype=np.float32)
    want = DenseInference(net, patch=(100, 100))(vol)
    boxes = []
    from cct.infer import volume_io

    real_read = volume_io.InputVolume.read

    def spy(self, box):
        boxes.append(tuple(s.stop - s.start for s in box))
        return real_read(self, box)

    monkeypatch.setattr(volume_io.InputVolume, "read", spy)
    di = DenseInference(net, patch=(21, 17))
    s = di.run_files(f"{tmp}/vol.h5:raw", f"{tmp}/out.h5:pred", progress=False)
    assert s["tiles"] == len(boxes) > 4 and max(int(np.prod(b)) for b in boxes) < vol.size  # never whole
    with h5py.File(tmp / "out.h5") as f:
        np.testing.assert_allclose(f["pred"][...], want, rtol=1e-5, atol=1e-6)
        assert f["pred"].attrs["cct_infer_method"] == "mpf" and "_cct_infer_done" not in f
    di.run_files(f"{tmp}/vol.npy", f"{tmp}/out.npy", progress=False)
    np.testing.assert_allclose(np.load(tmp / "out.npy"), want, rtol=1e-5, atol=1e-6)
    assert not os.path.exists(tmp / "out.npy.partial")


def test_tiff_stack_input(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    net = _net(TXT3, dtype=np.float32)
    vol = np.random.default_rng(6).standard_normal((13, 16, 12)).astype(np.float32)
    tifffile.imwrite(tmp_path / "vol.tif", vol)
    DenseInference(net, patch=(14, 14, 14)).run_files(str(tmp_path / "vol.tif"), str(tmp_path / "o.h5"),
                                                      progress=False)
    with h5py.File(tmp_path / "o.h5") as f:
        np.testing.assert_allclose(f["main"][...], DenseInference(net, patch=(64,) * 3)(vol), rtol=1e-5, atol=1e-6)


def test_interrupted_run_resumes_to_the_same_output(files):
    tmp, vol = files
    net = _net(TXT2, dtype=np.float32)
    full = DenseInference(net, patch=(21, 17))
    full.run_files(f"{tmp}/vol.h5:raw", f"{tmp}/ref.h5", progress=False)
    seen = []

    def stop_after_three(tile):
        seen.append(tile.index)
        if len(seen) == 3:
            raise KeyboardInterrupt

    di = DenseInference(net, patch=(21, 17))
    with pytest.raises(KeyboardInterrupt):
        di.run_files(f"{tmp}/vol.h5:raw", f"{tmp}/out.h5", progress=False, on_tile=stop_after_three)
    assert os.path.exists(tmp / "out.h5.partial") and not os.path.exists(tmp / "out.h5")
    second = []
    s = di.run_files(f"{tmp}/vol.h5:raw", f"{tmp}/out.h5", progress=False, on_tile=lambda t: second.append(t.index))
    assert s["resumed_tiles"] == 3 and not set(second) & set(seen) and len(second) == s["tiles"] - 3
    with h5py.File(tmp / "out.h5") as a, h5py.File(tmp / "ref.h5") as b:
        np.testing.assert_array_equal(a["main"][...], b["main"][...])


def test_a_different_job_does_not_resume_a_partial_output(files):
    tmp, vol = files
    net = _net(TXT2, dtype=np.float32)
    di = DenseInference(net, patch=(21, 17))

    def stop(tile):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        di.run_files(f"{tmp}/vol.h5:raw", f"{tmp}/out.h5", progress=False, on_tile=stop)
    s = DenseInference(net, patch=(25, 17)).run_files(f"{tmp}/vol.h5:raw", f"{tmp}/out.h5", progress=False)
    assert s["resumed_tiles"] == 0


@pytest.mark.parametrize("spec,match", [
    ("missing.h5:raw", "no such input file"),
    ("vol.h5:nope", "no dataset 'nope'"),
    ("vol.h5", "name the input dataset"),
    ("bad.h5:raw", "cannot read the input volume"),
    ("vol3d.npy", "does not fit the net"),
])
def test_bad_inputs_give_one_line_errors(files, spec, match):
    tmp, _ = files
    (tmp / "bad.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"garbage" * 20)
    np.save(tmp / "vol3d.npy", np.zeros((20, 20, 20), dtype=np.float32))
    di = DenseInference(_net(TXT2, dtype=np.float32), patch=(21, 17))
    with pytest.raises(CctError, match=match) as e:
        di.run_files(f"{tmp}/{spec}", f"{tmp}/out.h5", progress=False)
    assert "\n" not in str(e.value) and not os.path.exists(tmp / "out.h5")


# -- planning -------------------------------------------------------------------------------
def test_plan_fits_the_budget_and_a_smaller_budget_gives_a_smaller_patch():
    net = _net(TXT3, dtype=np.float32)
    plans = []
    for budget in (32 << 20, 2 << 20, 600 << 10):
        plan = DenseInference(net, budget=budget).make_plan((40, 40, 40))
        assert plan.peak_bytes <= budget
        plans.append(plan)
    sizes = [int(np.prod(p.patch)) * p.fragments for p in plans]
    assert sizes[0] > sizes[1] > sizes[2] or [int(np.prod(p.patch)) for p in plans] == sorted(
        [int(np.prod(p.patch)) for p in plans], reverse=True)
    assert int(np.prod(plans[0].patch)) > int(np.prod(plans[2].patch))
    text = plans[0].describe()
    assert "voxels/s" in text and "conv1" in text and "fragments" in text
    with pytest.raises(MemoryBudgetError, match="memory budget"):
        DenseInference(net, budget=10 << 10).make_plan((40, 40, 40))


def test_fft_layers_are_priced_without_the_fixed_weights_transform_and_share_their_buffers():
    """An FFT layer's forward in a plan costs the optimizer's price less its weights' transform in every chunk
    (dense inference's weights stay fixed: transformed once), and a second layer of the same shape adds only
    its weights' spectrum to the peak (the transform buffers are shared by role)."""
    txt = TXT3.replace("num_output: 2 ", "num_output: 6 ")
    net = _net(txt, dtype=np.float32, config=current().replace(engine={"overrides": {"*": "fft"}}))
    geom = analyze(net)
    plan = predict(net, geom, (2, 2, 2), (True, True))
    machine = load_machine(measure_if_missing=False)
    cap = memory_budget(None)
    for lp in plan.layers:
        cg = ConvGeometry.from_param(net.layer_by_name(lp.name).param.convolution_param, lp.shape)
        chunks = -(-lp.shape[0] // priced_chunk("fft", cg, lp.shape[0], machine, cap, ("fwd",)))
        transform = price(priced_strategy("fft").weight_transform_ops(cg), machine)["total"]
        full = predictions(cg, lp.shape[0], machine, "fwd", ["fft"], cap, ("fwd",))["fft"]
        assert transform > 0 and lp.seconds == pytest.approx(full - chunks * transform, rel=1e-12)
    cg = ConvGeometry.from_param(net.layer_by_name("conv3").param.convolution_param, plan.layers[2].shape)
    first, roles, own = layer_growth(net, "fft", cg, plan.layers[2].shape[0], 4, {}, [], 0)
    again, same, _ = layer_growth(net, "fft", cg, plan.layers[2].shape[0], 4, {}, roles, 0)
    assert same == roles and own > 0
    assert again == priced_strategy("fft").kernel_bytes(cg, 4) and first == again + own


@pytest.mark.parametrize("forced", [None, "fft"])
def test_predicted_peak_is_within_15_percent_of_measured(forced):
    """As planned (direct kernels here) and with every convolution forced to FFT (``EngineConfig.overrides``,
    which the planner prices as the layers run them): the layers' shared buffers are the plan's, role by role."""
    import tracemalloc

    txt = TXT3.replace("num_output: 2 ", "num_output: 6 ")
    vol = np.random.default_rng(7).standard_normal((32, 32, 32)).astype(np.float32)
    config = current().replace(engine={"overrides": {"*": forced} if forced else {}})
    DenseInference(_net(txt, dtype=np.float32, config=config), patch=(32, 32, 32))(vol)  # compiles (numba)
    net = _net(txt, dtype=np.float32, config=config)
    tracemalloc.start()
    try:
        di = DenseInference(net, patch=(32, 32, 32))  # the measured span: setup and a whole run
        result = di(vol)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    peak -= result.nbytes  # __call__'s result array holds the whole output, not part of the plan
    assert abs(peak - di.plan.peak_bytes) <= 0.15 * di.plan.peak_bytes, (peak, di.plan.describe())
    strategies = {lp.strategy for lp in di.plan.layers}
    assert strategies == {"fft"} if forced else "fft" not in strategies
    ran = {r.name: r.lowering.inner.name for _i, r, _b, _t in di.runner.steps if hasattr(r, "lowering")}
    assert ran == di.plan.strategies()  # the layers run the plan's lowerings
    want = sorted((role, n) for r in di.plan.scratch_roles for role, n in r.items() if n and role != "weights")
    assert di.runner.scratch.sizes() == want
