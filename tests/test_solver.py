"""cct.solver against hand-written numpy references: every update rule, lr policy, regularisation,
lr/decay multipliers, gradient clipping, iter_size, snapshots/resume, NaN stop, signals, errors."""
from __future__ import annotations

import logging
import math
import os

import numpy as np
import pytest

import cct
from cct.errors import CctError, SolverError
from cct.io.prototxt import parse_text
from cct.layers.base import Layer, register
from cct.proto import caffe_pb2
from cct.solver import get_solver
from cct.solver import snapshot as snap

GPU_FALLBACK = ("solver_mode: GPU but no GPU is available (CuPy missing or no device visible); "
                "training on the CPU")

# -- a deterministic data layer with a read cursor ------------------------------------------------
_TABLE_X = np.random.RandomState(0).uniform(-1, 1, (10, 3)).astype(np.float32)
_TABLE_Y = np.random.RandomState(1).uniform(-1, 1, (10, 2)).astype(np.float32)
BATCH = 4


class SeqData(Layer):
    """Rows of a fixed table, BATCH per forward, wrapping row by row (like HDF5Data, shuffle off)."""

    exact_num_bottom = 0
    exact_num_top = 2

    def layer_setup(self, bottom, top):
        self.cursor = 0

    def reshape(self, bottom, top):
        top[0].reshape((BATCH, 3))
        top[1].reshape((BATCH, 2))

    def forward(self, bottom, top):
        idx = [(self.cursor + j) % len(_TABLE_X) for j in range(BATCH)]
        top[0].data[...] = _TABLE_X[idx]
        top[1].data[...] = _TABLE_Y[idx]
        self.cursor = (self.cursor + BATCH) % len(_TABLE_X)

    def backward(self, top, propagate_down, bottom):
        pass

    def allow_force_backward(self, i):
        return False

    def get_read_state(self):
        return {"cursor": self.cursor}

    def set_read_state(self, state):
        self.cursor = int(state["cursor"])


@pytest.fixture(autouse=True, scope="module")
def _seq_data_registered():
    """Register the test layer only while this module runs (other tests may enumerate layer types)."""
    from cct.layers import base

    register("CctTestSeqData")(SeqData)
    yield
    base._REGISTRY.pop("CctTestSeqData", None)


def batch(k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k-th batch SeqData produces."""
    idx = [(k * BATCH + j) % len(_TABLE_X) for j in range(BATCH)]
    return _TABLE_X[idx].astype(np.float64), _TABLE_Y[idx].astype(np.float64)


NET = """
name: "tiny"
layer { name: "data" type: "CctTestSeqData" top: "x" top: "y" }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "out"
  param { lr_mult: %(w_lr)s decay_mult: %(w_decay)s } param { lr_mult: %(b_lr)s decay_mult: %(b_decay)s }
  inner_product_param { num_output: 2 weight_filler { type: "gaussian" std: 0.5 }
                        bias_filler { type: "gaussian" std: 0.5 } } }
