"""Per-layer plans on in-process devices (cct.parallel_plan.inprocess): the workers of a ThreadComm, one solver
each, run the MPI executor unchanged; 2 workers at batch 2 equal real Caffe's batch-4 LeNet run, the bytes
they copy equal the planner's count, and ``cct train --devices cpu,cpu:1 --parallel FILE`` does the same from
the command line (worker 0 logs and snapshots); OWT (collectives) equals Caffe's run too."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import test_distributed_train as dp
from test_distributed_shard import RECORDS, _labels, _layer, _lmdb
from test_parallel_plan_perlayer import _plan_file
from test_parallel_plan_spatial import _predicted

from cct.config import Config
from cct.data.db import OPEN_DATABASES
from cct.distributed import run_workers
from cct.io.prototxt import read_net_prototxt
from cct.parallel_plan.inprocess import run_device_workers, worker_config
from cct.parallel_plan.owt import enable_owt
from cct.parallel_plan.perlayer import enable_per_layer
from cct.parallel_plan.split import PlanError, Split
from cct.solver import get_solver, read_solver_param

case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
pytestmark = pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available")

MIXED = {"conv1": Split(h=2), "pool1": Split(h=2), "conv2": Split(c=2), "pool2": Split(c=2), "ip1": Split(c=2)}


@pytest.mark.parametrize("plan", ["mixed", "owt"])
def test_plans_on_two_in_process_workers_equal_caffe_with_the_planned_bytes(case, monkeypatch, plan):
    """mixed: conv1 and pool1 by height, conv2, pool2 and ip1 by channel (point-to-point exchanges); owt: ip1
    and ip2 by channel (all-gather, all-to-all, reduce-scatter): on 2 worker threads at batch 2, Caffe's
    batch-4 weights and losses after 10 SGD iterations; the mixed plan's in-process copies are the bytes the
    executor counts, and their sum the planner's."""
    monkeypatch.chdir(case)
    param = read_solver_param("solver.prototxt")
    net = read_net_prototxt(param.net)
    for layer in net.layer:
        layer.hdf5_data_param.batch_size = 2
    param.ClearField("net")
    param.net_param.CopyFrom(net)
    config, losses = Config(), []

    def worker(comm):
        solver = get_solver(param, config=worker_config(config, comm.rank), comm=comm)
        solver.net.copy_from("init.caffemodel")
        ex = enable_per_layer(solver, MIXED) if plan == "mixed" else enable_owt(solver)
        if comm.is_root:
            solver.add_callback(on_gradients_ready=lambda: losses.append(solver.smoothed_loss))
        solver.solve()
        ex.gather_owned(solver.history)
        if comm.is_root:
            solver.net.save("two.caffemodel")
        return ex.bytes_moved, comm.bytes_received

    # worker 0 keeps the run's random source and the others get their own; no worker gets the scheduler's devices
    assert worker_config(config, 0).random is config.random and worker_config(config, 1).random is not config.random
    assert worker_config(config.replace(devices=object()), 1).devices is None
    moved = run_device_workers(2, worker, timeout_s=120)
    dp._compare(case / "two.caffemodel", case / "final.caffemodel", 1e-5)
    assert np.allclose(losses, json.loads((case / "losses.json").read_text())["losses"], rtol=1e-5)
    if plan == "owt":
        assert moved[0][0] > 0 and moved[0][1] == 0  # collectives only
        return
    step, forward = _predicted(case / "net.prototxt", 2, 2, MIXED)
    assert all(executor == copied for executor, copied in moved)
    assert sum(executor for executor, _ in moved) == 10 * step + forward
    with pytest.raises(PlanError, match="a per-layer plan needs at least 2"):
        run_device_workers(1, worker)


def test_cli_devices_with_a_plan_file_run_the_plan_on_workers_and_equal_caffe(case):
    solver = dp._cli_case(case, 2, "b2")
    plan = _plan_file(case / "mixed.plan", 2, MIXED)
    p = subprocess.run([sys.executable, "-m", "cct", "train", "--solver", solver, "--weights", "init.caffemodel",
                        "--devices", "cpu,cpu:1", "--parallel", str(plan)], cwd=case, env=dp._plain_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    log = p.stderr
    assert "on 2 in-process devices (cpu:0, cpu:1): one worker per device, each at the prototxt's batch" in log
    assert "Per-layer parallelism on 1 machine(s) x 2 worker(s), links " in log
    assert "Per-layer splits on 2 in-process workers: conv1 n=1 h=2 w=1 c=1, pool1" in log
    assert log.count("Data parallel on 2 in-process workers: each worker batch 2, global batch 4") == 1
    assert "MPI ranks" not in log
    assert log.count("Iteration 9 (") == 1 and log.count("Snapshotting to binary proto file snap/lenet_iter_10") == 1
    assert sorted(os.listdir(case / "snap")) == [f"lenet_iter_{i}.{e}" for i in (10, 5)
                                                 for e in ("caffemodel", "cctstate", "solverstate")]
    dp._compare(case / "snap" / "lenet_iter_10.caffemodel", case / "final.caffemodel", 1e-5)


def test_workers_share_one_lmdb_handle_and_read_their_shards_as_ranks(tmp_path):
    """Two workers' Data layers read one LMDB (one handle per process, shared and refcounted) on their own
    threads at once: rank r's records r, r+2, ... as under MPI, batch by batch the one-process stream."""
    spec = _lmdb(tmp_path)
    whole = _labels(*_layer(spec(4)), RECORDS // 4 * 2)

    def worker(comm):
        layer, top = _layer(spec(2), comm.rank, comm.size)
        comm.barrier()  # both set up before either reads
        labels = _labels(layer, top, RECORDS // 4 * 2)
        comm.barrier()  # both have read (a loader's prefetch opens its reader in the background): both are open
        readers = OPEN_DATABASES.readers("lmdb", os.path.realpath(tmp_path / "db"))
        comm.barrier()  # neither closes before both counted
        return readers, labels

    (r0, a), (r1, b) = run_workers(2, worker, timeout_s=60)
    assert r0 >= 2 and r1 >= 2  # one handle, both workers' readers on it
    assert [sorted(x + y) for x, y in zip(a, b)] == [sorted(w) for w in whole]
    assert all(all(v % 2 == 0 for v in x) and all(v % 2 == 1 for v in y) for x, y in zip(a, b))
