"""Property: mutated prototxts, caffemodels and HDF5 weights give success or one of cct's errors, never
a bare Python exception or a hang (hypothesis over the seeds of cct.fuzz; the long run is
tools/fuzz_inputs.py)."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cct import fuzz

SETTINGS = dict(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
# The big ImageNet nets take seconds each to build under fuzzing: the long run has them, CI does not.
CORPUS = [(name, text) for name, text in fuzz.prototxt_corpus()
          if not any(big in name for big in ("alexnet", "caffenet", "googlenet", "rcnn", "flickr", "vgg"))]


def _check(kind: str, seed: int) -> str:
    case = fuzz.make_case(kind, seed, CORPUS if kind == "prototxt" else None)
    outcome = fuzz.run_case(case, timeout=30)
    assert outcome == "ok" or outcome.startswith("cct:"), fuzz.describe(case, outcome)
    return outcome


@settings(max_examples=60, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_prototxt(seed):
    _check("prototxt", seed)


@settings(max_examples=40, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_caffemodel(seed):
    _check("caffemodel", seed)


@settings(max_examples=30, **SETTINGS)
@given(seed=st.integers(0, 2**31 - 1))
def test_mutated_hdf5(seed):
    _check("hdf5", seed)


def test_cases_are_deterministic_and_mutated():
    for kind in fuzz.KINDS:
        a, b = fuzz.make_case(kind, 7, CORPUS), fuzz.make_case(kind, 7, CORPUS)
        assert a == b and a.mutation != "none"
    originals = dict(CORPUS)
    case = fuzz.make_case("prototxt", 7, CORPUS)
    assert case.data != originals[case.origin]


def test_alarm_interrupts_a_slow_case():
    import time

    t0 = time.perf_counter()
    with pytest.raises(fuzz.CaseTimeout):
        with fuzz.alarm(0.2):
            while True:
                time.sleep(0.01)
    assert time.perf_counter() - t0 < 3
    with fuzz.alarm(5):  # disarmed on exit: nothing fires later
        pass
    time.sleep(0.05)
