"""The fused update over the flat parameter buffers (cct.solver.flat_update) on numpy: the same bits as the
per-parameter path for every solver type, L1 and L2, iter_size > 1, mixed and zero lr_mult/decay_mult,
weight sharing, gradient clipping and debug_info; the scalars it reads; its errors."""
from __future__ import annotations

import itertools
import logging
from collections import Counter

import numpy as np
import pytest
import update_cases
from update_cases import NET, RULES

from cct import kernels
from cct.errors import SolverError
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2
from cct.solver.flat_update import CORRECTION, NORM, RATE, FlatUpdate, Hyper, cupy_kernel_source
from cct.solver.flat_update import RULES as FLAT_RULES


def make_solver(kind: str, reg: str, iter_size: int, extra: str = "", flat: bool = False):
    s = update_cases.make_solver(kind, reg, iter_size, extra)
    assert s.use_flat_update(flat) is flat
    return s


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint32 if a.dtype == np.float32 else np.uint64)


def run_pair(kind: str, reg: str, iter_size: int, steps: int = 4, extra: str = "", scale: float = 1.0,
             debug: bool = False):
    """A per-parameter and a flat solver fed the same gradients; both after every update."""
    ref, flat = make_solver(kind, reg, iter_size, extra), make_solver(kind, reg, iter_size, extra, flat=True)
    ref.net.debug_info = flat.net.debug_info = debug
    assert flat.flat_update is not None and ref.flat_update is None
    rng = np.random.default_rng(11)
    for p, q in zip(ref.net.learnable_params, flat.net.learnable_params):
        assert np.array_equal(bits(p.data), bits(q.data))
        p.data[0] = q.data[0] = 0.0  # sign(0) and the exact zero in the L1 term
    for _ in range(steps):
        for p, q in zip(ref.net.learnable_params, flat.net.learnable_params):
            g = (rng.standard_normal(p.diff.shape) * scale).astype(np.float32)
            p.diff[...] = g
            q.diff[...] = g
        ref.apply_update()
        flat.apply_update()
        ref.iter += 1
        flat.iter += 1
        yield ref, flat


def assert_same_bits(ref, flat) -> None:
    for i, (p, q) in enumerate(zip(ref.net.learnable_params, flat.net.learnable_params)):
        assert np.array_equal(bits(p.data), bits(q.data)), f"param {i} data"
        assert np.array_equal(bits(p.diff), bits(q.diff)), f"param {i} diff"
    assert len(ref.history) == len(flat.history)
    for i, (h, k) in enumerate(zip(ref.history, flat.history)):
        assert np.array_equal(bits(h), bits(k)), f"history {i}"


@pytest.mark.parametrize("kind,reg,iter_size", list(itertools.product(RULES, ("L2", "L1"), (1, 3))))
def test_flat_equals_per_param_bit_for_bit(kind, reg, iter_size):
    for ref, flat in run_pair(kind, reg, iter_size):
        assert_same_bits(ref, flat)
    # the frozen bias (lr_mult 0) did not move, the others did
    nets = flat.net.learnable_params
    assert len(nets) == 5  # the shared weight is one learnable param
    fresh = make_solver(kind, reg, iter_size).net.learnable_params
    assert np.array_equal(nets[3].data[1:], fresh[3].data[1:]) and nets[3].data[0] == 0
    for i in (0, 1, 2, 4):
        assert not np.array_equal(nets[i].data[1:], fresh[i].data[1:]), i


@pytest.mark.parametrize("mode", ["numpy", "auto"])
def test_sgd_flat_equals_numba_and_numpy_per_param(mode):
    with kernels.forced_mode(mode):
        for ref, flat in run_pair("SGD", "L2", 1, steps=3):
            assert_same_bits(ref, flat)


def test_clipping_on_numpy_same_bits_and_log(caplog):
    with caplog.at_level(logging.INFO, logger="cct"):
        for ref, flat in run_pair("Adam", "L2", 2, steps=2, extra="clip_gradients: 0.5", scale=3.0):
            assert_same_bits(ref, flat)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Gradient clipping")]
    assert len(lines) == 4 and lines[0] == lines[1]  # each solver logs Caffe's line once per iteration
    assert "> 0.5) by scale factor" in lines[0]


