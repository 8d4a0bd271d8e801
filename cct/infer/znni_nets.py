"""The four benchmark ConvNets of ZNNi (Table III) as Caffe prototxts, full size or reduced for tests.

Each is a chain of convolutions (stride 1, no padding, ReLU after each but the last) and pooling layers
of window 2 (stride 2); the last convolution has 3 outputs followed by a Sigmoid (``prob``), as a
boundary/affinity detector would. Layer pattern per net (C = convolution of the given kernel, P = pool):

* n337: C2 P C3 P C3 P C3 C3 C3 C3 (field of view 85)
* n537: C4 P C5 P C5 P C5 C5 C5 C5 (163)
* n726: C6 P C7 P C7 C7 C7 C7 (117)
* n926: C8 P C9 P C9 C9 C9 C9 (155)
"""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import CctError

LAYOUTS: dict[str, tuple[int | str, ...]] = {
    "n337": (2, "P", 3, "P", 3, "P", 3, 3, 3, 3),
    "n537": (4, "P", 5, "P", 5, "P", 5, 5, 5, 5),
    "n726": (6, "P", 7, "P", 7, 7, 7, 7),
    "n926": (8, "P", 9, "P", 9, 9, 9, 9),
}


def znni_prototxt(name: str, fmaps: int = 80, nd: int = 3, input_size: int | None = None, pool: str = "MAX",
                  kernels: Sequence[int] | None = None, outputs: int = 3, channels: int = 1) -> str:
    """The prototxt text of ZNNi net ``name`` with ``fmaps`` feature maps, ``nd`` spatial axes, ``pool``
    (MAX or AVE); ``kernels`` replaces the convolution kernels (reduced test nets); ``input_size`` defaults
    to the field of view (one output voxel)."""
    if name not in LAYOUTS:
        raise CctError(f"unknown ZNNi net '{name}' (use {', '.join(LAYOUTS)})")
    layout = list(LAYOUTS[name])
    if kernels is not None:
        it = iter(kernels)
        layout = [x if x == "P" else next(it) for x in layout]
    fov = 1
    for x in reversed(layout):
        fov = fov * 2 if x == "P" else fov + int(x) - 1
    size = input_size or fov
    dims = "".join(f" dim: {d}" for d in [1, channels] + [size] * nd)
    lines = [f'name: "{name}"',
             'layer { name: "data" type: "Input" top: "data" input_param { shape {' + dims + " } } }"]
    bottom, nconv, npool = "data", 0, 0
    convs = sum(1 for x in layout if x != "P")
    for x in layout:
        if x == "P":
            npool += 1
            top = f"pool{npool}"
            lines.append(f'layer {{ name: "{top}" type: "Pooling" bottom: "{bottom}" top: "{top}" '
                         f"pooling_param {{ pool: {pool} kernel_size: 2 stride: 2 }} }}")
            bottom = top
            continue
        nconv += 1
        top = f"conv{nconv}"
        last = nconv == convs
        lines.append(f'layer {{ name: "{top}" type: "Convolution" bottom: "{bottom}" top: "{top}" '
                     f"convolution_param {{ num_output: {outputs if last else fmaps} kernel_size: {x} "
                     'weight_filler { type: "msra" } bias_filler { type: "constant" value: 0.01 } } }')
        if not last:
            lines.append(f'layer {{ name: "relu{nconv}" type: "ReLU" bottom: "{top}" top: "{top}" }}')
        bottom = top
    lines.append(f'layer {{ name: "prob" type: "Sigmoid" bottom: "{bottom}" top: "prob" }}')
    return "\n".join(lines) + "\n"
