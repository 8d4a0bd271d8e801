"""Import an ONNX model as a Caffe net (prototxt) and weights (caffemodel) where BVLC layers express it exactly.

Each ONNX node becomes one BVLC layer (or a few nodes one layer: Pad folded into Conv/AveragePool,
MatMul + Add into InnerProduct, Mul + Add into Scale with bias, Mul-by-constant inputs of Sum into
Eltwise coefficients). Weights are copied bit for bit. A node no BVLC layer computes exactly stops
the import with a :class:`~cct.errors.CctError` naming the node and op. :data:`IMPORTABLE_OPS` lists
the ONNX ops handled.
"""
from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from ..errors import CctError
from ..io.atomic import atomic_write_bytes
from ..io.blobproto import array_to_blobproto
from ..io.prototxt import to_text
from ..proto import caffe_pb2
from .graph import require

_POOL = caffe_pb2.PoolingParameter
_RED = caffe_pb2.ReductionParameter


class OnnxImportError(CctError):
    """An ONNX node (or model) that no BVLC Caffe layer expresses exactly."""


class _Importer:
    """One import: the ONNX graph, its constants and shapes, and the NetParameter being built."""

    def __init__(self, model):
        self.onnx = require("onnx")
        from onnx import numpy_helper, shape_inference

        try:
            self.onnx.checker.check_model(model)
            model = shape_inference.infer_shapes(model, strict_mode=True)
        except Exception as e:  # onnx raises several checker/inference error types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise OnnxImportError(f"the ONNX model is not valid: {first}") from None
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        self.graph = model.graph
        self.consts: dict[str, np.ndarray] = {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}
        self.shapes: dict[str, list[int | None]] = {}
        for vi in list(self.graph.input) + list(self.graph.value_info) + list(self.graph.output):
            if vi.type.tensor_type.HasField("shape"):
                self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None
                                        for d in vi.type.tensor_type.shape.dim]
        self.consumers: dict[str, list] = {}
        for node in self.graph.node:
            for v in dict.fromkeys(node.input):  # a node reading a value twice (x * x) is one consumer
                self.consumers.setdefault(v, []).append(node)
        self.graph_outputs = {o.name for o in self.graph.output}
        self.net = caffe_pb2.NetParameter(name=self.graph.name)
        self.weights = caffe_pb2.NetParameter(name=self.graph.name)
        self.alias: dict[str, str] = {}
        self.done: set[int] = set()
        self.layer_names: set[str] = set()
        # value -> (blob, axis, layer name): bottom[1] of a two-bottom Scale/Bias, reshaped for ONNX's broadcast
        self.operands: dict[str, tuple[str, int, str]] = {}
        # value -> (raw blob, moving-average factor): BatchNorm statistics the exporter divides explicitly
        self.bn_stats: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def producer(self, v: str):
        return next((n for n in self.graph.node if v in n.output), None)

    # -- helpers --------------------------------------------------------------------------------------
    def fail(self, node, why: str) -> OnnxImportError:
        if node.doc_string.startswith("unrolled "):  # cct's export of a recurrent layer, step by step
            why += f" (part of an {node.doc_string}: recurrent layers unrolled into ONNX nodes are not imported)"
        return OnnxImportError(f"ONNX node '{node.name or node.output[0]}' (op {node.op_type}): {why}")

    def const(self, v: str):
        return self.consts.get(v) if v else None

    def blob(self, node, v: str) -> str:
        if v in self.consts:
            raise self.fail(node, f"input '{v}' is a constant where BVLC layers take a blob")
        return self.alias.get(v, v)

    def only_consumer(self, v: str):
        users = self.consumers.get(v, [])
        return users[0] if len(users) == 1 and v not in self.graph_outputs else None

    def shape(self, v: str) -> list[int | None]:
        return self.shapes.get(v, [])

    def attr(self, node, name: str, default=None):
        for a in node.attribute:
            if a.name == name:
                return self.onnx.helper.get_attribute_value(a)
        return default

    def layer(self, node, type_: str, bottoms: list[str], tops: list[str] | None = None,
              blobs: list[np.ndarray] = (), name: str | None = None) -> caffe_pb2.LayerParameter:
        name = name or node.name or node.output[0]
        base, k = name, 1
        while name in self.layer_names:
            name, k = f"{base}_{k}", k + 1
        self.layer_names.add(name)
        lp = self.net.layer.add(name=name, type=type_)
        lp.bottom.extend(bottoms)
        lp.top.extend(tops if tops is not None else [node.output[0]])
        if blobs:
            wl = self.weights.layer.add(name=name, type=type_)
            for b in blobs:
                wl.blobs.append(array_to_blobproto(np.asarray(b, dtype=np.float32)))
        return lp

    def scalar(self, node, v: str) -> float | None:
        c = self.const(v)
        return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None

    # -- the walk ---------------------------------------------------------------------------------------
    def run(self) -> tuple[caffe_pb2.NetParameter, caffe_pb2.NetParameter]:
        _claim_batchnorm_stats(self)
        for vi in self.graph.input:
            if vi.name in self.consts:
                continue
            if vi.type.tensor_type.elem_type != self.onnx.TensorProto.FLOAT:
                raise OnnxImportError(f"graph input '{vi.name}' is not float32 (Caffe blobs are float)")
            dims = self.shape(vi.name)
            if not dims:
                raise OnnxImportError(f"graph input '{vi.name}' has no static rank")
            lp = self.net.layer.add(name=vi.name, type="Input")
            self.layer_names.add(vi.name)
            lp.top.append(vi.name)
            lp.input_param.shape.add().dim.extend([d if d else 1 for d in dims])  # symbolic batch -> 1
        for i, node in enumerate(self.graph.node):
            if i in self.done:
                continue
            if node.domain not in ("", "ai.onnx"):
                raise self.fail(node, f"custom domain '{node.domain}' has no BVLC layer")
            if node.op_type == "Constant":
                self.consts[node.output[0]] = self.onnx.numpy_helper.to_array(self.attr(node, "value"))
                continue
            handler = HANDLERS.get(node.op_type)
            if handler is None:
                raise self.fail(node, "no BVLC Caffe layer computes this op")
            handler(self, i, node)
        for out in self.graph.output:
            if self.alias.get(out.name, out.name) != out.name:
                # an output that is an alias of another blob (Identity): copy it under its own name
                self.layer(self.onnx.helper.make_node("Identity", [], [out.name], name=f"{out.name}_split"),
                           "Split", [self.alias[out.name]], [out.name])
        return self.net, self.weights

    def mark(self, node) -> None:
        self.done.add(next(i for i, n in enumerate(self.graph.node) if n is node))

    def users(self, v: str) -> list:
        """The nodes reading ``v`` (none when it is also a graph output: then it must stay a blob)."""
        return [] if v in self.graph_outputs else self.consumers.get(v, [])

    def ints(self, v: str) -> list[int] | None:
        """A constant integer tensor as a list (None when not a constant)."""
        c = self.const(v)
        return None if c is None or c.dtype.kind not in "iu" else [int(x) for x in c.reshape(-1)]