def test_debug_info_logs_then_updates_same_bits(caplog):
    with caplog.at_level(logging.INFO, logger="cct"):
        for ref, flat in run_pair("RMSProp", "L1", 1, steps=2, debug=True):
            assert_same_bits(ref, flat)
    update_lines = [r.getMessage() for r in caplog.records if "[Update]" in r.getMessage()]
    # both solvers log the same lines (each line twice: the diffs before the update, Caffe's order)
    assert len(update_lines) == 2 * 2 * 5 and all(n % 2 == 0 for n in Counter(update_lines).values())


def test_scalars_follow_rate_iteration_and_correction():
    s = make_solver("Adam", "L2", 4, flat=True)
    st = s.flat_update.groups[0]
    s.prepare_update()
    assert st.scalars[RATE] == np.float32(0.05) and st.scalars[NORM] == np.float32(1) / np.float32(4)
    want = np.float32(np.sqrt(1 - np.float32(0.999) ** 1.0 * 1) / (1 - float(np.float32(0.9))))
    assert st.scalars[CORRECTION] == pytest.approx(want, rel=1e-6)
    s.iter = 2  # step policy: 0.05 * 0.5
    s.prepare_update()
    assert st.scalars[RATE] == np.float32(0.025)
    b1, b2 = float(np.float32(0.9)), float(np.float32(0.999))
    assert st.scalars[CORRECTION] == np.float32(np.sqrt(1 - b2 ** 3) / (1 - b1 ** 3))


def test_broken_views_fall_back_to_per_param_path():
    """A learnable param rebound away from the flat buffer (share_data onto another array) is updated by the
    per-parameter path; the flat pass is skipped while the views are not intact."""
    s = make_solver("SGD", "L2", 1, flat=True)
    other = make_solver("SGD", "L2", 1)
    s.net.share_weights_with(other.net)  # rebinds s's data to other's arrays
    assert not s.net.flat_params.intact()
    for p in s.net.learnable_params:
        p.diff[...] = 1.0
    before = [p.data.copy() for p in s.net.learnable_params]
    s.apply_update()
    # conv weight: lr 1, decay 0.02 * 1: update = 0.05 * (1 + 0.02 * w)
    w = before[0]
    upd = np.float32(0.05) * (np.float32(1) + np.float32(0.02) * w)
    np.testing.assert_array_equal(other.net.learnable_params[0].data, w - upd)


def test_subclass_overriding_a_step_keeps_per_param_path():
    from cct.solver.rules import SGDSolver

    class Custom(SGDSolver):
        def compute_update_value(self, param_id, rate):
            self.net.learnable_params[param_id].diff[...] = 0

    p = parse_text('base_lr: 0.1 lr_policy: "fixed" solver_mode: CPU', caffe_pb2.SolverParameter())
    parse_text(NET, p.net_param)
    s = Custom(p)
    assert s.use_flat_update(True) is False and s.flat_update is None
    before = [q.data.copy() for q in s.net.learnable_params]
    for q in s.net.learnable_params:
        q.diff[...] = 1
    s.apply_update()
    for q, b in zip(s.net.learnable_params, before):
        np.testing.assert_array_equal(q.data, b)


def test_errors():
    s = make_solver("SGD", "L2", 1)
    flat = s.net.flat_params
    with pytest.raises(SolverError, match="unknown rule 'lion'"):
        FlatUpdate(flat, "lion", Hyper(), 0.0, s.net.params_lr, s.net.params_weight_decay, s.history_buffers)
    with pytest.raises(SolverError, match="Unknown regularization type"):
        FlatUpdate(flat, "sgd", Hyper(regularization="L3"), 0.0, s.net.params_lr, s.net.params_weight_decay,
                   s.history_buffers)
    with pytest.raises(SolverError, match="keeps 2 history set"):
        FlatUpdate(flat, "adam", Hyper(), 0.0, s.net.params_lr, s.net.params_weight_decay, s.history_buffers)


@pytest.mark.parametrize("rule", ["sgd", "nesterov", "adagrad", "rmsprop", "adadelta", "adam"])
def test_kernel_source_uses_rounded_ops_only(rule):
    """The CUDA body does every product, sum, quotient and root with a _rn intrinsic macro (no contraction);
    the L1 term is sign(w)."""
    src = cupy_kernel_source(rule, "L1")
    body = src.replace("MUL(", "").replace("ADD(", "").replace("SUB(", "").replace("DIV(", "").replace("SQRT(", "")
    for op in ("*", "/"):
        assert op not in body, (rule, op)
    assert "w > 0 ? one" in src and "if (apply) w = SUB(w, upd);" in src


