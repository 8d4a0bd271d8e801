"""Dense inference under ``mpiexec -n 2``: the output tiles divided among the ranks, one output file, resumable."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from cct import TEST, Net
from cct.cli import main
from cct.infer.example import make_example
from cct.infer.pipeline import DenseInference
from tests.mpirun import needs_mpi, run_mpi

pytestmark = needs_mpi()


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return make_example(str(tmp_path_factory.mktemp("example")))


def _args(ex, out, *extra):
    return ["infer", "--model", ex["model"], "--weights", ex["weights"], "--input", ex["volume"] + ":raw",
            "--output", out, "--noprogress", "--patch", "20,21,30", *extra]


class Interrupt(Exception):
    pass


def test_two_ranks_write_one_h5_equal_to_one_process_and_resume(example, tmp_path, capsys):
    one = str(tmp_path / "one.h5")
    assert main(_args(example, one)) == 0
    capsys.readouterr()
    with h5py.File(one) as f:
        want = f["main"][...]
    # an interrupted one-process run leaves a partial output; the two-rank job resumes it
    two = str(tmp_path / "two.h5")
    net = Net(example["model"], TEST, weights=example["weights"], dtype=np.float32)
    di = DenseInference(net, patch=(20, 21, 30))
    seen = []

    def stop(tile):
        seen.append(tile.index)
        if len(seen) == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        di.run_files(example["volume"] + ":raw", two, progress=False, on_tile=stop)
    r = run_mpi(2, ["python", "-m", "cct", *_args(example, two)], timeout=120)
    assert "resumed after 2 finished tiles" in r.stdout and "dense inference plan" in r.stdout
    assert r.stdout.count("wrote ") == 1  # rank 0 reports
    with h5py.File(two) as f:
        np.testing.assert_array_equal(f["main"][...], want)
        assert "_cct_infer_done" not in f
    assert not (tmp_path / "two.h5.partial").exists()


def test_two_ranks_write_one_npy_and_the_pipeline(example, tmp_path):
    one = str(tmp_path / "one.npy")
    assert main(_args(example, one)) == 0
    two = str(tmp_path / "two.npy")
    run_mpi(2, ["python", "-m", "cct", *_args(example, two, "--pipeline", "2")], timeout=120)
    np.testing.assert_array_equal(np.load(two), np.load(one))
