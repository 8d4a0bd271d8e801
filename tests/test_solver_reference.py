"""Solver runs of real BVLC Caffe (``shared/reference/solver_*`` beside the repo): same losses, rates and final weights.

Recipe (reference README, "Solver runs"): from inside a copy of the case directory,
``solver = get_solver("solver.prototxt"); solver.net.copy_from("init.caffemodel")``, then
``solver.step(1)`` max_iter times; compare ``losses.json`` (loss and lr of every iteration) and
``final.caffemodel``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from cct.config import using_config
from cct.lowering import strategy_names
from cct.paths import shared_path

REFERENCE = Path(os.environ.get("CCT_REFERENCE", shared_path("reference")))
CASES = sorted(p.name for p in REFERENCE.glob("solver_*")) if REFERENCE.is_dir() else []


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


@pytest.mark.skipif(not CASES, reason="no reference solver runs available")
@pytest.mark.parametrize("strategy", ["model"] + strategy_names())
@pytest.mark.parametrize("case", CASES or ["none"])
def test_solver_run_matches_caffe(case, strategy, tmp_path, monkeypatch):
    """``strategy``: the cost model's choice per conv layer, or one strategy forced on every conv layer (the
    optimizer's choice must not change the trajectory beyond float rounding)."""
    import cct.layers as L
    from cct.io.caffemodel import read_weights
    from cct.solver import get_solver

    if "HDF5Data" not in L.layer_type_list():
        pytest.skip("HDF5Data layer not available")
    src = REFERENCE / case
    work = tmp_path / case
    shutil.copytree(src, work)
    monkeypatch.chdir(work)
    ref = json.loads((work / "losses.json").read_text())
    meta = json.loads((work / "meta.json").read_text())

    overrides = {} if strategy == "model" else {"*": strategy}
    with using_config(engine={"overrides": overrides}):
        solver = get_solver("solver.prototxt")
    if strategy != "model":
        ran = {layer.lowering.name for layer in solver.net.layers if layer.type == "Convolution"}
        assert ran == {strategy}, f"the forced strategy did not run: {ran}"
    assert solver.type == meta.get("solver_type", solver.type)
    solver.net.copy_from("init.caffemodel")
    losses, rates = [], []
    forward_losses = []
    n_iter = solver.param.max_iter
    # record each forward pass's loss (iter_size passes per iteration)
    orig_fb = solver.net.forward_backward

    def fb(**kw):
        loss = orig_fb(**kw)
        forward_losses.append(float(loss))  # the solver asks for the loss as a device scalar
        return loss

    solver.net.forward_backward = fb
    for _ in range(n_iter):
        before = len(forward_losses)
        solver.step(1)
        passes = forward_losses[before:]
        losses.append(float(np.mean(np.asarray(passes, dtype=np.float32))))
        rates.append(solver.lr)
    assert solver.iter == n_iter

    # the rate Caffe's lr policy gave (bitwise: same float32 arithmetic)
    np.testing.assert_allclose(rates, ref["lr"], rtol=1e-7)
    # the loss of every iteration, evaluated before its update: the first one checks the forward
    # pass alone, the later ones every update before them
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-4)
    if "forward_losses" in ref:
        np.testing.assert_allclose(forward_losses, ref["forward_losses"], rtol=1e-4)

    final = read_weights(work / "final.caffemodel")
    got = {name: [b.data for b in layer.blobs] for name, layer in zip(solver.net.layer_names, solver.net.layers)}
    compared = 0
    for name, arrays in final.items():
        if not arrays:
            continue
        assert name in got, f"layer {name} of final.caffemodel missing from the net"
        for i, want in enumerate(arrays):
            have = np.asarray(got[name][i]).reshape(want.shape)
            err = _rel_l2(have, want)
            assert err < 1e-4, f"{name}[{i}]: relative L2 error {err:.3g}"
            compared += 1
    assert compared > 0
