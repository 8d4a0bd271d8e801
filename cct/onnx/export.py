"""Export a built cct Net (prototxt + caffemodel) to an ONNX model with the same forward semantics.

Every layer is converted by :mod:`cct.onnx.layers`; a layer ONNX cannot express exactly stops the
export with a one-line :class:`~cct.errors.LayerError` naming it and why. The model is checked with
``onnx.checker`` (full check, with strict shape inference) before it is written, atomically.
"""
from __future__ import annotations

import os
from collections import Counter

from ..errors import CctError, LayerError
from ..io.atomic import atomic_write_bytes
from ..net import Net
from .graph import GraphBuilder, require
from .layers import BATCH_DIM, CONVERTERS, REFUSED, LayerContext, batch_norm_with_scale
from .records import RECORDED, record_layer
from .recurrent import convert_lstm, convert_lstm_unit, convert_rnn

DEFAULT_OPSET = 17
MIN_OPSET = 13  # Softmax with Caffe's single-axis semantics, Split/ReduceSum/Unsqueeze taking inputs


UNROLLED = ("LSTM", "LSTMUnit", "RNN")
# every converter: the per-layer table of cct.onnx.layers and the unrolled recurrent layers
ALL_CONVERTERS = {**CONVERTERS, "LSTM": convert_lstm, "LSTMUnit": convert_lstm_unit, "RNN": convert_rnn}


def exportable_layer_types() -> list[str]:
    """The Caffe layer types the exporter converts (some settings of them may still be refused)."""
    return sorted(set(ALL_CONVERTERS) | {"Input", "Silence"})


def refused_layer_types() -> dict[str, str]:
    """Layer types never exported, with the reason."""
    return dict(REFUSED)


def _check_opset(opset: int) -> int:
    onnx = require("onnx")
    latest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= latest:
        raise CctError(f"ONNX opset {opset} is not supported: use {MIN_OPSET} .. {latest}")
    return opset


def _scale_after_batchnorm(net: Net) -> dict[int, int]:
    """BatchNorm layer index -> index of the per-channel Scale that alone reads its output (foldable pairs)."""
    pairs = {}
    for i, layer in enumerate(net.layers):
        if layer.type != "BatchNorm" or not layer.use_global_stats or len(net.top_names[i]) != 1:
            continue
        top = net.top_names[i][0]
        j = next((k for k in range(i + 1, len(net.layers)) if top in net.bottom_names[k]), None)
        if j is None or net.layers[j].type != "Scale" or len(net.bottom_names[j]) != 1:
            continue
        scale, shape = net.layers[j], net.blobs[top].shape
        if len(shape) >= 2 and scale.axis % len(shape) == 1 and tuple(scale.blobs[0].shape) == (shape[1],):
            pairs[i] = j
    return pairs


def to_onnx(net: Net, opset: int = DEFAULT_OPSET, dynamic_batch: bool = False, fold_batchnorm: bool = False):
    """The ``onnx.ModelProto`` of ``net``'s forward pass (graph inputs: its Input blobs; outputs: its
    output blobs), checked with ``onnx.checker``. ``dynamic_batch`` makes axis 0 of every input symbolic;
    ``fold_batchnorm`` writes a BatchNorm followed by a per-channel Scale as one BatchNormalization node
    (its scale and bias), else each layer is its own node."""
    onnx = require("onnx")
    g = GraphBuilder(_check_opset(opset))
    folded = _scale_after_batchnorm(net) if fold_batchnorm else {}
    skipped = set(folded.values())
    productions = Counter(t for names in net.top_names for t in names)
    produced: Counter = Counter()
    values: dict[str, str] = {}  # cct blob name -> ONNX value holding its current contents

    inputs = {t for layer, names in zip(net.layers, net.top_names) if layer.type == "Input" for t in names}

    def top_value(blob: str) -> str:
        # A blob rewritten in place gets one ONNX value per version. The blob's own name goes to the graph
        # input for an Input blob, else to the last version (so graph outputs carry their blob's name).
        produced[blob] += 1
        own = produced[blob] == 1 if blob in inputs else produced[blob] == productions[blob]
        return g.reserve(blob if own else f"{blob}__v{produced[blob]}")

    for blob, n in productions.items():
        g.reserve(blob)
        for k in range(1, n + 1 if n > 1 else 1):
            g.reserve(f"{blob}__v{k}")
    for i, layer in enumerate(net.layers):
        lp = layer.param
        tops = net.top_names[i]
        if lp.type == "Input":
            for t in tops:
                shape = list(net.blobs[t].shape)
                if dynamic_batch and shape:
                    shape[0] = BATCH_DIM
                values[t] = top_value(t)
                g.add_input(values[t], shape)
            continue
        if lp.type == "Silence" or i in skipped:
            continue
        if lp.type in REFUSED:
            raise LayerError(lp.name, lp.type, f"cannot be exported to ONNX: {REFUSED[lp.type]}")
        convert = ALL_CONVERTERS.get(lp.type)
        if convert is None:
            raise LayerError(lp.name, lp.type, "cannot be exported to ONNX: no converter for this layer type")
        bottoms = [values[b] for b in net.bottom_names[i]]
        top_values = [top_value(t) for t in tops]
        if i in folded:  # the BatchNormalization node writes the Scale's top
            tops = net.top_names[folded[i]]
            top_values = [top_value(t) for t in tops]
        ctx = LayerContext(g, layer, bottoms, top_values,
                           [tuple(b.shape) for b in net.bottom_vecs[i]], [tuple(t.shape) for t in net.top_vecs[i]],
                           dynamic_batch)
        first = len(g.nodes)
        if i in folded:
            batch_norm_with_scale(ctx, net.layers[folded[i]])
        else:
            convert(ctx)
        if lp.type in UNROLLED:  # tells the importer (and a reader) why these nodes form no layer of their own
            for node in g.nodes[first:]:
                node.doc_string = f"unrolled {lp.type} layer '{lp.name}'"
        elif lp.type in RECORDED and len(g.nodes) > first:
            g.nodes[first].doc_string = record_layer(lp)
        values.update(zip(tops, ctx.tops))
    for name in net.output_blob_names:
        shape = list(net.blobs[name].shape)
        if dynamic_batch and shape:
            shape[0] = BATCH_DIM
        g.add_output(values[name], shape)
    model = g.model(net.name, doc=f"exported by cct from net '{net.name}'")
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CctError(f"the ONNX model exported from net '{net.name}' fails onnx.checker: {first}") from e
    return model


def export(net: Net, path: str | os.PathLike, opset: int = DEFAULT_OPSET, dynamic_batch: bool = False,
           fold_batchnorm: bool = False) -> None:
    """Write ``net`` as an ONNX model to ``path`` (atomically; see :func:`to_onnx`)."""
    model = to_onnx(net, opset=opset, dynamic_batch=dynamic_batch, fold_batchnorm=fold_batchnorm)
    atomic_write_bytes(path, model.SerializeToString())
