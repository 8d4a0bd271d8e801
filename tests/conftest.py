import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Building nets in tests and in the CLI subprocesses they start must not stall on a one-time
# machine calibration: the lowering optimizer uses its nominal machine model instead.
os.environ.setdefault("CCT_CALIBRATE", "0")

# Tests must not depend on (or write into) the user's calibration cache in ~/.cache/cct: each test
# session gets an empty cache directory of its own.
if "CCT_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["CCT_CACHE_DIR"] = tempfile.mkdtemp(prefix="cct-test-cache-")


def _snapshot_artifacts() -> set[str]:
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {os.path.abspath(p) for d in {root, os.getcwd()} for p in glob.glob(os.path.join(d, "*_iter_*"))}


_ARTIFACTS_BEFORE = _snapshot_artifacts()


@pytest.fixture(autouse=True)
def _fresh_config():
    """Each test starts from a fresh default :class:`cct.config.Config` (its own planning caches, the
    environment read anew) and leaves the process default as it found it."""
    from cct import config

    saved = config.default()
    config.set_default(None)
    yield
    config.set_default(saved)


def pytest_configure(config):
    """In CI (``CI`` set) the shared folder must be there: the real-Caffe parity tests skip without it, and
    CI must run them, not skip them."""
    from cct.paths import shared_path

    if os.environ.get("CI", "").lower() not in ("", "0", "false") and not shared_path("reference").is_dir():
        raise pytest.UsageError(f"CI run without the shared folder ({shared_path('reference')} is missing): "
                                "the real-Caffe parity tests would be skipped")


def pytest_sessionfinish(session, exitstatus):
    """Tests write snapshots under tmp_path: fail the run if one landed in the repo root or the cwd."""
    new = sorted(_snapshot_artifacts() - _ARTIFACTS_BEFORE)
    if new:
        session.exitstatus = 1
        print(f"\nERROR: tests left snapshot files outside tmp_path: {', '.join(new)}", file=sys.stderr)


@pytest.fixture(scope="module")
def numpy_kernels():
    """``CCT_KERNELS=numpy`` for a module's tests and every process they start (``pytest.mark.usefixtures``).
    For the MPI tests of the per-layer executor: each rank otherwise loads the compiled kernels (3-4 ranks on
    2 cores). What they check is the executor: its runs against real Caffe's (1e-5) or against one process
    started under the same setting (the engine may pick another convolution without the compiled direct
    kernels, so a module's references and its MPI runs must share it). The kernels are checked against the
    numpy path in tests/test_kernels.py; the data-parallel (test_distributed_train), in-process worker
    (test_parallel_plan_devices) and CLI MPI tests keep the compiled kernels."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CCT_KERNELS", "numpy")
        yield
