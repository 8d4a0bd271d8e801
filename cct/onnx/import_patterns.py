"""The import of the exporter's multi-node forms (and their plain-ONNX equivalents) as one BVLC layer each.

MVN (mean, centring, variance chain), ArgMax (TopK of the reversed axis; or ONNX's ArgMax picking the last
maximum), Reduction (+ its coeff), Embed (Cast + Gather), Threshold (Greater + Cast), Swish (x * Sigmoid),
Crop (a Slice whose ends are the reference blob's shape plus the offsets), a Slice of constant bounds
(Caffe Slice layers), two-bottom Scale/Bias (bottom[1] reshaped for ONNX's broadcast, or a blob broadcast
over another) and BatchNorm statistics divided by the moving-average factor. :data:`HANDLERS` is the
importer's whole op table (:data:`cct.onnx.import_ops.OP_HANDLERS` with these on top).
"""
from __future__ import annotations

import numpy as np

from ..proto import caffe_pb2
from .import_ops import OP_HANDLERS, Handler, binary_op, broadcast_axis, renamed_node, reshape_op, shape_op
from .import_state import ImportState

_RED = caffe_pb2.ReductionParameter
_FLOAT, _INT64 = 1, 7  # TensorProto element types (Cast's 'to')


def claim_batchnorm_stats(imp: ImportState) -> None:
    """BatchNormalization mean/var written as ``raw * (1 / factor)`` (0 where the factor is 0): the exporter's
    form of a Caffe BatchNorm whose moving-average factor is not 1. The helper nodes are claimed up front
    (they precede the BatchNormalization node); the raw blobs and the factor are kept for the BatchNorm."""
    for node in imp.graph.node:
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        found = [_scaled_stat(imp, v, node) for v in node.input[3:5]]
        if any(f is None for f in found) or not np.array_equal(found[0][1], found[1][1]):
            continue
        claimed = [h for f in found for h in f[2]]
        values = [out for h in claimed for out in h.output]
        readers = [u for out in values for u in imp.consumers.get(out, [])]
        if any(out in imp.graph_outputs for out in values) or \
                any(u is not node and all(u is not h for h in claimed) for u in readers):
            continue  # a helper value read elsewhere too: not only this BatchNorm's arithmetic
        for v, (raw, factor, _) in zip(node.input[3:5], found):
            imp.bn_stats[v] = (raw, factor)
        for h in claimed:
            imp.mark(h)


def _scaled_stat(imp: ImportState, v: str, bn) -> tuple[np.ndarray, np.ndarray, list] | None:
    """(raw, factor, helper nodes) when ``v`` is Mul(raw, inv) with inv Reciprocal(factor) (or, for a factor
    of 0, Where(Equal(factor, 0), factor, Reciprocal(factor))), read only by ``bn``; else None."""
    mul = imp.producer(v)
    if mul is None or mul.op_type != "Mul" or imp.users(v) != [bn]:
        return None
    raw, inv = imp.const(mul.input[0]), mul.input[1]
    node = imp.producer(inv)
    if raw is None or node is None:
        return None
    helpers, where_factor = [mul], None
    if node.op_type == "Where":  # Where(factor == 0, factor, 1 / factor)
        eq, recip = imp.producer(node.input[0]), imp.producer(node.input[2])
        if eq is None or eq.op_type != "Equal" or imp.scalar(eq, eq.input[1]) != 0 or \
                eq.input[0] != node.input[1] or recip is None:
            return None
        helpers += [node, eq]
        node, where_factor = recip, node.input[1]
    if node.op_type != "Reciprocal" or where_factor not in (None, node.input[0]):
        return None
    factor = imp.const(node.input[0])
    if factor is None or factor.size != 1:
        return None
    return raw, factor.reshape(1), helpers + [node]


def _reduce_axes(imp: ImportState, node) -> list[int] | None:
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


def _mvn_variance(imp: ImportState, sub, axes: list[int]) -> tuple[list, str, float] | None:
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


def _mvn(imp: ImportState, head, x: str, sub, axes: list[int]) -> bool:
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


def _reduce(imp: ImportState, i: int, node) -> None:
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
        out = renamed_node(imp, node, mul.output[0])
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


def _sub(imp: ImportState, i: int, node) -> None:
    """x - x: Caffe's MVN of a 2-axis blob per channel (a mean over one value); else as Add/Mul."""
    x = node.input[0]
    if node.input[1] == x and imp.const(x) is None and _mvn(imp, node, x, node, []):
        return
    binary_op(imp, i, node)


