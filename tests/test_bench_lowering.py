"""benchmarks/bench_lowering.py's Figure 8 modes run end to end on a tiny sweep (a smoke test of the
scoring, not a timing). The benchmark scores the cost model of this machine: the first mode to run measures
the first-run calibration level into a cache folder both modes share (one calibration, not one each)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """The calibration cache of both modes' runs."""
    return tmp_path_factory.mktemp("bench_lowering_cache")


@pytest.mark.parametrize("mode", [[], ["--engine"]])
def test_figure8_modes_score_every_point(tmp_path, cache_dir, mode):
    out = tmp_path / "fig8.json"
    env = dict(os.environ, CCT_CALIBRATE="0", CCT_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_lowering.py"), "--quick", "--keep-env",
                          "--values", "16,32", "--repeats", "1", "--out", str(out), *mode],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    d = json.loads(out.read_text())
    types = d["config"]["types"]
    assert d["config"]["engine"] == bool(mode) and len(d["points"]) == 4
    for p in d["points"]:
        assert p["pick"] in types and p["fastest"] in types and p["slowdown"] >= 0
        assert all(p["measured"][t] > 0 for t in types) and set(p["predicted"]) == set(types)
        if mode:  # the optimizer's own plan: its partition count and chunk are recorded
            level = p["levels"]["cached"]
            assert level["partitions"] >= 1 and level["b_p"] >= 1
    assert 0 <= d["summary"]["pick_is_fastest"] <= 1
