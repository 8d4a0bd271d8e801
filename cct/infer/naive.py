"""The naive sliding window: the net applied once per window position (the definition dense inference must equal).

Windows of the field-of-view size are cut from the volume and run through the plain net in batches of
``batch`` windows; each gives one output voxel. This is the baseline of ZNNi's speedups and the
reference of the tests.
"""
from __future__ import annotations

import itertools

import numpy as np

from ..errors import CctError
from .geometry import NetGeometry


def naive_dense(net, geom: NetGeometry, volume: np.ndarray, blob: str | None = None, batch: int = 64) -> np.ndarray:
    """Output ``(C_out, *(n - fov + 1))`` of ``net`` applied at every window position of ``volume`` ``(C, *n)``."""
    fov = geom.field_of_view
    spatial = volume.shape[1:]
    if len(spatial) != geom.num_spatial:
        raise CctError(f"volume of shape {list(volume.shape)} for a net with {geom.num_spatial} spatial axes")
    out_shape = tuple(n - f + 1 for n, f in zip(spatial, fov))
    if min(out_shape) < 1:
        raise CctError(f"volume {list(spatial)} is smaller than the field of view {list(fov)}")
    blob = blob or geom.output_blob
    inp = net.blobs[geom.input_blob]
    positions = list(itertools.product(*(range(o) for o in out_shape)))
    out = None
    for first in range(0, len(positions), batch):
        chunk = positions[first:first + batch]
        inp.reshape((len(chunk), volume.shape[0]) + fov)
        for j, pos in enumerate(chunk):
            inp.data[j] = volume[(slice(None),) + tuple(slice(p, p + f) for p, f in zip(pos, fov))]
        net.forward()
        res = net.blobs[blob].data
        if tuple(res.shape[2:]) != (1,) * len(fov):
            raise CctError(f"blob '{blob}' of shape {list(res.shape)} for one window; expected one voxel")
        if out is None:
            out = np.empty((res.shape[1],) + out_shape, dtype=res.dtype)
        for j, pos in enumerate(chunk):
            out[(slice(None),) + pos] = res[j].reshape(-1)
    return out
