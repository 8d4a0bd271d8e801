"""Per-layer time of the non-GEMM vision work: numpy path vs compiled kernels (cct.kernels), side by side.

For the pooling and LRN layers of CaffeNet (batch 64), cifar10_quick (batch 100) and LeNet
(batch 64), and the im2col (forward) / col2im (backward data) of their convolutions in the
type-1 lowering's buffer layout, this times forward and backward with ``CCT_KERNELS=numpy``
and with the kernels, checks that both give the same arrays, and reports medians.

    python benchmarks/bench_layers.py --quick          # 3 runs per op (shared machine)
    python benchmarks/bench_layers.py --nets lenet --threads 1

Writes benchmarks/results/bench_layers.json (``--out`` to change).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import numpy as np  # noqa: E402

# (layer, kind, spec) per net; shapes are the layer inputs at the net's benchmark batch size.
# pool: (prototxt pooling_param body); lrn: (local_size, alpha, beta); conv: (k, pad, stride, num_output),
# time col2im; each conv also gives a "lift*" row (type 1's lifting + bias / _group_major transposes);
# relu: the ReLU numpy expressions vs cct.kernels.elementwise (a proposal: the layer does not use it yet).
NETS: dict[str, dict] = {
    "caffenet": {"batch": 64, "ops": [
        ("conv1", "conv", (3, 227, 227), (11, 0, 4, 96), False),
        ("relu1", "relu", (96, 55, 55), None),
        ("pool1", "pool", (96, 55, 55), "pool: MAX kernel_size: 3 stride: 2"),
        ("norm1", "lrn", (96, 27, 27), (5, 1e-4, 0.75)),
        ("conv2", "conv", (96, 27, 27), (5, 2, 1, 256), True),
        ("relu2", "relu", (256, 27, 27), None),
        ("pool2", "pool", (256, 27, 27), "pool: MAX kernel_size: 3 stride: 2"),
        ("norm2", "lrn", (256, 13, 13), (5, 1e-4, 0.75)),
        ("conv3", "conv", (256, 13, 13), (3, 1, 1, 384), True),
        ("conv4", "conv", (384, 13, 13), (3, 1, 1, 384), True),
        ("conv5", "conv", (384, 13, 13), (3, 1, 1, 256), True),
        ("relu5", "relu", (256, 13, 13), None),
        ("pool5", "pool", (256, 13, 13), "pool: MAX kernel_size: 3 stride: 2"),
    ]},
    "cifar10_quick": {"batch": 100, "ops": [
        ("conv1", "conv", (3, 32, 32), (5, 2, 1, 32), False),
        ("pool1", "pool", (32, 32, 32), "pool: MAX kernel_size: 3 stride: 2"),
        ("relu1", "relu", (32, 16, 16), None),
        ("conv2", "conv", (32, 16, 16), (5, 2, 1, 32), True),
        ("pool2", "pool", (32, 16, 16), "pool: AVE kernel_size: 3 stride: 2"),
        ("conv3", "conv", (32, 8, 8), (5, 2, 1, 64), True),
        ("pool3", "pool", (64, 8, 8), "pool: AVE kernel_size: 3 stride: 2"),
    ]},
    "lenet": {"batch": 64, "ops": [
        ("conv1", "conv", (1, 28, 28), (5, 0, 1, 20), False),
        ("pool1", "pool", (20, 24, 24), "pool: MAX kernel_size: 2 stride: 2"),
        ("conv2", "conv", (20, 12, 12), (5, 0, 1, 50), True),
        ("pool2", "pool", (50, 8, 8), "pool: MAX kernel_size: 2 stride: 2"),
        ("relu1", "relu", (500,), None),
    ]},
}


def _layer(text: str):
    from cct.io.prototxt import parse_text
    from cct.layers import create_layer
    from cct.proto import caffe_pb2

    lp = caffe_pb2.LayerParameter()
    parse_text(text, lp)
    lp.phase = caffe_pb2.TRAIN
    return create_layer(lp)


def _layer_case(kind, shape, spec, dtype, rng):
    """(forward, backward, outputs) closures of a pooling/LRN layer on random data."""
    from cct.blob import Blob

    if kind == "pool":
        text = f'name: "p" type: "Pooling" pooling_param {{ {spec} }}'
    else:
        size, alpha, beta = spec
        text = f'name: "n" type: "LRN" lrn_param {{ local_size: {size} alpha: {alpha} beta: {beta} }}'
    layer = _layer(text)
    bottom = [Blob(shape, dtype=dtype)]
    top = [Blob((), dtype=dtype)]
    bottom[0].data[...] = rng.standard_normal(shape, dtype=np.float32)
    layer.setup(bottom, top)
    layer.reshape(bottom, top)
    top[0].diff[...] = rng.standard_normal(top[0].shape, dtype=np.float32)

    def fwd():
        layer.forward(bottom, top)

    def bwd():
        layer.backward(top, [True], bottom)

    return fwd, bwd, lambda: (top[0].data, bottom[0].diff)


def _conv_case(shape, spec, batch, dtype, rng, backward: bool):
    """(forward = im2col into the type-1 buffer, backward = col2im of a type-1 dcol, outputs)."""
    li = importlib.import_module("cct.lowering.im2col")
    k, pad, stride, _ = spec
    geom = common.conv_geom(shape[1], k, shape[0], 16, pad=pad, stride=stride)
    x = rng.standard_normal((batch,) + shape, dtype=np.float32).astype(dtype, copy=False)
    c, (oh, ow) = shape[0], geom.out_shape
    buf = np.empty((c, k, k, batch, oh, ow), dtype=dtype)
    view = buf.transpose(3, 0, 1, 2, 4, 5)  # (N, C, kh, kw, OH, OW) over the type-1 buffer
    dcol = rng.standard_normal(buf.shape, dtype=np.float32).astype(dtype, copy=False).transpose(3, 0, 1, 2, 4, 5)
    res = {}

    def fwd():
        li.im2col(x, geom.kernel, geom.pad, geom.stride, geom.dilation, geom.out_shape, out=view)

    def bwd():
        res["dx"] = li.col2im(dcol, geom.in_shape, geom.kernel, geom.pad, geom.stride, geom.dilation)

    return fwd, (bwd if backward else None), lambda: (view, res.get("dx"))


def _lift_case(shape, spec, batch, dtype, rng, use_kernel: bool):
    """Type 1's lifting ``(M, N*P) -> (N, M, P)`` + bias (forward) and ``_group_major`` (backward):
    numpy expressions as cct/lowering/type1.py has them, or cct.kernels.elementwise.swap01 (not wired yet)."""
    k, pad, stride, m = spec
    geom = common.conv_geom(shape[1], k, shape[0], m, pad=pad, stride=stride)
    p = geom.out_size
    y = rng.standard_normal((1, m, batch * p), dtype=np.float32).astype(dtype, copy=False)  # GEMM output
    bias = rng.standard_normal(m, dtype=np.float32).astype(dtype, copy=False)
    dy = rng.standard_normal((batch, m, p), dtype=np.float32).astype(dtype, copy=False)
    top, dyg = np.empty((batch, m, p), dtype), np.empty((m, batch, p), dtype)
    from cct import kernels

    ke = kernels.get("elementwise") if use_kernel else None
    if ke is not None:
        def fwd():
            ke.swap01(y.reshape(m, batch, p), top, bias)

        def bwd():
            ke.swap01(dy, dyg)
    else:
        def fwd():
            top[...] = y.reshape(m, batch, p).swapaxes(0, 1) + bias.reshape(m, 1)

        def bwd():
            dyg[...] = np.ascontiguousarray(dy.reshape(batch, 1, m, p).transpose(1, 2, 0, 3)).reshape(m, batch, p)

    return fwd, bwd, lambda: (top, dyg)


def _relu_case(shape, dtype, rng, use_kernel: bool):
    """ReLU as cct.layers.activation computes it (numpy) or with cct.kernels.elementwise (not wired yet)."""
    x = rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
    dy = rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False)
    y, dx = np.empty_like(x), np.empty_like(x)
    from cct import kernels

    ke = kernels.get("elementwise") if use_kernel else None
    if ke is not None:
        def fwd():
            ke.relu_forward(x, y)

        def bwd():
            ke.relu_backward(x, dy, dx)
    else:
        def fwd():
            np.maximum(x, 0, out=y)

        def bwd():
            dx[...] = np.where(x > 0, dy, 0)

    return fwd, bwd, lambda: (y, dx)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 timed runs per op (default 7)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--nets", default="caffenet,cifar10_quick,lenet")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--threads", type=int, default=None, help="kernel (numba) threads (default: all cores)")
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench_layers.json)")
    args = ap.parse_args(argv)
    removed = common.reexec_clean(keep_env=args.keep_env)
    from cct import kernels

    repeats = args.repeats or (3 if args.quick else 7)
    dtype = np.dtype(args.dtype)
    nets = [n.strip() for n in args.nets.split(",") if n.strip()]
    for n in nets:
        if n not in NETS:
            ap.error(f"unknown net {n!r} (choose from {', '.join(NETS)})")
    if not kernels.numba_available():
        print("# numba unavailable: only the numpy path can run")
    if args.threads:
        kernels.set_num_threads(args.threads)
    env = common.environment_report(removed)
    common.print_environment(env)

    rows, results = [], []
    for net in nets:
        batch = NETS[net]["batch"]
        ops = []
        for op in NETS[net]["ops"]:
            ops.append(op)
            if op[1] == "conv":
                ops.append((op[0], "lift", op[2], op[3]))
        for op in ops:
            name, kind, shape = op[0], op[1], op[2]
            full = (batch,) + tuple(shape)
            entry = {"net": net, "layer": name, "kind": kind, "input": list(full), "batch": batch}
            times: dict[str, dict] = {}
            outs = {}
            for mode in ("numpy", "auto"):
                with kernels.forced_mode(mode):
                    if kind == "lift":
                        fwd, bwd, get = _lift_case(tuple(shape), op[3], batch, dtype, np.random.default_rng(1),
                                                   mode == "auto")
                    elif kind == "relu":
                        fwd, bwd, get = _relu_case(full, dtype, np.random.default_rng(1), mode == "auto")
                    elif kind == "conv":
                        fwd, bwd, get = _conv_case(tuple(shape), op[3], batch, dtype, np.random.default_rng(1),
                                                   op[4])
                    else:
                        fwd, bwd, get = _layer_case(kind, full, op[3], dtype, np.random.default_rng(1))
                    t0 = time.perf_counter()
                    fwd()
                    first = time.perf_counter() - t0
                    times[mode] = {"fwd": common.time_call(fwd, repeats=repeats, warmup=0)["median"],
                                   "first_fwd_s": first}
                    if bwd is not None:
                        t0 = time.perf_counter()
                        bwd()
                        times[mode]["first_bwd_s"] = time.perf_counter() - t0
                        times[mode]["bwd"] = common.time_call(bwd, repeats=repeats, warmup=0)["median"]
                    outs[mode] = [None if a is None else np.array(a) for a in get()]
            same = all((a is None and b is None) or np.array_equal(a, b, equal_nan=True)
                       for a, b in zip(outs["numpy"], outs["auto"]))
            entry.update(times=times, bitwise_equal=same)
            results.append(entry)
            label = {"conv": "im2col/col2im", "pool": "pool", "lrn": "lrn", "relu": "relu*", "lift": "lift*"}[kind]
            tn, tk = times["numpy"], times["auto"]
            rows.append([net, name, label, "x".join(map(str, full)),
                         tn["fwd"] * 1e3, tk["fwd"] * 1e3, tn["fwd"] / tk["fwd"],
                         tn.get("bwd", float("nan")) * 1e3, tk.get("bwd", float("nan")) * 1e3,
                         tn.get("bwd", float("nan")) / tk.get("bwd", float("nan")),
                         "yes" if same else "NO"])
            print(f"# {net}/{name} done", flush=True)
    print()
    common.print_table(["net", "layer", "op", "input", "np fwd ms", "kern fwd ms", "x", "np bwd ms", "kern bwd ms",
                        "x", "equal"], rows)
    totals = {}
    for net in nets:
        sel = [r for r in results if r["net"] == net and r["kind"] not in ("relu", "lift")]
        tot = {m: sum(r["times"][m]["fwd"] + r["times"][m].get("bwd", 0.0) for r in sel) for m in ("numpy", "auto")}
        totals[net] = tot
        print(f"# {net}: numpy {tot['numpy'] * 1e3:.1f} ms, kernels {tot['auto'] * 1e3:.1f} ms per iteration "
              f"({tot['numpy'] / tot['auto']:.1f}x)")
    path = common.write_json("bench_layers", {"environment": env, "kernels": kernels.info(), "dtype": str(dtype),
                                              "repeats": repeats, "statistic": "median", "results": results,
                                              "totals_s": totals}, args.out)
    print("# relu*, lift*: cct.kernels.elementwise (not in the totals); ReLU layers use relu*; lift* = type 1's "
          "lifting + bias (fwd) and _group_major (bwd), which type 1 does not use (it writes GEMM results into "
          "the top blob per chunk instead)")
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
