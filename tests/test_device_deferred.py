"""Checks recorded on the device and the loss kept on the device until a boundary (cct.device).

A numpy net checks at once, as it always has; the deferred mode (what a GPU net uses) is forced on numpy
nets here: the failure must surface at the next boundary (display, test, snapshot, end of step, the end of
``Net.forward``) naming the iteration it happened in, and the smoothed loss and the log must not change.
"""
import logging
import re

import numpy as np
import pytest

import cct
from cct.device.deferred import DeviceChecks
from cct.device.losses import LossLog
from cct.errors import LayerError, SolverError
from cct.io.prototxt import parse_text
from cct.proto import caffe_pb2
from cct.solver import get_solver

NET = """
name: "deferred"
layer { name: "x" type: "Input" top: "x" input_param { shape { dim: 4 dim: 5 } } }
layer { name: "label" type: "Input" top: "label" input_param { shape { dim: 4 } } }
layer { name: "ip" type: "InnerProduct" bottom: "x" top: "y"
        inner_product_param { num_output: 3 weight_filler { type: "gaussian" std: 0.3 } } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "y" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "y" bottom: "label" top: "acc" top: "per_class" }
"""

BAD_LABEL = r"label value 7 out of range \[0, 3\) at item 2 of the batch \(bottom\[1\]\)"


class Feed:
    """Fills the Input blobs before each iteration (a solver on_start callback): a fixed random stream of
    batches; ``bad_label_at`` puts label 7 at item 2, ``nan_at`` a NaN input, at that iteration."""

    def __init__(self, solver, bad_label_at=None, nan_at=None):
        self.solver, self.bad_label_at, self.nan_at = solver, bad_label_at, nan_at

    def __call__(self):
        it = self.solver.iter
        r = np.random.default_rng(it)
        net = self.solver.net
        net.blobs["x"].data[...] = r.standard_normal((4, 5))
        labels = r.integers(0, 3, 4).astype(np.float32)
        if it == self.bad_label_at:
            labels[2] = 7
        net.blobs["label"].data[...] = labels
        if it == self.nan_at:
            net.blobs["x"].data[0, 0] = np.nan


def make_solver(text, deferred, tmp_path=None, **feed):
    p = parse_text(text, caffe_pb2.SolverParameter())
    parse_text(NET, p.net_param)
    p.solver_mode = caffe_pb2.SolverParameter.CPU
    p.random_seed = 5
    if tmp_path is not None:
        p.snapshot_prefix = str(tmp_path / "snap")
    s = get_solver(p)
    s.net.checks.deferred = deferred
    s.add_callback(on_start=Feed(s, **feed))
    return s


