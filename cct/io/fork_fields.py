"""Clear errors for prototxt fields and layer types that exist only in forks of Caffe, not in BVLC Caffe.

Public models often come from a Caffe fork (SSD, PSPNet, SegNet, ShuffleNet ports, ...) whose
``caffe.proto`` adds fields BVLC Caffe lacks. Protobuf's text parser only says "no field named X";
:func:`explain_unknown_field` turns that into a message naming the layer, the field and, where known,
the fork it comes from (and BVLC's equivalent, if there is one).
"""
from __future__ import annotations

import re

# (message, field) -> (where the field comes from, what BVLC Caffe offers instead or "")
FORK_FIELDS: dict[tuple[str, str], tuple[str, str]] = {
    **{("LayerParameter", f): ("SSD's Caffe fork (weiliu89/caffe, branch ssd)", "") for f in (
        "permute_param", "prior_box_param", "detection_output_param", "detection_evaluate_param",
        "multibox_loss_param", "normalize_param", "annotated_data_param", "video_data_param")},
    ("LayerParameter", "shuffle_channel_param"): ("the ShuffleNet Caffe forks (ShuffleChannel layer)", ""),
    ("LayerParameter", "bn_param"): (
        "the BN layer of Caffe forks such as PSPNet's (hszhao/PSPNet) and SegNet's (alexgkendall/caffe-segnet)",
        "BVLC Caffe normalizes with a BatchNorm layer (batch_norm_param) followed by a Scale layer"),
    ("LayerParameter", "interp_param"): ("the Interp layer of DeepLab's and PSPNet's Caffe forks", ""),
    ("LayerParameter", "upsample_param"): ("SegNet's Caffe fork (alexgkendall/caffe-segnet)", ""),
    ("LayerParameter", "roi_pooling_param"): ("Fast/Faster R-CNN's Caffe fork (rbgirshick/caffe-fast-rcnn)", ""),
    ("LayerParameter", "smooth_l1_loss_param"): ("Fast/Faster R-CNN's Caffe forks", ""),
    ("LayerParameter", "psroi_pooling_param"): ("R-FCN's Caffe fork (daijifeng001/caffe-rfcn)", ""),
    ("PoolingParameter", "ceil_mode"): (
        "Caffe forks (e.g. yjxiong/caffe, used by DenseNet and TSN ports)",
        "BVLC Caffe's equivalent is round_mode: CEIL (ceil_mode: true) or round_mode: FLOOR (ceil_mode: false)"),
    ("BatchNormParameter", "scale_filler"): ("NVIDIA's Caffe fork (NVIDIA/caffe)",
                                             "BVLC Caffe's BatchNorm has no scale: add a Scale layer"),
    ("BatchNormParameter", "bias_filler"): ("NVIDIA's Caffe fork (NVIDIA/caffe)",
                                            "BVLC Caffe's BatchNorm has no bias: add a Scale layer with bias_term"),
}

_SSD = "SSD's Caffe fork (weiliu89/caffe, branch ssd)"
# layer type -> (where the type comes from, what BVLC Caffe offers instead or "")
FORK_LAYER_TYPES: dict[str, tuple[str, str]] = {
    **{t: (_SSD, "") for t in ("Permute", "PriorBox", "DetectionOutput", "DetectionEvaluate", "MultiBoxLoss",
                               "Normalize", "AnnotatedData", "VideoData")},
    "ShuffleChannel": ("the ShuffleNet Caffe forks", ""),
    "ConvolutionDepthwise": ("MobileNet Caffe forks",
                             "BVLC Caffe's equivalent is Convolution with group = num_output = input channels"),
    "DepthwiseConvolution": ("MobileNet Caffe forks",
                             "BVLC Caffe's equivalent is Convolution with group = num_output = input channels"),
    "ReLU6": ("MobileNet Caffe forks", "BVLC Caffe's equivalent is Clip with min: 0 max: 6"),
    "BN": ("Caffe forks such as PSPNet's and SegNet's", "BVLC Caffe uses BatchNorm followed by Scale"),
    "Interp": ("DeepLab's and PSPNet's Caffe forks", ""),
    "Upsample": ("SegNet's Caffe fork", ""),
    "ROIPooling": ("Fast/Faster R-CNN's Caffe fork", ""),
    "SmoothL1Loss": ("Fast/Faster R-CNN's Caffe fork", ""),
    "PSROIPooling": ("R-FCN's Caffe fork", ""),
    "Axpy": ("SENet Caffe ports", "BVLC Caffe can compose it from Scale (two bottoms) and Eltwise SUM"),
}


