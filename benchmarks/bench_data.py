"""Throughput of the Data layer alone (images/s), LMDB -> transformed float32 batches.

Cases:
* lenet: 1x28x28 uint8 records (make_digits), batch 64, scale 1/256 (LeNet's transform).
* caffenet: 3x256x256 uint8 records, batch 64, TRAIN, crop 227, mirror, mean_file (CaffeNet's).

The layer's forward copies a prefetched batch; with nothing else running, the steady-state rate
equals the rate of the background loader (reading, parsing, transforming). The first batches
(already in the queue) are excluded. Prints a table and writes benchmarks/results/bench_data.json.

    python benchmarks/bench_data.py            # default sizes
    python benchmarks/bench_data.py --quick    # smoke run (a few seconds)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from cct import rng as cct_rng  # noqa: E402
from cct.blob import Blob  # noqa: E402
from cct.io.blobproto import array_to_blobproto, write_binaryproto  # noqa: E402
from cct.io.prototxt import parse_text  # noqa: E402
from cct.layers.data import Data  # noqa: E402
from cct.proto import caffe_pb2  # noqa: E402
from cct.tools.convert_mnist import write_images_db  # noqa: E402
from cct.tools.make_digits import make_split  # noqa: E402


def _layer(source: str, batch: int, transform: str, phase: int):
    p = parse_text(f"""name: "data" type: "Data" top: "data" top: "label"
        data_param {{ source: "{source}" batch_size: {batch} backend: LMDB }}
        transform_param {{ {transform} }}""", caffe_pb2.LayerParameter())
    p.phase = phase
    layer = Data(p)
    top = [Blob(name="data"), Blob(name="label")]
    layer.setup([], top)
    return layer, top


def _measure(layer, top, batches: int, warm: int) -> float:
    for _ in range(warm):  # drain what the prefetcher filled during setup
        layer.forward([], top)
    t0 = time.perf_counter()
    for _ in range(batches):
        layer.forward([], top)
    return time.perf_counter() - t0


def run(quick: bool) -> list[dict]:
    cct_rng.set_random_seed(1)
    results = []
    with tempfile.TemporaryDirectory(prefix="cct-bench-data-") as tmp:
        # LeNet
        n = 1024 if quick else 8192
        x, y = make_split(n, np.random.SeedSequence(1))
        src = os.path.join(tmp, "lenet_lmdb")
        write_images_db(src, x, y)
        batches = 50 if quick else 400
        layer, top = _layer(src, 64, "scale: 0.00390625", caffe_pb2.TRAIN)
        dt = _measure(layer, top, batches, warm=5)
        layer.close()
        results.append({"case": "lenet", "input": "1x28x28", "batch": 64, "transform": "scale",
                        "batches": batches, "seconds": dt, "images_per_s": batches * 64 / dt})
        # CaffeNet
        n = 128 if quick else 512
        r = np.random.default_rng(0)
        imgs = r.integers(0, 256, (n, 3, 256, 256), dtype=np.uint8)
        src = os.path.join(tmp, "caffenet_lmdb")
        write_images_db(src, imgs, r.integers(0, 1000, n))
        mean_file = os.path.join(tmp, "mean.binaryproto")
        write_binaryproto(mean_file, array_to_blobproto(imgs.mean(axis=0, dtype=np.float64)[None], legacy_4d=True))
        del imgs
        batches = 6 if quick else 40
        layer, top = _layer(src, 64, f'crop_size: 227 mirror: true mean_file: "{mean_file}"', caffe_pb2.TRAIN)
        dt = _measure(layer, top, batches, warm=4)
        layer.close()
        results.append({"case": "caffenet", "input": "3x256x256 -> crop 227", "batch": 64,
                        "transform": "crop+mirror+mean_file", "batches": batches, "seconds": dt,
                        "images_per_s": batches * 64 / dt})
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: few batches")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "bench_data.json"))
    args = ap.parse_args(argv)
    results = run(args.quick)
    print(f"{'case':<10} {'input':<24} {'batch':>5} {'transform':<24} {'images/s':>10}")
    for r in results:
        print(f"{r['case']:<10} {r['input']:<24} {r['batch']:>5} {r['transform']:<24} {r['images_per_s']:>10.0f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"benchmark": "bench_data", "quick": args.quick, "machine": platform.platform(),
                   "cpus": os.cpu_count(), "results": results}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
