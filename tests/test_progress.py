"""Progress bars: drawn (count, rate, ETA) only on a terminal, never mixed into the glog lines."""
from __future__ import annotations

import io
import logging
import os
import re
import sys
import threading

import pytest

from cct import cli
from cct.progress import Progress, progress_enabled

GLOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ [\w.]+:\d+\] ")


def test_no_bar_without_a_terminal(monkeypatch):
    s = io.StringIO()
    assert not progress_enabled(True, s)
    with Progress(10, "x", stream=s) as bar:
        bar.update(3)
        bar.set(7)
        assert bar.n == 0 and not bar.enabled
    assert s.getvalue() == ""
    monkeypatch.setenv("CCT_PROGRESS", "0")
    assert not progress_enabled(True, sys.stdin)


class _Terminal:
    """sys.stderr on a pseudo-terminal (120 columns) for the duration of a ``with``; ``text``: what was written."""

    def __init__(self) -> None:
        self.monkeypatch = pytest.MonkeyPatch()
        self.chunks: list[bytes] = []

    def __enter__(self) -> _Terminal:
        pty = pytest.importorskip("pty")
        import fcntl
        import struct
        import termios

        self.master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
        self.file = os.fdopen(slave, "w", buffering=1, encoding="utf-8")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.monkeypatch.delenv("CCT_PROGRESS", raising=False)
        self.monkeypatch.setattr(sys, "stderr", self.file)
        return self

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the terminal was closed
                return
            if not data:
                return
            self.chunks.append(data)

    def __exit__(self, *exc: object) -> None:
        self.monkeypatch.undo()
        self.file.close()
        self.reader.join(timeout=10)
        os.close(self.master)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


def _check_glog_lines_whole(out: str, needle: str) -> list[str]:
    """Every line of ``out`` holding a glog record shows it whole after the bar's last carriage return."""
    shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in out.split("\n")]  # a pty ends lines \r\n
    records = [s for s in shown if needle in s]
    assert records, out[-2000:]
    for s in records:
        assert GLOG.match(s), repr(s)
    return records


def test_make_digits_bar_on_a_terminal(tmp_path, capsys):
    with _Terminal() as term:
        assert cli.main(["make_digits", str(tmp_path / "d"), "--train", "1000", "--test", "100"]) == 0
    out = term.text
    # a fast machine may finish before the first timed refresh: the bar then shows '<?, ?img/s'
    bar = r"train: (render|write): +\d+%\|.*\| *\d+/1000 \[[\d:]+<(?:[\d:]+|\?), *(?:[\d.]+|\?) ?img/s\]"
    assert re.search(bar, out), out
    _check_glog_lines_whole(out, "make_digits.py:")
    # not on a terminal: only glog lines
    capsys.readouterr()
    assert cli.main(["make_digits", str(tmp_path / "e"), "--train", "100", "--test", "10"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "img/s" not in err and all(GLOG.match(line) for line in err.splitlines()), err
    # --noprogress on a terminal: no bar
    with _Terminal() as term:
        assert cli.main(["make_digits", str(tmp_path / "f"), "--train", "100", "--test", "10", "--noprogress"]) == 0
    assert "img/s" not in term.text and "make_digits.py:" in term.text


def test_train_and_test_bars_on_a_terminal(tmp_path, monkeypatch):
    (tmp_path / "net.prototxt").write_text(
        'name: "D" layer { name: "d" type: "DummyData" top: "x" top: "y" dummy_data_param { '
        'shape { dim: 4 dim: 5 } shape { dim: 4 dim: 2 } data_filler { type: "gaussian" std: 1 } } }\n'
        'layer { name: "ip" type: "InnerProduct" bottom: "x" top: "o" inner_product_param { num_output: 2 '
        'weight_filler { type: "gaussian" std: 0.1 } } }\n'
        'layer { name: "loss" type: "EuclideanLoss" bottom: "o" bottom: "y" top: "loss" }\n')
    (tmp_path / "solver.prototxt").write_text('net: "net.prototxt" base_lr: 0.01 lr_policy: "fixed" max_iter: 60 '
                                              'display: 20 snapshot_prefix: "s/d" random_seed: 1\n')
    monkeypatch.setenv("CCT_CALIBRATE", "0")
    monkeypatch.chdir(tmp_path)
    net, weights = str(tmp_path / "net.prototxt"), str(tmp_path / "s" / "d_iter_60.caffemodel")
    with _Terminal() as term:
        assert cli.main(["train", f"--solver={tmp_path / 'solver.prototxt'}"]) == 0
    out = term.text
    assert re.search(r"train: +\d+%\|.*\| *\d+/60 \[[\d:]+<(?:[\d:]+|\?), *(?:[\d.]+|\?) ?iter/s\]", out), out[-3000:]
    records = _check_glog_lines_whole(out, "solver.py:")
    assert any("Iteration 40" in s for s in records)
    with _Terminal() as term:
        assert cli.main(["test", f"--model={net}", f"--weights={weights}", "--iterations=40"]) == 0
    assert re.search(r"test: +\d+%\|.*\| *\d+/40 \[", term.text), term.text[-3000:]
    _check_glog_lines_whole(term.text, "Batch 39")
    with _Terminal() as term:
        assert cli.main(["time", f"--model={net}", "--iterations=5", "-q"]) == 0
    assert "iter/s" not in term.text  # --quiet: no bar


def test_log_handler_follows_sys_stderr(capsys):
    from cct.log import init_log

    logger = init_log(logging.INFO)
    logger.info("first")
    assert "first" in capsys.readouterr().err
    old = sys.stderr
    sys.stderr = io.StringIO()
    try:
        logger.info("second")
        assert "second" in sys.stderr.getvalue()
    finally:
        sys.stderr = old
