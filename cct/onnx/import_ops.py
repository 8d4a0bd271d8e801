"""ONNX op handlers for the import: each node (or a short fused chain) becomes one BVLC layer.

A handler gets the :class:`~cct.onnx.import_state.ImportState`, the node's index and the node; it appends
the layer(s) or raises ``imp.fail(node, why)``. :data:`OP_HANDLERS` maps op type -> handler; the
exporter's multi-node forms are added on top by :mod:`cct.onnx.import_patterns`.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..proto import caffe_pb2
from .import_state import ImportState

_POOL = caffe_pb2.PoolingParameter

Handler = Callable[[ImportState, int, object], None]


def _spatial_pads(imp: ImportState, node, nd: int) -> tuple[list[int], list[int]]:
    pads = list(imp.attr(node, "pads", [0] * (2 * nd)))
    if imp.attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise imp.fail(node, "auto_pad (write explicit pads)")
    return pads[:nd], pads[nd:]


def _folded_pad(imp: ImportState, node) -> tuple[str, list[int] | None]:
    """The input of ``node`` with a preceding constant-zero spatial Pad folded: (input, pads begin) or (input, None)."""
    src = node.input[0]
    producer = imp.producer(src)
    if producer is None or producer.op_type != "Pad" or node.op_type not in ("Conv", "AveragePool") \
            or imp.only_consumer(src) is not node:
        return src, None
    mode = imp.attr(producer, "mode", b"constant")
    pads = imp.const(producer.input[1]) if len(producer.input) > 1 else None
    value = imp.scalar(producer, producer.input[2]) if len(producer.input) > 2 and producer.input[2] else 0.0
    if mode not in (b"constant", "constant") or pads is None or value != 0 or (len(producer.input) > 3 and
                                                                              producer.input[3]):
        return src, None
    pads = [int(p) for p in pads]
    r = len(pads) // 2
    begin, end = pads[:r], pads[r:]
    if begin[:2] != [0, 0] or end[:2] != [0, 0] or begin[2:] != end[2:] or min(pads) < 0:
        return src, None
    return producer.input[0], begin[2:]


def _pad(imp: ImportState, i: int, node) -> None:
    user = imp.only_consumer(node.output[0])
    if user is None or _folded_pad(imp, user)[1] is None:
        raise imp.fail(node, "only a constant-zero spatial Pad feeding one Conv or AveragePool maps (folded into "
                             "its pad)")


def _conv(imp: ImportState, i: int, node) -> None:
    w = imp.const(node.input[1])
    if w is None:
        raise imp.fail(node, "weights are not a constant")
    nd = w.ndim - 2
    src, folded = _folded_pad(imp, node)
    begin, end = _spatial_pads(imp, node, nd)
    if begin != end:
        raise imp.fail(node, f"asymmetric pads {begin + end} (Caffe pads both sides alike)")
    if folded is not None:
        begin = [a + b for a, b in zip(begin, folded)]
    bias = imp.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    transposed = node.op_type == "ConvTranspose"
    if transposed and (any(imp.attr(node, "output_padding", [])) or imp.attr(node, "output_shape")):
        raise imp.fail(node, "output_padding/output_shape (Caffe's Deconvolution output size has no such term)")
    group = int(imp.attr(node, "group", 1))
    lp = imp.layer(node, "Deconvolution" if transposed else "Convolution", [imp.blob(node, src)],
                   blobs=[w] + ([bias] if bias is not None else []))
    p = lp.convolution_param
    p.num_output = w.shape[1] * group if transposed else w.shape[0]
    p.bias_term = bias is not None
    kernel = list(imp.attr(node, "kernel_shape", w.shape[2:]))
    _set_nd(p, kernel, [int(s) for s in imp.attr(node, "strides", [1] * nd)], begin)
    dil = [int(d) for d in imp.attr(node, "dilations", [1] * nd)]
    if any(d != 1 for d in dil):
        p.dilation.extend(dil if len(set(dil)) > 1 else dil[:1])
    if group != 1:
        p.group = group


def _set_nd(p, kernel: list[int], stride: list[int], pad: list[int]) -> None:
    if len(kernel) == 2:
        p.kernel_h, p.kernel_w = kernel
        if stride != [1, 1]:
            p.stride_h, p.stride_w = stride
        if pad != [0, 0]:
            p.pad_h, p.pad_w = pad
        return
    p.kernel_size.extend(kernel)
    if any(s != 1 for s in stride):
        p.stride.extend(stride)
    if any(pad):
        p.pad.extend(pad)


def _caffe_pooled(size: int, k: int, pad: int, stride: int, ceil: bool, padded: bool) -> int:
    """Caffe's pooled size on one axis; ``padded``: either axis is padded (Caffe then drops, on every axis,
    a last window that starts in the padding)."""
    span = size + 2 * pad - k
    out = (-(-span // stride) if ceil else span // stride) + 1
    if padded and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def _pool(imp: ImportState, i: int, node) -> None:
    op = node.op_type
    if op in ("GlobalAveragePool", "GlobalMaxPool"):
        lp = imp.layer(node, "Pooling", [imp.blob(node, node.input[0])])
        lp.pooling_param.pool = _POOL.MAX if op == "GlobalMaxPool" else _POOL.AVE
        lp.pooling_param.global_pooling = True
        return
    if len(node.output) > 1:
        raise imp.fail(node, "the Indices output (flat over the whole tensor) has no Caffe equivalent")
    kernel = [int(k) for k in imp.attr(node, "kernel_shape")]
    if len(kernel) != 2:
        raise imp.fail(node, f"{len(kernel)}-D pooling (Caffe's Pooling takes _h/_w or one size)")
    if any(d != 1 for d in imp.attr(node, "dilations", [1, 1])):
        raise imp.fail(node, "dilated pooling")
    stride = [int(s) for s in imp.attr(node, "strides", [1, 1])]
    src, folded = (_folded_pad(imp, node) if op == "AveragePool" else (node.input[0], None))
    begin, end = _spatial_pads(imp, node, 2)
    in_hw, out_hw = imp.shape(src)[2:], imp.shape(node.output[0])[2:]
    if len(in_hw) != 2 or None in in_hw or None in out_hw:
        raise imp.fail(node, "needs static spatial input and output sizes")
    if op == "AveragePool":
        include = bool(imp.attr(node, "count_include_pad", 0))
        if not include and begin == [0, 0]:
            # (zero Pad, then) pooling that does not count ONNX's end pads: Caffe's divisor, the window
            # clipped to [-pad, H + pad), exactly
            pad = folded if folded is not None else [0, 0]
        elif include and begin == end and folded is None and not imp.attr(node, "ceil_mode", 0):
            pad = begin  # every window lies inside [-pad, H + pad): divisor k*k, as Caffe's
        else:
            raise imp.fail(node, "this padding/count_include_pad combination has no exact Caffe AVE divisor")
    else:
        pad = begin
    if any(p >= k for p, k in zip(pad, kernel)):
        raise imp.fail(node, f"pad {pad} not smaller than the kernel {kernel}")
    lp = imp.layer(node, "Pooling", [imp.blob(node, src)])
    p = lp.pooling_param
    p.pool = _POOL.MAX if op == "MaxPool" else _POOL.AVE
    _set_nd(p, kernel, stride, pad)
    # MAX ignores padding and AVE's divisor is settled above: only the output size decides the rounding.
    padded = any(pad)

    def sizes(ceil: bool) -> list[int]:
        return [_caffe_pooled(h, k, q, s, ceil, padded) for h, k, q, s in zip(in_hw, kernel, pad, stride)]

    if sizes(True) == out_hw:
        return
    if sizes(False) == out_hw:
        p.round_mode = _POOL.FLOOR
        return
    raise imp.fail(node, f"output size {out_hw} is neither Caffe's ceil {sizes(True)} nor floor {sizes(False)} size")


def _gemm(imp: ImportState, i: int, node) -> None:
    w = imp.const(node.input[1])
    if w is None or imp.attr(node, "transA", 0) or imp.attr(node, "alpha", 1.0) != 1.0:
        raise imp.fail(node, "needs constant B, transA 0 and alpha 1")
    bias = imp.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if bias is not None and imp.attr(node, "beta", 1.0) != 1.0:
        raise imp.fail(node, "beta != 1")
    trans_b = bool(imp.attr(node, "transB", 0))
    n = w.shape[0] if trans_b else w.shape[1]
    if bias is not None and bias.size != n:
        raise imp.fail(node, f"bias C of shape {list(bias.shape)} is not one value per output")
    _inner_product(imp, node, node.input[0], w, None if bias is None else bias.reshape(n), not trans_b, 1, n)


def _inner_product(imp: ImportState, node, src: str, w, bias, transpose: bool, axis: int, n: int) -> None:
    lp = imp.layer(node, "InnerProduct", [imp.blob(node, src)], blobs=[w] + ([bias] if bias is not None else []))
    p = lp.inner_product_param
    p.num_output = n
    p.bias_term = bias is not None
    if transpose:
        p.transpose = True
    if axis != 1:
        p.axis = axis


def _transposed_const(imp: ImportState, v: str) -> np.ndarray | None:
    """The constant 2-D ``W`` when ``v`` is ``Transpose(W)`` (perm [1, 0]), else None."""
    t = imp.producer(v)
    if t is None or t.op_type != "Transpose" or list(imp.attr(t, "perm", [1, 0])) != [1, 0]:
        return None
    w = imp.const(t.input[0])
    return w if w is not None and w.ndim == 2 else None


def _transpose(imp: ImportState, i: int, node) -> None:
    user = imp.only_consumer(node.output[0])
    if user is None or user.op_type != "MatMul" or user.input[1] != node.output[0] or \
            _transposed_const(imp, node.output[0]) is None:
        raise imp.fail(node, "no BVLC Caffe layer permutes axes (only a transposed constant MatMul weight maps)")


def _matmul(imp: ImportState, i: int, node) -> None:
    stored = _transposed_const(imp, node.input[1])  # InnerProduct's own (N, K) layout
    w = imp.const(node.input[1]) if stored is None else stored.T
    rank = len(imp.shape(node.input[0]))
    if w is None or w.ndim != 2 or rank < 2:
        raise imp.fail(node, "only X @ W with a constant 2-D W maps onto InnerProduct")
    out = node.output[0]
    add = imp.only_consumer(out)
    bias = None
    if add is not None and add.op_type == "Add":
        other = add.input[1] if add.input[0] == out else add.input[0]
        c = imp.const(other)
        if c is not None and c.size == w.shape[1] and c.ndim == 1:
            bias = c
            imp.mark(add)
            node = renamed_node(imp, node, add.output[0])
    transpose = stored is None
    _inner_product(imp, node, node.input[0], w if transpose else stored, bias, transpose, rank - 1, w.shape[1])


def renamed_node(imp: ImportState, node, output: str):
    """A copy of ``node`` whose output is ``output`` (a fused pattern ends at the last node's output)."""
    copy = imp.onnx.NodeProto()
    copy.CopyFrom(node)
    copy.output[0] = output
    return copy


def _batchnorm(imp: ImportState, i: int, node) -> None:
    gamma, beta = (imp.const(v) for v in node.input[1:3])
    factor = np.ones(1, np.float32)
    if node.input[3] in imp.bn_stats:  # raw running sums divided by the factor (claimed up front)
        (mean, factor), (var, _) = imp.bn_stats[node.input[3]], imp.bn_stats[node.input[4]]
    else:
        mean, var = (imp.const(v) for v in node.input[3:5])
    if any(a is None for a in (gamma, beta, mean, var)) or (len(node.output) > 1 and any(node.output[1:])):
        raise imp.fail(node, "needs constant scale/bias/mean/var and inference mode (one output)")
    affine = not (np.all(gamma == 1) and np.all(beta == 0))
    bn_top = f"{node.output[0]}__bn" if affine else node.output[0]
    lp = imp.layer(node, "BatchNorm", [imp.blob(node, node.input[0])], [bn_top], blobs=[mean, var, factor])
    lp.batch_norm_param.use_global_stats = True
    lp.batch_norm_param.eps = float(imp.attr(node, "epsilon", 1e-5))
    if np.float32(lp.batch_norm_param.eps) != np.float32(imp.attr(node, "epsilon", 1e-5)):
        raise imp.fail(node, "epsilon does not survive Caffe's float field")
    if affine:
        sc = imp.layer(node, "Scale", [bn_top], [node.output[0]], blobs=[gamma, beta], name=f"{lp.name}_scale")
        sc.scale_param.bias_term = True


def broadcast_axis(imp: ImportState, node, x: str, c: np.ndarray) -> tuple[int, np.ndarray] | None:
    """Where constant ``c`` broadcasts over ``x`` as Caffe's Scale/Bias (axis, operand), or None."""
    xs = imp.shape(x)
    if not xs or c.ndim > len(xs):
        return None
    dims = list(c.shape)
    while dims and dims[-1] == 1:
        dims.pop()
    axis = len(xs) - c.ndim
    if not dims:
        return None
    if [d for d in xs[axis:axis + len(dims)]] != dims:
        return None
    return axis, c.reshape(dims)


def binary_op(imp: ImportState, i: int, node) -> None:
    """Add/Mul/Sub: of two equal-shaped blobs an Eltwise (a chain one n-ary Eltwise); with a constant a Power,
    Scale (+ bias) or Bias."""
    a, b = node.input[0], node.input[1]
    ca, cb = imp.const(a), imp.const(b)
    op = node.op_type
    if ca is None and cb is None:
        if imp.shape(a) != imp.shape(b):
            raise imp.fail(node, "broadcasting between two blobs (Caffe's Eltwise takes equal shapes)")
        bottoms, last = [imp.blob(node, a), imp.blob(node, b)], node
        while op in ("Add", "Mul"):  # a chain x1 * x2 * x3 (Caffe's n-ary Eltwise, exported pairwise)
            nxt = imp.only_consumer(last.output[0])
            if nxt is None or nxt.op_type != op or nxt.input[0] != last.output[0] or imp.const(nxt.input[1]) is not \
                    None or imp.shape(nxt.input[1]) != imp.shape(a):
                break
            bottoms.append(imp.blob(nxt, nxt.input[1]))
            imp.mark(nxt)
            last = nxt
        lp = imp.layer(renamed_node(imp, node, last.output[0]) if last is not node else node, "Eltwise", bottoms)
        lp.eltwise_param.operation = {"Add": 1, "Mul": 0, "Max": 2}[op] if op != "Sub" else 1
        if op == "Sub":
            lp.eltwise_param.coeff.extend([1.0, -1.0])
        return
    if op == "Sub" and cb is not None:  # x - c == x + (-c) exactly (negation is exact)
        _bias_or_shift(imp, node, a, -cb)
        return
    if op not in ("Add", "Mul"):
        raise imp.fail(node, "a constant operand maps onto Scale/Bias only for Mul, Add and x - c")
    x, c = (b, ca) if ca is not None else (a, cb)
    if c.size == 1:
        user = imp.only_consumer(node.output[0])
        if op == "Mul" and cb is not None and user is not None and user.op_type == "Sum":
            return  # an Eltwise coefficient: taken by _sum
        _power_chain(imp, node, x)
        return
    found = broadcast_axis(imp, node, x, c)
    if found is None:
        raise imp.fail(node, f"constant of shape {list(c.shape)} does not broadcast as Caffe's Scale/Bias")
    axis, operand = found
    if op == "Add":
        _bias_or_shift(imp, node, x, c)
        return
    blobs, out = [operand], node
    add = imp.only_consumer(node.output[0])
    if add is not None and add.op_type == "Add":
        other = add.input[1] if add.input[0] == node.output[0] else add.input[0]
        cb2 = imp.const(other)
        found2 = broadcast_axis(imp, add, node.output[0], cb2) if cb2 is not None and cb2.size > 1 else None
        if found2 is not None and found2[0] == axis and found2[1].shape == operand.shape:
            blobs.append(found2[1])
            imp.mark(add)
            out = renamed_node(imp, node, add.output[0])
    lp = imp.layer(out, "Scale", [imp.blob(node, x)], blobs=blobs)
    lp.scale_param.axis = axis
    lp.scale_param.num_axes = operand.ndim
    lp.scale_param.bias_term = len(blobs) == 2


def _bias_or_shift(imp: ImportState, node, x: str, c: np.ndarray) -> None:
    """x + constant c: a Power shift for a scalar, else a Bias broadcast as Caffe's."""
    if c.size == 1:
        _power(imp, node, x, shift=float(c.reshape(-1)[0]))
        return
    found = broadcast_axis(imp, node, x, c)
    if found is None:
        raise imp.fail(node, f"constant of shape {list(c.shape)} does not broadcast as Caffe's Bias")
    axis, operand = found
    lp = imp.layer(node, "Bias", [imp.blob(node, x)], blobs=[operand])
    lp.bias_param.axis = axis
    lp.bias_param.num_axes = operand.ndim


def _power(imp: ImportState, node, x: str, scale: float = 1.0, shift: float = 0.0, power: float = 1.0) -> None:
    lp = imp.layer(node, "Power", [imp.blob(node, x)])
    p = lp.power_param
    if any(np.float32(v) != v for v in (scale, shift, power)):
        raise imp.fail(node, "constant does not survive Caffe's float field")
    p.power, p.scale, p.shift = power, scale, shift


def _pow(imp: ImportState, i: int, node) -> None:
    if imp.scalar(node, node.input[1]) is None or imp.const(node.input[0]) is not None:
        raise imp.fail(node, "only a constant scalar exponent maps onto Power")
    _power_chain(imp, node, node.input[0])


def _power_chain(imp: ImportState, node, x: str) -> None:
    """Scalar Mul, then Add, then Pow (each optional, in Caffe's order): one Power layer."""
    terms = {"Mul": 1.0, "Add": 0.0, "Pow": 1.0}
    order = ["Mul", "Add", "Pow"]
    last, step = node, order.index(node.op_type)
    terms[node.op_type] = imp.scalar(node, node.input[1] if node.input[0] == x else node.input[0])
    while True:
        nxt = imp.only_consumer(last.output[0])
        if nxt is None or nxt.op_type not in order[step + 1:]:
            break
        if nxt.op_type == "Pow" and nxt.input[0] != last.output[0]:
            break
        other = nxt.input[1] if nxt.input[0] == last.output[0] else nxt.input[0]
        k = imp.scalar(nxt, other)
        if k is None:
            break
        terms[nxt.op_type] = k
        step = order.index(nxt.op_type)
        imp.mark(nxt)
        last = nxt
    out = renamed_node(imp, node, last.output[0]) if last is not node else node
    _power(imp, out, x, scale=terms["Mul"], shift=terms["Add"], power=terms["Pow"])


def _sum(imp: ImportState, i: int, node) -> None:
    bottoms, coeffs = [], []
    for v in node.input:
        prod = imp.producer(v)
        k = None
        if prod is not None and prod.op_type == "Mul" and imp.only_consumer(v) is node:
            k = imp.scalar(prod, prod.input[1])
        if k is not None and imp.const(prod.input[0]) is None:
            bottoms.append(imp.blob(node, prod.input[0]))
            coeffs.append(k)
        else:
            bottoms.append(imp.blob(node, v))
            coeffs.append(1.0)
    if len({tuple(imp.shape(v)) for v in node.input}) > 1:
        raise imp.fail(node, "broadcasting Sum (Caffe's Eltwise takes equal shapes)")
    lp = imp.layer(node, "Eltwise", bottoms)
    lp.eltwise_param.operation = caffe_pb2.EltwiseParameter.SUM
    if any(k != 1 for k in coeffs):
        lp.eltwise_param.coeff.extend(coeffs)


def _max(imp: ImportState, i: int, node) -> None:
    if len({tuple(imp.shape(v)) for v in node.input}) > 1:
        raise imp.fail(node, "broadcasting Max (Caffe's Eltwise takes equal shapes)")
    lp = imp.layer(node, "Eltwise", [imp.blob(node, v) for v in node.input])
    lp.eltwise_param.operation = caffe_pb2.EltwiseParameter.MAX


def _simple(type_: str, setup: Callable | None = None) -> Handler:
    def handle(imp: ImportState, i: int, node) -> None:
        lp = imp.layer(node, type_, [imp.blob(node, node.input[0])])
        if setup is not None:
            setup(imp, node, lp)

    return handle


def _leaky(imp, node, lp) -> None:
    lp.relu_param.negative_slope = float(imp.attr(node, "alpha", 0.01))


def _elu(imp, node, lp) -> None:
    lp.elu_param.alpha = float(imp.attr(node, "alpha", 1.0))


def _softmax(imp, node, lp) -> None:
    axis = int(imp.attr(node, "axis", -1 if imp.opset >= 13 else 1))
    rank = len(imp.shape(node.input[0]))
    if imp.opset < 13 and axis % rank != rank - 1:
        raise imp.fail(node, "Softmax before opset 13 normalises the flattened trailing axes together")
    lp.softmax_param.axis = axis % rank


def _lrn(imp, node, lp) -> None:
    p = lp.lrn_param
    p.local_size = int(imp.attr(node, "size"))
    p.alpha, p.beta, p.k = (float(imp.attr(node, n, d)) for n, d in (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))
    if p.local_size % 2 == 0:
        raise imp.fail(node, "even LRN size (Caffe's window is centred: odd sizes only)")


def _prelu(imp: ImportState, i: int, node) -> None:
    slope = imp.const(node.input[1])
    xs = imp.shape(node.input[0])
    if slope is None or len(xs) < 2:
        raise imp.fail(node, "needs a constant slope and a channel axis")
    flat = slope.reshape(-1)
    if slope.size == 1:
        lp = imp.layer(node, "PReLU", [imp.blob(node, node.input[0])], blobs=[flat])
        lp.prelu_param.channel_shared = True
        return
    if slope.size != xs[1] or list(slope.shape) != [xs[1]] + [1] * (slope.ndim - 1):
        raise imp.fail(node, f"slope of shape {list(slope.shape)} is not one per channel")
    imp.layer(node, "PReLU", [imp.blob(node, node.input[0])], blobs=[flat])


def _clip(imp: ImportState, i: int, node) -> None:
    lo = imp.scalar(node, node.input[1]) if len(node.input) > 1 and node.input[1] else None
    hi = imp.scalar(node, node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if lo is None or hi is None:
        raise imp.fail(node, "Caffe's Clip needs constant min and max")
    lp = imp.layer(node, "Clip", [imp.blob(node, node.input[0])])
    lp.clip_param.min, lp.clip_param.max = lo, hi


def _concat(imp: ImportState, i: int, node) -> None:
    lp = imp.layer(node, "Concat", [imp.blob(node, v) for v in node.input])
    lp.concat_param.axis = int(imp.attr(node, "axis")) % len(imp.shape(node.input[0]))


def _split(imp: ImportState, i: int, node) -> None:
    rank = len(imp.shape(node.input[0]))
    axis = int(imp.attr(node, "axis", 0)) % rank
    sizes = [imp.shape(o)[axis] for o in node.output]
    if None in sizes:
        raise imp.fail(node, "needs static split sizes")
    lp = imp.layer(node, "Slice", [imp.blob(node, node.input[0])], list(node.output))
    lp.slice_param.axis = axis
    lp.slice_param.slice_point.extend(np.cumsum(sizes)[:-1].tolist())


def reshape_op(imp: ImportState, i: int, node) -> None:
    """Reshape/Flatten/Squeeze/Unsqueeze: a Reshape or Flatten layer (or nothing where InnerProduct flattens)."""
    if len(node.input) > 1:
        shape = imp.const(node.input[1])
        if shape is None or imp.attr(node, "allowzero", 0):
            raise imp.fail(node, "needs a constant shape (and allowzero 0)")
        dims = [int(d) for d in shape]
        if _flattens_for_matmul(imp, node):
            return
    else:  # Flatten / Squeeze / Unsqueeze: the inferred output shape, batch copied
        out = imp.shape(node.output[0])
        if not out or any(d is None for d in out[1:]):
            raise imp.fail(node, "needs a static output shape")
        dims = [0] + [int(d) for d in out[1:]]
        if node.op_type == "Flatten" and int(imp.attr(node, "axis", 1)) == 1 and len(out) == 2:
            user = imp.only_consumer(node.output[0])
            if user is not None and user.op_type == "Gemm" and user.input[0] == node.output[0]:
                # InnerProduct (axis 1) flattens its bottom itself
                imp.alias[node.output[0]] = imp.blob(node, node.input[0])
                return
            imp.layer(node, "Flatten", [imp.blob(node, node.input[0])])
            return
        if node.op_type == "Flatten" and int(imp.attr(node, "axis", 1)) == 0:
            dims = [1, -1]
    lp = imp.layer(node, "Reshape", [imp.blob(node, node.input[0])])
    lp.reshape_param.shape.dim.extend(dims)


def _flattens_for_matmul(imp: ImportState, node) -> bool:
    """A Reshape that only merges the trailing axes for a MatMul with constant weights: InnerProduct (axis
    = the kept leading axes) flattens those itself, so the Reshape is dropped."""
    user = imp.only_consumer(node.output[0])
    src, out = imp.shape(node.input[0]), imp.shape(node.output[0])
    if user is None or user.op_type != "MatMul" or user.input[0] != node.output[0] or \
            (imp.const(user.input[1]) is None and _transposed_const(imp, user.input[1]) is None):
        return False
    if not src or not out or None in src[1:] or None in out[1:] or len(out) > len(src):
        return False
    keep = len(out) - 1
    if src[:keep] != out[:keep] or out[-1] != int(np.prod(src[keep:], dtype=np.int64)):
        return False
    imp.alias[node.output[0]] = imp.blob(node, node.input[0])
    return True


def _identity(imp: ImportState, i: int, node) -> None:
    value = imp.const(node.input[0])
    if value is not None:  # a constant as a blob: Caffe's Parameter layer (its blob, bits kept)
        if value.dtype != np.float32:
            raise imp.fail(node, f"a {value.dtype} constant as a blob (Caffe's Parameter blobs are float32)")
        lp = imp.layer(node, "Parameter", [], blobs=[value])
        lp.parameter_param.shape.dim.extend(value.shape)
        return
    imp.alias[node.output[0]] = imp.blob(node, node.input[0])


def _dropout(imp: ImportState, i: int, node) -> None:
    if len(node.output) > 1 and node.output[1]:
        raise imp.fail(node, "the mask output (training mode) has no Caffe TEST equivalent")
    _identity(imp, i, node)


def _tile(imp: ImportState, i: int, node) -> None:
    reps = imp.const(node.input[1])
    if reps is None or sum(int(r) != 1 for r in reps) > 1:
        raise imp.fail(node, "Caffe's Tile repeats along one axis (constant repeats)")
    axis = next((a for a, r in enumerate(reps) if int(r) != 1), 0)
    lp = imp.layer(node, "Tile", [imp.blob(node, node.input[0])])
    lp.tile_param.axis, lp.tile_param.tiles = axis, int(reps[axis])


def shape_op(imp: ImportState, i: int, node) -> None:
    """Shape feeding ConstantOfShape (converted there); any other use of a shape has no BVLC layer."""
    user = imp.only_consumer(node.output[0])
    if user is None or user.op_type != "ConstantOfShape" or len(node.attribute):
        raise imp.fail(node, "a blob's shape as a tensor has no BVLC layer (only Shape -> ConstantOfShape maps)")


def _constant_of_shape(imp: ImportState, i: int, node) -> None:
    src = imp.producer(node.input[0])
    if src is None or src.op_type != "Shape" or len(src.attribute):
        raise imp.fail(node, "only a constant shaped like a blob (Shape -> ConstantOfShape) maps onto Power")
    value = imp.attr(node, "value")
    v = np.float32(0) if value is None else imp.onnx.numpy_helper.to_array(value).reshape(-1)[0]
    if np.asarray(v).dtype != np.float32:
        raise imp.fail(node, "a non-float constant")
    _power(imp, node, src.input[0], scale=0.0, shift=float(v), power=1.0)  # Caffe: pow(shift, 1) everywhere


def _nearest_source(i: np.ndarray, scale: int, mode: str, nearest: str) -> np.ndarray | None:
    """ONNX Resize's source index of output index ``i`` for an integer ``scale`` (None: a mode not handled)."""
    if mode == "asymmetric":
        x = i / scale
    elif mode in ("half_pixel", "pytorch_half_pixel"):
        x = (i + 0.5) / scale - 0.5
    else:
        return None
    if nearest == "floor":
        return np.floor(x)
    if nearest == "ceil":
        return np.ceil(x)
    frac = x - np.floor(x)
    tie_up = nearest == "round_prefer_ceil"
    return np.where(frac > 0.5, np.ceil(x), np.where(frac < 0.5, np.floor(x), np.ceil(x) if tie_up else np.floor(x)))


def _resize(imp: ImportState, i: int, node) -> None:
    """Nearest upsampling by integer factors that copies each pixel into a block: a grouped Deconvolution
    with an all-ones kernel of that size and stride (no overlap, so every output is exactly one input)."""
    xs, out = imp.shape(node.input[0]), imp.shape(node.output[0])
    mode = imp.attr(node, "mode", b"nearest")
    if mode not in (b"nearest", "nearest") or len(xs) != 4 or None in xs[1:] or not out or None in out[1:]:
        raise imp.fail(node, "only nearest resizing of a 4-D blob with static sizes maps (as a Deconvolution)")
    if out[:2] != xs[:2] and out[1] != xs[1]:
        raise imp.fail(node, "resizing the batch or channel axis")
    factors = [out[a] // xs[a] for a in (2, 3)]
    if any(f < 1 or out[a] != f * xs[a] for f, a in zip(factors, (2, 3))):
        raise imp.fail(node, f"output {out[2:]} is not an integer multiple of the input {xs[2:]}")
    ctm = imp.attr(node, "coordinate_transformation_mode", b"half_pixel")
    nearest = imp.attr(node, "nearest_mode", b"round_prefer_floor")
    ctm, nearest = (v.decode() if isinstance(v, bytes) else v for v in (ctm, nearest))
    for f, n in zip(factors, xs[2:]):
        idx = np.arange(f * n)
        src = _nearest_source(idx, f, ctm, nearest)
        if src is None or not np.array_equal(np.clip(src, 0, n - 1), idx // f):
            raise imp.fail(node, f"nearest resizing with coordinate_transformation_mode {ctm} and nearest_mode "
                                 f"{nearest} does not copy each pixel into a {f}x block")
    channels = xs[1]
    lp = imp.layer(node, "Deconvolution", [imp.blob(node, node.input[0])],
                   blobs=[np.ones((channels, 1, factors[0], factors[1]), np.float32)])
    p = lp.convolution_param
    p.num_output, p.group, p.bias_term = channels, channels, False
    _set_nd(p, factors, factors, [0, 0])


OP_HANDLERS: dict[str, Handler] = {
    "Conv": _conv, "ConvTranspose": _conv, "MaxPool": _pool, "AveragePool": _pool, "GlobalMaxPool": _pool,
    "GlobalAveragePool": _pool, "Gemm": _gemm, "MatMul": _matmul, "BatchNormalization": _batchnorm,
    "Add": binary_op, "Mul": binary_op, "Sub": binary_op, "Sum": _sum, "Max": _max, "Pow": _pow,
    "Relu": _simple("ReLU"), "LeakyRelu": _simple("ReLU", _leaky), "PRelu": _prelu, "Elu": _simple("ELU", _elu),
    "Sigmoid": _simple("Sigmoid"), "Tanh": _simple("TanH"), "Abs": _simple("AbsVal"), "Softplus": _simple("BNLL"),
    "Exp": _simple("Exp"), "Log": _simple("Log"), "Clip": _clip, "Softmax": _simple("Softmax", _softmax),
    "LRN": _simple("LRN", _lrn), "Concat": _concat, "Split": _split, "Reshape": reshape_op, "Flatten": reshape_op,
    "Squeeze": reshape_op, "Unsqueeze": reshape_op, "Identity": _identity, "Dropout": _dropout, "Tile": _tile,
    "Pad": _pad, "Transpose": _transpose, "Shape": shape_op, "ConstantOfShape": _constant_of_shape,
    "Resize": _resize,
}
