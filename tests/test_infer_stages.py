"""Dense inference, part 3: the two-stage CPU pipeline (ZNNi VII) gives the one-stage output; the planner's theta."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cct.errors import CctError
from cct.infer.geometry import analyze
from cct.infer.pipeline import DenseInference
from cct.infer.plan import choose_plan, parse_pipeline, predict, with_pipeline
from tests.infer_nets import TXT2, TXT3, random_net

_net = random_net


@pytest.mark.parametrize("method,mpf", [("mpf", None), ("mpf", (False, True)), ("shift", None)])
def test_every_split_gives_the_one_stage_output_2d(method, mpf):
    net = _net(TXT2)
    vol = np.random.default_rng(1).standard_normal((37, 30))
    want = DenseInference(net, patch=(24, 28), method=method, mpf=mpf)(vol).copy()
    nops = len(analyze(net).ops)
    for theta in range(1, nops):
        di = DenseInference(net, patch=(24, 28), method=method, mpf=mpf, pipeline=theta)
        got = di(vol)
        assert di.plan.theta == theta and di.stages is not None
        np.testing.assert_array_equal(got, want)


def test_3d_pipeline_and_files(tmp_path):
    net = _net(TXT3, dtype=np.float32)
    vol = np.random.default_rng(2).standard_normal((15, 13, 17)).astype(np.float32)
    want = DenseInference(net, patch=(13, 14, 12))(vol).copy()
    np.save(tmp_path / "v.npy", vol)
    di = DenseInference(net, patch=(13, 14, 12), pipeline=2)
    seen = []

    def interrupt(tile):
        seen.append(tile.index)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # the producer thread stops with the consumer
        di.run_files(f"{tmp_path}/v.npy", f"{tmp_path}/o.npy", progress=False, on_tile=interrupt)
    assert not any(t.name == "cct-infer-stage1" for t in threading.enumerate())
    s = di.run_files(f"{tmp_path}/v.npy", f"{tmp_path}/o.npy", progress=False)
    assert s["pipeline"] == 2 and s["tiles"] > 4 and s["resumed_tiles"] == 3
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), want)


def test_a_failing_first_stage_reaches_the_caller():
    net = _net(TXT2)
    di = DenseInference(net, patch=(24, 28), pipeline=1)
    di.prepare((30, 30))

    def broken(tile):
        raise CctError("cannot read tile")

    with pytest.raises(CctError, match="cannot read tile"):
        list(di.stages.results(range(3), broken))


def test_planner_prices_the_split_and_chooses_it_with_the_patch():
    net = _net(TXT2, dtype=np.float32)
    geom = analyze(net)
    one = predict(net, geom, (4, 4), (True, True))
    half = predict(net, geom, (4, 4), (True, True))
    nops = len(geom.ops)
    best = None
    for theta in range(1, nops):
        p = with_pipeline(net, geom, predict(net, geom, (4, 4), (True, True)), theta, half)
        s1, s2 = p.stage_seconds
        assert p.theta == theta and p.seconds == pytest.approx(max(s1, s2) * p.runs)
        assert s1 + s2 == pytest.approx(half.seconds / half.runs)
        assert p.peak_bytes > one.peak_bytes and f"first {theta} convolution/pooling" in p.describe()
        best = p if best is None or p.seconds < best.seconds else best
    auto = with_pipeline(net, geom, predict(net, geom, (4, 4), (True, True)), "auto", half)
    if best.seconds < one.seconds:
        assert auto.theta == best.theta and auto.seconds == pytest.approx(best.seconds)
    else:
        assert auto.theta == 0 and auto.seconds == one.seconds
    plan = choose_plan(net, geom, 64 << 20, (10, 10), pipeline="auto")
    assert plan.theta == 0 or plan.seconds < plan.one_stage_seconds
    forced = choose_plan(net, geom, 64 << 20, (10, 10), pipeline=2)
    assert forced.theta == 2


def test_bad_pipeline_values():
    assert parse_pipeline("auto") == "auto" and parse_pipeline("off") == "off" and parse_pipeline("3") == 3
    for bad in ("x", "-1"):
        with pytest.raises(CctError, match="--pipeline"):
            parse_pipeline(bad)
    net = _net(TXT2)
    with pytest.raises(CctError, match="theta must be 1..7"):
        DenseInference(net, patch=(24, 28), pipeline=8).prepare((30, 30))
