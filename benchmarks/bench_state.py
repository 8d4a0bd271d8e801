"""The paths issue 29's state objects sit on, side by side across source trees: no slowdown allowed.

* ``imagedata``: images/s of an ImageData layer over 256 JPEG files (128x128, batch 64, crop 112, mirror): the
  reading and decoding run on the loader's own ``DecodePool`` (before: one pool shared by the process).
* ``usable``, ``launch``, ``threads``, ``get``: ns per call of the kernels' dispatch helpers (the dispatch check,
  ``cct.device.driver.host_kernels_usable``, before the device driver ``kernels.usable``; a one-piece
  ``kernels.launch``, ``get_num_threads``, ``get``), now reached through ``kernels.RUNTIME`` (before: module
  globals); every layer's numba dispatch calls some of them.

Each round runs every tree once, in a fresh process (``--child``), in the order given; the table shows each
tree's median over the rounds. Writes benchmarks/results/bench_state.json.

    python benchmarks/bench_state.py --trees base=/path/to/base/checkout,final=. --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import timeit

METRICS = ("imagedata", "usable", "launch", "threads", "get")
HIGHER_IS_BETTER = {"imagedata"}


def _images(root: str) -> str:
    """256 random 128x128 JPEGs and their list file under ``root`` (made once); the list's path."""
    import numpy as np
    from PIL import Image

    listing = os.path.join(root, "list.txt")
    if not os.path.exists(listing):
        r = np.random.default_rng(0)
        lines = []
        for i in range(256):
            Image.fromarray(r.integers(0, 256, (128, 128, 3), dtype=np.uint8)).save(f"{root}/{i}.jpg", quality=90)
            lines.append(f"{i}.jpg {i % 10}\n")
        with open(listing + ".part", "w") as f:
            f.writelines(lines)
        os.replace(listing + ".part", listing)
    return listing


def child(tree: str, images: str) -> dict:
    """The figures of one tree, measured in this process (``tree`` first on the import path)."""
    sys.path.insert(0, os.path.abspath(tree))
    import numpy as np

    from cct import kernels
    from cct.blob import Blob
    from cct.io.prototxt import parse_text
    from cct.layers.data import ImageData
    from cct.proto import caffe_pb2

    try:
        from cct.device.driver import host_kernels_usable
    except ImportError:  # a tree from before the device driver
        host_kernels_usable = kernels.usable
    listing = _images(images)
    p = parse_text(f'''name: "d" type: "ImageData" top: "data" top: "label"
      image_data_param {{ source: "{listing}" root_folder: "{images}/" batch_size: 64 }}
      transform_param {{ crop_size: 112 mirror: true }}''', caffe_pb2.LayerParameter())
    p.phase = caffe_pb2.TRAIN
    layer = ImageData(p)
    top = [Blob(name="data"), Blob(name="label")]
    layer.setup([], top)
    for _ in range(6):  # drain what the prefetcher read during setup
        layer.forward([], top)
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(16):
            layer.forward([], top)
        rates.append(16 * 64 / (time.perf_counter() - t))
    layer.close()

    a = np.zeros(16, np.float32)

    def noop(piece: int, pieces: int) -> None:
        pass

    def ns(fn) -> float:
        return min(timeit.repeat(fn, number=100_000, repeat=5)) / 100_000 * 1e9

    import cct

    assert os.path.dirname(os.path.abspath(cct.__file__)) == os.path.join(os.path.abspath(tree), "cct"), cct.__file__
    return {"imagedata": max(rates), "usable": ns(lambda: host_kernels_usable(a)),
            "launch": ns(lambda: kernels.launch(noop, work=10)), "threads": ns(kernels.get_num_threads),
            "get": ns(lambda: kernels.get("pooling"))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="final=.", help="name=path,... (source checkouts of cct)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="bench_state", help="results file name (benchmarks/results/NAME.json)")
    ap.add_argument("--keep-env", action="store_true", help="keep OPENBLAS_CORETYPE/OPENBLAS_L2_SIZE")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--images", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.images)))
        return
    from common import environment_report, print_environment, print_table, reexec_clean, write_json

    removed = reexec_clean(keep_env=args.keep_env)
    trees = {name: os.path.abspath(path) for name, path in (t.split("=", 1) for t in args.trees.split(","))}
    rep = environment_report(removed)
    print_environment(rep)
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    with tempfile.TemporaryDirectory(prefix="cct-bench-state-") as images:
        for r in range(args.rounds):
            for name, path in trees.items():
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, "--images", images],
                                     capture_output=True, text=True, check=True, cwd=path)
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"# round {r + 1} {name}: " + ", ".join(f"{k} {v:.0f}" for k, v in runs[name][-1].items()))
    medians = {name: {m: statistics.median(x[m] for x in rs) for m in METRICS} for name, rs in runs.items()}
    first = next(iter(trees))
    rows = []
    for m in METRICS:
        unit = "img/s" if m in HIGHER_IS_BETTER else "ns/call"
        rows.append([m, unit] + [medians[n][m] for n in trees] +
                    [medians[n][m] / medians[first][m] for n in list(trees)[1:]])
    print_table(["metric", "unit"] + list(trees) + [f"{n}/{first}" for n in list(trees)[1:]], rows)
    argv = [os.path.basename(sys.argv[0]), "--trees", ",".join(f"{n}=<{n} checkout>" for n in trees),
            "--rounds", str(args.rounds)]  # no machine's directories in the results
    path = write_json(args.name, {"environment": rep, "trees": list(trees), "rounds": args.rounds, "runs": runs,
                                      "medians": medians, "argv": argv})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
