"""pycaffe's ``caffe.draw``: draw a NetParameter as a graph with pydot/graphviz.

pydot is optional: ``pip install cct[draw]`` (and graphviz's ``dot`` program to render images).
"""
from __future__ import annotations

from typing import Any

from cct.proto import caffe_pb2

__all__ = [
    "LAYER_STYLE_DEFAULT", "NEURON_LAYER_STYLE", "BLOB_STYLE", "get_pooling_types_dict", "get_edge_label",
    "get_layer_label", "get_layer_lr_mult", "choose_color_by_layertype", "get_pydot_graph", "draw_net",
    "draw_net_to_file",
]

# Internal layer and blob styles (pycaffe's).
LAYER_STYLE_DEFAULT = {"shape": "record", "fillcolor": "#6495ED", "style": "filled"}
NEURON_LAYER_STYLE = {"shape": "record", "fillcolor": "#90EE90", "style": "filled"}
BLOB_STYLE = {"shape": "octagon", "fillcolor": "#E0E0E0", "style": "filled"}


def _pydot() -> Any:
    try:
        import pydot
    except ImportError as e:
        raise ImportError("caffe.draw needs pydot, an optional dependency of cct: pip install cct[draw] "
                          "(rendering images also needs graphviz's 'dot' program)") from e
    return pydot


def get_pooling_types_dict() -> dict[int, str]:
    """Pooling method number -> name (0 -> 'MAX', ...)."""
    desc = caffe_pb2.PoolingParameter.PoolMethod.DESCRIPTOR
    return {v.number: k for k, v in desc.values_by_name.items()}


def get_edge_label(layer: caffe_pb2.LayerParameter) -> str:
    """Edge label of a layer's tops: the batch size of Data, num_output of Convolution/InnerProduct."""
    if layer.type == "Data":
        return "Batch " + str(layer.data_param.batch_size)
    if layer.type in ("Convolution", "Deconvolution"):
        return str(layer.convolution_param.num_output)
    if layer.type == "InnerProduct":
        return str(layer.inner_product_param.num_output)
    return '""'


def get_layer_lr_mult(layer: caffe_pb2.LayerParameter) -> tuple[float, float]:
    """The lr_mult of the weights and of the bias of a Convolution/Deconvolution/InnerProduct layer."""
    lr_mult = lr_mult2 = 1.0
    if layer.type in ("Convolution", "Deconvolution", "InnerProduct"):
        has_bias = (layer.convolution_param.bias_term if layer.type != "InnerProduct"
                    else layer.inner_product_param.bias_term)
        if len(layer.param) > 0:
            lr_mult = layer.param[0].lr_mult
        if has_bias:
            if len(layer.param) > 1:
                lr_mult2 = layer.param[1].lr_mult
        else:
            lr_mult2 = 0.0
    return lr_mult, lr_mult2


def get_layer_label(layer: caffe_pb2.LayerParameter, rankdir: str, display_lrm: bool = False) -> str:
    """The node label of a layer: name, (type), kernel/stride/pad of spatial layers, lr mults if asked."""
    separator = " " if rankdir in ("TB", "BT") else "\\n"
    descriptors = [layer.name]
    if layer.type == "Pooling":
        descriptors.append(f"({layer.type} {get_pooling_types_dict()[layer.pooling_param.pool]})")
    else:
        descriptors.append(f"({layer.type})")
    if layer.type in ("Convolution", "Deconvolution", "Pooling"):
        if layer.type == "Pooling":
            kernel_size = layer.pooling_param.kernel_size
            stride = layer.pooling_param.stride
            padding = layer.pooling_param.pad
        else:
            cp = layer.convolution_param
            kernel_size = cp.kernel_size[0] if len(cp.kernel_size) else 1
            stride = cp.stride[0] if len(cp.stride) else 1
            padding = cp.pad[0] if len(cp.pad) else 0
        descriptors.append(separator.join([f"kernel size: {kernel_size:d}", f"stride: {stride:d}",
                                           f"pad: {padding:d}"]))
    if display_lrm and layer.type in ("Convolution", "Deconvolution", "InnerProduct"):
        lrm0, lrm1 = get_layer_lr_mult(layer)
        if any([lrm0, lrm1]):
            descriptors.append(f"lr mult: {lrm0:.1f}, {lrm1:.1f}")
    # outer double quotes, or graphviz does not parse the colons
    return "\"" + separator.join(descriptors) + "\""