# -- the CUDA kernels' arithmetic, compiled as C++ on the CPU -----------------------------------------------
_CPP_PREAMBLE = """#include <cmath>
typedef float T;
#define MUL(a, b) ((T)((a) * (b)))
#define ADD(a, b) ((T)((a) + (b)))
#define SUB(a, b) ((T)((a) - (b)))
#define DIV(a, b) ((T)((a) / (b)))
#define SQRT(a) ((T)std::sqrt(a))
"""


@pytest.fixture(scope="module")
def cpp_kernels(tmp_path_factory):
    """Every rule's CUDA body (cupy_kernel_source) in a loop over the elements, built by the system C++
    compiler without FMA contraction (IEEE float ops like the _rn intrinsics): one function per rule and
    regularisation, ``k_<rule>_<L1|L2>``."""
    import ctypes
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    parts = [_CPP_PREAMBLE]
    for rule, reg in itertools.product(FLAT_RULES, ("L1", "L2")):
        h2 = ", T* h2_" if FLAT_RULES[rule] == 2 else ""
        h2ref = "T& h2 = h2_[i];" if FLAT_RULES[rule] == 2 else ""
        parts.append(f"""extern "C" void k_{rule}_{reg}(const T* s, const long long* starts, const long long* ends,
    const T* seg_lr, const T* seg_decay, long long nseg, int norm, int clip, int apply, T* w_, T* d_, T* h_{h2},
    long long n) {{
  for (long long i = 0; i < n; ++i) {{
    T& w = w_[i]; T& d = d_[i]; T& h = h_[i]; {h2ref}
    {cupy_kernel_source(rule, reg)}
  }}
}}
""")
    d = tmp_path_factory.mktemp("kernels")
    (d / "k.cpp").write_text("".join(parts))
    subprocess.run([cxx, "-O1", "-ffp-contract=off", "-shared", "-fPIC", str(d / "k.cpp"), "-o", str(d / "k.so")],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(d / "k.so"))


@pytest.mark.parametrize("kind,reg,iter_size", list(itertools.product(RULES, ("L2", "L1"), (1, 3))))
def test_kernel_body_matches_per_param_bits(cpp_kernels, kind, reg, iter_size):
    """The device kernels' body, run on the CPU over the flat buffers with the solver's scalars and segment
    tables, gives the per-parameter path's bits; it leaves the alignment gaps at zero."""
    import ctypes

    ref, dev = make_solver(kind, reg, iter_size), make_solver(kind, reg, iter_size, flat=True)
    st = dev.flat_update.groups[0]
    g = st.group
    starts = np.array(g.offsets, np.int64)
    ends = starts + np.array(g.sizes, np.int64)
    seg_lr = g.per_segment(dev.net.params_lr)
    seg_decay = g.per_segment([np.float32(0.02) * np.float32(m) for m in dev.net.params_weight_decay])
    kernel = getattr(cpp_kernels, f"k_{kind.lower()}_{reg}")
    p_ = ctypes.c_void_p

    def ptr(a):
        return a.ctypes.data_as(p_)

    rng = np.random.default_rng(2)
    for _ in range(3):
        for p, q in zip(ref.net.learnable_params, dev.net.learnable_params):
            grad = rng.standard_normal(p.diff.shape).astype(np.float32)
            p.diff[...] = grad
            q.diff[...] = grad
        ref.apply_update()
        dev.prepare_update()  # the scalars the kernel reads
        kernel(ptr(st.scalars), ptr(starts), ptr(ends), ptr(seg_lr), ptr(seg_decay),
               ctypes.c_longlong(len(g.param_ids)), int(iter_size != 1), 0, 1, ptr(g.data), ptr(g.diff),
               *[ptr(h) for h in st.history], ctypes.c_longlong(g.size))
        ref.iter += 1
        dev.iter += 1
        assert_same_bits(ref, dev)
        for end, nxt in zip(ends, [*starts[1:], g.size]):
            assert not g.data[end:nxt].any() and not g.diff[end:nxt].any()
            assert not any(h[end:nxt].any() for h in st.history)