Handler = Callable[[_Importer, int, object], None]


def _spatial_pads(imp: _Importer, node, nd: int) -> tuple[list[int], list[int]]:
    pads = list(imp.attr(node, "pads", [0] * (2 * nd)))
    if imp.attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        raise imp.fail(node, "auto_pad (write explicit pads)")
    return pads[:nd], pads[nd:]


def _folded_pad(imp: _Importer, node) -> tuple[str, list[int] | None]:
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


def _pad(imp: _Importer, i: int, node) -> None:
    user = imp.only_consumer(node.output[0])
    if user is None or _folded_pad(imp, user)[1] is None:
        raise imp.fail(node, "only a constant-zero spatial Pad feeding one Conv or AveragePool maps (folded into "
                             "its pad)")


def _conv(imp: _Importer, i: int, node) -> None:
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


def _pool(imp: _Importer, i: int, node) -> None:
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


def _gemm(imp: _Importer, i: int, node) -> None:
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


def _inner_product(imp: _Importer, node, src: str, w, bias, transpose: bool, axis: int, n: int) -> None:
    lp = imp.layer(node, "InnerProduct", [imp.blob(node, src)], blobs=[w] + ([bias] if bias is not None else []))
    p = lp.inner_product_param
    p.num_output = n
    p.bias_term = bias is not None
    if transpose:
        p.transpose = True
    if axis != 1:
        p.axis = axis


def _transposed_const(imp: _Importer, v: str) -> np.ndarray | None:
    """The constant 2-D ``W`` when ``v`` is ``Transpose(W)`` (perm [1, 0]), else None."""
    t = imp.producer(v)
    if t is None or t.op_type != "Transpose" or list(imp.attr(t, "perm", [1, 0])) != [1, 0]:
        return None
    w = imp.const(t.input[0])
    return w if w is not None and w.ndim == 2 else None


def _transpose(imp: _Importer, i: int, node) -> None:
    user = imp.only_consumer(node.output[0])
    if user is None or user.op_type != "MatMul" or user.input[1] != node.output[0] or \
            _transposed_const(imp, node.output[0]) is None:
        raise imp.fail(node, "no BVLC Caffe layer permutes axes (only a transposed constant MatMul weight maps)")


def _matmul(imp: _Importer, i: int, node) -> None:
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
            node = _renamed(imp, node, add.output[0])
    transpose = stored is None
    _inner_product(imp, node, node.input[0], w if transpose else stored, bias, transpose, rank - 1, w.shape[1])


def _renamed(imp: _Importer, node, output: str):
    """A copy of ``node`` whose output is ``output`` (a fused pattern ends at the last node's output)."""
    copy = imp.onnx.NodeProto()
    copy.CopyFrom(node)
    copy.output[0] = output
    return copy


