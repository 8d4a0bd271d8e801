"""The shipped dense-inference example: a generated cell volume and hand-set weights of a tiny boundary detector.

``python -m cct.infer.example DIR`` writes ``DIR/volume.h5`` (dataset ``raw``: bright cells of random
brightness with dark membranes between them and noise, as in an electron-microscopy stack; dataset
``labels``: the cells) and ``DIR/tiny3d.caffemodel``: the weights of ``models/znni/tiny3d.prototxt``,
whose first layer takes the six one-sided intensity differences along z, y and x, and whose second
layer turns their mean into a membrane probability. Then::

    cct infer --model models/znni/tiny3d.prototxt --weights DIR/tiny3d.caffemodel \\
              --input DIR/volume.h5:raw --output DIR/membranes.h5:prob --mode same --padding mirror
"""
from __future__ import annotations

import os
import sys

import h5py
import numpy as np
from scipy.spatial import cKDTree

import cct

from ..paths import repo_root

MODEL = os.path.join("models", "znni", "tiny3d.prototxt")


def make_volume(shape: tuple[int, int, int] = (48, 64, 64), cells: int = 40, seed: int = 0) -> tuple[np.ndarray,
                                                                                                      np.ndarray]:
    """``(raw, labels)``: Voronoi cells of random brightness, membranes (label changes) dark, plus noise."""
    rng = np.random.default_rng(seed)
    seeds = rng.uniform(0, 1, (cells, 3)) * np.array(shape)
    grid = np.stack(np.meshgrid(*(np.arange(n) + 0.5 for n in shape), indexing="ij"), axis=-1)
    labels = cKDTree(seeds).query(grid.reshape(-1, 3))[1].reshape(shape).astype(np.int32)
    membrane = np.zeros(shape, dtype=bool)
    for axis in range(3):
        diff = np.diff(labels, axis=axis) != 0
        lo = [slice(None)] * 3
        lo[axis] = slice(0, -1)
        membrane[tuple(lo)] |= diff
    raw = rng.uniform(0.55, 0.9, cells)[labels]
    raw[membrane] = 0.1
    raw += rng.normal(0, 0.03, shape)
    return raw.astype(np.float32), labels


def tiny3d_weights(net: cct.Net, threshold: float = 0.16, gain: float = 60.0) -> None:
    """Set ``tiny3d``'s weights: conv1 = the six one-sided differences, conv2 = gain * (mean - threshold)."""
    w1 = net.params["conv1"][0].data
    w1[...] = 0
    for axis in range(3):
        for sign, k in ((1.0, 2 * axis), (-1.0, 2 * axis + 1)):
            lo, hi = [1, 1, 1], [1, 1, 1]
            lo[axis], hi[axis] = 0, 2
            w1[k, 0][tuple(hi)] = sign
            w1[k, 0][tuple(lo)] = -sign
    net.params["conv1"][1].data[...] = 0
    net.params["conv2"][0].data[...] = gain / net.params["conv2"][0].data.size
    net.params["conv2"][1].data[...] = -gain * threshold


def make_example(directory: str) -> dict[str, str]:
    """Write the example volume and weights into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    raw, labels = make_volume()
    vol = os.path.join(directory, "volume.h5")
    with h5py.File(vol, "w") as f:
        f.create_dataset("raw", data=raw, chunks=(16, 32, 32))
        f.create_dataset("labels", data=labels, chunks=(16, 32, 32))
    net = cct.Net(str(repo_root() / MODEL), cct.TEST)
    tiny3d_weights(net)
    weights = os.path.join(directory, "tiny3d.caffemodel")
    net.save(weights)
    return {"volume": vol, "weights": weights, "model": str(repo_root() / MODEL)}


def main(argv: list[str] | None = None) -> int:
    """``python -m cct.infer.example DIR``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m cct.infer.example DIR", file=sys.stderr)
        return 1
    paths = make_example(argv[0])
    print(f"wrote {paths['volume']} (datasets raw, labels) and {paths['weights']}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
