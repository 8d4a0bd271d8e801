"""Lowering cost model (Figure 6), calibration cache and the automatic optimizer."""
import math

import numpy as np
import pytest

from cct.config import current, parse_overrides
from cct.kernels import simd_tiles
from cct.lowering import ConvGeometry, get_strategy
from cct.lowering import calibrate as cal
from cct.lowering import cost_model as cm
from cct.lowering import direct_layout as dl
from cct.lowering import fft as fft_mod
from cct.lowering import optimizer as opt
from cct.lowering.base import check_names


def square(n, k, d, o, pad=0, stride=1, group=1):
    m = (n + 2 * pad - k) // stride + 1
    return ConvGeometry(d, o, group, (n, n), (k, k), (pad, pad), (stride, stride), (1, 1), (m, m), True)


def flat_machine(gflops=100.0, copy_ns=1.0, add_ns=1.0):
    dims = [1, 100000]
    return cm.Machine(grid_dims=dims, gemm_bign=[[gflops] * 2] * 2, gemm_bigk=[[gflops] * 2] * 2,
                      big_curve=[], copy_ns=copy_ns, add_ns=add_ns, zero_ns=0.0, gemm_overhead_s=0.0,
                      cache_bytes=1 << 60)  # no DRAM-streaming term unless a test asks for one


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    current().caches.clear()