def _argmax_pattern(imp: ImportState, rev) -> tuple | None:
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
        if uses and len(uses) == 1 and uses[0].op_type == "Identity" and not imp.consumers.get(cast.output[0]) \
                and cast.output[0] not in imp.graph_outputs:
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


def _slice(imp: ImportState, i: int, node) -> None:
    """The exporter's reversing Slice of an ArgMax, else a Slice of constant bounds with step 1: per cut axis
    one Caffe Slice layer whose middle top is kept (the parts cut off end in a Silence layer)."""
    found = _argmax_pattern(imp, node)
    if found is not None:
        _argmax_layer(imp, node, *found)
        return
    cuts = _slice_bounds(imp, node)
    name, src = node.name or node.output[0], imp.blob(node, node.input[0])
    if not cuts:  # the whole blob
        imp.alias[node.output[0]] = src
        return
    dropped = []
    for k, (axis, start, end, size) in enumerate(cuts):
        out = node.output[0] if k == len(cuts) - 1 else f"{node.output[0]}__axis{axis}"
        tops = ([f"{out}__before"] if start > 0 else []) + [out] + ([f"{out}__after"] if end < size else [])
        lp = imp.layer(node, "Slice", [src], tops, name=name if k == 0 else f"{name}_axis{axis}")
        lp.slice_param.axis = axis
        lp.slice_param.slice_point.extend(p for p in (start, end) if 0 < p < size)
        dropped += [t for t in tops if t != out]
        src = out
    imp.layer(node, "Silence", dropped, [], name=f"{name}_cut_off")


def _slice_bounds(imp: ImportState, node) -> list[tuple[int, int, int, int]]:
    """(axis, start, end, size) per axis a Slice of constant bounds and step 1 cuts (ONNX's clamping applied)."""
    ins = [imp.ints(v) if v else None for v in list(node.input[1:]) + [""] * (5 - len(node.input))]
    starts, ends, axes, steps = ins
    if starts is None or ends is None or (len(node.input) > 3 and node.input[3] and axes is None) or \
            (len(node.input) > 4 and node.input[4] and steps is None):
        raise imp.fail(node, "a Slice maps onto Caffe's Slice only with constant starts, ends, axes and steps")
    shape = imp.shape(node.input[0])
    axes = list(range(len(starts))) if axes is None else axes
    if any(st != 1 for st in steps or []):
        raise imp.fail(node, f"steps {steps} (Caffe's Slice and Crop copy contiguous ranges: step 1 only)")
    cuts = []
    for axis, start, end in sorted((a % len(shape), st, e) for a, st, e in zip(axes, starts, ends)):
        size = shape[axis]
        if size is None:
            raise imp.fail(node, f"slices axis {axis} of unknown size (Caffe's Slice takes fixed slice points)")
        start, end = (min(max(v + size if v < 0 else v, 0), size) for v in (start, end))
        if end <= start:
            raise imp.fail(node, f"an empty slice [{start}, {end}) of axis {axis} (Caffe blobs are not empty)")
        if (start, end) != (0, size):
            cuts.append((axis, start, end, size))
    return cuts


