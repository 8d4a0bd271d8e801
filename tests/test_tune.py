"""cct.lowering.tune: the optimizer's close calls settled by running them on the layer."""
import time

import numpy as np
import pytest

from cct.config import current
from cct.lowering import base, tune
from cct.lowering import optimizer as opt
from cct.lowering.cost_model import Machine
from cct.lowering.geometry import ConvGeometry


def square(n, k, d, o, pad=0):
    m = n + 2 * pad - k + 1
    return ConvGeometry(d, o, 1, (n, n), (k, k), (pad, pad), (1, 1), (1, 1), (m, m), True)


class _SlowType1(type(base.get_strategy("type1"))):
    """type 1 with 20 ms of sleep in every forward: priced like type 1, measurably slower."""

    name = "slow"
    calls = 0

    def forward(self, x, w, b, geom):
        _SlowType1.calls += 1
        time.sleep(0.02)
        return super().forward(x, w, b, geom)

    def forward_into(self, x, w, b, geom, out):
        _SlowType1.calls += 1
        time.sleep(0.02)
        return super().forward_into(x, w, b, geom, out)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    current().caches.clear()
    base.register_strategy("slow", _SlowType1)
    _SlowType1.calls = 0
    yield
    base.unregister_strategy("slow")


def _plan(preds: dict[str, float], passes=("fwd",)) -> opt.Plan:
    pick = min(preds, key=preds.get)
    return opt.Plan(pick, pick, pick, {p: dict(preds) for p in opt.PASSES}, workspace=dict.fromkeys(preds, 0),
                    budget=1 << 40, passes=passes)


def _machine(**info) -> Machine:
    m = Machine(grid_dims=[1, 100000], gemm_bign=[[100.0] * 2] * 2, gemm_bigk=[[100.0] * 2] * 2, big_curve=[],
                copy_ns=1.0, add_ns=1.0, zero_ns=0.0, gemm_overhead_s=0.0, cache_bytes=1 << 60)
    m.info = dict(info, rates_version=1, measured_at=123.0)
    return m


def test_close_candidates_within_margin_cheapest_first():
    preds = {"a": 1.0, "b": 1.25, "c": 1.31, "d": 0.99}
    assert tune.close_candidates(preds, margin=0.3) == ["d", "a", "b"]
    assert tune.close_candidates(preds, margin=0.3, limit=2) == ["d", "a"]
    assert tune.close_candidates({"a": 1.0, "b": 2.0}) == ["a"]
    assert tune.close_candidates({}) == []


def test_measure_keeps_each_runners_best_and_tells_slow_from_fast():
    calls = {"fast": 0, "slow": 0}

    def run(name, seconds):
        calls[name] += 1
        time.sleep(seconds)

    best = tune.measure({"fast": lambda: run("fast", 0.001), "slow": lambda: run("slow", 0.006)}, repeats=3)
    assert calls == {"fast": 6, "slow": 6}  # an untimed call before each timed one
    assert 0.001 <= best["fast"] < best["slow"] and best["slow"] >= 0.006


def test_refine_picks_the_measured_fastest_of_a_close_call():
    g = square(8, 3, 4, 4)
    plan = _plan({"slow": 1.0e-3, "type1": 1.1e-3, "type3": 5e-3})  # the model prefers the slow one
    out = tune.refine(plan, g, 4, lambda names: (1, 4))
    assert out.fwd == "type1" and set(out.measured) == {"slow", "type1"}  # type 3 is not close
    assert out.measured["slow"] >= 0.02 > out.measured["type1"]
    assert "[measured slow " in opt.describe_plan("conv", out)
    x, w, b, _ = tune.layer_inputs(g, 4)  # the pick computes the layer
    ref = base.get_strategy("type3").forward(x, w, b, g)
    np.testing.assert_allclose(out.strategy().forward(x, w, b, g), ref, rtol=1e-4, atol=1e-5)


def test_refine_leaves_slow_layers_overrides_and_clear_calls_to_the_model():
    g = square(8, 3, 4, 4)
    big = _plan({"slow": 1.0, "type1": 1.1})  # measuring would take seconds: the model decides
    assert tune.refine(big, g, 4, lambda names: (1, 4)).fwd == "slow" and not big.measured
    clear = _plan({"slow": 1e-3, "type1": 2e-3})
    assert tune.refine(clear, g, 4, lambda names: (1, 4)).fwd == "slow" and not clear.measured
    forced = _plan({"slow": 1e-3, "type1": 1.1e-3})
    forced.overridden = True
    assert tune.refine(forced, g, 4, lambda names: (1, 4)).fwd == "slow" and _SlowType1.calls == 0


