"""The fused update's CuPy kernels (cct.solver.flat_update) against the per-parameter xp path on the same GPU
(to 1e-6 relative), on-device gradient clipping and its log line, and a CUDA-graph replay of the update
reading the current iteration's scalars (skipped without CuPy and a GPU)."""
from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
import update_cases
from update_cases import RULES

from cct.device.driver import cupy_available

pytestmark = pytest.mark.skipif(not cupy_available(), reason="needs CuPy and a GPU")


def make_solver(kind: str, reg: str, iter_size: int, extra: str = ""):
    return update_cases.make_solver(kind, reg, iter_size, extra, mode="GPU")


def feed(solvers, rng, scale=1.0):
    import cupy

    for params in zip(*(s.net.learnable_params for s in solvers)):
        g = (rng.standard_normal(params[0].diff.shape) * scale).astype(np.float32)
        for p in params:
            p.diff[...] = cupy.asarray(g)


def assert_close(ref, got, rtol=1e-6):
    from cct.device.driver import to_host

    for i, (p, q) in enumerate(zip(ref.net.learnable_params, got.net.learnable_params)):
        np.testing.assert_allclose(to_host(q.data), to_host(p.data), rtol=rtol, atol=1e-7, err_msg=f"data {i}")
    for i, (h, k) in enumerate(zip(ref.history, got.history)):
        np.testing.assert_allclose(to_host(k), to_host(h), rtol=rtol, atol=1e-7, err_msg=f"history {i}")


@pytest.mark.parametrize("kind,reg,iter_size", list(itertools.product(RULES, ("L2", "L1"), (1, 3))))
def test_kernel_matches_per_param_xp_path(kind, reg, iter_size):
    import cupy

    ref, flat = make_solver(kind, reg, iter_size), make_solver(kind, reg, iter_size)
    assert isinstance(flat.net.learnable_params[0].data, cupy.ndarray)
    assert flat.flat_update is not None and flat.flat_update.on_device
    assert ref.use_flat_update(False) is False
    rng = np.random.default_rng(3)
    for _ in range(4):
        feed((ref, flat), rng)
        ref.apply_update()
        flat.apply_update()
        ref.iter += 1
        flat.iter += 1
        assert_close(ref, flat)


def test_clipping_on_device_and_log(caplog):
    ref, flat = make_solver("Adam", "L2", 2, "clip_gradients: 0.5"), make_solver("Adam", "L2", 2, "clip_gradients: 0.5")
    ref.use_flat_update(False)
    rng = np.random.default_rng(4)
    with caplog.at_level(logging.INFO, logger="cct"):
        for _ in range(2):
            feed((ref, flat), rng, scale=3.0)
            ref.apply_update()
            flat.apply_update()
            ref.iter += 1
            flat.iter += 1
            assert_close(ref, flat, rtol=2e-6)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Gradient clipping: scaling")]
    assert len(lines) == 4
    norms = [float(line.split("L2 norm ")[1].split(" >")[0]) for line in lines]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5) and norms[0] > 0.5
    # deferred (a graph runner): nothing is logged until the boundary, then the last iteration and the count
    caplog.clear()
    flat.defer_host_reads = True
    with caplog.at_level(logging.INFO, logger="cct"):
        for _ in range(3):
            feed((flat,), rng, scale=3.0)
            flat.apply_update()
        assert not [r for r in caplog.records if "Gradient clipping" in r.getMessage()]
        flat.flush_update_log()
    msgs = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("Gradient clipping: scaling down gradients (L2 norm") for m in msgs)
    assert "Gradient clipping: 3 iterations were clipped since the last report" in msgs


def test_graph_replay_reads_current_scalars():
    """The update captured once in a CUDA graph and replayed for three iterations (the solver writing the
    rate and Adam's correction between replays) equals the eager update."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    if not hasattr(stream, "begin_capture"):
        pytest.skip("this CuPy cannot capture graphs")
    eager, graph_solver = make_solver("Adam", "L2", 1), make_solver("Adam", "L2", 1)
    rng = np.random.default_rng(5)
    grads = []
    for _ in range(4):
        feed((eager,), rng)
        grads.append([p.diff.copy() for p in eager.net.learnable_params])
        eager.apply_update()
        eager.iter += 1
    s = graph_solver
    s.defer_host_reads = True

    def load(k):
        for p, g in zip(s.net.learnable_params, grads[k]):
            p.diff[...] = g

    load(0)
    s.apply_update()  # warm-up (compiles the kernel) as iteration 0
    s.iter += 1
    with stream:
        stream.begin_capture()
        s.device_update()
        graph = stream.end_capture()
    for k in (1, 2, 3):
        load(k)
        cupy.cuda.get_current_stream().synchronize()
        s.prepare_update()
        cupy.cuda.get_current_stream().synchronize()
        graph.launch(stream)
        stream.synchronize()
        s.iter += 1
    assert_close(eager, s)