def explain_fork_layer_type(type_name: str) -> str | None:
    """Where a layer type that BVLC Caffe lacks comes from (and BVLC's equivalent), or None."""
    fork = FORK_LAYER_TYPES.get(type_name)
    if fork is None:
        return None
    origin, instead = fork
    return f"'{type_name}' is a layer type of {origin}, not of BVLC Caffe" + (f"; {instead}" if instead else "")


_NO_FIELD = re.compile(r'Message type "caffe\.([\w.]+)" has no field named "(\w+)"')
_LAYER_KEYS = ("layer", "layers")


def _code_chars(text: str, start: int = 0, stop: int | None = None):
    """(index, character) of ``text[start:stop]`` outside ``#`` comments and quoted strings."""
    i, n = start, len(text) if stop is None else min(stop, len(text))
    while i < n:
        c = text[i]
        if c == "#":
            j = text.find("\n", i)
            i = len(text) if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < len(text) and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            yield i, c
            i += 1


def _block_stack(text: str, offset: int) -> list[tuple[str, int]]:
    """The blocks ``key { ... }`` enclosing character ``offset``, outermost first, as (key, index of '{')."""
    stack: list[tuple[str, int]] = []
    for i, c in _code_chars(text, 0, offset):
        if c == "{":
            m = re.search(r"(\w+)\s*:?\s*$", text[max(0, i - 200):i])
            stack.append((m.group(1) if m else "", i))
        elif c == "}" and stack:
            stack.pop()
    return stack


def _top_level_value(text: str, open_brace: int, key: str) -> str | None:
    """The string value of ``key: "..."`` directly inside the block opened at ``open_brace``."""
    pattern = re.compile(rf'{key}\s*:\s*"((?:[^"\\]|\\.)*)"')
    depth = 0
    for i, c in _code_chars(text, open_brace):
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return None
        elif depth == 1 and not (text[i - 1].isalnum() or text[i - 1] == "_"):
            m = pattern.match(text, i)
            if m:
                return m.group(1)
    return None


def _offset(text: str, line: int, col: int) -> int:
    lines = text.splitlines(keepends=True)
    return sum(len(x) for x in lines[:max(line - 1, 0)]) + max(col - 1, 0)


def explain_unknown_field(text: str, line: int, col: int, parser_message: str) -> str | None:
    """A message for protobuf's "no field named X" error at ``line``:``col`` of ``text`` naming the layer
    and the field and saying which Caffe fork the field belongs to; None for any other error."""
    m = _NO_FIELD.search(parser_message)
    if not m:
        return None
    message_type, field = m.group(1), m.group(2)
    stack = _block_stack(text, _offset(text, line, col))
    where = ""
    layer_block = next((pos for key, pos in stack if key in _LAYER_KEYS), None)
    if layer_block is not None:
        name = _top_level_value(text, layer_block, "name")
        ltype = _top_level_value(text, layer_block, "type")
        where = f"layer '{name}'" if name is not None else "a layer"
        if ltype:
            where += f" (type {ltype})"
        where += ": "
    lookup = "LayerParameter" if message_type == "V1LayerParameter" else message_type
    fork = FORK_FIELDS.get((lookup, field))
    if fork is None:
        return (f"{where}'{field}' is not a field of BVLC Caffe's {message_type} (a typo, or a field of a "
                f"Caffe fork? cct reads BVLC Caffe's format)")
    origin, instead = fork
    out = (f"{where}field '{field}' ({message_type}) belongs to {origin}, not to BVLC Caffe; "
           f"cct reads BVLC Caffe's format")
    return out + (f". {instead}" if instead else "")
