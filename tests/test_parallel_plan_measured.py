"""``--parallel auto``'s measured pick (cct.parallel_plan.measured): the rule on given timings, and on
2 MPI ranks the measurement leaves no trace (the run still equals real Caffe's batch-4 run), is
cached for the next run, and is skipped (data parallelism) when each rank splits its batch over devices."""
import json

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi

from cct.parallel_plan.measured import MARGIN, pick_measured

#: auto's measured pick given this optimum (train_run.py's measure: mode)
OPTIMUM = "measure:conv1=h=2;pool1=h=2;conv2=c=2;pool2=c=2;ip1=c=2"
case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case


@pytest.mark.parametrize("seconds, ranks, want", [
    ({2: 1.0, 1: 1.2}, 2, 2),            # OWT slower: data parallelism
    ({2: 1.0, 1: 0.95}, 2, 2),           # faster, but within the margin: data parallelism
    ({2: 1.0, 1: 0.85}, 2, 1),           # faster by more than the margin: OWT
    ({2: 1.0, 1: 1.0}, 2, 2),            # a tie: data parallelism
    ({4: 1.0, 2: 0.8, 1: 0.7}, 4, 1),    # the fastest of several
    ({4: 1.0, 2: 0.85, 1: 0.95}, 4, 2),  # the tail n=2 c=2
    ({4: 1.0, 2: 0.91, 1: 0.92}, 4, 4),  # none beats the margin
])
def test_the_pick_keeps_data_parallelism_unless_another_is_faster_by_the_margin(seconds, ranks, want):
    assert MARGIN == 0.10
    assert pick_measured(seconds, ranks) == want
    named = {("data" if a == ranks else f"c{a}"): s for a, s in seconds.items()}  # keyed by name
    assert pick_measured(named, "data") == ("data" if want == ranks else f"c{want}")


def test_the_pick_needs_data_parallelism_measured():
    with pytest.raises(ValueError, match="data parallelism"):
        pick_measured({1: 0.5}, 2)


@needs_mpi()
@pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available")
@pytest.mark.usefixtures("numpy_kernels")  # conftest.py: the ranks run the numpy kernels
def test_auto_measures_on_the_ranks_leaves_training_exact_and_caches(case, tmp_path):
    env = {"CCT_CACHE_DIR": str(tmp_path / "cache")}
    auto = ("--init", "init.caffemodel", "--parallel", "auto")
    optimum = ("--init", "init.caffemodel", "--parallel", OPTIMUM)
    # one launch: auto measures; the next run (another iteration count: the same net and ranks) takes the
    # cached times; DeePa's optimum as candidates
    runs = [(case, 2, 10, case / "auto.caffemodel", *auto), (case, 2, 1, case / "again.caffemodel", *auto),
            (case, 2, 10, case / "parts.caffemodel", *optimum)]
    _, (first, again, parts) = dp._train_runs(2, runs, timeout=180, env=env)
    line = next(x for x in first.splitlines() if "--parallel auto: measured step ms" in x)
    assert "cached" not in line and "data " in line and "owt " in line
    ran = line.rsplit("running ", 1)[1].split(" (")[0]
    assert f"{ran} " in line  # one of the measured candidates (which one wins depends on this box's load)
    # the candidates' passes changed nothing: still Caffe's batch-4 weights and losses
    dp._compare(case / "auto.caffemodel", case / "final.caffemodel", 1e-4)
    got = json.loads((case / "auto.caffemodel.json").read_text())["losses"]
    want = json.loads((case / "losses.json").read_text())["losses"]
    assert np.allclose(got, want, rtol=1e-5)
    assert list((tmp_path / "cache").glob("deepa-pick-*.json"))
    # the next run takes the cached times
    cached = next(x for x in again.splitlines() if "--parallel auto: measured step ms" in x)
    assert "cached" in cached and cached.rsplit("running ", 1)[1] == line.rsplit("running ", 1)[1]
    # DeePa's optimum as candidates (one with conv1/pool1 by height, conv2/pool2 and ip1 by channel, ip2 by
    # sample): its channel and height splits alone and the optimum itself layer by layer ("deepa") measured
    # beside data parallelism and the tail's splits; whichever runs, training is still Caffe's
    line = next(x for x in parts.splitlines() if "--parallel auto: measured step ms" in x)
    assert all(f"{name} " in line for name in ("data", "owt", "conv c=2", "spatial", "deepa")), line
    ran = line.rsplit("running ", 1)[1].split(" (")[0]
    assert ran in ("data", "owt", "conv c=2", "spatial", "deepa")
    dp._compare(case / "parts.caffemodel", case / "final.caffemodel", 1e-4)
    # the cached times edited so that the optimum is the fastest: the next run picks and trains with it
    # (height, channel and sample splits layer by layer), still Caffe's run
    (cache_file,) = (tmp_path / "cache").glob("deepa-pick-*.json")
    data = json.loads(cache_file.read_text())
    for entry in data["entries"].values():
        if "deepa" in entry["seconds"]:
            entry["seconds"]["deepa"] = 0.5 * min(entry["seconds"].values())  # the fastest by far, whatever the load
    cache_file.write_text(json.dumps(data))
    # one launch: the edited cache's pick; then each rank splitting its batch over two devices (the last run:
    # the devices stay set for the rest of the process)
    _, (deepa, devices) = dp._train_runs(2, [(case, 2, 10, case / "deepa.caffemodel", *optimum),
                                             (case, 2, 10, case / "devices.caffemodel", *auto, "--devices",
                                              "cpu:0:threads=1,cpu:1:threads=1")], timeout=180, env=env)
    line = next(x for x in deepa.splitlines() if "--parallel auto: measured step ms" in x)
    assert "cached" in line and line.rsplit("running ", 1)[1].startswith("deepa (")
    assert ("--parallel auto: running deepa: conv1 n=1 h=2 w=1 c=1, pool1 n=1 h=2 w=1 c=1, conv2 n=1 h=1 w=1 c=2, "
            "pool2 n=1 h=1 w=1 c=2, ip1 n=1 h=1 w=1 c=2") in deepa
    dp._compare(case / "deepa.caffemodel", case / "final.caffemodel", 1e-4)
    # each rank splitting its batch over two devices: no split candidate can run with that executor yet
    assert "--parallel auto: the train net has its own executor (--devices); data parallelism" in devices
    dp._compare(case / "devices.caffemodel", case / "final.caffemodel", 1e-4)
