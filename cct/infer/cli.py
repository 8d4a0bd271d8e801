"""``cct infer``: the net's output at every voxel of a large 2-D or 3-D image, file to file.

    cct infer --model deploy.prototxt --weights w.caffemodel --input vol.h5:raw --output out.h5:prob \
              [--blob prob] [--patch 64,64,64] [--mode valid|same] [--padding zero|mirror] \
              [--method mpf|shift|strided] [--memory_budget 4G] [--plan_only] [--restart] \
              [--gpu N [--host_ram] [--device_memory_budget 8G]]

Prints the plan (patch, fragments, per-layer strategy, predicted voxels/s and peak memory), streams the
volume tile by tile (progress with voxels/s and ETA), and resumes an interrupted run into the same output
unless ``--restart``. ``--gpu N`` builds the net on GPU N and runs it there; with ``--host_ram`` the net
stays in host RAM and its convolutions run on the GPU in sub-layers that fit ``--device_memory_budget``
(ZNNi section VII-B); with ``--pipeline auto|THETA`` the first theta layers run on the CPU and a copy of the
rest on the GPU (the CPU-GPU pipeline, VII-C).
"""
from __future__ import annotations

import argparse
import logging

import numpy as np

import cct

from ..distributed import world
from ..errors import CctError
from ..flags import FlagParser
from ..membudget import parse_size
from ..tools import tool_parser
from .dense import METHODS
from .pipeline import DenseInference
from .placement import gpu_config, gpu_device
from .tiling import MODES, PADDINGS
from .volume_io import InputVolume

log = logging.getLogger("cct")


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise CctError(f"{flag} {text!r}: expected comma-separated integers, e.g. 64,64,64") from None
    if not values or min(values) < 1:
        raise CctError(f"{flag} {text!r}: sizes must be positive")
    return values


def build_parser() -> FlagParser:
    """The flags of ``cct infer``."""
    p = tool_parser("infer", "Dense sliding-window inference of a 2-D/3-D ConvNet over a large image "
                             "(max-pooling fragments, overlap-save tiling, resumable).")
    p.add_argument("--model", required=True, help="the deploy prototxt (one Input blob (N, C, [z,] y, x))")
    p.add_argument("--weights", default=None, help="the trained weights (.caffemodel or .h5)")
    p.add_argument("--input", required=True, help="the input volume: vol.h5[:dataset], vol.npy or stack.tif")
    p.add_argument("--output", required=True, help="the output volume: out.h5[:dataset] (default dataset "
                                                   "'main'), out.npy or out.tif")
    p.add_argument("--blob", default=None, help="the output blob (default: the net's last output)")
    p.add_argument("--patch", default=None, help="input patch shape, e.g. 64,64,64 (default: the planner's "
                                                 "choice under the memory budget); the largest valid patch "
                                                 "within it is used")
    p.add_argument("--mode", default="valid", choices=MODES,
                   help="valid: output at window positions inside the image; same: output of the image's size")
    p.add_argument("--padding", default="zero", choices=PADDINGS,
                   help="how 'same' pads the image: zero, or mirror (reflection, edge voxel not repeated)")
    p.add_argument("--method", default="mpf", choices=METHODS,
                   help="mpf: max-pooling fragments; shift: dense by shifted runs of the plain net (no MPF); "
                        "strided: the net's own strided output")
    p.add_argument("--mpf", default=None, help="per pooling layer, 1 = fragments, 0 = plain pooling "
                                               "(e.g. 0,1,1; default: the planner's choice)")
    p.add_argument("--memory_budget", default=None, help="peak memory of the whole run, e.g. 4G (default "
                                                         "CCT_MEMORY_BUDGET, else the physical memory)")
    p.add_argument("--pipeline", default="off",
                   help="two-stage CPU pipeline (ZNNi VII): off, auto (the planner picks the split with the patch, "
                        "by predicted throughput) or THETA, the convolution/pooling layers of the first stage; "
                        "with --gpu N the CPU-GPU pipeline (first stage on the CPU, the rest on the GPU)")
    p.add_argument("--gpu", default=None, help="run on GPU N (the net built there; an error when there is no GPU)")
    p.add_bool("host_ram", "with --gpu: GPU + host RAM (ZNNi VII-B): activations in host RAM, each convolution on "
                           "the GPU in sub-layers over samples, input and output maps that fit the device budget",
               default=False)
    p.add_argument("--device_memory_budget", default=None,
                   help="with --gpu: the GPU memory the plan may use, e.g. 8G (default: the GPU's free memory)")
    p.add_bool("plan_only", "print the plan and exit")
    p.add_bool("restart", "ignore a partial output of an interrupted run and start over")
    return p