def test_refined_picks_are_cached_per_calibration():
    g = square(8, 3, 4, 4)
    m = _machine()
    first = tune.refine(_plan({"slow": 1e-3, "type1": 1.1e-3}), g, 4, lambda names: (1, 4), cache=tune.cache_for(m))
    assert first.fwd == "type1" and _SlowType1.calls > 0
    _SlowType1.calls = 0
    current().caches.tunings.clear()  # a new process: read back from the cache file
    again = tune.refine(_plan({"slow": 1e-3, "type1": 1.1e-3}), g, 4, lambda names: (1, 4), cache=tune.cache_for(m))
    assert again.fwd == "type1" and again.measured == first.measured and _SlowType1.calls == 0
    m2 = _machine()
    m2.info["measured_at"] = 456.0  # recalibrated: measured again
    tune.refine(_plan({"slow": 1e-3, "type1": 1.1e-3}), g, 4, lambda names: (1, 4), cache=tune.cache_for(m2))
    assert _SlowType1.calls > 0


def test_plan_convolution_tunes_only_when_asked():
    g = square(8, 3, 4, 4)
    m = _machine()
    plain = opt.plan_convolution(g, 4, m, partitions=1, names=["slow", "type1"])
    assert plain.fwd == "slow" and not plain.measured  # equal prices: the name order decides
    tuned = opt.plan_convolution(g, 4, m, partitions=1, names=["slow", "type1"], tune=True)
    assert tuned.fwd == "type1" and "slow" in tuned.measured and tuned.b_p >= 1


def test_engine_tunes_when_configured():
    from cct.lowering import engine

    assert not engine.EngineConfig().tune and not engine.EngineConfig().tune_device
    assert engine.EngineConfig(tune=True).tune and engine.EngineConfig(tune_device=True).tune_device


def test_cli_tunes_when_it_calibrates(monkeypatch):
    import argparse

    from cct.runsetup import engine_config

    args = argparse.Namespace(partitions="model", lowering=None, lowering_mode="cct")
    monkeypatch.setenv("CCT_CALIBRATE", "1")
    monkeypatch.delenv("CCT_TUNE", raising=False)
    assert engine_config(args, calibrate=True).tune
    assert not engine_config(args, calibrate=False).tune  # commands that do not calibrate do not measure
    monkeypatch.setenv("CCT_TUNE", "0")
    assert not engine_config(args, calibrate=True).tune
    monkeypatch.setenv("CCT_TUNE", "1")
    monkeypatch.setenv("CCT_CALIBRATE", "0")  # nominal constants: nothing to refine
    assert not engine_config(args, calibrate=True).tune


def test_a_measured_pick_must_beat_the_models_by_min_gain(monkeypatch):
    """Timings that scatter within MIN_GAIN leave the model's pick; a clear gain replaces it."""
    g = square(8, 3, 4, 4)
    timings = {}
    monkeypatch.setattr(tune, "measure", lambda runners, repeats: {n: timings[n] for n in runners})
    timings.update(slow=1.00e-3, type1=0.97e-3)
    assert tune.refine(_plan({"slow": 1e-3, "type1": 1.1e-3}), g, 4, lambda names: (1, 4)).fwd == "slow"
    timings.update(slow=1.00e-3, type1=0.90e-3)
    out = tune.refine(_plan({"slow": 1e-3, "type1": 1.1e-3}), g, 4, lambda names: (1, 4))
    assert out.fwd == "type1" and out.measured == {"slow": 1.00e-3, "type1": 0.90e-3}


def test_rounds_fill_the_layer_bound_and_one_round_needs_a_clear_gain(monkeypatch):
    """A 40-80 ms layer gets every round (one noisy round picked wrong); a long one gets what its bound
    allows, and its one round must show twice MIN_GAIN."""
    g = square(8, 3, 4, 4)
    seen, timings = [], {}

    def fake(runners, repeats):
        seen.append(repeats)
        return {n: timings[n] for n in runners}

    monkeypatch.setattr(tune, "measure", fake)
    timings.update(slow=1.0, type1=0.92)
    mid = tune.refine(_plan({"slow": 0.05, "type1": 0.06}), g, 4, lambda names: (1, 4))
    assert seen[-1] == tune.MAX_REPEATS and mid.fwd == "type1"  # 8% faster over 7 rounds: switched
    long = tune.refine(_plan({"slow": 0.6, "type1": 0.7}), g, 4, lambda names: (1, 4))
    assert seen[-1] == 1 and long.fwd == "slow"  # 8% after one round: not enough
    timings.update(type1=0.85)
    assert tune.refine(_plan({"slow": 0.6, "type1": 0.7}), g, 4, lambda names: (1, 4)).fwd == "type1"


def test_layer_candidates_whole_strategies_and_one_pass_swaps():
    preds = {"fwd": {"a": 1.0, "b": 1.2, "c": 3.0}, "bwd_data": {"a": 2.0, "b": 1.9, "c": 2.1},
             "bwd_weights": {"a": 2.0, "b": 2.5, "c": 9.0}}
    plan = opt.Plan("a", "a", "a", preds, workspace=dict.fromkeys("abc", 0), budget=1 << 40)
    cands = tune.layer_candidates(plan, {"a", "b", "c"}, limit=10)
    assert cands[0] == {"fwd": "a", "bwd_data": "a", "bwd_weights": "a"}  # the model's plan first
    assert cands[1] == {"fwd": "a", "bwd_data": "b", "bwd_weights": "a"}  # cheapest alternative next
    assert {"fwd": "b", "bwd_data": "b", "bwd_weights": "b"} in cands  # 5.6 s: within 30% of 5.0
    assert all(c["bwd_weights"] != "c" and c["fwd"] != "c" for c in cands)  # not close
    assert len(tune.layer_candidates(plan, {"a", "b", "c"}, limit=2)) == 2
    assert tune.layer_candidates(plan, {"a"}) == [cands[0]]  # the others do not fit the budget


