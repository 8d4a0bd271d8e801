"""InnerProduct layers at the end of a net as the equivalent convolutions (Caffe's ``net_surgery`` example).

An InnerProduct (``axis: 1``) on a blob ``(N, C, *window)`` computes, for each of its ``num_output``
outputs, the dot product of its weight row with the ``C * prod(window)`` inputs in C order: exactly a
convolution whose kernel is the whole ``window`` (weights reshaped to ``(num_output, C, *window)``, the
same bias), which slides over a larger input. An InnerProduct after such a layer (input ``(N, K)``, now
``(N, K, 1, ..., 1)``) becomes a ``1 x ... x 1`` convolution. :func:`convert_inner_products` rebuilds
the net that way, with the trained weights, so dense inference can run it; the layers converted are
named in the plan.
"""
from __future__ import annotations

import numpy as np

from ..errors import CctError
from ..proto import caffe_pb2


def convert_inner_products(net) -> tuple[object, list[str]]:
    """``(net', notes)``: ``net`` with each InnerProduct over channels and space (or over a converted
    InnerProduct's output) replaced by the equivalent convolution and its weights; ``notes`` says which
    layers were converted and to what kernel. A net without InnerProduct comes back unchanged."""
    layers = list(net.param.layer)
    if not any(lp.type == "InnerProduct" for lp in layers):
        return net, []
    nd = len(net.blobs[net.input_blob_names[0]].shape) - 2 if net.input_blob_names else 0
    param = caffe_pb2.NetParameter()
    param.CopyFrom(net.param)
    del param.layer[:]
    kernels: dict[str, tuple[int, ...]] = {}
    transposed: set[str] = set()
    notes: list[str] = []
    for i, lp in enumerate(layers):
        new = param.layer.add()
        new.CopyFrom(lp)
        if lp.type != "InnerProduct" or nd < 1:
            continue
        ip = lp.inner_product_param
        shape = tuple(net.bottom_vecs[i][0].shape)
        if ip.axis != 1:
            continue  # analyze() names the layer: an InnerProduct over some other axis stays as it is
        if len(shape) == 2 + nd:
            kernel = shape[2:]
        elif len(shape) == 2:
            kernel = (1,) * nd
        else:
            continue
        new.type = "Convolution"
        new.ClearField("inner_product_param")
        cp = new.convolution_param
        cp.num_output = ip.num_output
        cp.bias_term = ip.bias_term
        cp.kernel_size.extend(kernel)
        if ip.HasField("weight_filler"):
            cp.weight_filler.CopyFrom(ip.weight_filler)
        if ip.HasField("bias_filler"):
            cp.bias_filler.CopyFrom(ip.bias_filler)
        kernels[lp.name] = kernel
        if ip.transpose:  # weights stored (inputs, num_output)
            transposed.add(lp.name)
        notes.append(f"InnerProduct '{lp.name}' converted to the equivalent {'x'.join(map(str, kernel))} "
                     f"convolution (Caffe's net_surgery)")
    if not kernels:
        return net, []
    out = type(net)(param, caffe_pb2.TEST, dtype=net.dtype, config=net.config)
    for name, blobs in net.params.items():
        target = out.params.get(name)
        if target is None or len(target) != len(blobs):
            raise CctError(f"internal: layer '{name}' lost its parameters in the InnerProduct conversion")
        for j, (src, dst) in enumerate(zip(blobs, target)):
            data = src.data
            if name in transposed and j == 0:
                data = np.ascontiguousarray(data.T)
            if data.size != int(np.prod(dst.shape)):
                raise CctError(f"layer '{name}': {data.size} weights do not fit the convolution of shape "
                               f"{list(dst.shape)}")
            dst.data[...] = data.reshape(dst.shape)
    return out, notes
