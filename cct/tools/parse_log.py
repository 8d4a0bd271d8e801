"""parse_log: a training log (glog lines of ``cct train`` or ``caffe train``) -> two CSV tables.

``cct parse_log LOG [OUTDIR] [--tensorboard DIR]`` writes ``OUTDIR/<basename of LOG>.train`` and ``.test``
(OUTDIR defaults to LOG's folder) with the columns and values of Caffe's ``tools/extra/parse_log.py`` (which is Python 2
and does not run on Python 3): ``NumIters, Seconds, LearningRate`` then one column per net output
(``loss``, ``accuracy`` ...), values as Python floats, rows in excel CSV dialect (``\\r\\n``);
``--tensorboard DIR`` also writes them as TensorBoard events (:mod:`cct.solver.tensorboard`).

The rules are Caffe's, kept exactly so both tools write the same files for the same log:

* reading starts after the first line containing ``Solving`` (its time is second 0); the year of the
  glog timestamps (which have none) is the year of the log file's ctime, plus one for each wrap of
  the month;
* ``Iteration N`` anywhere sets the current iteration; nothing is recorded before the first one;
* ``lr = X`` sets the learning rate carried by later rows (NaN until the first one; the first row
  then takes the second row's rate);
* ``Train net output #k: NAME = V`` / ``Test net output #k: NAME = V`` fill a row per iteration; a row
  is written once it has as many columns as the first row, and the first row when the next one starts
  (so a dangling incomplete last row, or a log with a single row, writes nothing for it, as in Caffe).

Differences, where Caffe's script would stop with a traceback: a line that is not a glog line (empty,
or a continuation of a multi-line message) is skipped; a row with a column the first row lacks drops
that value; a log with no ``Solving`` line is an error naming the file.
"""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import logging
import math
import os
import re
from collections.abc import Iterable

from ..errors import CctError
from ..flags import FlagParser
from ..solver.tensorboard import write_log_events
from . import run_tool, tool_parser

log = logging.getLogger("cct")

_ITERATION = re.compile(r"Iteration (\d+)")
_TRAIN_OUTPUT = re.compile(r"Train net output #(\d+): (\S+) = ([.\deE+-]+)")
_TEST_OUTPUT = re.compile(r"Test net output #(\d+): (\S+) = ([.\deE+-]+)")
_LEARNING_RATE = re.compile(r"lr = ([-+]?[0-9]*\.?[0-9]+([eE]?[-+]?[0-9]+)?)")

Row = dict[str, float]


class LogParseError(CctError):
    """A file that is not a training log."""


def glog_time(line: str, year: int) -> _dt.datetime:
    """The time of a glog line ``I1124 22:39:50.123456 ...`` in ``year`` (ValueError if it is not one)."""
    words = line.split()
    if len(words) < 2 or len(words[0]) < 5:
        raise ValueError("not a glog line")
    month, day = int(words[0][1:3]), int(words[0][3:])
    clock, _, micro = words[1].rpartition(".")
    h, m, s = (int(x) for x in clock.split(":"))
    return _dt.datetime(year, month, day, h, m, s, int(micro))


def _log_year(path: str) -> int:
    return _dt.datetime.fromtimestamp(os.path.getctime(path)).year


