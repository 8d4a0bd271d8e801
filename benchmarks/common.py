"""Shared helpers of the cct benchmarks: clean environment, BLAS report, timing, tables, JSON.

Environment: some machines set ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE``, which force
OpenBLAS onto a slower kernel (e.g. Haswell instead of SkylakeX: about half the SGEMM speed).
:func:`reexec_clean` re-executes the benchmark once without them -- for the benchmark's own
process only -- unless ``--keep-env`` is given; every benchmark reports which kernel ran.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from cct import blas  # noqa: E402
from cct.lowering.geometry import ConvGeometry  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DIRTY_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_MARK = "CCT_BENCH_REEXEC"


def reexec_clean(argv: Sequence[str] | None = None, keep_env: bool = False) -> dict:
    """Re-exec this script without OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE (once); returns what was removed.

    Call before anything loads numpy's BLAS threads heavily (the kernel is picked at load
    time). With ``keep_env`` nothing happens.
    """
    if _MARK in os.environ:
        try:
            return json.loads(os.environ[_MARK])
        except ValueError:
            return {}
    removed = {k: os.environ[k] for k in DIRTY_VARS if k in os.environ}
    if keep_env or not removed:
        return {}
    env = {k: v for k, v in os.environ.items() if k not in DIRTY_VARS}
    env[_MARK] = json.dumps(removed)
    args = [sys.executable, os.path.abspath(sys.argv[0])] + list(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, args, env)
    return removed  # pragma: no cover (execve does not return)


def environment_report(removed: dict | None = None) -> dict:
    """BLAS backend/kernel/threads, CPU, and the environment overrides removed for this run."""
    info = blas.blas_info()
    return {
        "host": platform.node(),
        "cpu": blas.cpu_model(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "blas": info,
        "kernel": info.get("architecture"),
        "removed_env": removed or {},
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def print_environment(rep: dict) -> None:
    """One paragraph naming the kernel that ran and the overrides removed."""
    print(f"# {blas.describe()}")
    print(f"# CPU: {rep['cpu']} ({rep['cpus']} logical CPUs), load avg {rep['load_avg']}")
    if rep["removed_env"]:
        print("# removed for this run: " + " ".join(f"{k}={v}" for k, v in rep["removed_env"].items()))


def time_call(fn: Callable[[], Any], repeats: int = 3, warmup: int = 1, min_time: float = 0.0) -> dict:
    """Best / median seconds of ``fn`` over ``repeats`` runs (after ``warmup`` runs)."""
    for _ in range(warmup):
        fn()
    ts = []
    t_start = time.perf_counter()
    while len(ts) < repeats or (time.perf_counter() - t_start < min_time and len(ts) < 100):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return {"best": min(ts), "median": statistics.median(ts), "runs": len(ts)}


def sgemm_peak(threads: int | None = None, size: int = 2048, repeats: int = 3) -> float:
    """Measured GFLOPS of a large square SGEMM on the current backend (the device's practical peak)."""
    with blas.blas_threads(threads):
        return blas.gemm_gflops([(size, size, size)], repeats=repeats, backend=blas.get_backend())


def conv_geom(n: int, k: int, d: int, o: int, pad: int = 0, stride: int = 1, group: int = 1) -> ConvGeometry:
    """Square-input, square-kernel ConvGeometry (Caffe output size)."""
    m = (n + 2 * pad - k) // stride + 1
    return ConvGeometry(channels_in=d, channels_out=o, group=group, in_shape=(n, n), kernel=(k, k), pad=(pad, pad),
                        stride=(stride, stride), dilation=(1, 1), out_shape=(m, m), bias_term=True)


# CaffeNet (bvlc_reference_caffenet) convolutions: name -> (n, k, d, o, pad, stride, group)
CAFFENET = {
    "conv1": (227, 11, 3, 96, 0, 4, 1),
    "conv2": (27, 5, 96, 256, 2, 1, 2),
    "conv3": (13, 3, 256, 384, 1, 1, 1),
    "conv4": (13, 3, 384, 384, 1, 1, 2),
    "conv5": (13, 3, 384, 256, 1, 1, 2),
}


def caffenet_geom(name: str, groups: bool = True) -> ConvGeometry:
    """A CaffeNet conv layer's geometry (``groups=False``: the paper's Figure 7, group 1)."""
    n, k, d, o, pad, stride, group = CAFFENET[name]
    return conv_geom(n, k, d, o, pad, stride, group if groups else 1)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Plain fixed-width table."""
    cells = [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(headers)]
    print("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for r in cells:
        print("  ".join(v.rjust(w) for v, w in zip(r, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def caffe_report(binary: str) -> dict:
    """What a BVLC ``caffe`` binary is: its version line, the BLAS library it loads (file name, which
    carries the version) and the OpenBLAS core it picks on this CPU (``OPENBLAS_VERBOSE=2``)."""
    import re
    import subprocess

    env = dict(os.environ, OPENBLAS_VERBOSE="2")
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, env=env, timeout=60)
        ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"caffe binary '{binary}' does not run: {e}") from None
    text = out.stdout + out.stderr
    if out.returncode != 0 or "caffe" not in text.lower():
        raise SystemExit(f"'{binary} --version' failed (rc {out.returncode}): {text[-500:]}")
    version = next((ln.strip() for ln in text.splitlines() if "version" in ln.lower()), "?")
    core = re.search(r"Core:\s*(\S+)", text)
    blas_libs = sorted({os.path.basename(os.path.realpath(m)) for m in re.findall(r"=>\s*(\S+)", ldd)
                        if re.search(r"blas|mkl|atlas", os.path.basename(m))})
    return {"binary": os.path.basename(binary), "version": version, "blas": blas_libs,
            "openblas_core": core.group(1) if core else None}


def caffe_line(rep: dict) -> str:
    """One comment line naming the Caffe that ran (from ``caffe_report``)."""
    return f"# BVLC Caffe: {rep['version']}, BLAS {', '.join(rep['blas'])}, OpenBLAS core {rep['openblas_core']}"


def write_json(name: str, payload: dict, out: str | None = None) -> Path:
    """Write ``payload`` (plus argv and a timestamp) to ``benchmarks/results/<name>.json`` (or ``out``)."""
    path = Path(out) if out else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = dict(payload)
    payload.setdefault("argv", sys.argv)
    payload.setdefault("timestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    with open(path, "w") as f:
        json.dump(machine_neutral(json.loads(json.dumps(payload, default=_json_default))), f, indent=1)
    return path


def machine_neutral(obj: Any) -> Any:
    """``obj`` with every absolute path (a BLAS library, a Caffe binary, a work directory) reduced to
    its last component: results in the repository name no machine's directories."""
    if isinstance(obj, dict):
        return {k: machine_neutral(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [machine_neutral(v) for v in obj]
    if isinstance(obj, str) and obj.startswith("/") and len(obj) > 1:
        return os.path.basename(obj.rstrip("/"))
    return obj


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, (tuple, set)):
        return list(o)
    if hasattr(o, "__dataclass_fields__"):
        import dataclasses

        return dataclasses.asdict(o)
    return str(o)


def set_threads(n: int | None) -> None:
    """Set the BLAS thread count of the current backend for the rest of the run."""
    if n:
        blas.set_num_threads(n)
