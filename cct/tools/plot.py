"""plot: training curves of one or more training logs in one PNG (matplotlib, the ``[plot]`` extra).

``cct plot LOG [LOG...] --out curves.png [--chart all|N[,N...]] [--x iters|seconds]``

The chart types are those of Caffe's ``tools/extra/plot_training_log.py.example`` (Python 2, and it
needs ``parse_log.sh``), numbered as there::

    0: Test accuracy  vs. Iters      1: Test accuracy  vs. Seconds
    2: Test loss  vs. Iters          3: Test loss  vs. Seconds
    4: Train learning rate  vs. Iters  5: Train learning rate  vs. Seconds
    6: Train loss  vs. Iters         7: Train loss  vs. Seconds

``--chart all`` (the default) draws test accuracy, test loss, train loss and learning rate against
``--x`` in a 2x2 figure; several chart numbers draw one panel each. Every log is one line per panel
(labelled with its file name without ``.log``), so runs can be compared. The logs are read by
:mod:`cct.tools.parse_log`: a log whose last iteration has no ``lr =`` line, or with no test
phase, still plots (panels without data say so).
"""
from __future__ import annotations

import argparse
import math
import os

from ..errors import CctError
from ..flags import FlagParser
from . import run_tool, tool_parser
from .parse_log import Row, parse_log

SEPARATOR = "  vs. "
_Y_FIELDS = ("Test accuracy", "Test loss", "Train learning rate", "Train loss")
_X_FIELDS = ("Iters", "Seconds")
CHART_TYPES: list[str] = [f"{y}{SEPARATOR}{x}" for y in _Y_FIELDS for x in _X_FIELDS]
_ALL = ("Test accuracy", "Test loss", "Train loss", "Train learning rate")


def _column(rows: list[Row], field: str) -> str | None:
    """The CSV column holding ``field`` ('Test accuracy' -> an output named like 'accuracy'...)."""
    if not rows:
        return None
    if field.endswith("learning rate"):
        return "LearningRate"
    want = "acc" if field.endswith("accuracy") else "loss"
    names = [k for k in rows[0] if k not in ("NumIters", "Seconds", "LearningRate")]
    exact = [k for k in names if k == ("accuracy" if want == "acc" else "loss")]
    matches = exact or [k for k in names if want in k.lower()]
    return matches[0] if matches else None


def series(train: list[Row], test: list[Row], chart: str) -> tuple[list[float], list[float]]:
    """(x, y) of one chart type (see :data:`CHART_TYPES`) from parsed log rows; empty if absent."""
    y_field, x_field = chart.split(SEPARATOR)
    rows = test if y_field.startswith("Test") else train
    col = _column(rows, y_field)
    if col is None:
        return [], []
    xkey = "NumIters" if x_field == "Iters" else "Seconds"
    pts = [(r[xkey], r[col]) for r in rows if col in r and not math.isnan(r[col])]
    return [p[0] for p in pts], [p[1] for p in pts]


def parse_charts(text: str, x: str) -> list[str]:
    """Chart descriptions for ``--chart`` (``all`` or numbers 0-7) and ``--x``."""
    if text == "all":
        axis = "Iters" if x == "iters" else "Seconds"
        return [f"{y}{SEPARATOR}{axis}" for y in _ALL]
    out = []
    for part in text.split(","):
        try:
            i = int(part)
        except ValueError:
            i = -1
        if not 0 <= i < len(CHART_TYPES):
            raise CctError(f"--chart: '{part}' is not a chart type; use 'all' or 0-{len(CHART_TYPES) - 1}: "
                           + "; ".join(f"{j}: {c}" for j, c in enumerate(CHART_TYPES)))
        out.append(CHART_TYPES[i])
    return out


def log_label(path: str) -> str:
    """A log's legend label: its file name without a ``.log`` suffix."""
    name = os.path.basename(path)
    return name[:-4] if name.endswith(".log") else name


def plot_logs(logs: list[str], out: str, charts: list[str], title: str | None = None, dpi: int = 100,
              log_loss: bool = False) -> None:
    """Draw ``charts`` for every log in ``logs`` into the image file ``out`` (format from its extension);
    ``log_loss``: loss axes on a log scale."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise CctError("cct plot needs matplotlib, an optional dependency: pip install 'cct[plot]'") from None
    parsed = [(log_label(p), *parse_log(p)) for p in logs]
    n = len(charts)
    ncols = 1 if n == 1 else 2
    nrows = (n + ncols - 1) // ncols
    fig = Figure(figsize=(6.4 * ncols, 4.2 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    markers = "os^vD<>ph*"
    for ax, chart in zip(axes, charts):
        y_field, x_field = chart.split(SEPARATOR)
        drawn = 0
        for k, (label, train, test) in enumerate(parsed):
            xs, ys = series(train, test, chart)
            if not xs:
                continue
            ax.plot(xs, ys, label=label, linewidth=1.0, marker=markers[k % len(markers)] if len(xs) <= 40 else None,
                    markersize=4)
            drawn += 1
        ax.set_title(chart)
        ax.set_xlabel(x_field)
        ax.set_ylabel(y_field)
        ax.grid(True, alpha=0.3)
        if log_loss and y_field.endswith("loss") and drawn:
            ax.set_yscale("log")
        if drawn:
            loc = "lower right" if "accuracy" in y_field else "upper right"
            ax.legend(loc=loc, fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data in the log(s)", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    ext = os.path.splitext(out)[1].lstrip(".").lower() or "png"
    try:
        fig.savefig(out, format=ext, dpi=dpi)
    except ValueError as e:
        raise CctError(f"--out '{out}': {e}") from None


def build_parser() -> FlagParser:
    """The arguments of ``cct plot``."""
    p = tool_parser("plot", "Plot training curves (test accuracy, test loss, train loss, learning rate) "
                    "of one or more training logs into one image.", progress=False)
    p.add_argument("logs", metavar="LOG", nargs="+", help="training logs (stderr of cct train or caffe train)")
    p.add_argument("--out", "-o", default="curves.png", help="the image to write (.png, .svg, .pdf)")
    p.add_argument("--chart", default="all",
                   help="'all' or chart numbers of plot_training_log.py, comma-separated: "
                        + "; ".join(f"{j}: {c.replace(SEPARATOR, ' vs. ')}" for j, c in enumerate(CHART_TYPES)))
    p.add_argument("--x", default="iters", choices=["iters", "seconds"], help="x axis of --chart=all")
    p.add_argument("--title", default=None, help="a title over the figure")
    p.add_argument("--dpi", type=int, default=100, help="resolution of raster images")
    p.add_argument("--log_loss", action="store_true", help="draw the loss axes on a log scale")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct plot`` on parsed arguments."""
    import logging

    plot_logs(a.logs, a.out, parse_charts(a.chart, a.x), a.title, a.dpi, a.log_loss)
    logging.getLogger("cct").info("Wrote %s", a.out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