%(extra)s
layer { name: "loss" type: "EuclideanLoss" bottom: "%(loss_bottom)s" bottom: "y" top: "loss" }
"""


def net_text(w_lr=1, w_decay=1, b_lr=2, b_decay=0, extra="", loss_bottom="out") -> str:
    return NET % dict(w_lr=w_lr, w_decay=w_decay, b_lr=b_lr, b_decay=b_decay, extra=extra, loss_bottom=loss_bottom)


def make_param(solver_text: str, **net_kw) -> caffe_pb2.SolverParameter:
    p = parse_text(solver_text, caffe_pb2.SolverParameter())
    if not (p.HasField("net") or p.HasField("train_net") or p.HasField("train_net_param")):
        parse_text(net_text(**net_kw), p.net_param)
    if not p.HasField("solver_mode"):
        p.solver_mode = caffe_pb2.SolverParameter.CPU
    if not p.HasField("random_seed"):
        p.random_seed = 3
    return p


# -- the numpy reference ------------------------------------------------------------------------
def ref_forward_backward(W, b, X, Y):
    out = X @ W.T + b
    d = out - Y
    n = X.shape[0]
    return (d ** 2).sum() / (2 * n), [d.T @ X / n, d.sum(0) / n]


def ref_rate(cfg: dict, it: int, state: dict) -> float:
    pol = cfg.get("lr_policy", "fixed")
    base, gamma, power = cfg.get("base_lr", 0.1), cfg.get("gamma", 0.0), cfg.get("power", 0.0)
    if pol == "fixed":
        return base
    if pol == "step":
        return base * gamma ** (it // cfg["stepsize"])
    if pol == "exp":
        return base * gamma ** it
    if pol == "inv":
        return base * (1 + gamma * it) ** (-power)
    if pol == "multistep":
        sv = cfg["stepvalue"]
        if state["step"] < len(sv) and it >= sv[state["step"]]:
            state["step"] += 1
        return base * gamma ** state["step"]
    if pol == "poly":
        return base * (1 - it / cfg["max_iter"]) ** power
    if pol == "sigmoid":
        return base / (1 + math.exp(-gamma * (it - cfg["stepsize"])))
    raise AssertionError(pol)


class RefSolver:
    """Float64 re-statement of the update rules, from their textbook formulas."""

    def __init__(self, kind, params, cfg, lr_mult=(1, 2), decay_mult=(1, 0)):
        self.kind, self.p, self.cfg = kind, [np.array(x, dtype=np.float64) for x in params], cfg
        self.lr_mult, self.decay_mult = lr_mult, decay_mult
        self.h = [np.zeros_like(x) for x in self.p]
        self.h2 = [np.zeros_like(x) for x in self.p]
        self.it = 0
        self.batch_k = 0
        self.state = {"step": 0}
        self.rates, self.losses = [], []

    def step(self):
        cfg = self.cfg
        iter_size = cfg.get("iter_size", 1)
        grads = [np.zeros_like(x) for x in self.p]
        loss = 0.0
        for _ in range(iter_size):
            X, Y = batch(self.batch_k)
            self.batch_k += 1
            l, g = ref_forward_backward(self.p[0], self.p[1], X, Y)
            loss += l
            grads = [a + c for a, c in zip(grads, g)]
        self.losses.append(loss / iter_size)
        rate = ref_rate(cfg, self.it, self.state)
        self.rates.append(rate)
        clip = cfg.get("clip_gradients", -1)
        if clip >= 0:
            norm = math.sqrt(sum((g ** 2).sum() for g in grads))
            if norm > clip:
                grads = [g * (clip / norm) for g in grads]
        grads = [g / iter_size for g in grads]
        mom, wd, delta = cfg.get("momentum", 0.0), cfg.get("weight_decay", 0.0), cfg.get("delta", 1e-8)
        for i, (w, g) in enumerate(zip(self.p, grads)):
            decay = wd * self.decay_mult[i]
            g = g + decay * (np.sign(w) if cfg.get("regularization_type", "L2") == "L1" else w)
            lr = rate * self.lr_mult[i]
            h, h2 = self.h[i], self.h2[i]
            if self.kind == "SGD":
                h[...] = mom * h + lr * g
                upd = h.copy()
            elif self.kind == "Nesterov":
                prev = h.copy()
                h[...] = mom * h + lr * g
                upd = (1 + mom) * h - mom * prev
            elif self.kind == "AdaGrad":
                h += g * g
                upd = lr * g / (np.sqrt(h) + delta)
            elif self.kind == "RMSProp":
                rd = cfg.get("rms_decay", 0.99)
                h[...] = rd * h + (1 - rd) * g * g
                upd = lr * g / (np.sqrt(h) + delta)
            elif self.kind == "AdaDelta":
                h[...] = mom * h + (1 - mom) * g * g
                u = g * np.sqrt((h2 + delta) / (h + delta))
                h2[...] = mom * h2 + (1 - mom) * u * u
                upd = lr * u
            elif self.kind == "Adam":
                b1, b2 = mom, cfg.get("momentum2", 0.999)
                t = self.it + 1
                h[...] = b1 * h + (1 - b1) * g
                h2[...] = b2 * h2 + (1 - b2) * g * g
                upd = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * h / (np.sqrt(h2) + delta)
            else:
                raise AssertionError(self.kind)
            w -= upd
        self.it += 1


def solver_text(cfg: dict) -> str:
    lines = []
    for k, v in cfg.items():
        if isinstance(v, (list, tuple)):
            lines += [f"{k}: {x}" for x in v]
        elif isinstance(v, str) and k not in ("solver_mode", "snapshot_format", "solver_type"):
            lines.append(f'{k}: "{v}"')
        else:
            lines.append(f"{k}: {v}")
    return "\n".join(lines)


def run_both(kind, cfg, steps=5, rtol=2e-5, atol=2e-6, lr_mult=(1, 2), decay_mult=(1, 0), **net_kw):
    full = {"type": kind, "lr_policy": "fixed", "display": 0, "max_iter": 100, **cfg}
    s = get_solver(make_param(solver_text(full), w_lr=lr_mult[0], b_lr=lr_mult[1], w_decay=decay_mult[0],
                              b_decay=decay_mult[1], **net_kw))
    assert s.type == kind and type(s).__name__ == f"{kind}Solver"
    ref = RefSolver(kind, [b.data for b in s.net.learnable_params], full, lr_mult, decay_mult)
    ref.initial = [x.copy() for x in ref.p]
    for _ in range(steps):
        s.step(1)
        ref.step()
        np.testing.assert_allclose(s.lr, ref.rates[-1], rtol=1e-6)
        for got, want in zip(s.net.learnable_params, ref.p):
            np.testing.assert_allclose(got.data, want, rtol=rtol, atol=atol)
    assert s.iter == steps
    return s, ref


BASE = {"base_lr": 0.1, "weight_decay": 0.01}


@pytest.mark.parametrize("kind,cfg", [
    ("SGD", {**BASE, "momentum": 0.9}),
    ("Nesterov", {**BASE, "momentum": 0.9}),
    ("AdaGrad", {**BASE, "delta": 1e-6}),
    ("RMSProp", {**BASE, "rms_decay": 0.9, "delta": 1e-6}),
    ("AdaDelta", {"base_lr": 1.0, "momentum": 0.95, "delta": 1e-6, "weight_decay": 0.01}),
    ("Adam", {"base_lr": 0.01, "momentum": 0.9, "momentum2": 0.999, "delta": 1e-8, "weight_decay": 0.01}),
])
def test_update_rules_match_reference(kind, cfg):
    s, ref = run_both(kind, cfg, steps=6)
    # the weights did move (the check compares something)
    assert np.abs(ref.p[0] - ref.initial[0]).max() > 1e-3
    assert len(s.history) == (2 if kind in ("AdaDelta", "Adam") else 1) * 2


@pytest.mark.parametrize("cfg", [
    {"lr_policy": "fixed"},
    {"lr_policy": "step", "gamma": 0.5, "stepsize": 2},
    {"lr_policy": "exp", "gamma": 0.9},
    {"lr_policy": "inv", "gamma": 0.1, "power": 0.75},
    {"lr_policy": "multistep", "gamma": 0.3, "stepvalue": [1, 3, 4]},
    {"lr_policy": "poly", "power": 2.0, "max_iter": 8},
    {"lr_policy": "sigmoid", "gamma": 0.5, "stepsize": 3},
])
def test_lr_policies(cfg):
    full = {"base_lr": 0.1, "momentum": 0.9, **cfg}
    s, ref = run_both("SGD", full, steps=7)
    if cfg["lr_policy"] == "multistep":
        assert s.current_step == 3
    # rates actually vary for the non-fixed policies
    assert (len(set(np.round(ref.rates, 12))) > 1) == (cfg["lr_policy"] != "fixed")


def test_sigmoid_needs_nonnegative_gamma_like_caffe():
    with pytest.raises(SolverError, match="gamma"):
        get_solver(make_param('base_lr: 0.1 lr_policy: "sigmoid" gamma: -0.5 stepsize: 3')).step(1)


def test_lr_values_float32_like_caffe():
    from cct.solver.lr_policy import learning_rate

    p = parse_text('base_lr: 0.01 lr_policy: "step" gamma: 0.5 stepsize: 4', caffe_pb2.SolverParameter())
    assert learning_rate(p, 0, 0) == (float(np.float32(0.01)), 0)
    rate, step = learning_rate(p, 9, 0)
    assert step == 2 and rate == float(np.float32(0.0025))
    with pytest.raises(SolverError, match="Unknown learning rate policy"):
        learning_rate(parse_text('base_lr: 1 lr_policy: "cosine"', caffe_pb2.SolverParameter()), 0, 0)


def test_l1_regularization():
    run_both("SGD", {"base_lr": 0.1, "momentum": 0.5, "weight_decay": 0.05, "regularization_type": "L1"})


def test_lr_mult_and_decay_mult():
    s, ref = run_both("SGD", {"base_lr": 0.1, "momentum": 0.9, "weight_decay": 0.1},
                      lr_mult=(0.5, 3), decay_mult=(2, 1))
    assert s.net.params_lr == [0.5, 3.0] and s.net.params_weight_decay == [2.0, 1.0]


def test_lr_mult_zero_freezes_param():
    s, _ = run_both("SGD", {"base_lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}, lr_mult=(1, 0), decay_mult=(1, 1))
    bias0 = RefSolver("SGD", [b.data for b in s.net.learnable_params], {}).p[1]
    s.step(2)
    np.testing.assert_array_equal(s.net.learnable_params[1].data, bias0)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def cct_log():
    logger = logging.getLogger("cct")
    h = _Capture()
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(h)
    yield h.lines
    logger.removeHandler(h)
    logger.setLevel(old)


def test_clip_gradients(cct_log):
    s, ref = run_both("SGD", {"base_lr": 0.1, "momentum": 0.9, "clip_gradients": 0.05})
    clip_lines = [l for l in cct_log if l.startswith("Gradient clipping")]
    assert len(clip_lines) == 5
    assert " > 0.05) by scale factor " in clip_lines[0]
    assert clip_lines[0].startswith("Gradient clipping: scaling down gradients (L2 norm ")


def test_clip_gradients_inactive_when_norm_small(cct_log):
    run_both("SGD", {"base_lr": 0.1, "clip_gradients": 1000.0})
    assert not [l for l in cct_log if l.startswith("Gradient clipping")]


def test_iter_size_accumulates_and_normalizes():
    s, ref = run_both("SGD", {"base_lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "iter_size": 3,
                              "clip_gradients": 0.2})
    assert s.net.layer_by_name("data").cursor == (5 * 3 * BATCH) % 10


def test_display_log_lines_and_smoothed_loss(cct_log):
    s = get_solver(make_param('type: "SGD" base_lr: 0.05 lr_policy: "fixed" display: 2 average_loss: 2 '
                              'max_iter: 4 snapshot_after_train: false'))
    ref = RefSolver("SGD", [b.data for b in s.net.learnable_params], {"base_lr": 0.05})
    s.solve()
    for _ in range(4):
        ref.step()
    iters = [l for l in cct_log if l.startswith("Iteration ") and "iter/s" in l]
    assert [l.split(" (")[0] for l in iters] == ["Iteration 0", "Iteration 2"]
    assert "s/2 iters), loss = " in iters[0]
    # loss at iteration 2 is averaged over iterations 1 and 2
    shown = float(iters[1].rsplit("= ", 1)[1])
    assert shown == pytest.approx((ref.losses[1] + ref.losses[2]) / 2, rel=1e-5)
    outs = [l for l in cct_log if l.startswith("    Train net output #0: loss = ")]
    assert len(outs) == 2 and outs[0].endswith(" loss)") and "(* 1 = " in outs[0]
    assert "Iteration 0, lr = 0.05" in cct_log and "Iteration 2, lr = 0.05" in cct_log
    assert cct_log[-1] == "Optimization Done."
    assert any(l.startswith("Iteration 4, loss = ") for l in cct_log)


def test_test_nets_share_weights_and_report_means(cct_log):
    text = ('type: "SGD" base_lr: 0.05 lr_policy: "fixed" display: 0 max_iter: 3 test_iter: 2 test_interval: 2 '
            'snapshot_after_train: false test_compute_loss: true')
    s = get_solver(make_param(text))
    assert len(s.test_nets) == 1 and s.test_nets[0].phase == caffe_pb2.TEST
    ref = RefSolver("SGD", [b.data for b in s.net.learnable_params], {"base_lr": 0.05})
    s.solve()
    ref.step()
    ref.step()
    # test at iteration 2: the test net's own cursor reads batches 2 and 3, with the weights after 2 updates
    expected = np.mean([ref_forward_backward(ref.p[0], ref.p[1], *batch(k))[0] for k in (2, 3)])
    ref.step()
    # tests at iterations 0 and 2 (test_initialization), none at 3 (3 % 2 != 0)
    assert [l for l in cct_log if "Testing net" in l] == ["Iteration 0, Testing net (#0)",
                                                           "Iteration 2, Testing net (#0)"]
    # test net shares the trained weights
    for a, b in zip(s.test_nets[0].layer_by_name("ip").blobs, s.net.layer_by_name("ip").blobs):
        np.testing.assert_array_equal(a.data, b.data)
    # second test at iteration 2: test net's own cursor read batches 2 and 3 with the weights after 2 updates
    outs = [l for l in cct_log if l.startswith("    Test net output #0: loss = ")]
    assert len(outs) == 2 and "(* 1 = " in outs[0]
    assert float(outs[1].split(" = ")[1].split(" ")[0]) == pytest.approx(expected, rel=1e-5)
    assert any(l.startswith("Test loss: ") for l in cct_log)


def test_test_net_errors():
    with pytest.raises(SolverError, match="test_iter must be specified for each test network"):
        p = make_param('base_lr: 0.1 lr_policy: "fixed" test_interval: 1')
        p.train_net_param.CopyFrom(p.net_param)
        p.ClearField("net_param")
        p.test_net_param.add().CopyFrom(p.train_net_param)
        get_solver(p)
    with pytest.raises(SolverError, match="test_interval"):
        get_solver(make_param('base_lr: 0.1 lr_policy: "fixed" test_iter: 1'))
    with pytest.raises(SolverError, match="test_state must be unspecified or specified once per test net"):
        get_solver(make_param('base_lr: 0.1 lr_policy: "fixed" test_iter: 1 test_interval: 1 '
                              'test_state { stage: "a" } test_state { stage: "b" }'))


def test_train_net_field_errors(tmp_path):
    with pytest.raises(SolverError, match="must specify a train net using one of these fields"):
        get_solver(parse_text('base_lr: 0.1 lr_policy: "fixed"', caffe_pb2.SolverParameter()))
    p = make_param('base_lr: 0.1 lr_policy: "fixed"')
    p.train_net = "x.prototxt"
    with pytest.raises(SolverError, match="must not contain more than one"):
        get_solver(p)


def test_missing_net_file_names_the_path(tmp_path):
    sp = tmp_path / "solver.prototxt"
    missing = tmp_path / "nope" / "net.prototxt"
    sp.write_text(f'net: "{missing}" base_lr: 0.1 lr_policy: "fixed" solver_mode: CPU\n')
    with pytest.raises(CctError) as e:
        get_solver(str(sp))
    assert str(missing) in str(e.value) and str(sp) in str(e.value)
    with pytest.raises(CctError, match="nothere.prototxt"):
        get_solver(str(tmp_path / "nothere.prototxt"))


def test_solver_type_selection_and_deprecated_enum():
    s = get_solver(make_param('solver_type: NESTEROV base_lr: 0.1 lr_policy: "fixed"'))
    assert s.type == "Nesterov"
    s = get_solver(make_param('type: "Adam" base_lr: 0.1 lr_policy: "fixed"'), solver_type="SGD")
    assert s.type == "SGD"
    with pytest.raises(CctError, match="cannot be both specified"):
        get_solver(make_param('solver_type: ADAM type: "Adam" base_lr: 0.1 lr_policy: "fixed"'))
    with pytest.raises(SolverError, match="Unknown solver type: Foo"):
        get_solver(make_param('type: "Foo" base_lr: 0.1 lr_policy: "fixed"'))


@pytest.mark.parametrize("text,msg", [
    ('type: "AdaGrad" momentum: 0.9', "Momentum cannot be used with AdaGrad"),
    ('type: "RMSProp" momentum: 0.9', "Momentum cannot be used with RMSProp"),
    ('type: "RMSProp" rms_decay: 1.5', "rms_decay should lie between 0 and 1"),
    ('lr_policy: "cosine"', "Unknown learning rate policy"),
    ('lr_policy: "step" stepsize: 0', "stepsize > 0"),
    ('regularization_type: "L3"', "Unknown regularization type"),
    ('average_loss: 0', "average_loss"),
    ('snapshot: 10', "snapshot is specified but snapshot_prefix is not"),
])
def test_parameter_errors(text, msg):
    if "lr_policy" not in text:
        text += ' lr_policy: "fixed"'
    with pytest.raises(SolverError, match=msg):
        get_solver(make_param("base_lr: 0.1 " + text)).step(1)


def test_bad_lr_policy_fails_before_any_iteration():
    s = get_solver(make_param("base_lr: 0.1 max_iter: 5"))  # no lr_policy: constructing is fine (pycaffe nets)
    w = s.net.learnable_params[0].data.copy()
    with pytest.raises(SolverError, match='Unknown learning rate policy: ""'):
        s.solve()
    assert s.iter == 0 and s.net.layer_by_name("data").cursor == 0
    np.testing.assert_array_equal(s.net.learnable_params[0].data, w)


def test_random_seed_makes_runs_deterministic():
    a = get_solver(make_param('base_lr: 0.1 lr_policy: "fixed" random_seed: 11'))
    b = get_solver(make_param('base_lr: 0.1 lr_policy: "fixed" random_seed: 11'))
    c = get_solver(make_param('base_lr: 0.1 lr_policy: "fixed" random_seed: 12'))
    np.testing.assert_array_equal(a.net.learnable_params[0].data, b.net.learnable_params[0].data)
    assert not np.array_equal(a.net.learnable_params[0].data, c.net.learnable_params[0].data)


def test_callbacks_and_apply_update():
    s = get_solver(make_param('base_lr: 0.1 lr_policy: "fixed"'))
    events = []
    s.add_callback(lambda: events.append(("start", s.iter)), lambda: events.append(("grad", s.iter)))
    s.step(2)
    assert events == [("start", 0), ("grad", 0), ("start", 1), ("grad", 1)]
    # apply_update alone (pycaffe): uses the current diffs, does not advance iter
    s.net.clear_param_diffs()
    s.net.learnable_params[1].diff[...] = 1.0
    before = s.net.learnable_params[1].data.copy()
    s.apply_update()
    np.testing.assert_allclose(s.net.learnable_params[1].data, before - np.float32(0.1) * 2, rtol=1e-6)
    assert s.iter == 2


# -- snapshots and resume -----------------------------------------------------------------------
DROPOUT = 'layer { name: "drop" type: "Dropout" bottom: "out" top: "dout" dropout_param { dropout_ratio: 0.3 } }'


def _resume_param(kind: str, fmt: str, prefix: str, max_iter: int, snapshot: int) -> caffe_pb2.SolverParameter:
    return make_param(f'type: "{kind}" base_lr: 0.05 momentum: 0.9 lr_policy: "step" gamma: 0.7 stepsize: 2 '
                      f'weight_decay: 0.001 display: 0 max_iter: {max_iter} snapshot: {snapshot} '
                      f'snapshot_prefix: "{prefix}" snapshot_format: {fmt} random_seed: 5 test_iter: 1 '
                      f'test_interval: 3', extra=DROPOUT, loss_bottom="dout")


@pytest.mark.parametrize("kind,fmt", [("SGD", "BINARYPROTO"), ("Adam", "HDF5")])
def test_resume_equals_straight_run(tmp_path, kind, fmt):
    n = 4
    straight = get_solver(_resume_param(kind, fmt, str(tmp_path / "a" / "run"), 2 * n, 0))
    straight.solve()
    ext = (".caffemodel", ".solverstate") if fmt == "BINARYPROTO" else (".caffemodel.h5", ".solverstate.h5")
    # first half, snapshot at n (the snapshot interval), then a fresh process-like solver resumes
    first = get_solver(_resume_param(kind, fmt, str(tmp_path / "b" / "run"), n, n))
    first.solve()
    names = sorted(os.listdir(tmp_path / "b"))
    assert names == sorted([f"run_iter_{n}{ext[0]}", f"run_iter_{n}{ext[1]}", f"run_iter_{n}.cctstate"])
    second = get_solver(_resume_param(kind, fmt, str(tmp_path / "b" / "run"), 2 * n, n))
    second.solve(str(tmp_path / "b" / f"run_iter_{n}{ext[1]}"))
    assert second.iter == straight.iter == 2 * n
    for a, b in zip(straight.net.learnable_params, second.net.learnable_params):
        np.testing.assert_array_equal(a.data, b.data)
    for a, b in zip(straight.history, second.history):
        np.testing.assert_array_equal(a, b)
    assert straight.net.layer_by_name("data").cursor == second.net.layer_by_name("data").cursor
    assert os.path.exists(tmp_path / "a" / f"run_iter_{2 * n}{ext[0]}")  # snapshot_after_train


def test_solverstate_contents_match_caffe_layout(tmp_path):
    s = get_solver(_resume_param("SGD", "BINARYPROTO", str(tmp_path / "p"), 3, 0))
    s.step(3)
    model = s.snapshot()
    assert model == str(tmp_path / "p") + "_iter_3.caffemodel"
    st = caffe_pb2.SolverState()
    st.ParseFromString((tmp_path / "p_iter_3.solverstate").read_bytes())
    assert st.iter == 3 and st.learned_net == model and st.current_step == 1 and len(st.history) == 2
    assert list(st.history[0].shape.dim) == [2, 3]
    np.testing.assert_array_equal(np.asarray(st.history[0].data, np.float32).reshape(2, 3), s.history[0])
    weights = caffe_pb2.NetParameter()
    weights.ParseFromString((tmp_path / "p_iter_3.caffemodel").read_bytes())
    ip = [l for l in weights.layer if l.name == "ip"][0]
    np.testing.assert_array_equal(np.asarray(ip.blobs[0].data, np.float32).reshape(2, 3),
                                  s.net.layer_by_name("ip").blobs[0].data)
    # restore without a .cctstate works (Caffe's own snapshots)
    os.remove(tmp_path / "p_iter_3.cctstate")
    t = get_solver(_resume_param("SGD", "BINARYPROTO", str(tmp_path / "p"), 3, 0))
    t.restore(str(tmp_path / "p_iter_3.solverstate"))
    assert t.iter == 3 and t.current_step == 1
    np.testing.assert_array_equal(t.history[1], s.history[1])
    np.testing.assert_array_equal(t.net.learnable_params[0].data, s.net.learnable_params[0].data)


def test_restore_history_count_mismatch(tmp_path):
    s = get_solver(_resume_param("SGD", "BINARYPROTO", str(tmp_path / "p"), 3, 0))
    s.step(1)
    s.snapshot()
    t = get_solver(_resume_param("Adam", "BINARYPROTO", str(tmp_path / "p"), 3, 0))
    with pytest.raises(SolverError, match="Incorrect length of history blobs"):
        t.restore(str(tmp_path / "p_iter_1.solverstate"))
    with pytest.raises(CctError, match="no such file"):
        t.restore(str(tmp_path / "missing.solverstate"))


def test_cctstate_roundtrip(tmp_path):
    state = {"a": np.arange(5, dtype=np.int64), "b": [1, 2.5, "x"], "c": {"d": b"\x00\x01"}, "big": 2 ** 100}
    snap.write_cctstate(str(tmp_path / "s.cctstate"), state)
    back = snap.read_cctstate(str(tmp_path / "s.cctstate"))
    np.testing.assert_array_equal(back["a"], state["a"])
    assert back["b"] == state["b"] and back["c"] == state["c"] and back["big"] == 2 ** 100
    assert snap.cctstate_path("x/p_iter_3.solverstate.h5") == "x/p_iter_3.cctstate"


# -- NaN / inf loss ------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nonfinite_loss_stops_naming_iteration(tmp_path):
    p = make_param(f'base_lr: 1e15 lr_policy: "fixed" momentum: 0.9 display: 0 max_iter: 50 '
                   f'snapshot_prefix: "{tmp_path / "nan"}"')
    s = get_solver(p)
    with pytest.raises(SolverError) as e:
        s.solve()
    msg = str(e.value)
    assert msg.startswith(f"Iteration {s.iter}: loss is ")
    assert s.iter > 0 and ("inf" in msg or "nan" in msg)
    # snapshot_after_train (default true) asked for a snapshot: the last finite weights are saved
    assert os.path.exists(tmp_path / f"nan_iter_{s.iter}.caffemodel")
    assert f"nan_iter_{s.iter}.caffemodel" in msg


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nonfinite_loss_in_step_without_snapshot_settings():
    p = make_param('base_lr: 1e15 lr_policy: "fixed" momentum: 0.9 snapshot_after_train: false')
    s = get_solver(p)
    with pytest.raises(SolverError, match=r"^Iteration \d+: loss is"):
        s.step(50)


# -- signals -------------------------------------------------------------------------------------
def test_action_function_snapshot_and_stop(tmp_path):
    p = make_param(f'base_lr: 0.1 lr_policy: "fixed" max_iter: 10 snapshot_prefix: "{tmp_path / "sig"}"')
    s = get_solver(p)
    actions = {2: "snapshot", 5: "stop"}
    s.set_action_function(lambda: actions.get(s.iter, "none"))
    s.solve()
    assert s.iter == 5 and s.requested_early_exit
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".caffemodel"))
    assert files == ["sig_iter_2.caffemodel", "sig_iter_5.caffemodel"]


def test_signal_handler_records_signals():
    import signal

    from cct.solver.signals import SignalHandler

    with pytest.raises(CctError, match='Invalid signal effect "halt"'):
        SignalHandler("halt")
    before = signal.getsignal(signal.SIGINT)
    with SignalHandler("stop", "snapshot") as h:
        assert h.action() == "none"
        os.kill(os.getpid(), signal.SIGINT)
        assert h.action() == "stop"
        if hasattr(signal, "SIGHUP"):
            os.kill(os.getpid(), signal.SIGHUP)
            assert h.action() == "snapshot"
        assert h.action() == "none"
    assert signal.getsignal(signal.SIGINT) is before


def test_solver_mode_gpu_falls_back_to_cpu(cct_log):
    from cct.device.driver import cupy_available

    p = make_param('base_lr: 0.1 lr_policy: "fixed"')
    p.solver_mode = caffe_pb2.SolverParameter.GPU
    get_solver(p).step(1)
    if not cupy_available():
        assert GPU_FALLBACK in cct_log


def test_weights_field_finetunes(tmp_path):
    a = get_solver(make_param('base_lr: 0.1 lr_policy: "fixed" random_seed: 1'))
    a.step(2)
    a.net.save(str(tmp_path / "w.caffemodel"))
    p = make_param('base_lr: 0.1 lr_policy: "fixed" random_seed: 2')
    p.weights.append(str(tmp_path / "w.caffemodel"))
    b = get_solver(p)
    np.testing.assert_array_equal(a.net.learnable_params[0].data, b.net.learnable_params[0].data)


def test_get_solver_from_file_and_pycaffe_shim(tmp_path, monkeypatch):
    (tmp_path / "net.prototxt").write_text(net_text())
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.1 lr_policy: "fixed" '
                                              'solver_mode: CPU type: "Nesterov" momentum: 0.5\n')
    monkeypatch.chdir(tmp_path)
    s = get_solver("solver.prototxt")
    assert s.type == "Nesterov" and s.param.snapshot_prefix == "solver"
    s.step(1)
    assert s.lr == pytest.approx(0.1)
    assert isinstance(cct.solver.SGDSolver, type)


def test_debug_info_logs_forward_backward_update(cct_log):
    s = get_solver(make_param('base_lr: 0.1 lr_policy: "fixed" display: 2 debug_info: true'))
    s.step(2)
    fwd = [l for l in cct_log if l.startswith("    [Forward] Layer ip")]
    upd = [l for l in cct_log if l.startswith("    [Update] Layer ip")]
    assert fwd and upd and len(upd) == 2  # only on the displayed iteration 0: weight and bias
    assert any(l.startswith("    [Backward] Layer ip") for l in cct_log)


def test_train_and_test_state_select_layers():
    extra = ('layer { name: "scale" type: "Power" bottom: "out" top: "dout" power_param { scale: 2 } '
             'include { stage: "double" } } '
             'layer { name: "noscale" type: "Power" bottom: "out" top: "dout" exclude { stage: "double" } }')
    p = make_param('base_lr: 0.1 lr_policy: "fixed" train_state { stage: "double" } test_iter: 1 test_interval: 5 '
                   'test_iter: 1 test_state { level: 0 } test_state { stage: "double" }',
                   extra=extra, loss_bottom="dout")
    s = get_solver(p)
    assert s.net.has_layer("scale") and not s.net.has_layer("noscale")
    assert s.net.phase == caffe_pb2.TRAIN
    assert [n.has_layer("scale") for n in s.test_nets] == [False, True]
    assert all(n.phase == caffe_pb2.TEST for n in s.test_nets)