def _batchnorm(imp: _Importer, i: int, node) -> None:
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


def _broadcast_axis(imp: _Importer, node, x: str, c: np.ndarray) -> tuple[int, np.ndarray] | None:
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


def _binary(imp: _Importer, i: int, node) -> None:
    a, b = node.input[0], node.input[1]
    ca, cb = imp.const(a), imp.const(b)
    op = node.op_type
    if b in imp.operands:
        _two_bottom(imp, node)
        return
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
        lp = imp.layer(_renamed(imp, node, last.output[0]) if last is not node else node, "Eltwise", bottoms)
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
    found = _broadcast_axis(imp, node, x, c)
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
        found2 = _broadcast_axis(imp, add, node.output[0], cb2) if cb2 is not None and cb2.size > 1 else None
        if found2 is not None and found2[0] == axis and found2[1].shape == operand.shape:
            blobs.append(found2[1])
            imp.mark(add)
            out = _renamed(imp, node, add.output[0])
    lp = imp.layer(out, "Scale", [imp.blob(node, x)], blobs=blobs)
    lp.scale_param.axis = axis
    lp.scale_param.num_axes = operand.ndim
    lp.scale_param.bias_term = len(blobs) == 2


def _bias_or_shift(imp: _Importer, node, x: str, c: np.ndarray) -> None:
    """x + constant c: a Power shift for a scalar, else a Bias broadcast as Caffe's."""
    if c.size == 1:
        _power(imp, node, x, shift=float(c.reshape(-1)[0]))
        return
    found = _broadcast_axis(imp, node, x, c)
    if found is None:
        raise imp.fail(node, f"constant of shape {list(c.shape)} does not broadcast as Caffe's Bias")
    axis, operand = found
    lp = imp.layer(node, "Bias", [imp.blob(node, x)], blobs=[operand])
    lp.bias_param.axis = axis
    lp.bias_param.num_axes = operand.ndim


def _power(imp: _Importer, node, x: str, scale: float = 1.0, shift: float = 0.0, power: float = 1.0) -> None:
    lp = imp.layer(node, "Power", [imp.blob(node, x)])
    p = lp.power_param
    if any(np.float32(v) != v for v in (scale, shift, power)):
        raise imp.fail(node, "constant does not survive Caffe's float field")
    p.power, p.scale, p.shift = power, scale, shift


def _pow(imp: _Importer, i: int, node) -> None:
    if imp.scalar(node, node.input[1]) is None or imp.const(node.input[0]) is not None:
        raise imp.fail(node, "only a constant scalar exponent maps onto Power")
    _power_chain(imp, node, node.input[0])


def _power_chain(imp: _Importer, node, x: str) -> None:
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
    out = _renamed(imp, node, last.output[0]) if last is not node else node
    _power(imp, out, x, scale=terms["Mul"], shift=terms["Add"], power=terms["Pow"])


def _sum(imp: _Importer, i: int, node) -> None:
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


def _max(imp: _Importer, i: int, node) -> None:
    if len({tuple(imp.shape(v)) for v in node.input}) > 1:
        raise imp.fail(node, "broadcasting Max (Caffe's Eltwise takes equal shapes)")
    lp = imp.layer(node, "Eltwise", [imp.blob(node, v) for v in node.input])
    lp.eltwise_param.operation = caffe_pb2.EltwiseParameter.MAX


def _simple(type_: str, setup: Callable | None = None) -> Handler:
    def handle(imp: _Importer, i: int, node) -> None:
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


def _prelu(imp: _Importer, i: int, node) -> None:
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