def test_run_layer_computes_the_layers_pass_results():
    g = square(9, 3, 3, 5, pad=1)
    s = base.get_strategy("type1")
    x, w, b, dy = tune.layer_inputs(g, 2)
    out, dw, dx = np.empty_like(dy), np.zeros_like(w), np.empty_like(x)
    tune.run_layer(s, opt.PASSES, x, w, b, dy, g, out, dw, dx)  # flips w[0] first: an update
    np.testing.assert_allclose(out, s.forward(x, w, b, g), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, s.backward_data(dy, w, g), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dw, s.backward_weights(dy, x, g)[0], rtol=1e-5, atol=1e-6)
    dw2 = np.zeros_like(w)
    tune.run_layer(s, ("bwd_weights",), x, w, b, dy, g, out, dw2, dx)  # no forward: the weights stay
    np.testing.assert_allclose(dw2, dw, rtol=1e-5, atol=1e-6)


def test_pick_on_device_runs_every_supporting_strategy_and_keeps_the_fastest():
    g = square(8, 3, 4, 4)
    pick, seconds = tune.pick_on_device(g, 4, ("fwd", "bwd_data", "bwd_weights"), np, names=["slow", "type1", "type3"])
    assert pick in ("type1", "type3") and set(seconds) == {"slow", "type1", "type3"}
    assert seconds["slow"] >= 0.02 > seconds["type1"]
    # type 1 is the default: another must beat it by MIN_GAIN; the slow one never does
    pick, _ = tune.pick_on_device(g, 4, ("fwd",), np, names=["slow", "type1"])
    assert pick == "type1"
    pick, _ = tune.pick_on_device(g, 4, ("fwd",), np, names=["slow", "type1"], default="slow")
    assert pick == "type1"
    assert tune.pick_on_device(g, 4, ("fwd",), np, names=["type1"]) == ("type1", {})  # nothing to compare


def test_device_picks_are_cached_per_device_model():
    g = square(8, 3, 4, 4)
    first = tune.pick_on_device(g, 4, ("fwd",), np, names=["slow", "type1"], cache=tune.device_cache(np))
    assert _SlowType1.calls > 0
    _SlowType1.calls = 0
    current().caches.tunings.clear()  # a new process: read back from the cache file
    again = tune.pick_on_device(g, 4, ("fwd",), np, names=["slow", "type1"], cache=tune.device_cache(np))
    assert again == first and _SlowType1.calls == 0
    assert tune.device_name(np) == "numpy"


def test_plan_device_lowering_follows_overrides_mode_and_tuning(monkeypatch):
    from cct.lowering import engine

    g = square(8, 3, 4, 4)
    monkeypatch.delenv("CCT_LOWERING", raising=False)
    plain = engine.plan_device_lowering("conv", g, 4, np, engine.EngineConfig())
    assert plain.name == "type1" and "(default)" in plain.plan_report
    forced = engine.plan_device_lowering("conv", g, 4, np, engine.EngineConfig(overrides={"conv": "fft"}))
    assert forced.name == "fft" and "(override)" in forced.plan_report
    caffe = engine.plan_device_lowering("conv", g, 4, np, engine.EngineConfig(mode="caffe", overrides={"*": "fft"}))
    assert caffe.name == "type1"
    assert "(default)" in engine.plan_device_lowering("conv", g, 4, np, engine.EngineConfig(tune=True)).plan_report
    tuned = engine.plan_device_lowering("conv", g, 4, np, engine.EngineConfig(tune_device=True))
    assert "measured on numpy" in tuned.plan_report and "[measured " in tuned.plan_report
    x, w, b, _ = tune.layer_inputs(g, 4)
    np.testing.assert_allclose(tuned.forward(x, w, b, g), base.get_strategy("type3").forward(x, w, b, g),
                               rtol=1e-4, atol=1e-5)


def test_pick_on_device_drops_a_strategy_that_runs_out_of_memory(monkeypatch):
    class _OutOfMemory(type(base.get_strategy("type1"))):
        name = "oom"

        def forward_into(self, x, w, b, geom, out):
            raise MemoryError("out of device memory (test)")

    base.register_strategy("oom", _OutOfMemory)
    try:
        g = square(8, 3, 4, 4)
        assert tune.pick_on_device(g, 4, ("fwd",), np, names=["oom", "type1"]) == ("type1", {})
        pick, seconds = tune.pick_on_device(g, 4, ("fwd",), np, names=["oom", "slow", "type1"])
        assert pick == "type1" and set(seconds) == {"slow", "type1"}
    finally:
        base.unregister_strategy("oom")
