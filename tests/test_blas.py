"""cct.blas: backend selection, GEMM correctness on both backends, caching, thread control."""
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from cct import blas, config
from cct.blas import choice, openblas, product
from cct.errors import CctError

BACKENDS = ["openblas"] + (["mkl"] if blas.mkl_available() else [])


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("CCT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CCT_BLAS", raising=False)
    saved = config.default()
    config.set_default(config.Config())  # fresh caches: 'auto' not resolved yet
    yield
    config.set_default(saved)  # set_backend changes the process default


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_matches_numpy(backend, dtype, ta, tb):
    rng = np.random.default_rng(0)
    m, n, k = 7, 9, 5
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
    c0 = rng.standard_normal((m, n)).astype(dtype)
    expect = 1.5 * ((a.T if ta else a) @ (b.T if tb else b)) + 0.5 * c0
    out = c0.copy()
    res = blas.gemm(a, b, out=out, trans_a=ta, trans_b=tb, alpha=1.5, beta=0.5, backend=backend)
    assert res is out
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_strided_operands_and_output(backend):
    rng = np.random.default_rng(1)
    big = rng.standard_normal((12, 20)).astype(np.float32)
    a = big[1:7, 2:10]  # row-major with a leading dimension
    b = np.asfortranarray(rng.standard_normal((8, 5)).astype(np.float32))  # column-major
    c = rng.standard_normal((6, 30)).astype(np.float32)[:, ::3][:, :5]  # non-contiguous output
    ref = a @ b
    blas.gemm(a, b, out=c, backend=backend)
    np.testing.assert_allclose(c, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(CctError):
        blas.gemm(a, b, out=np.empty((5, 5), np.float32), backend=backend)
    with pytest.raises(CctError):
        blas.gemm(a, a, backend=backend)


def test_sgemm_uses_selected_backend(monkeypatch):
    calls = []
    monkeypatch.setattr(product, "mkl_gemm", lambda *a: calls.append(1) or a[2])
    blas.set_backend("openblas")
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(blas.sgemm(x, x, trans_b=True), np.full((2, 2), 3.0))
    assert calls == []
    if blas.mkl_available():
        blas.set_backend("mkl")
        blas.sgemm(x, x, trans_b=True)
        assert calls == [1]


def test_selection_precedence(monkeypatch):
    monkeypatch.setenv("CCT_BLAS", "openblas")
    assert blas.get_backend() == "openblas"
    monkeypatch.setenv("CCT_BLAS", "bogus")
    with pytest.raises(CctError, match="CCT_BLAS"):
        blas.get_backend()
    blas.set_backend("openblas")  # explicit choice wins over the environment
    assert blas.get_backend() == "openblas"
    with pytest.raises(CctError, match="unknown BLAS backend"):
        blas.set_backend("atlas")


def test_auto_benchmarks_once_and_caches(monkeypatch, tmp_path):
    speeds = {"openblas": 100.0, "mkl": 250.0}
    seen = []

    def fake(name, *a, **k):
        seen.append(name)
        return speeds[name]

    monkeypatch.setattr(choice, "time_backend", fake)
    monkeypatch.setattr(choice, "mkl_available", lambda: True)
    monkeypatch.setenv("CCT_BLAS", "auto")
    assert blas.choose_backend() == "mkl"
    files = list(tmp_path.glob("blas-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["best"] == "mkl"
    n = len(seen)
    config.current().caches.blas_auto = None  # as a new process: read from the disk cache
    assert blas.choose_backend() == "mkl" and len(seen) == n  # from the cache, no re-measurement
    speeds["openblas"] = 900.0
    assert blas.calibrate(force=True)["best"] == "openblas" and len(seen) > n


def test_missing_mkl_gives_clean_error():
    # a fresh process (the library is looked for once per process) in which libmkl_rt cannot be found
    code = ("import cct.blas as blas\n"
            "import cct.blas.mkl as mkl\n"
            "mkl.find_mkl_rt = lambda: None\n"
            "try:\n    blas.set_backend('mkl')\nexcept blas.BlasUnavailable as e:\n    print('refused:', e)\n"
            "print('available:', blas.mkl_available())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "refused:" in out and "pip install mkl" in out
    assert out.strip().endswith("available: False")


def test_openblas_thread_limit_is_scoped():
    blas.set_backend("openblas")
    before = blas.get_num_threads()
    with blas.blas_threads(1):
        assert blas.get_num_threads() == 1
    assert blas.get_num_threads() == before
    assert not blas.supports_thread_local_limits("openblas")


@pytest.mark.skipif(not blas.mkl_available(), reason="MKL not installed")
def test_mkl_thread_limit_is_thread_local():
    blas.set_backend("mkl")
    assert blas.supports_thread_local_limits()
    before = blas.get_num_threads()
    inner = []
    with blas.blas_threads(1):
        inner.append(blas.get_num_threads())
        t = threading.Thread(target=lambda: inner.append(blas.get_num_threads()))
        t.start()
        t.join()
    assert inner == [1, before]
    assert blas.get_num_threads() == before


def test_blas_info_reports_kernel():
    blas.set_backend("openblas")
    info = blas.blas_info()
    assert info["backend"] == "openblas" and info["internal_api"] == "openblas"
    assert "architecture" in info and info["num_threads"] >= 1
    assert "kernel" in blas.describe()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    assert blas.cache_dir() == tmp_path
    monkeypatch.delenv("CCT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert blas.cache_dir() == tmp_path / "xdg" / "cct"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert blas.cache_dir().parts[-2:] == (".cache", "cct")


def test_openblas_accumulating_gemm_goes_through_cblas():
    """beta != 0 on OpenBLAS is one cblas call into numpy's own library (no temporary), also for a
    strided output and a transposed operand."""
    ob = openblas.load_openblas()
    assert ob is not None and ob.sgemm is not None
    rng = np.random.default_rng(3)
    a = rng.standard_normal((40, 30)).astype(np.float32)
    b = rng.standard_normal((20, 30)).astype(np.float32)  # used transposed
    base = rng.standard_normal((40, 60)).astype(np.float32)
    before = base.copy()
    out = base[:, ::3]  # non-contiguous
    expect = out + a @ b.T
    blas.gemm(a, b, out=out, trans_b=True, beta=1.0, backend="openblas")
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(base[:, 1::3], before[:, 1::3])  # the columns in between stay


def test_scoped_backend_wins_over_default_and_environment_and_is_per_thread(monkeypatch):
    monkeypatch.setenv("CCT_BLAS", "openblas")
    blas.set_backend("openblas")
    seen = []
    with config.using_config(blas={"backend": "auto"}):
        config.current().caches.blas_auto = "mkl"  # what 'auto' measured
        assert blas.get_backend() == "mkl"
        t = threading.Thread(target=lambda: seen.append(blas.get_backend()))
        t.start()
        t.join()
    assert seen == ["openblas"]  # another thread is outside the block: the process default
    assert blas.get_backend() == "openblas"
    with pytest.raises(CctError, match="unknown BLAS backend"):
        config.BlasConfig("atlas")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemm_timer_modes(backend):
    """The one GEMM timer: best-of-repeats and fixed-duration rates are positive and of the same order."""
    shapes = [(32, 64, 48), (16, 128, 32)]
    best = blas.gemm_gflops(shapes, repeats=2, backend=backend)
    sustained = blas.gemm_gflops(shapes, duration=0.02, backend=backend)
    assert best > 0 and sustained > 0
    assert sustained < best * 5  # both time the same GEMMs; best-of is the faster measure
    calls = []
    assert blas.best_time(lambda: calls.append(time.sleep(0.002)), 3) >= 0.002
    assert len(calls) == 4  # one warm-up call, then the best of three


def test_gemm_timer_aborts_the_barrier_when_setup_fails():
    barrier = threading.Barrier(2)

    def broken(_):
        raise MemoryError("no room")

    with pytest.raises(MemoryError):
        blas.gemm_gflops([(4, 4, 4)], duration=0.01, asarray=broken, barrier=barrier)
    assert barrier.broken  # the other device does not wait for ever


def test_cblas_operand_of_empty_and_strided_views():
    """Zero-size operands (numpy gives them zero strides) and strided slices of stacked arrays become
    row-major buffers without recursing; an accumulating GEMM over k = 0 only scales the output."""
    for shape in ((3, 0), (0, 3), (0, 0)):
        a, _, ld = product._as_cblas_operand(np.zeros(shape, np.float32), False)
        assert a.shape == shape and ld == max(shape[1], 1)
    stacked = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    view = stacked[:, 1, ::2]  # (2, 2), strides (48, 8): neither row- nor column-major
    a, trans, ld = product._as_cblas_operand(view, False)
    np.testing.assert_array_equal(a, view)
    assert (trans, ld) == (False, 2)
    out = np.ones((3, 2), np.float32)
    blas.gemm(np.zeros((3, 0), np.float32), np.zeros((0, 2), np.float32), out=out, beta=1.0)
    np.testing.assert_array_equal(out, np.ones((3, 2), np.float32))
    out2 = np.ones((2, 2), np.float32)
    blas.gemm(view, view, out=out2, beta=1.0)
    np.testing.assert_allclose(out2, view @ view + 1)