def choose_color_by_layertype(layertype: str) -> str:
    """Node fill colour of a layer type."""
    if layertype in ("Convolution", "Deconvolution"):
        return "#FF5050"
    if layertype == "Pooling":
        return "#FF9900"
    if layertype == "InnerProduct":
        return "#CC33FF"
    return "#6495ED"


def _included(layer: caffe_pb2.LayerParameter, phase) -> bool:
    if phase is None:
        return True
    if len(layer.include) > 0 and len(layer.exclude) > 0:
        raise ValueError(f"layer {layer.name} has both include and exclude specified.")
    included = len(layer.include) == 0
    for rule in layer.include:
        included = included or rule.phase == phase
    for rule in layer.exclude:
        included = included and not rule.phase == phase
    return included


def get_pydot_graph(caffe_net: caffe_pb2.NetParameter, rankdir: str, label_edges: bool = True, phase=None,
                    display_lrm: bool = False):
    """A ``pydot.Dot`` graph of the net: layers are boxes, blobs octagons (in-place layers green).

    ``phase`` (caffe.TRAIN / caffe.TEST) keeps only the layers of that phase; None keeps all.
    """
    pydot = _pydot()
    pydot_graph = pydot.Dot(caffe_net.name if caffe_net.name else "Default", graph_type="digraph",
                            rankdir=rankdir)
    pydot_nodes: dict[str, Any] = {}
    pydot_edges: list[dict[str, str]] = []
    for layer in caffe_net.layer:
        if not _included(layer, phase):
            continue
        node_name = layer.name + "_" + layer.type
        node_label = get_layer_label(layer, rankdir, display_lrm=display_lrm)
        if len(layer.bottom) == 1 and len(layer.top) == 1 and layer.bottom[0] == layer.top[0]:
            pydot_nodes[node_name] = pydot.Node(node_label, **NEURON_LAYER_STYLE)
        else:
            style = dict(LAYER_STYLE_DEFAULT)
            style["fillcolor"] = choose_color_by_layertype(layer.type)
            pydot_nodes[node_name] = pydot.Node(node_label, **style)
        for bottom_blob in layer.bottom:
            pydot_nodes[bottom_blob + "_blob"] = pydot.Node(bottom_blob, **BLOB_STYLE)
            pydot_edges.append({"src": bottom_blob + "_blob", "dst": node_name, "label": '""'})
        for top_blob in layer.top:
            pydot_nodes[top_blob + "_blob"] = pydot.Node(top_blob)
            label = get_edge_label(layer) if label_edges else '""'
            pydot_edges.append({"src": node_name, "dst": top_blob + "_blob", "label": label})
    for node in pydot_nodes.values():
        pydot_graph.add_node(node)
    for edge in pydot_edges:
        pydot_graph.add_edge(pydot.Edge(pydot_nodes[edge["src"]], pydot_nodes[edge["dst"]], label=edge["label"]))
    return pydot_graph


def draw_net(caffe_net: caffe_pb2.NetParameter, rankdir: str, ext: str = "png", phase=None,
             display_lrm: bool = False) -> bytes:
    """The net drawn as an image encoded in format ``ext`` ('png', 'svg', 'raw' for dot text ...)."""
    return get_pydot_graph(caffe_net, rankdir, phase=phase, display_lrm=display_lrm).create(format=ext)


def draw_net_to_file(caffe_net: caffe_pb2.NetParameter, filename: str, rankdir: str = "LR", phase=None,
                     display_lrm: bool = False) -> None:
    """Draw the net into ``filename``, in the format its extension names ('.raw': dot text)."""
    ext = filename[filename.rfind(".") + 1:]
    data = draw_net(caffe_net, rankdir, ext, phase, display_lrm)
    with open(filename, "wb") as fid:
        fid.write(data)