class _Table:
    """Rows of one net's outputs, grouped by iteration as Caffe's parse_log.py groups them."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern = pattern
        self.rows: list[Row] = []
        self.row: Row | None = None

    def feed(self, line: str, iteration: float, seconds: float, lr: float) -> None:
        m = self.pattern.search(line)
        if m:
            if not self.row or self.row["NumIters"] != iteration:
                if self.row:
                    self.rows.append(self.row)
                self.row = {"NumIters": iteration, "Seconds": seconds, "LearningRate": lr}
            self.row[m.group(2)] = float(m.group(3))
        if self.row and self.rows and len(self.row) == len(self.rows[0]):
            self.rows.append(self.row)
            self.row = None

    def finish(self) -> list[Row]:
        if len(self.rows) > 1:
            self.rows[0]["LearningRate"] = self.rows[1]["LearningRate"]
        return self.rows


def parse_lines(lines: Iterable[str], year: int, source: str = "<log>") -> tuple[list[Row], list[Row]]:
    """(train rows, test rows) of a training log's lines; ``year`` completes the glog timestamps."""
    it = iter(lines)
    start = None
    for line in it:
        if "Solving" in line:
            try:
                start = glog_time(line, year)
            except ValueError:
                raise LogParseError(f"{source}: the 'Solving' line is not a glog line: {line.strip()!r}") from None
            break
    if start is None:
        raise LogParseError(f"{source}: no 'Solving' line; not the log of a training run")
    last = start
    iteration = -1.0
    lr = math.nan
    train, test = _Table(_TRAIN_OUTPUT), _Table(_TEST_OUTPUT)
    for line in it:
        m = _ITERATION.search(line)
        if m:
            iteration = float(m.group(1))
        if iteration == -1:
            continue
        try:
            t = glog_time(line, year)
        except ValueError:
            continue
        if t.month < last.month:  # the log went past New Year
            year += 1
            t = glog_time(line, year)
        last = t
        seconds = (t - start).total_seconds()
        m = _LEARNING_RATE.search(line)
        if m:
            lr = float(m.group(1))
        train.feed(line, iteration, seconds, lr)
        test.feed(line, iteration, seconds, lr)
    return train.finish(), test.finish()


def parse_log(path: str) -> tuple[list[Row], list[Row]]:
    """(train rows, test rows) of the log file at ``path`` (see the module docstring)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return parse_lines(f, _log_year(path), source=path)
    except OSError as e:
        raise CctError(f"cannot read log '{path}': {e.strerror}") from None


def write_csv(path: str, rows: list[Row], delimiter: str = ",") -> bool:
    """Write ``rows`` as Caffe's parse_log.py does (columns of the first row); False if there are none."""
    if not rows:
        return False

    class Dialect(csv.excel):
        pass

    Dialect.delimiter = delimiter
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), dialect=Dialect, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return True


def save_csv_files(log_path: str, out_dir: str, train: list[Row], test: list[Row], delimiter: str = ",",
                   verbose: bool = False) -> list[str]:
    """Write ``<out_dir>/<basename>.train`` and ``.test``; returns the paths written."""
    base = os.path.join(out_dir, os.path.basename(log_path))
    written = []
    for suffix, rows in ((".train", train), (".test", test)):
        if write_csv(base + suffix, rows, delimiter):
            written.append(base + suffix)
            if verbose:
                print(f"Wrote {base + suffix}")
        elif verbose:
            print(f"Not writing {base + suffix}; no lines to write")
    return written


def build_parser() -> FlagParser:
    """The arguments of ``cct parse_log``."""
    p = tool_parser("parse_log", "Parse a training log into two CSV files of training and test outputs "
                    "(Caffe's tools/extra/parse_log.py).", progress=False)
    p.add_argument("logfile_path", metavar="LOG", help="the log (stderr of cct train or caffe train)")
    p.add_argument("output_dir", metavar="OUTDIR", nargs="?", default=None,
                   help="where to write LOG.train and LOG.test (default: LOG's folder)")
    p.add_argument("--verbose", action="store_true", help="print the names of the files written")
    p.add_argument("--delimiter", default=",", help="column delimiter")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write the rows as TensorBoard event files to DIR (train/<output>, test/<output>, lr; "
                        "the [tensorboard] extra)")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct parse_log`` on parsed arguments."""
    if len(a.delimiter) != 1:
        raise CctError(f"--delimiter must be one character, not '{a.delimiter}'")
    out_dir = a.output_dir if a.output_dir is not None else (os.path.dirname(a.logfile_path) or ".")
    if not os.path.isdir(out_dir):
        raise CctError(f"output folder '{out_dir}' does not exist")
    train, test = parse_log(a.logfile_path)
    save_csv_files(a.logfile_path, out_dir, train, test, a.delimiter, a.verbose)
    if a.tensorboard is not None:
        points = write_log_events(a.tensorboard, train, test)
        log.info("Wrote %d TensorBoard points to %s", points, a.tensorboard)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