def test_figure6_formulas():
    n, k, d, o = 13, 3, 384, 256
    m = n - k + 1
    g = square(n, k, d, o)
    f1, f2, f3 = (cm.figure6(t, g) for t in ("type1", "type2", "type3"))
    assert f1["lowered_data"] == (k * k * d, m * m) and f1["lowered_kernel"] == (o, k * k * d)
    assert f2["lowered_data"] == (k * d, m * n) and f2["lowered_kernel"] == (o * k, k * d)
    assert f3["lowered_data"] == (d, n * n) and f3["lowered_kernel"] == (o * k * k, d)
    assert f1["gemm_flops"] == 2 * o * k * k * d * m * m
    assert f2["gemm_flops"] == 2 * o * k * k * d * m * n
    assert f3["gemm_flops"] == 2 * o * k * k * d * n * n
    assert (f1["lifting_flops"], f2["lifting_flops"], f3["lifting_flops"]) == (0, m * m * k * o, m * m * k * k * o)
    assert (f1["lifting_ram_read"], f2["lifting_ram_read"], f3["lifting_ram_read"]) == (
        o * m * m, o * k * m * n, o * k * k * n * n)
    # batches and groups scale the columns / split the matrices
    gg = square(n, k, d, o, group=2)
    assert cm.figure6("type1", gg, 4)["lowered_data"] == (k * k * d // 2, 4 * m * m)
    assert cm.figure6("type1", gg, 4)["gemm_flops"] == 4 * f1["gemm_flops"] // 2


def test_ratio_d_over_o_decides_type1_vs_type3():
    mach = flat_machine()
    many_in = square(13, 3, 512, 16)
    many_out = square(13, 3, 16, 512)
    assert opt.choose_plan(many_in, 8, mach, per_pass=False).single == "type3"
    assert opt.choose_plan(many_out, 8, mach, per_pass=False).single == "type1"
    p_in = opt.predictions(many_in, 8, mach)
    assert p_in["type3"] < p_in["type1"]


def test_predictions_scale_with_batch_and_machine():
    g = square(27, 5, 96, 256, pad=2)
    fast, slow = flat_machine(200.0), flat_machine(100.0)
    for t in ("type1", "type2", "type3"):
        for p in ("fwd", "bwd_data", "bwd_weights"):
            a = cm.predict_seconds(t, g, 4, slow, p)
            assert a > 0
            assert cm.predict_seconds(t, g, 8, slow, p) == pytest.approx(2 * a, rel=1e-6)
            assert cm.predict_seconds(t, g, 4, fast, p) < a
        assert cm.predict_seconds(t, g, 4, slow, "total") == pytest.approx(
            sum(cm.predict_seconds(t, g, 4, slow, p) for p in cm.PASSES))


def test_gemm_interpolation():
    mach = cm.Machine(grid_dims=[4, 64, 1024], gemm_bign=[[10, 20, 40], [20, 40, 80], [40, 80, 160]],
                      gemm_bigk=[[1, 1, 1]] * 3, big_curve=[(16, 0.5), (4096, 1.0)])
    assert mach.gemm_gflops(64, 10**6, 64) == pytest.approx(40)  # n >> k: the big-N grid
    assert mach.gemm_gflops(16, 10**6, 64) == pytest.approx(np.sqrt(20 * 40))  # log-midpoint
    assert mach.gemm_gflops(1, 10**6, 1) == pytest.approx(10)  # clamped to the grid
    assert mach.gemm_gflops(64, 10**6, 16) == pytest.approx(np.sqrt(20 * 40))  # k=16: log-midpoint of 4 and 64
    assert mach.gemm_gflops(64, 16, 10**6) == pytest.approx(1.0)  # k >> n: the big-K grid
    assert mach.gemm_gflops(64, 4096, 4096) == pytest.approx(np.sqrt(80 * 1.0))  # both large: blend
    assert mach.gemm_gflops(64, 10**6, 4) == pytest.approx(20)
    assert mach.gemm_gflops(4, 16, 1) == pytest.approx(10 * 0.5)  # n >= 8k, small n: the small-N factor


def test_workspace_linear_in_batch():
    g = square(13, 3, 64, 64, pad=1)
    for t in ("type1", "type2", "type3"):
        assert cm.workspace_bytes(t, g, 8) == 8 * cm.workspace_bytes(t, g, 1)


def test_overrides_and_per_pass_plans():
    g = square(13, 3, 384, 256, pad=1)
    mach = flat_machine()
    assert opt.choose_plan(g, 4, mach, override="type2").single == "type2"
    assert parse_overrides("type3") == {"*": "type3"}
    assert parse_overrides("conv1=type3, conv5=type1") == {"conv1": "type3", "conv5": "type1"}
    with pytest.raises(KeyError, match="unknown lowering 'type9'"):
        check_names(parse_overrides("conv1=type9").values())
    plan = opt.plan_convolution(g, 4, mach, override="type3", partitions=1)
    assert plan.strategy().name == "type3" and plan.single == "type3"
    assert opt.describe_plan("conv1", plan).endswith("[override]")
    plan = opt.plan_convolution(g, 4, mach, partitions=1)
    assert opt.describe_plan("conv2", plan).startswith("conv2: ")
    mixed = opt.Plan("type3", "type1", "type2", plan.predictions)
    s = mixed.strategy()
    assert isinstance(s, opt.PerPassLowering) and s.fwd.name == "type3" and s.bwd_weights.name == "type2"
    assert "bwd_data type 1" in opt.describe_plan("convX", mixed)
    # per-pass only when it pays more than min_gain
    single = opt.choose_plan(g, 4, mach, per_pass=True, min_gain=1.0)
    assert single.single is not None


def test_predictions_account_for_the_memory_budget():
    g = square(13, 3, 64, 64, pad=1)
    mach = flat_machine()
    free = opt.predictions(g, 8, mach, budget=10**15)
    tight = opt.predictions(g, 8, mach, budget=1)  # every lowering falls back to b_p = 1
    over = mach.chunk_overhead_s
    for t in free:
        # the cost model's best chunking: never worse than one whole-batch lowering
        whole = cm.predict_seconds(t, g, 8, mach) + over
        assert free[t] <= whole * (1 + 1e-9)
        assert free[t] == pytest.approx(min(cm.chunked_seconds(t, g, 8, bp, mach, "fwd")
                                            for bp in [cm.best_batch_partition(t, g, 8, mach)[0]]))
        assert tight[t] == pytest.approx(8 * (cm.predict_seconds(t, g, 1, mach) + over))
    overheady = flat_machine()
    overheady.gemm_overhead_s = 1e-3
    assert opt.predictions(g, 8, overheady, budget=1)["type1"] > opt.predictions(g, 8, overheady)["type1"]


def test_strategies_declare_their_operations():
    """The model prices what each strategy declares: type 3's forward GEMM is Figure 6's, the direct
    kernel declares its multiply-adds, FFT its transforms and complex GEMMs; prices add up."""
    g = square(13, 3, 64, 64, pad=1)
    ops = get_strategy("type3").pass_ops(g, 4, "fwd")
    gemm = [op for op in ops if op[0] == "gemm"]
    f6 = cm.figure6("type3", g, 4)
    assert gemm == [("gemm", *f6["gemm_output"], f6["lowered_kernel"][1], 1)]
    direct = get_strategy("direct").pass_ops(g, 4, "fwd")
    # every position the tiles compute counts (the layout's dropped ones and the blocking's idle ones,
    # cct.lowering.direct_layout), with the kernel width for the per-row term
    lay = dl.plan_layout(g, dl.priced_lanes())
    macs = 4 * 64 * 64 * 9 * 13 * 13 / lay.efficiency * dl.forward_blocking(64, lay.nrow)[1]
    assert ("direct", pytest.approx(macs), 3) in direct
    if simd_tiles.host_vector_bytes() == 64:  # one vector of 16 per row; 13 rows as 4 tiles of 3 and 1 of 1
        assert macs == pytest.approx(4 * 64 * 64 * 9 * 13 * 13 * 16 / 13 * (4 * 24 + 9) / (8 * 13))
    kinds = {op[0] for op in get_strategy("fft").pass_ops(g, 4, "bwd_weights")}
    assert {"fft", "cgemm"} <= kinds
    mach = flat_machine()
    for name in ("type1", "type2", "type3", "direct", "fft"):
        parts = cm.predict_breakdown(name, g, 4, mach, "total")
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total")) and parts["total"] > 0
    assert cm.price([("direct", 1e9)], mach)["direct"] == pytest.approx(2.0 / (cm.DIRECT_SHARE * 100.0))
    mach.direct_gflops, mach.fft_gflops = 50.0, 5.0
    assert cm.price([("direct", 1e9), ("fft", 1e9)], mach)["total"] == pytest.approx(2.0 / 50 + 1.0 / 5)
    # the kernel-width term: seconds per multiply-add a + b / width through the 5x5 and 3x3 rates
    mach.direct_k3_gflops = 40.0
    per = {k: cm.price([("direct", 1e9, k)], mach)["direct"] for k in (1, 3, 5, 11)}
    assert per[5] == pytest.approx(2.0 / 50) and per[3] == pytest.approx(2.0 / 40)
    b = (2.0 / 40 - 2.0 / 50) / (1 / 3 - 1 / 5)
    assert per[1] == pytest.approx(2.0 / 50 + 0.8 * b) and per[11] == pytest.approx(2.0 / 50 + (1 / 11 - 0.2) * b)
    assert cm.price([("direct", 1e9)], mach)["direct"] == per[5]  # no width given: the 5x5 rate
    # forward transforms: the rate interpolated in log(points) between the two measured sizes, held outside
    mach.fft_large_gflops = 20.0
    fft = {p: cm.price([("fft", 1e9, p)], mach)["fft"] for p in (8, 18, 25, 36, 128)}
    assert fft[8] == fft[18] == pytest.approx(1.0 / 5) and fft[36] == fft[128] == pytest.approx(1.0 / 20)
    t = math.log(25 / 18) / math.log(2)
    assert fft[25] == pytest.approx(1.0 / (5 ** (1 - t) * 20 ** t))
    assert cm.price([("ifft", 1e9, 36)], mach)["fft"] == pytest.approx(1.0 / 5)  # inverse: one rate
    # the input's transform, pruned to the lines its padded extent fills
    assert ("fft", pytest.approx(4 * 64 * fft_mod._fft_flops(fft_mod.fft_shape(g), g.used_extent)),
            max(fft_mod.fft_shape(g))) in get_strategy("fft").pass_ops(g, 4, "fwd")
    # a complex GEMM: the real GEMM of its 2x2 real blocks, (m, 2k) @ (2k, 2n)
    single = cm.price([("gemm", 10, 20, 20, 1)], mach)["gemm"] - mach.gemm_overhead_s
    assert cm.price([("cgemm", 10, 10, 10, 3)], mach)["gemm"] == pytest.approx(3 * single + mach.gemm_overhead_s)


def test_machine_cache_roundtrip(tmp_path):
    m = cal.calibrate(quick=True, save=False)
    assert all(v > 0 for row in m.gemm_bign for v in row) and m.copy_ns > 0 and m.threads >= 1
    m2 = cm.Machine.from_json(m.to_json())
    assert m2.gemm_bign == m.gemm_bign and m2.big_curve == m.big_curve
    # a cached file is what load_machine returns, without measuring
    from cct import blas

    fake = flat_machine(123.0)
    fake.threads = m.threads
    blas.write_cache(cal._cache_name(blas.get_num_threads(), blas.get_backend()), fake.to_json())
    current().caches.clear()
    loaded = cal.load_machine(measure_if_missing=False)
    assert loaded.gemm_bign[0][0] == 123.0
    current().caches.clear()
    for f in tmp_path.glob("machine-*.json"):
        f.unlink()
    assert cal.load_machine(measure_if_missing=False).nominal


def test_calibrate_cli_quick(capsys):
    assert cal.main(["--quick", "--blas", "openblas"]) == 0
    out = capsys.readouterr().out
    assert "GEMM GFLOPS" in out and "kernel" in out


def test_chunked_seconds_and_best_batch_partition():
    g = square(16, 5, 32, 32, pad=2)
    mach = flat_machine()
    over = mach.chunk_overhead_s
    # whole batch = one chunk; b_p = 1 = batch chunks; a remainder chunk is priced at its own size
    assert cm.chunked_seconds("type1", g, 10, 10, mach, "fwd") == pytest.approx(
        cm.predict_seconds("type1", g, 10, mach, "fwd") + over)
    assert cm.chunked_seconds("type1", g, 10, 1, mach, "fwd") == pytest.approx(
        10 * (cm.predict_seconds("type1", g, 1, mach, "fwd") + over))
    assert cm.chunked_seconds("type1", g, 10, 4, mach, "fwd") == pytest.approx(
        2 * (cm.predict_seconds("type1", g, 4, mach, "fwd") + over)
        + cm.predict_seconds("type1", g, 2, mach, "fwd") + over)
    cands = cm.batch_partition_candidates(100)
    assert cands[0] == 1 and cands[-1] == 100 and {2, 4, 50, 34} <= set(cands)
    assert cm.batch_partition_candidates(100, max_bp=10)[-1] == 10
    # flat per-element costs: nothing favours small chunks, the per-chunk overhead favours one big one
    assert cm.best_batch_partition("type1", g, 64, mach)[0] == 64
    # cache effect: sweeps that stream from DRAM above ~1M elements cost 5x -> cache-sized chunks win
    cachey = flat_machine()
    cachey.lowering_curves = {"type1": {"lower": [(1e4, 0.2), (1e6, 0.2), (4e6, 1.0), (1e9, 1.0)],
                                        "unlower": [(1e4, 0.2), (1e6, 0.2), (4e6, 1.0), (1e9, 1.0)]}}
    bp, t = cm.best_batch_partition("type1", g, 64, cachey)
    per_image = 32 * 25 * 256
    assert 1 <= bp < 64 and bp * per_image <= 4e6
    assert t < cm.chunked_seconds("type1", g, 64, 64, cachey, "total")


def test_gemm_operands_beyond_the_cache_are_priced_as_streaming():
    g = square(16, 5, 32, 32, pad=2)
    roomy = flat_machine()
    small = flat_machine()
    small.cache_bytes, small.stream_ns_per_byte = 2 << 20, 0.05
    ops = [op for op in cm.pass_ops("type1", g, 64, "fwd") if op[0] == "gemm"]
    (_, m, n, k, count), = ops
    extra = (4.0 * count * (m * k + k * n + m * n) - (2 << 20) * cm.CACHE_SHARE) * 0.05e-9
    assert cm.predict_seconds("type1", g, 64, small, "fwd") == pytest.approx(
        cm.predict_seconds("type1", g, 64, roomy, "fwd") + extra)
    # one image's operands fit: no extra cost; so cache-sized chunks win despite the per-chunk overhead
    one = cm.predict_seconds("type1", g, 1, roomy, "fwd")
    assert cm.predict_seconds("type1", g, 1, small, "fwd") == pytest.approx(one)
    assert cm.best_batch_partition("type1", g, 64, small)[0] < 64
    assert small.streaming_seconds(1 << 18) == 0.0
    assert cm.detect_cache_bytes() > 0


def test_type1_single_image_backward_has_no_group_major_copy():
    """Type 1 reshapes one image's dy in place (no copy); a chunk of several images copies it group-major.
    The model prices exactly that, which is what makes b_p = 1 win for CaffeNet's conv1/conv2."""
    g = square(27, 5, 96, 256, pad=2, group=2)
    per_image = g.channels_out * g.out_size
    copies = {n: [op for op in cm.pass_ops("type1", g, n, "bwd_weights") if op[0] == "copy"] for n in (1, 4)}
    assert copies[1] == []
    assert copies[4] == [("copy", 4 * per_image, g.out_size)]  # runs of one output plane
    # the data-gradient pass likewise
    assert not [op for op in cm.pass_ops("type1", g, 1, "bwd_data") if op[0] == "copy"]
    mach = flat_machine()
    assert cm.predict_seconds("type1", g, 4, mach, "bwd_weights") > 4 * cm.predict_seconds("type1", g, 1, mach,
                                                                                           "bwd_weights")


def test_recalibrate_kernels_keeps_gemm_grids_and_remeasures_curves(monkeypatch):
    """``cct calibrate --kernels``: the cached GEMM grids stay, the copy/lowering curves are measured
    anew (for real, quickly: small sizes); with nothing cached it is a full calibration."""
    from cct import blas

    real_ew, real_lw = cal.measure_elementwise, cal.measure_lowerings
    monkeypatch.setattr(cal, "measure_elementwise", lambda sizes, repeats: real_ew((1 << 12, 1 << 14), 1))
    monkeypatch.setattr(cal, "measure_lowerings", lambda sizes, repeats: real_lw(((16, 2),), 1))
    full = []
    monkeypatch.setattr(cal, "calibrate", lambda **kw: full.append(kw) or "full")
    assert cal.recalibrate_kernels(threads=1) == "full" and full  # nothing cached yet
    m = flat_machine(gflops=123.0)
    m.threads, m.backend = 1, blas.get_backend()
    m.lowering_curves = {"type1": {"lower": [(1, 99.0)]}}
    blas.write_cache(cal._cache_name(1, m.backend), m.to_json())
    new = cal.recalibrate_kernels(threads=1)
    assert new.gemm_bign == m.gemm_bign and new.gemm_bigk == m.gemm_bigk
    assert new.lowering_curves["type1"]["lower"] != [(1, 99.0)]
    assert set(new.elem_curves) >= {"copy", "add", "zero"} and new.copy_ns == new.elem_curves["copy"][-1][1]
    again = cal.Machine.from_json(blas.read_cache(cal._cache_name(1, m.backend)))
    assert again.lowering_curves == new.lowering_curves and "kernels_measured_at" in again.info


class _ToyConvolution(type(get_strategy("type1"))):
    """type 1's arithmetic, declared ten times cheaper: a strategy the optimizer knows only by its ops."""

    name = "toy"

    def pass_ops(self, geom, batch, pass_):
        return [(op[0], *(v / 10 if i == 0 and op[0] != "gemm" else v for i, v in enumerate(op[1:])))
                if op[0] != "gemm" else ("gemm", op[1], max(1, op[2] // 10), op[3], op[4])
                for op in super().pass_ops(geom, batch, pass_)]


def test_registered_toy_strategy_is_chosen_when_cheapest():
    from cct.lowering import base

    g = square(13, 3, 64, 64, pad=1)
    mach = flat_machine()
    assert "toy" not in opt.candidates(g)
    base.register_strategy("toy", _ToyConvolution)
    try:
        assert "toy" in opt.candidates(g)
        plan = opt.plan_convolution(g, 8, mach, partitions=1)
        assert plan.single == "toy" and plan.b_p >= 1 and plan.partitions == 1
        assert isinstance(plan.strategy(), _ToyConvolution)
        line = opt.describe_plan("conv", plan)
        assert line.startswith("conv: toy, b_p=") and "type 1" in line and "workspace" in line
    finally:
        base.unregister_strategy("toy")
    assert "toy" not in opt.candidates(g)


def test_memory_budget_picks_the_fastest_strategy_that_fits():
    """ZNNi's memory-aware choice: with a budget below the fastest strategy's one-image workspace the
    next fastest that fits wins; with none fitting, the smallest workspace, flagged in the report."""
    g = square(13, 3, 64, 64, pad=1)
    mach = flat_machine()
    free = opt.choose_plan(g, 8, mach, per_pass=False, budget=10**15)
    ws1 = {n: cm.workspace_bytes(n, g, 1) for n in free.predictions["fwd"]}
    fastest = free.single
    tight = min(ws1[fastest] - 1, max(ws1.values()))
    fits = [n for n in ws1 if ws1[n] <= tight]
    assert fits, ws1
    plan = opt.choose_plan(g, 8, mach, per_pass=False, budget=tight)
    totals = {n: sum(plan.predictions[p][n] for p in cm.PASSES) for n in fits}
    assert plan.single == min(totals, key=totals.get) and plan.single != fastest and plan.fits
    assert plan.chosen_workspace() <= tight
    none = opt.choose_plan(g, 8, mach, per_pass=False, budget=1)
    assert not none.fits and none.single == min(ws1, key=ws1.get)
    assert "[over budget" in opt.describe_plan("c", none)


def test_operand_pool_views():
    from cct import blas

    pool = blas.OperandPool(seed=1)
    a, b = pool.pair(3, 5, 4)
    assert a.shape == (3, 4) and b.shape == (4, 5) and a.flags.c_contiguous and b.flags.c_contiguous
    assert not np.shares_memory(a, b)
    first = a.copy()
    a2, b2 = pool.pair(10, 20, 30)  # the pool grows; what was drawn stays
    assert a2.shape == (10, 30) and b2.shape == (30, 20) and not np.shares_memory(a2, b2)
    assert np.array_equal(a2.reshape(-1)[:12], first.reshape(-1))
    assert np.all(np.abs(a2) <= 0.5) and a2.std() > 0.1


def test_first_run_level_is_cached_and_full_grid(monkeypatch, caplog):
    from cct import blas

    lv = cal.LEVELS
    assert lv["first"].dims == lv["full"].dims and lv["first"].cached and lv["full"].cached
    assert not lv["quick"].cached and lv["first"].passes < lv["full"].passes
    # the first run measures at the "first" level (here shrunk to the quick grid to stay fast) and caches it
    monkeypatch.setitem(cal.LEVELS, "first", cal.CalibrationLevel(
        "first", lv["quick"].dims, 1, 1, 2e7, 256, 8192, (32,), (1 << 14,), ((16, 2),), True))
    current().caches.clear()
    with caplog.at_level("INFO", logger="cct"):
        m = cal.load_machine(measure_if_missing=True, threads=1)
    assert m.info["level"] == "first" and not m.nominal and m.direct_gflops > 0
    assert "first-run level" in caplog.text
    cached = blas.read_cache(cal._cache_name(1, blas.get_backend()))
    assert cached is not None and cached["info"]["level"] == "first"
    current().caches.clear()
    assert cal.load_machine(measure_if_missing=True, threads=1).gemm_bign == m.gemm_bign  # read, not re-measured
    current().caches.clear()


def test_unknown_calibration_level_is_a_clean_error():
    from cct.errors import CctError

    with pytest.raises(CctError, match="unknown calibration level 'fast'"):
        cal.calibrate(level="fast", save=False)


def test_corrupt_calibration_cache_is_reported(caplog):
    from cct import blas

    path = blas.cache_dir() / cal._cache_name(1, blas.get_backend())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    current().caches.clear()
    with caplog.at_level("WARNING", logger="cct"):
        m = cal.load_machine(measure_if_missing=False, threads=1)
    assert m.nominal and "unreadable" in caplog.text and str(path) in caplog.text
    current().caches.clear()


def test_call_overheads_are_measured_and_priced():
    from cct.lowering.rates import measure_call_overheads

    fixed = measure_call_overheads(repeats=2)
    assert {"type1", "type2", "type3", "direct", "fft"} <= set(fixed)
    assert all(0 < v < 0.5 for passes in fixed.values() for v in passes.values())
    g = square(4, 3, 3, 3)
    mach = flat_machine()
    base = cm.predict_breakdown("type1", g, 2, mach, "fwd")
    assert base["overhead"] == 0.0
    mach.call_overhead_s = {"type1": {"fwd": 1e-3, "bwd_data": 2e-3, "bwd_weights": 3e-3}}
    parts = cm.predict_breakdown("type1", g, 2, mach, "fwd")
    assert parts["overhead"] == 1e-3 and parts["total"] == pytest.approx(base["total"] + 1e-3)
    assert cm.predict_seconds("type1", g, 2, mach, "total") == pytest.approx(
        cm.predict_seconds("type1", g, 2, flat_machine(), "total") + 6e-3)
    # a chunked run pays it once per chunk
    assert cm.chunked_seconds("type1", g, 4, 1, mach, "fwd") == pytest.approx(
        cm.chunked_seconds("type1", g, 4, 1, flat_machine(), "fwd") + 4e-3)
    assert cm.Machine.from_json(mach.to_json()).call_overhead_s == mach.call_overhead_s


def test_plan_counts_only_the_passes_the_layer_runs():
    """Without the data gradient the plan is the cheapest on forward plus weight gradient."""
    g = square(13, 3, 64, 64, pad=1)
    mach = flat_machine()
    plan = opt.choose_plan(g, 8, mach, per_pass=False, passes=("fwd", "bwd_weights"))
    totals = {n: plan.predictions["fwd"][n] + plan.predictions["bwd_weights"][n] for n in plan.predictions["fwd"]}
    assert plan.single == min(totals, key=totals.get)
    assert plan.predicted("total") == pytest.approx(totals[plan.single])
    assert "bwd_data" not in opt.describe_plan("conv", plan)


def test_contiguous_run_of_a_slice():
    from cct.lowering.gemm_ops import contiguous_run

    assert contiguous_run((15, 15), (13, 13)) == 13  # a padded window: one row at a time
    assert contiguous_run((13, 13), (13, 13)) == 169  # a whole plane
    assert contiguous_run((15, 11), (13, 11)) == 143  # full rows: the cut axis times the rows
    assert contiguous_run((4, 5, 6), (4, 5, 6)) == 120


def test_copy_runs_are_priced_between_the_window_and_the_stream_curves():
    """A copy declared with its run length pays the stream rate plus the window curve's excess scaled by
    WINDOW_RUN / run; without a run (or a stream curve) it pays the window curve."""
    m = flat_machine()
    m.elem_curves = {"copy": [(1, 0.3), (1 << 30, 0.3)], "stream": [(1, 0.1), (1 << 30, 0.1)]}
    n = 1000
    window = m.elem_seconds("copy", n)
    assert window == pytest.approx(n * 0.3e-9)
    assert m.elem_seconds("copy", n, None, cm.WINDOW_RUN) == pytest.approx(window)
    assert m.elem_seconds("copy", n, None, 10 * cm.WINDOW_RUN) == pytest.approx(n * (0.1 + 0.02) * 1e-9)
    assert m.elem_seconds("copy", n, None, 1 << 20) == pytest.approx(n * 0.1e-9, rel=1e-3)
    assert cm.price([("copy", n, 130)], m)["elementwise"] == pytest.approx(m.elem_seconds("copy", n, None, 130))
    del m.elem_curves["stream"]
    assert m.elem_seconds("copy", n, None, 1 << 20) == pytest.approx(window)  # an older cache: no stream curve


def test_bias_gradients_are_priced_as_reductions():
    """Every strategy's weight-gradient pass declares the bias gradient as a ``sum`` over dy, priced by
    the reduction curve (a read-only sweep, cheaper than an accumulating ``add``)."""
    g = square(13, 3, 16, 32, pad=1)
    dy = 8 * g.channels_out * g.out_size
    for name in ("type1", "type2", "type3", "direct", "fft"):
        assert ("sum", dy) in cm.pass_ops(name, g, 8, "bwd_weights"), name
    m = flat_machine()
    m.elem_curves = {"sum": [(1, 0.2), (1 << 30, 0.2)], "add": [(1, 0.8), (1 << 30, 0.8)]}
    assert cm.price([("sum", 1000)], m)["elementwise"] == pytest.approx(0.2e-6)


def test_direct_data_gradient_is_priced_on_the_transposed_convolution():
    """The data gradient runs the forward kernel of the transposed convolution over the whole padded
    input, zero border included: at n = 13, k = 3, pad 0 that is 169 positions per plane where the
    forward pass computes 121."""
    g = square(13, 3, 32, 64)
    macs = {p: sum(op[1] for op in cm.pass_ops("direct", g, 4, p) if op[0] == "direct") for p in ("fwd", "bwd_data")}
    assert macs["fwd"] >= 4 * 32 * 64 * 9 * 121
    assert macs["bwd_data"] >= 4 * 32 * 64 * 9 * 169 > macs["fwd"]


def test_cache_from_older_curves_is_remeasured(monkeypatch):
    """A Machine cached by an older cct's curves (no ``curves_version``: before the ``sum`` and
    ``stream`` sweeps, and lowering curves timed on every kernel thread whatever its thread count) gets
    its element-wise and lowering curves measured anew on load, on its own thread count; the GEMM
    grids stay."""
    from cct import blas, kernels

    real_ew, real_lw = cal.measure_elementwise, cal.measure_lowerings
    monkeypatch.setattr(cal, "measure_elementwise", lambda sizes, repeats: real_ew((1 << 12, 1 << 14), 1, 1))
    seen = []
    monkeypatch.setattr(cal, "measure_lowerings",
                        lambda sizes, repeats: seen.append(kernels.get_num_threads()) or real_lw(((16, 2),), 1))
    m = flat_machine(gflops=77.0)
    m.threads, m.backend, m.direct_gflops, m.call_overhead_s = 1, blas.get_backend(), 50.0, {"type1": {"fwd": 1e-5}}
    m.info = {"rates_version": cal.RATES_VERSION, "grid_version": cal.GRID_VERSION}
    m.elem_curves = {"copy": [(1, 0.3)], "add": [(1, 0.8)], "zero": [(1, 0.1)]}
    blas.write_cache(cal._cache_name(1, m.backend), m.to_json())
    got = cal.load_machine(threads=1)
    assert set(got.elem_curves) == set(cal.ELEM_KINDS) and got.gemm_bign == m.gemm_bign
    assert got.info["curves_version"] == cal.CURVES_VERSION and seen == [1]
    assert set(cal.Machine.from_json(blas.read_cache(cal._cache_name(1, m.backend))).elem_curves) == set(cal.ELEM_KINDS)


def test_grid_long_dimensions_do_not_alias():
    """The GEMM grids' long dimension (a contiguous operand's row stride) is never a multiple of 1 KiB
    of float32: such rows share cache sets and ran 1.5-2x slower than a conv layer's ``b * P`` columns."""
    assert cal._unaliased(65536) == 65520 and cal._unaliased(4096) == 4080 and cal._unaliased(1525) == 1525
    assert cal._unaliased(256) == 240 and cal._unaliased(16) == 16
    for m in (4, 16, 64, 256, 1024, 4096):
        for k in (4, 16, 64, 256, 1024, 4096):
            big = cal._big(m, k, 2e8, 512, 65536)
            assert (4 * big) % 1024 != 0 and 496 <= big <= 65536


def test_cache_from_older_grids_is_calibrated_anew(monkeypatch):
    """A Machine whose GEMM grids an older cct measured (no ``grid_version``) is calibrated anew when
    load_machine may measure, and still returned as cached when it may not."""
    from cct import blas

    m = flat_machine(gflops=77.0)
    m.threads, m.backend, m.direct_gflops, m.call_overhead_s = 1, blas.get_backend(), 50.0, {"type1": {"fwd": 1e-5}}
    m.info = {"rates_version": cal.RATES_VERSION, "curves_version": cal.CURVES_VERSION}
    blas.write_cache(cal._cache_name(1, m.backend), m.to_json())
    assert cal.load_machine(measure_if_missing=False, threads=1).gemm_bign[0][0] == 77.0
    current().caches.clear()
    calls, fresh = [], flat_machine(gflops=99.0)
    fresh.info = {"seconds": 0.1}
    monkeypatch.setattr(cal, "calibrate", lambda **kw: calls.append(kw) or fresh)
    assert cal.load_machine(threads=1) is fresh and calls == [{"threads": 1, "level": "first"}]


def test_precompile_kernels_fills_numba_cache_in_worker_processes(tmp_path, monkeypatch):
    """A first calibration compiles its kernels on every core, the first share in the calibrating process
    and the others in worker processes: the workers write the kernels' machine code into numba's on-disk
    cache, where the calibrating process loads it."""
    from cct import kernels

    if not kernels.enabled():
        pytest.skip("compiled kernels unavailable")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "RUNTIME", kernels.KernelRuntime())  # not precompiled yet
    here, warm_kernel = [], cal.warm_kernel
    monkeypatch.setattr(cal, "warm_kernel", here.append)
    assert cal.precompile_kernels(("train:elementwise", "train:pool", "type1:unlower"), processes=2) > 0
    assert here == ["train:elementwise", "type1:unlower"]  # this process's share
    cached = {p.name.split("-")[0] for p in tmp_path.rglob("*.nbi")}
    # the worker's share: what a net's first iteration would otherwise compile, MAX pooling 2x2/2 and its backward
    assert {"pooling._max_bwd", "pooling._make_max_fwd_fixed.locals.kernel"} <= cached
    assert cal.precompile_kernels(("type1:unlower", "type1:unlower")) == 0.0  # once per process
    with pytest.raises(cal.CctError, match="unknown kernel warm-up job 'nope'"):
        warm_kernel("nope")


def test_calibration_times_its_largest_gemm_points_once(monkeypatch):
    """A grid point whose one GEMM is at least ONE_TIMING_FLOPS is timed once after its warm-up (a call
    long enough to average out what repeats would); smaller points keep the level's repeats."""
    seen = []
    monkeypatch.setattr(cal.blas, "gemm_gflops",
                        lambda shapes, repeats, operands=None, backend=None: seen.append(repeats) or 1.0)
    cal._gemm_gflops(4096, 240, 4096, 2)
    cal._gemm_gflops(256, 4096, 256, 2)
    assert 2.0 * 4096 * 240 * 4096 >= cal.ONE_TIMING_FLOPS > 2.0 * 256 * 4096 * 256
    assert seen == [1, 2]


def test_first_run_calibration_defers_the_3x3_direct_rate_to_the_first_layer_that_needs_it(monkeypatch, tmp_path):
    """A first-run level measures every rate but the direct forward's 3x3 one (its own compiled driver,
    ~1.5 s of a first run that a 5x5-only net like LeNet never needs); planning the first layer whose
    kernel is not 5 wide measures it, once, and writes the process's cached machine back."""
    from cct.lowering import rates as rates_mod

    asked = []

    def fake_rates(repeats=3, kernel_widths=True):
        asked.append(kernel_widths)
        return {"direct_gflops": 50.0, "direct_k3_gflops": 40.0 if kernel_widths else 0.0}

    monkeypatch.setattr(cal, "measure_rates", fake_rates)
    first, full = flat_machine(), flat_machine()
    first.info, full.info = {"level": "first"}, {"level": "full"}
    cal._add_rates(first)
    cal._add_rates(full)
    assert asked == [False, True]
    assert first.direct_k3_gflops == 0.0 and first.info["deferred_rates"] == ["direct_k3_gflops"]
    assert full.direct_k3_gflops == 40.0 and full.info["deferred_rates"] == []

    timed = []
    monkeypatch.setattr(cal, "direct_rate",
                        lambda pass_, layers, repeats=3: timed.append((pass_, layers)) or 30.0)
    five = ConvGeometry(4, 4, 1, (8, 8), (5, 5), (2, 2), (1, 1), (1, 1), (8, 8))
    three = ConvGeometry(4, 4, 1, (8, 8), (3, 3), (1, 1), (1, 1), (1, 1), (8, 8))
    assert cal.ensure_kernel_width_rate(first, five) is first and timed == []  # a 5x5 layer needs only the 5x5 rate
    cal.remember(first)  # the configuration's machine for its thread count
    opt.plan_convolution(three, 8, first, partitions=1)
    assert timed == [("fwd", rates_mod.DIRECT_K3_LAYERS)] and first.direct_k3_gflops == 30.0
    assert first.info["deferred_rates"] == []
    assert any(p.name.startswith("machine-") for p in tmp_path.iterdir())  # written back to the cache
    opt.plan_convolution(three, 8, first, partitions=1)
    assert len(timed) == 1  # measured once
