"""``cct device_query``: the CPU, the BLAS backend, the devices' measured SGEMM rates and any GPUs; under
``mpiexec`` every rank's report, printed by rank 0 in rank order."""
from __future__ import annotations

import argparse
import io
import os
import platform
import sys

import numpy as np

from .. import blas
from ..device.driver import cupy_available
from ..errors import CctError
from ..flags import FlagParser, command_parser
from ..runsetup import select_gpus
from ..scheduler import device_query, format_device_query
from .mpi import mpi_world


def build_parser() -> FlagParser:
    """The flags of ``cct device_query``."""
    p = command_parser("device_query", "Show the CPU, the BLAS backend and any GPUs.")
    p.add_argument("--gpu", default=None, help="only query these GPU ids ('all' or a comma list)")
    return p


def run(args: argparse.Namespace) -> int:
    """``cct device_query``: CPU, BLAS backend and (when CuPy sees any) GPU information; under
    mpiexec every rank's, printed by rank 0 in rank order."""
    comm = mpi_world()
    if comm is None:
        return report(args, sys.stdout)

    buf = io.StringIO()
    try:
        rc = report(args, buf)
    except CctError as e:
        buf.write(f"error: {e}\n")
        rc = 1
    reports = comm.gather_obj((platform.node(), buf.getvalue(), rc))
    if comm.is_root:
        for r, (host, text, _) in enumerate(reports):
            sys.stdout.write(f"=== MPI rank {r} of {comm.size} (host {host}) ===\n{text}")
        sys.stdout.flush()
    return max(x[2] for x in reports) if comm.is_root else rc


def report(args: argparse.Namespace, out) -> int:
    """Write this process's report to ``out``; the exit status (1 when ``--gpu`` names GPUs that are not there)."""
    try:
        cpu = blas._cpu_model()
    except Exception:  # pragma: no cover - informational only
        cpu = platform.processor() or "unknown"
    print(f"CPU: {cpu}", file=out)
    print(f"CPU cores: {os.cpu_count()}", file=out)
    print(f"Platform: {platform.platform()}", file=out)
    print(f"Python: {platform.python_version()}; numpy {np.__version__}", file=out)
    try:
        backend = blas.get_backend()
    except CctError as e:
        backend = f"unavailable ({e})"
    print(f"BLAS backend: {backend}", file=out)
    try:
        print(f"BLAS threads: {blas.get_num_threads()}", file=out)
    except Exception:  # pragma: no cover - informational only
        pass

    print("Devices (measured SGEMM rate, cached):", file=out)
    print(format_device_query(device_query()), file=out)

    if not cupy_available():
        if args.gpu:
            raise CctError(f"--gpu={args.gpu} given but no GPU is available (CuPy not installed or no CUDA device)")
        print("GPUs: none (CuPy not installed or no CUDA device visible)", file=out)
        return 0
    import cupy  # type: ignore

    count = cupy.cuda.runtime.getDeviceCount()
    ids = select_gpus(args.gpu) if args.gpu else list(range(count))
    print(f"GPUs: {count} (CuPy {cupy.__version__})", file=out)
    for i in ids:
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props.get("name", b"?")
        name = name.decode() if isinstance(name, bytes) else str(name)
        print(f"Device id: {i}", file=out)
        print(f"  Name: {name}", file=out)
        print(f"  Compute capability: {props.get('major')}.{props.get('minor')}", file=out)
        print(f"  Total global memory: {props.get('totalGlobalMem')}", file=out)
        print(f"  Multiprocessors: {props.get('multiProcessorCount')}", file=out)
    return 0