@pytest.fixture
def cct_log():
    lines = []

    class Capture(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    logger = logging.getLogger("cct")
    handler, level = Capture(), logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _net(deferred):
    net = cct.Net(parse_text(NET, caffe_pb2.NetParameter()), cct.TRAIN)
    net.checks.deferred = deferred
    net.blobs["x"].data[...] = np.random.default_rng(0).standard_normal((4, 5))
    net.blobs["label"].data[...] = [0, 1, 7, 2]
    return net


# -- the numpy net: at once, as before --------------------------------------------------------------
def test_numpy_net_checks_at_once_with_the_same_error():
    net = _net(deferred=False)
    assert net.checks.deferred is False
    with pytest.raises(LayerError, match=rf"^layer 'loss' \(type SoftmaxWithLoss\): {BAD_LABEL}$"):
        net.forward()
    s = make_solver('base_lr: 0.1 lr_policy: "fixed" display: 4', deferred=False, bad_label_at=5)
    with pytest.raises(LayerError, match=rf"^layer 'loss' \(type SoftmaxWithLoss\): {BAD_LABEL} "
                                         r"\(train net, iteration 5\)$"):
        s.step(20)
    assert s.iter == 5  # raised inside the iteration, before its update


# -- the deferred mode -------------------------------------------------------------------------------
def test_deferred_net_forward_raises_at_its_end_and_clears_the_record():
    net = _net(deferred=True)
    loss = net.forward(device_loss=True)  # no read: the failure stays on the device
    assert np.ndim(loss) == 0 and loss.dtype == np.float64
    assert net.checks.record[0] == 1
    with pytest.raises(LayerError, match=rf"^layer 'loss' \(type SoftmaxWithLoss\): {BAD_LABEL}$"):
        net.raise_deferred_errors()
    net.raise_deferred_errors()  # read and cleared
    with pytest.raises(LayerError, match=rf"^layer 'loss' \(type SoftmaxWithLoss\): {BAD_LABEL}$"):
        net.forward()  # pycaffe's forward: raises at its end
    net.blobs["label"].data[...] = [0, 1, 2, 2]
    good = net.forward()
    immediate = _net(deferred=False)
    immediate.copy_from(net.to_proto())
    immediate.blobs["label"].data[...] = [0, 1, 2, 2]
    assert good == immediate.forward()  # same float, bit for bit


def test_deferred_gather_stays_in_bounds_and_first_failure_wins():
    """A bad label must not read out of bounds (the gather clips it); the first failing check of the
    pass (SoftmaxWithLoss, before Accuracy) is the one reported, with its position in the batch."""
    net = _net(deferred=True)
    net.blobs["label"].data[...] = [0, -3, 9, 2]
    loss = net.forward(device_loss=True)
    assert np.isfinite(loss)
    net.backward()
    with pytest.raises(LayerError, match=r"^layer 'loss' .*label value -3 out of range \[0, 3\) at item 1 "):
        net.raise_deferred_errors()


def test_deferred_label_error_raises_at_the_display_boundary_naming_its_iteration(cct_log):
    s = make_solver('base_lr: 0.1 lr_policy: "fixed" display: 4', deferred=True, bad_label_at=5)
    with pytest.raises(LayerError, match=rf"^layer 'loss' \(type SoftmaxWithLoss\): {BAD_LABEL} "
                                         r"\(train net, iteration 5\)$"):
        s.step(20)
    assert s.iter == 8  # found at the display of iteration 8, before its update
    shown = [int(m.group(1)) for m in map(re.compile(r"^Iteration (\d+) \(").match, cct_log) if m]
    assert shown == [0, 4]


def test_deferred_label_error_raises_before_a_snapshot_and_writes_none(tmp_path):
    s = make_solver('base_lr: 0.1 lr_policy: "fixed" snapshot: 6 snapshot_after_train: false', deferred=True,
                    tmp_path=tmp_path, bad_label_at=3)
    with pytest.raises(LayerError, match=r"\(train net, iteration 3\)$"):
        s.step(20)
    assert s.iter == 6 and not list(tmp_path.iterdir())


def test_deferred_label_error_raises_before_a_test_and_at_the_end_of_step():
    s = make_solver('base_lr: 0.1 lr_policy: "fixed" test_iter: 1 test_interval: 5 test_initialization: false '
                    'test_net_param { ' + NET + ' }', deferred=True, bad_label_at=2)
    with pytest.raises(LayerError, match=r"\(train net, iteration 2\)$"):
        s.step(20)
    assert s.iter == 5
    s = make_solver('base_lr: 0.1 lr_policy: "fixed"', deferred=True, bad_label_at=12)
    with pytest.raises(LayerError, match=r"\(train net, iteration 12\)$"):
        s.step(15)
    assert s.iter == 15


def _comparable(lines):
    """The log without its timings and paths."""
    speed = re.compile(r"\(\S+ iter/s, \S+s/(\d+) iters\)")
    return [speed.sub(r"(-, -/\1)", line) for line in lines]


def test_smoothed_loss_and_log_lines_identical_to_the_immediate_path(cct_log, tmp_path):
    text = ('base_lr: 0.2 lr_policy: "step" gamma: 0.5 stepsize: 9 momentum: 0.9 display: 7 average_loss: 5 '
            'iter_size: 2 snapshot: 12 snapshot_after_train: false test_iter: 2 test_interval: 10 '
            'test_net_param { ' + NET + ' }')
    runs = []
    for deferred in (False, True):
        start = len(cct_log)
        s = make_solver(text, deferred=deferred, tmp_path=tmp_path)
        s.test_nets[0].blobs["label"].data[...] = [0, 1, 2, 0]
        smoothed = []
        s.add_callback(on_gradients_ready=lambda s=s, smoothed=smoothed: smoothed.append((s.iter, s.smoothed_loss)))
        s.step(30)
        lines = [line for line in cct_log[start:] if not line.startswith(("Initializing", "Creating", "Setting",
                                                                            "Top shape", "Memory", "Network",
                                                                            "    with loss", "Solver scaff"))]
        runs.append((s, _comparable(lines), smoothed))
    (a, log_a, sm_a), (b, log_b, sm_b) = runs
    assert b._loss_log.capacity == 7  # the display interval: no read between two boundaries
    assert sum(line.startswith("Iteration ") and "(-, -/7)" in line for line in log_a) == 5  # 0, 7, 14, 21, 28
    assert log_a == log_b
    assert a.smoothed_loss == b.smoothed_loss
    # the immediate path knows the smoothed loss every iteration, the deferred one at its boundaries
    boundaries = {0, 7, 14, 21, 28}
    assert [v for v in sm_b if v[0] in boundaries] == [v for v in sm_a if v[0] in boundaries]
    for pa, pb in zip(a.net.learnable_params, b.net.learnable_params):
        np.testing.assert_array_equal(pa.data, pb.data)


def test_smoothed_loss_without_boundaries_reads_once_at_the_end():
    results = []
    for deferred in (False, True):
        s = make_solver('base_lr: 0.1 lr_policy: "fixed" average_loss: 4', deferred=deferred)
        s.step(9)
        results.append((s.smoothed_loss, s._losses))
    assert results[0] == results[1]
    assert s._loss_log.capacity == 9


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_nonfinite_loss_names_the_iteration_it_happened_in(tmp_path, cct_log):
    text = 'base_lr: 0.1 lr_policy: "fixed" display: 4'
    s = make_solver(text, deferred=False, nan_at=6)
    with pytest.raises(SolverError, match=r"^Iteration 6: loss is nan \(NaN\); training stopped\. Lower base_lr"):
        s.step(20)
    assert s.iter == 6
    s = make_solver(text, deferred=True, tmp_path=tmp_path, nan_at=6)
    with pytest.raises(SolverError) as e:
        s.step(20)
    assert s.iter == 8
    msg = str(e.value)
    assert msg.startswith("Iteration 6: loss is nan (NaN); training stopped (found at iteration 8: a device net's "
                          "losses are read at display, test and snapshot boundaries); the weights before iteration "
                          f"8 were saved to {tmp_path / 'snap_iter_8.caffemodel'}. Lower base_lr"), msg
    assert (tmp_path / "snap_iter_8.caffemodel").exists()
    assert not any(line.startswith("Iteration 8 (") for line in cct_log)  # stopped before the display
    # found on the display iteration itself: the display line first, then the stop, as on numpy
    s = make_solver(text, deferred=True, nan_at=8)
    with pytest.raises(SolverError, match=r"^Iteration 8: loss is nan \(NaN\); training stopped\. Lower"):
        s.step(20)
    assert any(line.startswith("Iteration 8 (") and line.endswith("loss = nan") for line in cct_log)


# -- the facility itself ---------------------------------------------------------------------------
def test_device_checks_record_only_the_first_failure_with_its_iteration():
    class Owner:
        name, type = "owner", "Test"

        def error(self, message):
            return LayerError(self.name, self.type, message)

    checks = DeviceChecks(np, deferred=True)
    checks.set_iteration(41)

    def describe(flat, value):
        return f"value {value} at {flat}"

    checks.fail_where(Owner(), "a", np.array([False, False]), np.array([1, 2]), describe)
    checks.fail_where(Owner(), "a", np.zeros(0, bool), np.zeros(0, np.int64), describe)  # an empty batch
    checks.advance()
    checks.fail_where(Owner(), "a", np.array([False, True, True]), np.array([1, -5, 9]), describe)
    checks.advance()
    checks.fail_where(Owner(), "b", np.array([True]), np.array([3]), describe)
    failure = checks.take_failure()
    assert failure.iteration == 42 and str(failure.error) == "layer 'owner' (type Test): value -5 at 1"
    assert checks.take_failure() is None and int(checks.iteration) == 43
    checks.deferred = False
    with pytest.raises(LayerError, match=r"value 9 at 2$"):
        checks.fail_where(Owner(), "a", np.array([False, False, True]), np.array([1, -5, 9]), describe)


def test_loss_log_keeps_losses_in_order_until_taken():
    log = LossLog(np, 3)
    for it, v in ((4, 1.5), (5, np.float32(np.inf)), (6, 0.25)):
        log.append(it, np.asarray(v, dtype=np.float32))
    assert log.full
    taken = log.take()
    assert taken == [(4, np.float32(1.5)), (5, np.float32(np.inf)), (6, np.float32(0.25))]
    assert all(type(v) is np.float32 for _, v in taken)
    assert log.take() == [] and not log.full
    log.append(7, np.float32(2.0))
    assert log.take() == [(7, np.float32(2.0))]


def test_accuracy_per_class_counts_match_a_direct_count():
    net = _net(deferred=False)
    labels = np.array([0, 2, 2, 1], dtype=np.float32)
    net.blobs["label"].data[...] = labels
    net.forward()
    y = net.blobs["y"].data
    correct = y.argmax(axis=1) == labels  # top-1; ties do not occur with gaussian weights
    expect = [correct[labels == c].mean() if (labels == c).any() else 0.0 for c in range(3)]
    np.testing.assert_array_equal(net.blobs["per_class"].data, np.array(expect, dtype=np.float32))
