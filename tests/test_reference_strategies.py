"""The optimizer's choice cannot change results beyond float rounding: every real-Caffe case with a
convolution (unit and model cases of ../shared/reference) matches Caffe to 1e-4 with each registered
strategy forced on every conv layer whose geometry it supports, and with the choice the cost model makes
from an empty cct cache (a fresh process: calibrations and tunings are kept per process)."""
import json
import os
import subprocess
import sys

import pytest
from refcase import (
    conv_geometries,
    has_convolutions,
    list_cases,
    load_case,
    max_rel_err,
    once_per_name,
    reference_available,
    run_case,
)

from cct.config import using_config
from cct.lowering import get_strategy, strategy_names, supports

pytestmark = pytest.mark.skipif(not reference_available(), reason="../shared/reference not present")

# the solver cases run whole training runs: tests/test_solver_reference.py forces each strategy on them
CONV_CASES = ([c for c in list_cases() if has_convolutions(c) and not c.startswith("solver_")]
              if reference_available() else [])


# Layers a strategy is not forced on although it supports them. Type 3 lifts every spatial axis, so on
# CaffeNet's conv1 (kernel 11, stride 4 on 227 x 227) its GEMM runs at all 227^2 input positions: 17x the
# work of the 55^2 outputs, about 10 s of this file's time. Type 3 stays forced on conv2-conv5 here (padding,
# group 2, kernels 5 and 3); its lifting of strided layers is compared with Caffe on the unit cases
# conv_group2_pad1_stride2, conv_rect_kh3kw5_ph1pw2_sh1sw2 and conv_combined_g2_p1_s2_d2_kh3kw5, and with a
# float64 convolution on strides up to 4 in tests/test_conv_properties.py.
NOT_FORCED = {("caffenet_trunk", "type3"): {"conv1"}}


def _assert_matches(case, results, label):
    assert results, f"{case}: nothing compared"
    for what, ours, theirs in results:
        err = max_rel_err(ours, theirs)
        assert err <= 1e-4, f"{case} ({label}): {what} differs from Caffe by {err:.3g} (relative to its max)"


def test_cases_with_convolutions_are_found():
    assert {"conv_group2_pad1_stride2", "deconv_k3s2", "lenet", "caffenet_trunk"} <= set(CONV_CASES)


@pytest.fixture(scope="module")
def loaded():
    """``load(case)``: the case's arrays and weights and its conv geometries, read once for all the strategies
    (each run only reads them)."""
    return once_per_name(lambda name: (load_case(name), conv_geometries(name)))


@pytest.mark.parametrize("strategy", strategy_names())
@pytest.mark.parametrize("case", CONV_CASES)
def test_case_with_each_strategy_forced(loaded, case, strategy):
    loaded_case, geoms = loaded(case)
    skip = NOT_FORCED.get((case, strategy), set())
    forced = {name: strategy for name, g in geoms.items()
              if name not in skip and supports(get_strategy(strategy), g)}
    if not forced:
        pytest.skip(f"{strategy} supports none of {case}'s convolutions")
    with using_config(engine={"overrides": forced}):
        results, ran = run_case(case, loaded_case)
    assert {name: ran[name] for name in forced} == forced, f"{case}: the forced strategy did not run"
    _assert_matches(case, results, f"{strategy} forced")


def test_cases_with_an_empty_cache(tmp_path):
    env = dict(os.environ, CCT_CACHE_DIR=str(tmp_path / "cache"), CCT_CALIBRATE="0", CCT_TUNE="0")
    env.pop("CCT_LOWERING", None)
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, os.path.join(here, "refcase.py"), *CONV_CASES], env=env,
                          capture_output=True, text=True, timeout=600, cwd=here)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(CONV_CASES)
    for case, r in report.items():
        assert r["compared"] > 0 and r["strategies"], f"{case}: nothing compared"
        assert r["max_rel_err"] <= 1e-4, f"{case}: {r['worst']} differs from Caffe by {r['max_rel_err']:.3g} " \
                                         f"with the strategies {r['strategies']}"
