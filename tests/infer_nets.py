"""Small random ZNNi-shaped nets for the dense-inference tests."""
from __future__ import annotations

import numpy as np
from google.protobuf import text_format

import cct
from cct.config import Config
from cct.infer.znni_nets import znni_prototxt
from cct.proto import caffe_pb2

TXT2 = znni_prototxt("n726", fmaps=3, nd=2, kernels=[2, 2, 1, 1, 2, 1])  # field of view 11, stride 4
TXT3 = znni_prototxt("n726", fmaps=2, nd=3, kernels=[2, 1, 1, 1, 2, 1])  # field of view 9, stride 4


def random_net(txt: str, dtype=np.float64, seed: int = 0, config: Config | None = None) -> cct.Net:
    """The TEST net of prototxt text ``txt`` with standard-normal weights scaled by 0.5 (built under ``config``)."""
    net = cct.Net(text_format.Parse(txt, caffe_pb2.NetParameter()), cct.TEST, dtype=dtype, config=config)
    rng = np.random.default_rng(seed)
    for blobs in net.params.values():
        for b in blobs:
            b.data[...] = rng.standard_normal(b.shape) * 0.5
    return net