def _argmax_layer(imp: ImportState, head, x: str, axis: int | None, flattened: bool, k: int, out_max_val: bool,
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


def _argmax(imp: ImportState, i: int, node) -> None:
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


def _cast(imp: ImportState, i: int, node) -> None:
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
    lp = imp.layer(renamed_node(imp, node, out.output[0]), "Embed", [imp.blob(node, node.input[0])], blobs=blobs)
    p = lp.embed_param
    p.input_dim, p.num_output, p.bias_term = table.shape[0], table.shape[1], len(blobs) == 2


def _gather(imp: ImportState, i: int, node) -> None:
    raise imp.fail(node, "a Gather maps only as an Embed: rows of a constant 2-D table by indices cast from a blob")


def _greater(imp: ImportState, i: int, node) -> None:
    """x > t (a float32 scalar constant), cast to float: Caffe's Threshold."""
    t = imp.scalar(node, node.input[1])
    cast = imp.only_consumer(node.output[0])
    if t is None or imp.const(node.input[0]) is not None or cast is None or cast.op_type != "Cast" or \
            imp.attr(cast, "to") != _FLOAT:
        raise imp.fail(node, "only x > constant scalar, cast to float, maps (Caffe's Threshold)")
    imp.mark(cast)
    lp = imp.layer(renamed_node(imp, node, cast.output[0]), "Threshold", [imp.blob(node, node.input[0])])
    lp.threshold_param.threshold = t


def _crop_pattern(imp: ImportState, shape_node) -> tuple | None:
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


def _crop(imp: ImportState, shape_node, found: tuple) -> None:
    x, ref, axis, offsets, nodes, top = found
    for n in nodes:
        imp.mark(n)
    name = shape_node.name or top
    lp = imp.layer(shape_node, "Crop", [imp.blob(shape_node, x), imp.blob(shape_node, ref)], [top], name=name)
    lp.crop_param.axis = axis
    if any(offsets):
        lp.crop_param.offset.extend(offsets[:1] if len(set(offsets)) == 1 else offsets)


def _operand_reshape(imp: ImportState, node) -> bool:
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
            len(x) < len(dims) or x[len(x) - len(dims):][:r] != src:
        return False
    imp.operands[node.output[0]] = (imp.blob(node, node.input[0]), len(x) - len(dims), node.name or node.output[0])
    return True


def _two_bottom(imp: ImportState, node) -> None:
    """Mul/Add of a blob and a reshaped blob (see :func:`_operand_reshape`): Caffe's Scale/Bias with two bottoms;
    a Scale's following Add of a constant shaped like the operand is its bias."""
    src, axis, name = imp.operands[node.input[1]]
    out, blobs = node, []
    if node.op_type == "Mul":
        add = imp.only_consumer(node.output[0])
        c = imp.const(add.input[1]) if add is not None and add.op_type == "Add" and \
            add.input[0] == node.output[0] else None
        found = broadcast_axis(imp, add, node.output[0], c) if c is not None else None
        if found is not None and found[0] == axis and list(found[1].shape) == imp.shape(src):
            blobs.append(found[1])
            imp.mark(add)
            out = renamed_node(imp, node, add.output[0])
    type_ = "Scale" if node.op_type == "Mul" else "Bias"
    lp = imp.layer(out, type_, [imp.blob(node, node.input[0]), src], blobs=blobs, name=name)
    if type_ == "Scale":
        lp.scale_param.axis = axis
        if blobs:
            lp.scale_param.bias_term = True
    else:
        lp.bias_param.axis = axis


def _swish_pattern(imp: ImportState, sig) -> tuple[str, float, list, str] | None:
    """x * Sigmoid(x) or x * Sigmoid(x * beta) (beta a float32 scalar) from the Sigmoid node: (x, beta, the
    other nodes, the product's value) of Caffe's Swish, or None."""
    x, beta, nodes = sig.input[0], 1.0, []
    pre = imp.producer(x)
    if pre is not None and pre.op_type == "Mul" and imp.users(x) == [sig] and imp.scalar(pre, pre.input[1]) is \
            not None and imp.const(pre.input[0]) is None:
        x, beta, nodes = pre.input[0], imp.scalar(pre, pre.input[1]), [pre]
    mul = imp.only_consumer(sig.output[0])
    if mul is None or mul.op_type != "Mul" or sorted(mul.input) != sorted([x, sig.output[0]]) or \
            np.float32(beta) != beta:
        return None
    return x, beta, nodes + [sig, mul], mul.output[0]


def _swish(imp: ImportState, head, found: tuple) -> None:
    x, beta, nodes, top = found
    for n in nodes:
        if n is not head:
            imp.mark(n)
    lp = imp.layer(head, "Swish", [imp.blob(head, x)], [top])
    if beta != 1:
        lp.swish_param.beta = beta


def _sigmoid(imp: ImportState, i: int, node) -> None:
    """Sigmoid: Caffe's Swish where it gates its own input (x * Sigmoid(x)), else Caffe's Sigmoid."""
    found = _swish_pattern(imp, node)
    if found is not None and not found[2][:-2]:  # (with a beta the Mul before the Sigmoid opened the pattern)
        _swish(imp, node, found)
        return
    imp.layer(node, "Sigmoid", [imp.blob(node, node.input[0])])


def _mul_add(imp: ImportState, i: int, node) -> None:
    """Mul/Add: a two-bottom Scale/Bias when its second input is a recorded operand or a blob broadcast over
    the first as Caffe's Scale/Bias broadcasts (e.g. a squeeze-and-excitation gate); x * beta opening a
    Swish; else as one node."""
    if node.input[1] in imp.operands:
        _two_bottom(imp, node)
        return
    sig = imp.only_consumer(node.output[0])
    if node.op_type == "Mul" and sig is not None and sig.op_type == "Sigmoid":
        found = _swish_pattern(imp, sig)
        if found is not None and found[2][0] is node:
            _swish(imp, node, found)
            return
    a, b = node.input[0], node.input[1]
    if imp.const(a) is None and imp.const(b) is None and imp.shape(a) != imp.shape(b):
        x, operand = (a, b) if imp.shape(a) == imp.shape(node.output[0]) else (b, a)
        found = _blob_broadcast(imp, x, operand)
        if found is None:
            raise imp.fail(node, f"a blob of shape {imp.shape(operand)} broadcast over one of {imp.shape(x)} "
                                 "(Caffe's Scale/Bias broadcast a blob over the leading and trailing axes only)")
        _broadcast_layer(imp, node, x, operand, *found)
        return
    binary_op(imp, i, node)


def _blob_broadcast(imp: ImportState, x: str, operand: str) -> tuple[int, list[int]] | None:
    """(axis, dims) when ``operand`` broadcasts over ``x`` as bottom[1] of Caffe's Scale/Bias of those dims at
    that axis (its other axes all 1), else None."""
    xs, os_ = imp.shape(x), imp.shape(operand)
    if not xs or not os_ or None in xs[1:] or None in os_[1:] or len(os_) > len(xs):
        return None
    full = [1] * (len(xs) - len(os_)) + list(os_)
    used = [k for k, d in enumerate(full) if d != 1]
    if not used:
        return None
    start, end = used[0], used[-1] + 1
    # (a symbolic batch on both: equal or, at run time, Caffe's shape check fails cleanly; never a silent broadcast)
    if full[start:end] != xs[start:end]:
        return None
    return start, full[start:end]


def _broadcast_layer(imp: ImportState, node, x: str, operand: str, axis: int, dims: list[int]) -> None:
    """Scale (Mul) or Bias (Add) of ``x`` by the blob ``operand``, first reshaped to ``dims`` where it has
    more axes (1s before or after them)."""
    bottom = imp.blob(node, operand)
    name = node.name or node.output[0]
    if list(imp.shape(operand)) != dims:
        shaped = f"{node.output[0]}__operand"
        rp = imp.layer(node, "Reshape", [bottom], [shaped], name=f"{name}_operand")
        rp.reshape_param.shape.dim.extend(0 if d is None else d for d in dims)  # (None: a symbolic batch)
        if axis == 0 and len(imp.shape(operand)) == len(imp.shape(x)):
            rp.reshape_param.shape.dim[0] = 0  # the batch: copied (it may differ from the imported Input's)
        bottom = shaped
    lp = imp.layer(node, "Scale" if node.op_type == "Mul" else "Bias", [imp.blob(node, x), bottom], name=name)
    if node.op_type == "Mul":
        lp.scale_param.axis = axis
    else:
        lp.bias_param.axis = axis


def _reshape_or_pattern(imp: ImportState, i: int, node) -> None:
    """A Reshape that opens a pattern (a two-bottom Scale/Bias operand, the flattening of an ArgMax without an
    axis) or a plain one (:func:`cct.onnx.import_ops.reshape_op`)."""
    if node.op_type == "Reshape" and len(node.input) > 1 and imp.ints(node.input[1]) is not None and \
            not imp.attr(node, "allowzero", 0):
        if _operand_reshape(imp, node):
            return
        rev = imp.only_consumer(node.output[0])
        found = _argmax_pattern(imp, rev) if rev is not None and rev.op_type == "Slice" else None
        if found is not None and found[2]:
            _argmax_layer(imp, node, *found)  # ArgMax without an axis: this flattening is its first node
            imp.mark(rev)
            return
    reshape_op(imp, i, node)


def _shape_or_crop(imp: ImportState, i: int, node) -> None:
    """Shape opening the exporter's Crop, else as :func:`cct.onnx.import_ops.shape_op`."""
    found = _crop_pattern(imp, node)
    if found is not None:
        _crop(imp, node, found)
        return
    shape_op(imp, i, node)


HANDLERS: dict[str, Handler] = {
    **OP_HANDLERS, "Add": _mul_add, "Mul": _mul_add, "Sub": _sub, "Reshape": _reshape_or_pattern,
    "Shape": _shape_or_crop, "ReduceSum": _reduce, "ReduceMean": _reduce, "ReduceSumSquare": _reduce,
    "ReduceL1": _reduce, "Sigmoid": _sigmoid, "Slice": _slice, "ArgMax": _argmax, "Cast": _cast, "Gather": _gather,
    "Greater": _greater,
}