def _clip(imp: _Importer, i: int, node) -> None:
    lo = imp.scalar(node, node.input[1]) if len(node.input) > 1 and node.input[1] else None
    hi = imp.scalar(node, node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if lo is None or hi is None:
        raise imp.fail(node, "Caffe's Clip needs constant min and max")
    lp = imp.layer(node, "Clip", [imp.blob(node, node.input[0])])
    lp.clip_param.min, lp.clip_param.max = lo, hi


def _concat(imp: _Importer, i: int, node) -> None:
    lp = imp.layer(node, "Concat", [imp.blob(node, v) for v in node.input])
    lp.concat_param.axis = int(imp.attr(node, "axis")) % len(imp.shape(node.input[0]))


def _split(imp: _Importer, i: int, node) -> None:
    rank = len(imp.shape(node.input[0]))
    axis = int(imp.attr(node, "axis", 0)) % rank
    sizes = [imp.shape(o)[axis] for o in node.output]
    if None in sizes:
        raise imp.fail(node, "needs static split sizes")
    lp = imp.layer(node, "Slice", [imp.blob(node, node.input[0])], list(node.output))
    lp.slice_param.axis = axis
    lp.slice_param.slice_point.extend(np.cumsum(sizes)[:-1].tolist())


def _reshape(imp: _Importer, i: int, node) -> None:
    if len(node.input) > 1:
        shape = imp.const(node.input[1])
        if shape is None or imp.attr(node, "allowzero", 0):
            raise imp.fail(node, "needs a constant shape (and allowzero 0)")
        dims = [int(d) for d in shape]
        if _flattens_for_matmul(imp, node) or _operand_reshape(imp, node):
            return
        rev = imp.only_consumer(node.output[0])
        found = _argmax_pattern(imp, rev) if rev is not None and rev.op_type == "Slice" else None
        if found is not None and found[2]:
            _argmax_layer(imp, node, *found)  # ArgMax without an axis: this flattening is its first node
            imp.mark(rev)
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


def _flattens_for_matmul(imp: _Importer, node) -> bool:
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


def _identity(imp: _Importer, i: int, node) -> None:
    imp.alias[node.output[0]] = imp.blob(node, node.input[0])


def _dropout(imp: _Importer, i: int, node) -> None:
    if len(node.output) > 1 and node.output[1]:
        raise imp.fail(node, "the mask output (training mode) has no Caffe TEST equivalent")
    _identity(imp, i, node)


def _tile(imp: _Importer, i: int, node) -> None:
    reps = imp.const(node.input[1])
    if reps is None or sum(int(r) != 1 for r in reps) > 1:
        raise imp.fail(node, "Caffe's Tile repeats along one axis (constant repeats)")
    axis = next((a for a, r in enumerate(reps) if int(r) != 1), 0)
    lp = imp.layer(node, "Tile", [imp.blob(node, node.input[0])])
    lp.tile_param.axis, lp.tile_param.tiles = axis, int(reps[axis])


def _shape(imp: _Importer, i: int, node) -> None:
    found = _crop_pattern(imp, node)
    if found is not None:
        _crop(imp, node, found)
        return
    user = imp.only_consumer(node.output[0])
    if user is None or user.op_type != "ConstantOfShape" or len(node.attribute):
        raise imp.fail(node, "a blob's shape as a tensor has no BVLC layer (only Shape -> ConstantOfShape maps)")


def _constant_of_shape(imp: _Importer, i: int, node) -> None:
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


def _resize(imp: _Importer, i: int, node) -> None:
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


# -- the exporter's multi-node forms (and their plain-ONNX equivalents) -------------------------------------
_FLOAT, _INT64 = 1, 7  # TensorProto element types (Cast's 'to')


def _claim_batchnorm_stats(imp: _Importer) -> None:
    """BatchNormalization mean/var written as ``raw * (1 / factor)`` (0 where the factor is 0): the exporter's
    form of a Caffe BatchNorm whose moving-average factor is not 1. The helper nodes are claimed up front
    (they precede the BatchNormalization node); the raw blobs and the factor are kept for the BatchNorm."""
    for node in imp.graph.node:
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        found = [_scaled_stat(imp, v, node) for v in node.input[3:5]]
        if None in found or found[0][1] is not found[1][1] and not np.array_equal(found[0][1], found[1][1]):
            continue
        for v, (raw, factor, helpers) in zip(node.input[3:5], found):
            imp.bn_stats[v] = (raw, factor)
            for h in helpers:
                imp.mark(h)


def _scaled_stat(imp: _Importer, v: str, bn) -> tuple[np.ndarray, np.ndarray, list] | None:
    """(raw, factor, helper nodes) when ``v`` is Mul(raw, inv) with inv Reciprocal(factor) (or, for a factor
    of 0, Where(Equal(factor, 0), factor, Reciprocal(factor))), read only by ``bn``; else None."""
    mul = imp.producer(v)
    if mul is None or mul.op_type != "Mul" or imp.users(v) != [bn]:
        return None
    raw, inv = imp.const(mul.input[0]), mul.input[1]
    node = imp.producer(inv)
    if raw is None or node is None:
        return None
    helpers = [mul]
    if node.op_type == "Where":
        eq, recip = imp.producer(node.input[0]), imp.producer(node.input[2])
        if eq is None or eq.op_type != "Equal" or imp.scalar(eq, eq.input[1]) != 0 or \
                eq.input[0] != node.input[1] or recip is None:
            return None
        helpers += [node, eq]
        node = recip
    if node.op_type != "Reciprocal" or node.input[0] != (helpers[1].input[1] if len(helpers) > 1 else node.input[0]):
        return None
    factor = imp.const(node.input[0])
    if factor is None or factor.size != 1:
        return None
    return raw, factor.reshape(1), helpers + [node]


def _reduce_axes(imp: _Importer, node) -> list[int] | None:
    """The sorted, non-negative axes a Reduce* node reduces (None: given by a non-constant input)."""
    rank = len(imp.shape(node.input[0]))
    if len(node.input) > 1 and node.input[1]:
        axes = imp.ints(node.input[1])
        if axes is None:
            return None
    else:
        axes = imp.attr(node, "axes")
    if not axes:
        return [] if imp.attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    return sorted(int(a) % rank for a in axes)


def _mvn_across(rank: int, axes: list[int]) -> bool | None:
    """MVN's across_channels for a mean over ``axes`` of a ``rank``-axis blob (None: not Caffe's MVN)."""
    if axes == list(range(2, rank)):
        return False
    if axes == list(range(1, rank)):
        return True
    return None


def _mvn_variance(imp: _Importer, sub, axes: list[int]) -> tuple[list, str, float] | None:
    """After centred = x - mean: Div(centred, Sqrt(mean(centred * centred)) + eps) as (nodes, output, eps)."""
    c = sub.output[0]
    users = imp.users(c)
    mul = next((u for u in users if u.op_type == "Mul" and list(u.input) == [c, c]), None)
    div = next((u for u in users if u.op_type == "Div" and u.input[0] == c), None)
    if len(users) != 2 or mul is None or div is None:
        return None
    nodes, var = [mul], mul.output[0]
    if axes:
        red = imp.only_consumer(var)
        if red is None or red.op_type != "ReduceMean" or _reduce_axes(imp, red) != axes or \
                not imp.attr(red, "keepdims", 1):
            return None
        nodes.append(red)
        var = red.output[0]
    sqrt = imp.only_consumer(var)
    add = imp.only_consumer(sqrt.output[0]) if sqrt is not None and sqrt.op_type == "Sqrt" else None
    if add is None or add.op_type != "Add" or add.input[0] != sqrt.output[0] or div.input[1] != add.output[0]:
        return None
    eps = imp.scalar(add, add.input[1])
    if eps is None:
        return None
    return nodes + [sqrt, add, div], div.output[0], eps


def _mvn(imp: _Importer, head, x: str, sub, axes: list[int]) -> bool:
    """Caffe's MVN from its centring Sub (mean over ``axes``, empty for a 2-axis blob): True when it maps."""
    rank = len(imp.shape(x))
    across = _mvn_across(rank, axes)
    if across is None or rank < 2:
        return False
    tail = _mvn_variance(imp, sub, axes)
    out = tail[1] if tail else sub.output[0]
    for n in ([sub] + tail[0]) if tail else [sub]:
        if n is not head:
            imp.mark(n)
    lp = imp.layer(head, "MVN", [imp.blob(head, x)], [out])
    p = lp.mvn_param
    p.normalize_variance = tail is not None
    p.across_channels = across
    if tail:
        p.eps = tail[2]
    return True


def _reduce(imp: _Importer, i: int, node) -> None:
    """Reduce{Sum,Mean,SumSquare,L1} over the trailing axes: Caffe's Reduction (a following scalar Mul its
    coeff); ReduceMean read by x - mean (and the variance chain): Caffe's MVN."""
    x = node.input[0]
    axes = _reduce_axes(imp, node)
    rank = len(imp.shape(x))
    keep = int(imp.attr(node, "keepdims", 1))
    if axes is None:
        raise imp.fail(node, "the axes are not a constant")
    sub = imp.only_consumer(node.output[0])
    if node.op_type == "ReduceMean" and keep and sub is not None and sub.op_type == "Sub" and \
            list(sub.input) == [x, node.output[0]] and _mvn(imp, node, x, sub, axes):
        return
    if not axes or axes != list(range(axes[0], rank)):
        raise imp.fail(node, f"reduces axes {axes} of a {rank}-axis blob (Caffe's Reduction: every axis from one on)")
    op = {"ReduceSum": _RED.SUM, "ReduceMean": _RED.MEAN, "ReduceSumSquare": _RED.SUMSQ, "ReduceL1": _RED.ASUM}
    out, coeff = node, 1.0
    mul = imp.only_consumer(node.output[0])
    if not keep and mul is not None and mul.op_type == "Mul" and mul.input[0] == node.output[0] and \
            imp.scalar(mul, mul.input[1]) is not None and np.float32(imp.scalar(mul, mul.input[1])) == \
            imp.scalar(mul, mul.input[1]):
        coeff = imp.scalar(mul, mul.input[1])
        imp.mark(mul)
        out = _renamed(imp, node, mul.output[0])
    top = out.output[0] if not keep else f"{node.output[0]}__reduced"
    lp = imp.layer(out, "Reduction", [imp.blob(node, x)], [top])
    p = lp.reduction_param
    p.operation = op[node.op_type]
    p.axis = axes[0]
    if coeff != 1:
        p.coeff = coeff
    if keep:  # the reduced axes kept as 1s
        rp = imp.layer(node, "Reshape", [top], [node.output[0]], name=f"{lp.name}_keepdims")
        rp.reshape_param.shape.dim.extend([0] * axes[0] + [1] * len(axes))


def _sub(imp: _Importer, i: int, node) -> None:
    """x - x: Caffe's MVN of a 2-axis blob per channel (a mean over one value); else as Add/Mul."""
    x = node.input[0]
    if node.input[1] == x and imp.const(x) is None and _mvn(imp, node, x, node, []):
        return
    _binary(imp, i, node)


def _argmax_pattern(imp: _Importer, rev) -> tuple | None:
    """The exporter's ArgMax from its reversing Slice: (input, axis, flattened, top_k, out_max_val, nodes, top)
    or None. Caffe orders ties by descending index: TopK of the reversed axis, indices mapped back."""
    if rev.op_type != "Slice" or len(rev.input) != 5:
        return None
    starts, ends, axes, steps = (imp.ints(v) for v in rev.input[1:5])
    if starts != [-1] or steps != [-1] or axes is None or len(axes) != 1 or ends is None or ends[0] > -2 ** 62:
        return None
    topk = imp.only_consumer(rev.output[0])
    if topk is None or topk.op_type != "TopK" or topk.input[0] != rev.output[0] or \
            not imp.attr(topk, "largest", 1) or not imp.attr(topk, "sorted", 1):
        return None
    k = imp.ints(topk.input[1])
    rank = len(imp.shape(rev.input[0]))
    axis = axes[0] % rank if rank else None
    if k is None or axis is None or int(imp.attr(topk, "axis", -1)) % rank != axis:
        return None
    values, ridx = topk.output
    n = imp.shape(rev.input[0])[axis]
    sub = imp.only_consumer(ridx)
    cast = imp.only_consumer(sub.output[0]) if sub is not None and sub.op_type == "Sub" else None
    if cast is None or imp.ints(sub.input[0]) != [n - 1] or sub.input[1] != ridx or cast.op_type != "Cast" or \
            imp.attr(cast, "to") != _FLOAT:
        return None
    nodes = [topk, sub, cast]
    flat = imp.producer(rev.input[0])
    flattened = flat is not None and flat.op_type == "Reshape" and imp.ints(flat.input[1]) == [0, n] and \
        axis == 1 and imp.users(flat.output[0]) == [rev]
    unsq = imp.only_consumer(cast.output[0])
    if not flattened or unsq is None or unsq.op_type != "Unsqueeze":
        # ArgMax with an axis: the top is the indices, or the values through an Identity
        uses = imp.users(values)
        if uses and len(uses) == 1 and uses[0].op_type == "Identity" and imp.users(cast.output[0]) == []:
            return rev.input[0], axis, False, k[0], True, nodes + uses, uses[0].output[0]
        if not uses:
            return rev.input[0], axis, False, k[0], False, nodes, cast.output[0]
        return None
    # no axis: flattened per item; the indices (and values) unsqueezed, concatenated, reshaped to (N, 1|2, k)
    nodes.append(unsq)
    last = unsq
    with_values = bool(imp.users(values))
    if with_values:
        uv = imp.only_consumer(values)
        cat = imp.only_consumer(unsq.output[0])
        if uv is None or uv.op_type != "Unsqueeze" or cat is None or cat.op_type != "Concat" or \
                list(cat.input) != [unsq.output[0], uv.output[0]]:
            return None
        nodes += [uv, cat]
        last = cat
    reshape = imp.only_consumer(last.output[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    return flat.input[0], None, True, k[0], with_values, nodes + [reshape], reshape.output[0]


def _slice(imp: _Importer, i: int, node) -> None:
    """The exporter's reversing Slice of an ArgMax (else: no BVLC layer for a plain Slice of constant bounds)."""
    found = _argmax_pattern(imp, node)
    if found is None:
        raise imp.fail(node, "a Slice maps only as Caffe's Crop (ends computed from the reference blob's shape, as "
                             "cct exports it) or within cct's ArgMax form; constant bounds name no reference blob")
    _argmax_layer(imp, node, *found)


def _argmax_layer(imp: _Importer, head, x: str, axis: int | None, flattened: bool, k: int, out_max_val: bool,
                  nodes: list, top: str) -> None:
    for n in nodes:
        imp.mark(n)
    lp = imp.layer(head, "ArgMax", [imp.blob(head, x)], [top])
    p = lp.argmax_param
    if k != 1:
        p.top_k = k
    if out_max_val:
        p.out_max_val = True
    if axis is not None:
        p.axis = axis


def _argmax(imp: _Importer, i: int, node) -> None:
    """ONNX ArgMax picking the last of equal maxima (Caffe's tie rule), cast to float: Caffe's ArgMax."""
    if not imp.attr(node, "select_last_index", 0):
        raise imp.fail(node, "select_last_index 0 picks the first of equal maxima; Caffe's ArgMax picks the last")
    cast = imp.only_consumer(node.output[0])
    if cast is None or cast.op_type != "Cast" or imp.attr(cast, "to") != _FLOAT:
        raise imp.fail(node, "the int64 indices must be cast to float (Caffe's ArgMax writes a float blob)")
    rank = len(imp.shape(node.input[0]))
    axis = int(imp.attr(node, "axis", 0)) % rank
    imp.mark(cast)
    if imp.attr(node, "keepdims", 1):
        _argmax_layer(imp, node, node.input[0], axis, False, 1, False, [], cast.output[0])
        return
    kept = f"{cast.output[0]}__argmax"
    _argmax_layer(imp, node, node.input[0], axis, False, 1, False, [], kept)
    rp = imp.layer(node, "Reshape", [kept], [cast.output[0]], name=f"{node.name or node.output[0]}_squeeze")
    rp.reshape_param.axis, rp.reshape_param.num_axes = axis, 1
    rp.reshape_param.shape.SetInParent()  # drop the axis: Reshape of that one axis to no axes


def _cast(imp: _Importer, i: int, node) -> None:
    """Cast to int64 feeding a Gather from a constant 2-D table (and an optional bias Add): Caffe's Embed."""
    gather = imp.only_consumer(node.output[0])
    table = imp.const(gather.input[0]) if gather is not None and gather.op_type == "Gather" else None
    if imp.attr(node, "to") != _INT64 or table is None or table.ndim != 2 or gather.input[1] != node.output[0] or \
            int(imp.attr(gather, "axis", 0)) != 0:
        raise imp.fail(node, "a Cast maps only as the index cast of an Embed (Gather from a constant table), the "
                             "float cast of a Threshold or ArgMax")
    imp.mark(gather)
    out, blobs = gather, [table]
    add = imp.only_consumer(gather.output[0])
    if add is not None and add.op_type == "Add" and add.input[0] == gather.output[0]:
        bias = imp.const(add.input[1])
        if bias is not None and bias.shape == (table.shape[1],):
            blobs.append(bias)
            imp.mark(add)
            out = add
    lp = imp.layer(_renamed(imp, node, out.output[0]), "Embed", [imp.blob(node, node.input[0])], blobs=blobs)
    p = lp.embed_param
    p.input_dim, p.num_output, p.bias_term = table.shape[0], table.shape[1], len(blobs) == 2


def _gather(imp: _Importer, i: int, node) -> None:
    raise imp.fail(node, "a Gather maps only as an Embed: rows of a constant 2-D table by indices cast from a blob")


def _greater(imp: _Importer, i: int, node) -> None:
    """x > t (a float32 scalar constant), cast to float: Caffe's Threshold."""
    t = imp.scalar(node, node.input[1])
    cast = imp.only_consumer(node.output[0])
    if t is None or imp.const(node.input[0]) is not None or cast is None or cast.op_type != "Cast" or \
            imp.attr(cast, "to") != _FLOAT:
        raise imp.fail(node, "only x > constant scalar, cast to float, maps (Caffe's Threshold)")
    imp.mark(cast)
    lp = imp.layer(_renamed(imp, node, cast.output[0]), "Threshold", [imp.blob(node, node.input[0])])
    lp.threshold_param.threshold = t


def _crop_pattern(imp: _Importer, shape_node) -> tuple | None:
    """The exporter's Crop: Slice(x, offsets, Shape(ref)[axis:] + offsets, axes axis..) as
    (x, ref, axis, offsets, nodes, top), or None."""
    start = int(imp.attr(shape_node, "start", 0))
    ref_rank = len(imp.shape(shape_node.input[0]))
    nodes, v = [], shape_node.output[0]
    if imp.attr(shape_node, "end") is not None:
        return None
    cut = imp.only_consumer(v)
    if cut is not None and cut.op_type == "Slice" and start == 0:  # opset < 15: Shape, then Slice of it
        s, e, a = (imp.ints(x) for x in cut.input[1:4])
        if len(cut.input) > 4 or s is None or e is None or a != [0] or len(s) != 1 or e[0] < ref_rank:
            return None
        start, v = s[0] % ref_rank if ref_rank else 0, cut.output[0]
        nodes.append(cut)
    add = imp.only_consumer(v)
    if add is None or add.op_type != "Add" or add.input[0] != v:
        return None
    offsets = imp.ints(add.input[1])
    crop = imp.only_consumer(add.output[0])
    if crop is None or crop.op_type != "Slice" or len(crop.input) != 4 or crop.input[2] != add.output[0] or \
            imp.ints(crop.input[1]) != offsets or offsets is None:
        return None
    rank = len(imp.shape(crop.input[0]))
    if rank != ref_rank or imp.ints(crop.input[3]) != list(range(start, rank)) or min(offsets, default=0) < 0:
        return None
    return crop.input[0], shape_node.input[0], start, offsets, nodes + [add, crop], crop.output[0]


def _crop(imp: _Importer, shape_node, found: tuple) -> None:
    x, ref, axis, offsets, nodes, top = found
    for n in nodes:
        imp.mark(n)
    name = shape_node.name or top
    lp = imp.layer(shape_node, "Crop", [imp.blob(shape_node, x), imp.blob(shape_node, ref)], [top], name=name)
    lp.crop_param.axis = axis
    if any(offsets):
        lp.crop_param.offset.extend(offsets[:1] if len(set(offsets)) == 1 else offsets)


def _operand_reshape(imp: _Importer, node) -> bool:
    """A Reshape appending 1s to a blob read as the broadcast operand of one Mul/Add: bottom[1] of Caffe's
    two-bottom Scale/Bias (recorded for that node, no layer of its own)."""
    dims = imp.ints(node.input[1])
    src = imp.shape(node.input[0])
    user = imp.only_consumer(node.output[0])
    if dims is None or user is None or user.op_type not in ("Mul", "Add") or list(user.input[1:]) != [node.output[0]]:
        return False
    r = len(src)
    x = imp.shape(user.input[0])
    if dims[:r] != [0] * r or any(d != 1 for d in dims[r:]) or imp.const(user.input[0]) is not None or \
            len(x) < len(dims) or None in src or x[len(x) - len(dims):][:r] != src:
        return False
    imp.operands[node.output[0]] = (imp.blob(node, node.input[0]), len(x) - len(dims), node.name or node.output[0])
    return True


def _two_bottom(imp: _Importer, node) -> None:
    """Mul/Add of a blob and a reshaped blob (see :func:`_operand_reshape`): Caffe's Scale/Bias with two bottoms;
    a Scale's following Add of a constant shaped like the operand is its bias."""
    src, axis, name = imp.operands[node.input[1]]
    out, blobs = node, []
    if node.op_type == "Mul":
        add = imp.only_consumer(node.output[0])
        c = imp.const(add.input[1]) if add is not None and add.op_type == "Add" and \
            add.input[0] == node.output[0] else None
        found = _broadcast_axis(imp, add, node.output[0], c) if c is not None else None
        if found is not None and found[0] == axis and list(found[1].shape) == imp.shape(src):
            blobs.append(found[1])
            imp.mark(add)
            out = _renamed(imp, node, add.output[0])
    type_ = "Scale" if node.op_type == "Mul" else "Bias"
    lp = imp.layer(out, type_, [imp.blob(node, node.input[0]), src], blobs=blobs, name=name)
    if type_ == "Scale":
        lp.scale_param.axis = axis
        if blobs:
            lp.scale_param.bias_term = True
    else:
        lp.bias_param.axis = axis


HANDLERS: dict[str, Handler] = {
    "Conv": _conv, "ConvTranspose": _conv, "MaxPool": _pool, "AveragePool": _pool, "GlobalMaxPool": _pool,
    "GlobalAveragePool": _pool, "Gemm": _gemm, "MatMul": _matmul, "BatchNormalization": _batchnorm,
    "Add": _binary, "Mul": _binary, "Sum": _sum, "Max": _max, "Pow": _pow,
    "Relu": _simple("ReLU"), "LeakyRelu": _simple("ReLU", _leaky), "PRelu": _prelu, "Elu": _simple("ELU", _elu),
    "Sigmoid": _simple("Sigmoid"), "Tanh": _simple("TanH"), "Abs": _simple("AbsVal"), "Softplus": _simple("BNLL"),
    "Exp": _simple("Exp"), "Log": _simple("Log"), "Clip": _clip, "Softmax": _simple("Softmax", _softmax),
    "LRN": _simple("LRN", _lrn), "Concat": _concat, "Split": _split, "Reshape": _reshape, "Flatten": _reshape,
    "Squeeze": _reshape, "Unsqueeze": _reshape, "Identity": _identity, "Dropout": _dropout, "Tile": _tile,
    "Pad": _pad, "Transpose": _transpose, "Shape": _shape, "ConstantOfShape": _constant_of_shape,
    "Resize": _resize, "ReduceSum": _reduce, "ReduceMean": _reduce, "ReduceSumSquare": _reduce, "ReduceL1": _reduce,
    "Sub": _sub, "Slice": _slice, "ArgMax": _argmax, "Cast": _cast, "Gather": _gather, "Greater": _greater,
}
IMPORTABLE_OPS = sorted(HANDLERS) + ["Constant"]


def from_onnx(model) -> tuple[caffe_pb2.NetParameter, caffe_pb2.NetParameter]:
    """The Caffe net (``NetParameter`` for the prototxt) and weights (``NetParameter`` with blobs) of ``model``."""
    return _Importer(model).run()


def import_onnx(path: str | os.PathLike, out_model: str | os.PathLike, out_weights: str | os.PathLike) -> None:
    """Convert the ONNX file ``path`` into a deploy prototxt and a caffemodel (both written atomically)."""
    onnx = require("onnx")
    try:
        model = onnx.load(os.fspath(path))
    except Exception as e:  # a missing file, or bytes that do not parse as a ModelProto
        raise OnnxImportError(f"{os.fspath(path)}: cannot read an ONNX model: {e}") from None
    net, weights = from_onnx(model)
    atomic_write_bytes(out_model, to_text(net).encode())
    atomic_write_bytes(out_weights, weights.SerializeToString())