def _gpu_index(args: argparse.Namespace) -> int | None:
    """``--gpu N`` as one device id (None without it); the GPU-only flags refused without it."""
    if args.gpu is None:
        if args.host_ram or args.device_memory_budget:
            raise CctError("--host_ram and --device_memory_budget need --gpu N")
        return None
    try:
        return int(args.gpu)
    except ValueError:
        raise CctError(f"--gpu {args.gpu!r}: cct infer runs on one GPU, give its id (e.g. --gpu 0)") from None


def run(args: argparse.Namespace) -> int:
    """``cct infer`` on parsed arguments."""
    gpu = _gpu_index(args)
    pipelined = args.pipeline not in (None, "off", "0")
    on_gpu = gpu is not None and not args.host_ram and not pipelined  # else the net stays on the host
    config = gpu_config(gpu) if on_gpu else None
    net = cct.Net(args.model, cct.TEST, weights=args.weights, dtype=np.float32, config=config)
    if args.weights is None:
        log.warning("no --weights: the net runs with the weights of its fillers")
    budget = parse_size(args.memory_budget, "--memory_budget") if args.memory_budget else None
    patch = _ints(args.patch, "--patch") if args.patch else None
    mpf = None
    if args.mpf:
        flags = args.mpf.split(",")
        if any(f not in ("0", "1") for f in flags):
            raise CctError(f"--mpf {args.mpf!r}: expected 0/1 per pooling layer, e.g. 1,1,0")
        mpf = tuple(f == "1" for f in flags)
    device_budget = parse_size(args.device_memory_budget, "--device_memory_budget") \
        if args.device_memory_budget else None
    di = DenseInference(net, patch=patch, mode=args.mode, padding=args.padding, method=args.method, mpf=mpf,
                        blob=args.blob, budget=budget, pipeline=args.pipeline,
                        device=gpu_device(gpu) if gpu is not None and not on_gpu else None,
                        host_ram=bool(args.host_ram), device_budget=device_budget)
    if mpf is not None and len(mpf) != len(di.geom.pools):
        raise CctError(f"--mpf has {len(mpf)} entries; the net has {len(di.geom.pools)} pooling layers "
                       f"({', '.join(op.name for op in di.geom.pools) or 'none'})")
    with InputVolume(args.input) as src:
        spatial = di.volume_layout(src.shape)
    di.prepare(spatial)
    if world().rank == 0:
        print(di.plan.describe() + (f"\n  {di.stages.describe()}" if di.stages else ""), flush=True)
    if args.plan_only:
        return 0
    comm = world()  # under mpiexec -n N: the tiles are divided among the ranks
    s = di.run_files(args.input, args.output, resume=not args.restart, progress=args.progress, comm=comm)
    if comm.rank != 0:
        return 0
    how = {"mpf": "max-pooling fragments", "shift": "shifted runs of the plain net (no MPF)",
           "strided": "the net's own strided output"}[s["method"]]
    print(f"wrote {args.output}: shape {s['output_shape']}, {how}, mode {s['mode']}"
          f"{' (' + s['padding'] + ' padding)' if s['mode'] == 'same' else ''}; {s['voxels']} voxels in "
          f"{s['seconds']:.2f} s ({s['voxels_per_second']:,.0f} voxels/s)"
          f"{', resumed after ' + str(s['resumed_tiles']) + ' finished tiles' if s['resumed_tiles'] else ''}")
    return 0
