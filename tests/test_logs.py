"""cct parse_log (column for column what Caffe's parse_log.py writes) and cct plot (PNG of several logs)."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
from PIL import Image

from cct import cli
from cct.tools.parse_log import LogParseError, parse_lines, parse_log
from cct.tools.plot import CHART_TYPES, parse_charts, series

DATA = Path(__file__).resolve().parent / "data" / "parse_log"
# tiny_train.log: stderr of a real `cct train` (30 iterations, display 5, test every 10);
# tiny_train.log.train/.test: what BVLC Caffe's tools/extra/parse_log.py (master, its one Python 2
# print statement made a call) wrote for that log, kept as the expected output.


def _log(tmp_path: Path) -> Path:
    dst = tmp_path / "tiny_train.log"
    shutil.copyfile(DATA / "tiny_train.log", dst)
    return dst


def test_parse_log_writes_what_caffe_parse_log_writes(tmp_path):
    log = _log(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    assert cli.main(["parse_log", str(log), str(out)]) == 0
    for suffix in (".train", ".test"):
        got = (out / f"tiny_train.log{suffix}").read_bytes()
        want = (DATA / f"tiny_train.log{suffix}").read_bytes()
        assert got.split(b"\r\n") == want.split(b"\r\n")  # row by row, column by column
        assert got == want
    header = (out / "tiny_train.log.test").read_text().splitlines()[0]
    assert header == "NumIters,Seconds,LearningRate,accuracy,loss"
    # OUTDIR defaults to the log's folder
    assert cli.main(["parse_log", str(log)]) == 0
    assert (tmp_path / "tiny_train.log.train").read_bytes() == (DATA / "tiny_train.log.train").read_bytes()


def test_parse_log_values():
    train, test = parse_log(str(DATA / "tiny_train.log"))
    assert [r["NumIters"] for r in train] == [0.0, 5.0, 10.0, 15.0, 20.0, 25.0]
    assert train[1]["LearningRate"] == 0.01 and train[2]["LearningRate"] == 0.00999625  # lr of the line before
    assert train[0]["loss"] == 2.34568 and train[0]["Seconds"] == pytest.approx(0.15262)
    assert [r["accuracy"] for r in test] == [0.0625, 0.3125, 0.125, 0.6875]
    assert test[0]["LearningRate"] == test[1]["LearningRate"]  # the first row takes the second row's rate


def test_parse_log_delimiter_and_errors(tmp_path, capsys):
    log = _log(tmp_path)
    assert cli.main(["parse_log", "--delimiter", "\t", str(log), str(tmp_path)]) == 0
    assert (tmp_path / "tiny_train.log.test").read_text().splitlines()[0] == "NumIters\tSeconds\tLearningRate" \
        "\taccuracy\tloss"
    bad = tmp_path / "not_a_log.txt"
    bad.write_text("hello\n")
    assert cli.main(["parse_log", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "not_a_log.txt: no 'Solving' line" in err and "Traceback" not in err
    assert cli.main(["parse_log", str(tmp_path / "missing.log")]) == 1
    assert "missing.log" in capsys.readouterr().err
    assert cli.main(["parse_log", str(log), str(tmp_path / "nodir")]) == 1
    with pytest.raises(LogParseError):
        parse_lines(["I1124 23:03:31.655595 25239 solver.py:315] Iteration 0"], 2026)


def test_parse_log_new_year_and_odd_lines():
    lines = ["I1231 23:59:59.500000 1 solver.py:1] Solving X",
             "I1231 23:59:59.600000 1 solver.py:1] Iteration 0, lr = 0.5",
             "",  # empty and continuation lines are skipped (Caffe's script would stop)
             "   continued message",
             "I1231 23:59:59.700000 1 solver.py:1]     Train net output #0: loss = 2",
             "I0101 00:00:00.700000 1 solver.py:1] Iteration 1, lr = 0.25",
             "I0101 00:00:00.800000 1 solver.py:1]     Train net output #0: loss = 1"]
    train, test = parse_lines(lines, 2026)
    assert test == []
    assert [r["Seconds"] for r in train] == [pytest.approx(0.2), pytest.approx(1.3)]
    assert [r["LearningRate"] for r in train] == [0.25, 0.25]


def _truncated(tmp_path: Path, name: str) -> Path:
    """The tiny log cut after its last train output: the last iteration has no 'lr =' line."""
    lines = (DATA / "tiny_train.log").read_text().splitlines(keepends=True)
    last = max(i for i, line in enumerate(lines) if "Train net output" in line)
    p = tmp_path / name
    p.write_text("".join(lines[:last + 1]))
    return p


def test_plot_several_logs_and_chart_types(tmp_path):
    pytest.importorskip("matplotlib")
    a = _log(tmp_path)
    b = _truncated(tmp_path, "cut.log")
    train, test = parse_log(str(b))
    assert not math.isnan(train[-1]["LearningRate"])
    out = tmp_path / "curves.png"
    assert cli.main(["plot", str(a), str(b), "--out", str(out), "--title", "two runs"]) == 0
    with Image.open(out) as im:
        assert im.format == "PNG" and im.size == (1280, 840)
        colors = im.convert("RGB").getcolors(1 << 20)
    assert len(colors) > 50  # lines, text and legends, not a blank canvas
    out2 = tmp_path / "one.png"
    assert cli.main(["plot", str(a), "--chart", "7", "-o", str(out2)]) == 0
    with Image.open(out2) as im:
        assert im.size == (640, 420)
    assert cli.main(["plot", str(a), "--chart", "0,3", "--x", "seconds", "--log_loss",
                     "--out", str(tmp_path / "c.svg")]) == 0
    assert (tmp_path / "c.svg").read_text().lstrip().startswith("<?xml")


def test_plot_chart_types_are_plot_training_log_s():
    assert CHART_TYPES[0] == "Test accuracy  vs. Iters"
    assert CHART_TYPES[5] == "Train learning rate  vs. Seconds"
    assert CHART_TYPES[7] == "Train loss  vs. Seconds"
    train, test = parse_log(str(DATA / "tiny_train.log"))
    xs, ys = series(train, test, CHART_TYPES[0])
    assert xs == [0.0, 10.0, 20.0, 30.0] and ys == [0.0625, 0.3125, 0.125, 0.6875]
    xs, ys = series(train, test, CHART_TYPES[4])
    assert ys[0] == ys[1] == 0.01
    assert parse_charts("all", "seconds")[0] == "Test accuracy  vs. Seconds"


def test_plot_bad_input(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log = _log(tmp_path)
    assert cli.main(["plot", str(log), "--chart", "9", "--out", str(tmp_path / "x.png")]) == 1
    assert "not a chart type" in capsys.readouterr().err
    assert cli.main(["plot", str(log), "--out", str(tmp_path / "x.nope")]) == 1
    err = capsys.readouterr().err
    assert "x.nope" in err and "Traceback" not in err
