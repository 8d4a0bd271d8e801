"""The per-layer executor's communication overlapped with backward (cct.parallel_plan.perlayer, ``overlap``):
the channel slices' sums started non-blocking and completed in finish_backward, data parallelism's buckets
started from the backward hooks, give bit for bit the weights of the synchronous path whichever rank is late
(both orders of completion), with the same bytes (the overlapped path, now the default, equals real Caffe in
test_parallel_plan_perlayer.py)."""
import json

import numpy as np
import pytest
import test_distributed_train as dp
from mpirun import needs_mpi, run_mpi, script

case = dp.case  # the fixture: a fresh copy of Caffe's solver_sgd_lenet case
pytestmark = [pytest.mark.skipif(not dp.CASE.is_dir(), reason="shared/reference not available"),
              pytest.mark.usefixtures("numpy_kernels")]  # conftest.py: the ranks run the numpy kernels

#: 4 ranks at batch 1. ``four``: conv2 and ip1 n=2 c=2 (each slice summed by the 2 ranks holding it), conv1
#: whole on every rank (all-reduced); ``chan``: conv1 and ip1 n=2 c=2, conv2 and ip2 by sample (all-reduced)
PLANS = {"four": "conv1:n=2 h=2,pool1:n=2 w=2,conv2:n=2 c=2,pool2:h=2 c=2,ip1:n=2 c=2,ip2:c=4",
         "chan": "conv1:n=2 c=2,pool1:n=2 c=2,ip1:n=2 c=2"}
MODES = ("sync", "late0", "late1")
#: floats of one rank's slice of conv2 (25 of 50 filters 20x5x5, 25 biases), conv1 (10 of 20 filters 1x5x5,
#: 10 biases) and ip1 (250 of 500 rows of 800, 250 biases)
CONV2, CONV1, IP1 = 25 * 20 * 25 + 25, 10 * 25 + 10, 250 * 800 + 250


@needs_mpi()
def test_overlapped_sums_equal_the_synchronous_path_bit_for_bit_in_both_orders(case, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    run_mpi(4, ["python", script("overlap_check.py"), str(case), "1", "3", str(out)]
            + [f"{k}={v}" for k, v in PLANS.items()], timeout=240)
    want_losses = json.loads((case / "losses.json").read_text())["losses"][:3]
    for plan, summed in (("four", CONV2 + IP1), ("chan", CONV1 + IP1)):
        base = np.load(out / f"{plan}-sync.npz")
        info = {m: json.loads((out / f"{plan}-{m}.json").read_text()) for m in MODES}
        assert info["sync"]["sums"] == (["conv2", "ip1"] if plan == "four" else ["conv1", "ip1"])
        # each rank sums its slices with the one other rank holding them: (2-1)/2 x 2 x slice bytes, 3 steps
        assert info["sync"]["update_bytes"] == [3 * 4 * summed] * 4
        assert not info["sync"]["layer_diffs_final"]
        for m in MODES[1:]:
            got = np.load(out / f"{plan}-{m}.npz")
            assert sorted(got.files) == sorted(base.files)
            for k in base.files:
                assert np.array_equal(got[k], base[k]), f"{plan} {m}: {k} differs from the synchronous path"
            assert info[m]["layer_diffs_final"]
            for key in ("losses", "bytes_moved", "update_bytes", "allreduced"):
                assert info[m][key] == info["sync"][key], f"{plan} {m}: {key}"
        assert np.allclose(info["late0"]["losses"], want_losses, rtol=1e-5)  # Caffe's first 3 iterations

