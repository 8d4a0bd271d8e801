"""The benchmarks read cct's and BVLC Caffe's logs: train logs alike (glog with or without the year), `caffe time`."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_e2e  # noqa: E402
import bench_train  # noqa: E402
from common import caffe_report  # noqa: E402

CAFFE_LOG = """\
I20261125 02:45:34.948501  8164 caffe.cpp:239] Starting Optimization
I20261125 02:45:34.948509  8164 solver.cpp:289] Solving LeNet
I20261125 02:45:40.664857  8164 solver.cpp:414]     Test net output #0: accuracy = 0.9429
I20261125 02:45:40.664935  8164 solver.cpp:414]     Test net output #1: loss = 0.180313 (* 1 = 0.180313 loss)
I20261125 02:45:41.014509  8164 caffe.cpp:250] Optimization Done.
"""

CCT_LOG = """\
I1125 02:45:30.500000  8100 cli.py:300] Starting Optimization
I1125 02:45:31.000000  8100 solver.py:414]     Test net output #0: accuracy = 0.93
I1125 02:45:33.780000  8100 solver.py:370] Optimization Done.
I1125 02:45:33.790000  8100 timing.py:50]   forward:   0.644 s   3.22 ms/iter
I1125 02:45:33.790000  8100 timing.py:50]   test:   1.756 s   8.78 ms/iter
I1125 02:45:33.790000  8100 timing.py:50]   bogus:   1.0 s   5.0 ms/iter
"""


def test_parse_caffe_log_with_year():
    r = bench_train.parse_train_log(CAFFE_LOG, 1999)
    assert r["loop_s"] == pytest.approx(6.066008, abs=1e-6)
    assert r["accuracy"] == pytest.approx(0.9429) and r["phases_s"] == {}


def test_parse_cct_log_phases():
    r = bench_train.parse_train_log(CCT_LOG, 2026)
    assert r["loop_s"] == pytest.approx(3.28, abs=1e-6)
    assert r["phases_s"] == {"forward": 0.644, "test": 1.756} and r["accuracy"] == pytest.approx(0.93)


def test_parse_log_without_loop_lines():
    with pytest.raises(ValueError, match="Starting Optimization"):
        bench_train.parse_train_log("I1125 02:45:30.5 1 x] nothing\n", 2026)


def test_results_name_no_machine_directory(tmp_path):
    """Benchmark JSON keeps file names but drops the directories of the machine that ran it."""
    import json

    import common

    path = common.write_json("x", {"blas": {"filepath": "/opt/venv/lib/libopenblas.so", "threads": 2},
                                   "argv": ["bench.py", "--caffe", "/srv/caffe/build/tools/caffe", "3"]},
                             out=str(tmp_path / "x.json"))
    got = json.loads(path.read_text())
    assert got["blas"] == {"filepath": "libopenblas.so", "threads": 2}
    assert got["argv"] == ["bench.py", "--caffe", "caffe", "3"]
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for p in results.glob("*.json"):
        data = json.loads(p.read_text())
        assert common.machine_neutral(data) == data, f"{p.name} names an absolute path"


CAFFE_TIME_LOG = """\
I1127 20:04:59.773291  9185 caffe.cpp:408] Average Forward pass: 13.8296 ms.
I1127 20:04:59.773300  9185 caffe.cpp:410] Average Backward pass: 17.1461 ms.
I1127 20:04:59.773308  9185 caffe.cpp:412] Average Forward-Backward: 31.05 ms.
I1127 20:04:59.773317  9185 caffe.cpp:414] Total Time: 621 ms.
"""


def test_parse_caffe_time_log():
    assert bench_e2e.parse_caffe_time(CAFFE_TIME_LOG) == pytest.approx(0.03105)
    assert bench_e2e.parse_caffe_time(CAFFE_TIME_LOG.replace("Forward-Backward", "F-B")) is None


def test_caffe_report_refuses_a_binary_that_is_not_caffe():
    with pytest.raises(SystemExit, match="--version"):
        caffe_report(sys.executable)
    with pytest.raises(SystemExit, match="does not run"):
        caffe_report(str(Path(__file__).parent / "no-such-caffe"))
