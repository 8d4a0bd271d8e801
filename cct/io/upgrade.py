"""Upgrade of legacy Caffe definitions to the current format, following Caffe's upgrade_proto rules.

Nets (what Caffe's ``UpgradeNetAsNeeded`` does, in the same order):

1. V0 -> V1: ``layers { layer { type: "conv" ... } }`` becomes ``layers { type: CONVOLUTION
   convolution_param { ... } }``; "padding" layers are folded into the conv/pool layer they feed.
2. Legacy data transformation fields (``scale``, ``mean_file``, ``crop_size``, ``mirror`` of the
   data/image_data/window_data params of V1 DATA/IMAGE_DATA/WINDOW_DATA layers) move to ``transform_param``.
3. V1 -> V2: ``layers { type: CONVOLUTION blobs_lr: 1 }`` becomes ``layer { type: "Convolution"
   param { lr_mult: 1 } }`` (V1 ``param`` names, ``blob_share_mode``, ``blobs_lr``, ``weight_decay``,
   ``loss_weight``, include/exclude, blobs and every ``*_param`` sub-message are carried over).
4. ``input:`` + ``input_dim:``/``input_shape:`` become an ``Input`` layer named "input", placed first.
5. BatchNorm layers that declare three param specs (the old way of freezing their statistics) get
   ``lr_mult: 0`` and ``decay_mult: 0`` on each (names kept), as in BVLC Caffe since PR #5184.

Solvers: the deprecated ``solver_type`` enum becomes the ``type`` string, and (when read from a file)
a missing ``snapshot_prefix`` defaults to the solver file's path without extension, a directory
prefix to ``<dir>/<solver file stem>``.

Every upgrade is logged on the "cct" logger. Where Caffe would abort (LOG(FATAL)/CHECK) the upgrade
raises :class:`~cct.errors.ProtoParseError` naming the source and the layer; where Caffe only logs a
problem and continues (a V0 field that does not apply to the layer's type) a warning is logged.
"""
from __future__ import annotations

import logging
import os

from ..errors import ProtoParseError
from ..proto import caffe_pb2

log = logging.getLogger("cct")

V1 = caffe_pb2.V1LayerParameter

# V1 LayerType enum -> V2 type string (Caffe's UpgradeV1LayerType).
V1_TYPE_NAMES: dict[int, str] = {
    V1.NONE: "",
    V1.ABSVAL: "AbsVal",
    V1.ACCURACY: "Accuracy",
    V1.ARGMAX: "ArgMax",
    V1.BNLL: "BNLL",
    V1.CONCAT: "Concat",
    V1.CONTRASTIVE_LOSS: "ContrastiveLoss",
    V1.CONVOLUTION: "Convolution",
    V1.DECONVOLUTION: "Deconvolution",
    V1.DATA: "Data",
    V1.DROPOUT: "Dropout",
    V1.DUMMY_DATA: "DummyData",
    V1.EUCLIDEAN_LOSS: "EuclideanLoss",
    V1.ELTWISE: "Eltwise",
    V1.EXP: "Exp",
    V1.FLATTEN: "Flatten",
    V1.HDF5_DATA: "HDF5Data",
    V1.HDF5_OUTPUT: "HDF5Output",
    V1.HINGE_LOSS: "HingeLoss",
    V1.IM2COL: "Im2col",
    V1.IMAGE_DATA: "ImageData",
    V1.INFOGAIN_LOSS: "InfogainLoss",
    V1.INNER_PRODUCT: "InnerProduct",
    V1.LRN: "LRN",
    V1.MEMORY_DATA: "MemoryData",
    V1.MULTINOMIAL_LOGISTIC_LOSS: "MultinomialLogisticLoss",
    V1.MVN: "MVN",
    V1.POOLING: "Pooling",
    V1.POWER: "Power",
    V1.RELU: "ReLU",
    V1.SIGMOID: "Sigmoid",
    V1.SIGMOID_CROSS_ENTROPY_LOSS: "SigmoidCrossEntropyLoss",
    V1.SILENCE: "Silence",
    V1.SOFTMAX: "Softmax",
    V1.SOFTMAX_LOSS: "SoftmaxWithLoss",
    V1.SPLIT: "Split",
    V1.SLICE: "Slice",
    V1.TANH: "TanH",
    V1.WINDOW_DATA: "WindowData",
    V1.THRESHOLD: "Threshold",
}

# V0 type string -> V1 LayerType enum (Caffe's UpgradeV0LayerType).
V0_TYPES: dict[str, int] = {
    "accuracy": V1.ACCURACY,
    "bnll": V1.BNLL,
    "concat": V1.CONCAT,
    "conv": V1.CONVOLUTION,
    "data": V1.DATA,
    "dropout": V1.DROPOUT,
    "euclidean_loss": V1.EUCLIDEAN_LOSS,
    "flatten": V1.FLATTEN,
    "hdf5_data": V1.HDF5_DATA,
    "hdf5_output": V1.HDF5_OUTPUT,
    "im2col": V1.IM2COL,
    "images": V1.IMAGE_DATA,
    "infogain_loss": V1.INFOGAIN_LOSS,
    "innerproduct": V1.INNER_PRODUCT,
    "lrn": V1.LRN,
    "multinomial_logistic_loss": V1.MULTINOMIAL_LOGISTIC_LOSS,
    "pool": V1.POOLING,
    "relu": V1.RELU,
    "sigmoid": V1.SIGMOID,
    "softmax": V1.SOFTMAX,
    "softmax_loss": V1.SOFTMAX_LOSS,
    "split": V1.SPLIT,
    "tanh": V1.TANH,
    "window_data": V1.WINDOW_DATA,
}

# Where each V0 field goes, by V0 layer type: v0 field -> {v0 type: (V1 sub-message, field, repeated)}.
# A V0 field set on a layer whose type is not listed is reported (Caffe: "Unknown parameter X for layer
# type Y") and dropped.
_V0_FIELD_MAP: dict[str, dict[str, tuple[str, str, bool]]] = {
    "num_output": {"conv": ("convolution_param", "num_output", False),
                   "innerproduct": ("inner_product_param", "num_output", False)},
    "biasterm": {"conv": ("convolution_param", "bias_term", False),
                 "innerproduct": ("inner_product_param", "bias_term", False)},
    "weight_filler": {"conv": ("convolution_param", "weight_filler", False),
                      "innerproduct": ("inner_product_param", "weight_filler", False)},
    "bias_filler": {"conv": ("convolution_param", "bias_filler", False),
                    "innerproduct": ("inner_product_param", "bias_filler", False)},
    "pad": {"conv": ("convolution_param", "pad", True), "pool": ("pooling_param", "pad", False)},
    "kernelsize": {"conv": ("convolution_param", "kernel_size", True),
                   "pool": ("pooling_param", "kernel_size", False)},
    "group": {"conv": ("convolution_param", "group", False)},
    "stride": {"conv": ("convolution_param", "stride", True), "pool": ("pooling_param", "stride", False)},
    "pool": {"pool": ("pooling_param", "pool", False)},
    "dropout_ratio": {"dropout": ("dropout_param", "dropout_ratio", False)},
    "local_size": {"lrn": ("lrn_param", "local_size", False)},
    "alpha": {"lrn": ("lrn_param", "alpha", False)},
    "beta": {"lrn": ("lrn_param", "beta", False)},
    "k": {"lrn": ("lrn_param", "k", False)},
    "source": {"data": ("data_param", "source", False), "hdf5_data": ("hdf5_data_param", "source", False),
               "images": ("image_data_param", "source", False),
               "window_data": ("window_data_param", "source", False),
               "infogain_loss": ("infogain_loss_param", "source", False)},
    "batchsize": {"data": ("data_param", "batch_size", False),
                  "hdf5_data": ("hdf5_data_param", "batch_size", False),
                  "images": ("image_data_param", "batch_size", False),
                  "window_data": ("window_data_param", "batch_size", False)},
    "rand_skip": {"data": ("data_param", "rand_skip", False), "images": ("image_data_param", "rand_skip", False)},
    "shuffle_images": {"images": ("image_data_param", "shuffle", False)},
    "new_height": {"images": ("image_data_param", "new_height", False)},
    "new_width": {"images": ("image_data_param", "new_width", False)},
    "concat_dim": {"concat": ("concat_param", "concat_dim", False)},
    "det_fg_threshold": {"window_data": ("window_data_param", "fg_threshold", False)},
    "det_bg_threshold": {"window_data": ("window_data_param", "bg_threshold", False)},
    "det_fg_fraction": {"window_data": ("window_data_param", "fg_fraction", False)},
    "det_context_pad": {"window_data": ("window_data_param", "context_pad", False)},
    "det_crop_mode": {"window_data": ("window_data_param", "crop_mode", False)},
    "hdf5_output_param": {"hdf5_output": ("hdf5_output_param", "", False)},
}
# V0 transformation fields: whatever the layer type, Caffe puts them in transform_param.
_V0_TRANSFORM_FIELDS = {"scale": "scale", "meanfile": "mean_file", "cropsize": "crop_size", "mirror": "mirror"}

# V1 data layers whose *_param carries legacy transformation fields.
_DATA_LAYER_PARAMS = {V1.DATA: "data_param", V1.IMAGE_DATA: "image_data_param",
                      V1.WINDOW_DATA: "window_data_param"}
_V2_DATA_LAYER_PARAMS = {"Data": "data_param", "ImageData": "image_data_param", "WindowData": "window_data_param"}
_TRANSFORM_FIELDS = ("scale", "mean_file", "crop_size", "mirror")

_SOLVER_TYPE_NAMES = {
    caffe_pb2.SolverParameter.SGD: "SGD",
    caffe_pb2.SolverParameter.NESTEROV: "Nesterov",
    caffe_pb2.SolverParameter.ADAGRAD: "AdaGrad",
    caffe_pb2.SolverParameter.RMSPROP: "RMSProp",
    caffe_pb2.SolverParameter.ADADELTA: "AdaDelta",
    caffe_pb2.SolverParameter.ADAM: "Adam",
}


def _layer_desc(name: str, index: int) -> str:
    return f"layer '{name}'" if name else f"layer #{index}"


# ---------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------
def net_needs_v0_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """True if some V1 ``layers`` entry still holds a V0 ``layer`` definition."""
    return any(l.HasField("layer") for l in net.layers)


def net_needs_data_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """True if a V1 data layer carries transformation fields outside ``transform_param``."""
    for l in net.layers:
        field = _DATA_LAYER_PARAMS.get(l.type)
        if field and l.HasField(field):
            sub = getattr(l, field)
            if any(sub.HasField(f) for f in _TRANSFORM_FIELDS):
                return True
    return False


def net_needs_v1_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """True if the net uses the legacy V1 ``layers`` field."""
    return len(net.layers) > 0


def net_needs_input_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """True if the net declares inputs with the legacy ``input`` fields."""
    return len(net.input) > 0 or len(net.input_shape) > 0 or len(net.input_dim) > 0


def net_needs_batchnorm_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """True if a BatchNorm layer declares three param specs (the pre-2016 way to freeze its statistics)."""
    return any(l.type == "BatchNorm" and len(l.param) == 3 for l in net.layer)


def net_needs_upgrade(net: caffe_pb2.NetParameter) -> bool:
    """True if :func:`upgrade_net` would change ``net``."""
    return (net_needs_v0_upgrade(net) or net_needs_data_upgrade(net) or net_needs_v1_upgrade(net)
            or net_needs_input_upgrade(net) or net_needs_batchnorm_upgrade(net))


# ---------------------------------------------------------------------------------------------
# V0 -> V1
# ---------------------------------------------------------------------------------------------
def _fold_padding_layers(net: caffe_pb2.NetParameter, source: str) -> list[caffe_pb2.V1LayerParameter]:
    """The V0 layers with each "padding" layer removed and its pad set on the conv/pool layer it feeds."""
    last_top: dict[str, int] = {name: -1 for name in net.input}
    out: list[caffe_pb2.V1LayerParameter] = []
    for i, conn in enumerate(net.layers):
        v0 = conn.layer
        where = f"{source}: {_layer_desc(v0.name, i)}"
        if v0.type != "padding":
            copy = caffe_pb2.V1LayerParameter()
            copy.CopyFrom(conn)
            out.append(copy)
        for j, blob in enumerate(conn.bottom):
            if blob not in last_top:
                raise ProtoParseError(f"{where}: unknown bottom blob '{blob}' (V0 upgrade)")
            src_idx = last_top[blob]
            if src_idx == -1:
                continue
            src = net.layers[src_idx]
            if src.layer.type != "padding":
                continue
            if v0.type not in ("conv", "pool"):
                raise ProtoParseError(f"{where}: padding layer '{src.layer.name}' feeds a layer of type "
                                      f"'{v0.type}'; only conv and pool layers can absorb a V0 padding layer")
            if len(conn.bottom) != 1:
                raise ProtoParseError(f"{where}: a conv/pool layer fed by a padding layer must have one bottom")
            if len(src.bottom) != 1 or len(src.top) != 1:
                raise ProtoParseError(f"{source}: padding layer '{src.layer.name}' must have exactly one bottom "
                                      "and one top")
            out[-1].layer.pad = src.layer.pad
            out[-1].bottom[j] = src.bottom[0]
            log.info("%s: folded V0 padding layer '%s' (pad %d) into it", where, src.layer.name, src.layer.pad)
        for blob in conn.top:
            last_top[blob] = i
    return out


def _upgrade_v0_layer(conn: caffe_pb2.V1LayerParameter, index: int, source: str) -> caffe_pb2.V1LayerParameter:
    out = caffe_pb2.V1LayerParameter()
    out.bottom.extend(conn.bottom)
    out.top.extend(conn.top)
    if not conn.HasField("layer"):
        return out
    v0 = conn.layer
    where = f"{source}: {_layer_desc(v0.name, index)}"
    if v0.HasField("name"):
        out.name = v0.name
    vtype = v0.type
    if v0.HasField("type"):
        if vtype not in V0_TYPES:
            raise ProtoParseError(f"{where}: unknown V0 layer type '{vtype}'")
        out.type = V0_TYPES[vtype]
    for b in v0.blobs:
        out.blobs.add().CopyFrom(b)
    out.blobs_lr.extend(v0.blobs_lr)
    out.weight_decay.extend(v0.weight_decay)
    problems = []
    for field, value in v0.ListFields():
        fname = field.name
        if fname in ("name", "type", "blobs", "blobs_lr", "weight_decay"):
            continue
        if fname in _V0_TRANSFORM_FIELDS:
            setattr(out.transform_param, _V0_TRANSFORM_FIELDS[fname], value)
            continue
        target = _V0_FIELD_MAP.get(fname, {}).get(vtype)
        if target is None:
            problems.append(fname)
            continue
        sub_name, sub_field, repeated = target
        sub = getattr(out, sub_name)
        if not sub_field:  # a whole sub-message (hdf5_output_param)
            sub.CopyFrom(value)
        elif repeated:
            getattr(sub, sub_field).append(value)
        elif field.message_type is not None:
            getattr(sub, sub_field).CopyFrom(value)
        else:
            setattr(sub, sub_field, value)  # pool: V0 PoolMethod values equal PoolingParameter's
    for fname in problems:
        log.warning("%s: V0 parameter '%s' does not apply to layer type '%s'; dropped (as Caffe does)",
                    where, fname, vtype)
    return out


def upgrade_v0_net(net: caffe_pb2.NetParameter, source: str = "<net>") -> None:
    """V0 -> V1 in place: fold padding layers, then turn each V0 ``layer`` into V1 fields."""
    folded = _fold_padding_layers(net, source)
    upgraded = [_upgrade_v0_layer(conn, i, source) for i, conn in enumerate(folded)]
    del net.layers[:]
    net.layers.extend(upgraded)


# ---------------------------------------------------------------------------------------------
# Data transformation fields
# ---------------------------------------------------------------------------------------------
def upgrade_net_data_transformation(net: caffe_pb2.NetParameter, source: str = "<net>") -> None:
    """Move scale/mean_file/crop_size/mirror of V1 data layers' params into ``transform_param``."""
    for i, l in enumerate(net.layers):
        field = _DATA_LAYER_PARAMS.get(l.type)
        if not field or not l.HasField(field):
            continue
        sub = getattr(l, field)
        for f in _TRANSFORM_FIELDS:
            if sub.HasField(f):
                setattr(l.transform_param, f, getattr(sub, f))
                sub.ClearField(f)
                log.info("%s: %s: moved %s.%s to transform_param", source, _layer_desc(l.name, i), field, f)


# ---------------------------------------------------------------------------------------------
# V1 -> V2
# ---------------------------------------------------------------------------------------------
_V1_SUBMESSAGES = tuple(f.name for f in caffe_pb2.V1LayerParameter.DESCRIPTOR.fields if f.name.endswith("_param"))


def upgrade_v1_layer(v1: caffe_pb2.V1LayerParameter, index: int = 0,
                     source: str = "<net>") -> caffe_pb2.LayerParameter:
    """One V1 ``layers`` entry as a V2 LayerParameter (Caffe's UpgradeV1LayerParameter)."""
    where = f"{source}: {_layer_desc(v1.name, index)}"
    out = caffe_pb2.LayerParameter()
    out.bottom.extend(v1.bottom)
    out.top.extend(v1.top)
    if v1.HasField("name"):
        out.name = v1.name
    for rule in v1.include:
        out.include.add().CopyFrom(rule)
    for rule in v1.exclude:
        out.exclude.add().CopyFrom(rule)
    if v1.HasField("type"):
        if v1.type not in V1_TYPE_NAMES:
            raise ProtoParseError(f"{where}: unknown V1 layer type {v1.type}")
        out.type = V1_TYPE_NAMES[v1.type]
    for b in v1.blobs:
        out.blobs.add().CopyFrom(b)

    def spec(i: int) -> caffe_pb2.ParamSpec:
        while len(out.param) <= i:
            out.param.add()
        return out.param[i]

    for i, name in enumerate(v1.param):
        spec(i).name = name
    for i, mode in enumerate(v1.blob_share_mode):
        spec(i).share_mode = (caffe_pb2.ParamSpec.STRICT if mode == V1.STRICT else caffe_pb2.ParamSpec.PERMISSIVE)
    for i, lr in enumerate(v1.blobs_lr):
        spec(i).lr_mult = lr
    for i, decay in enumerate(v1.weight_decay):
        spec(i).decay_mult = decay
    out.loss_weight.extend(v1.loss_weight)
    for name in _V1_SUBMESSAGES:
        if v1.HasField(name):
            getattr(out, name).CopyFrom(getattr(v1, name))
    if v1.HasField("layer"):
        raise ProtoParseError(f"{where}: V1 layer still holds a V0 'layer' definition")
    return out


def upgrade_v1_net(net: caffe_pb2.NetParameter, source: str = "<net>") -> None:
    """V1 -> V2 in place: every ``layers`` entry becomes a ``layer`` entry."""
    if len(net.layer) > 0:
        # Caffe drops the 'layer' entries here ("these will be ignored"); refusing is safer.
        raise ProtoParseError(f"{source}: the net mixes current 'layer' and legacy V1 'layers' definitions; "
                              "write all layers in one format")
    upgraded = [upgrade_v1_layer(l, i, source) for i, l in enumerate(net.layers)]
    del net.layers[:]
    net.layer.extend(upgraded)


# ---------------------------------------------------------------------------------------------
# input fields -> Input layer
# ---------------------------------------------------------------------------------------------
def upgrade_net_input(net: caffe_pb2.NetParameter, source: str = "<net>") -> None:
    """``input`` + ``input_shape``/``input_dim`` -> an ``Input`` layer named "input", put first."""
    n = len(net.input)
    has_shape, has_dim = len(net.input_shape) > 0, len(net.input_dim) > 0
    if has_shape and has_dim:
        raise ProtoParseError(f"{source}: give either input_shape or the deprecated input_dim, not both")
    if has_shape and len(net.input_shape) != n:
        raise ProtoParseError(f"{source}: {n} input(s) but {len(net.input_shape)} input_shape(s); "
                              "give one input_shape per input")
    if has_dim and len(net.input_dim) != 4 * n:
        raise ProtoParseError(f"{source}: {n} input(s) need {4 * n} input_dim values (4 per input), "
                              f"got {len(net.input_dim)}")
    if has_shape or has_dim:
        layer = caffe_pb2.LayerParameter(name="input", type="Input")
        for i, name in enumerate(net.input):
            layer.top.append(name)
            shape = layer.input_param.shape.add()
            if has_shape:
                shape.CopyFrom(net.input_shape[i])
            else:
                shape.dim.extend(net.input_dim[4 * i:4 * i + 4])
        rest = list(net.layer)
        del net.layer[:]
        net.layer.append(layer)
        net.layer.extend(rest)
        log.info("%s: converted the deprecated input fields (%s) into an Input layer 'input'",
                 source, ", ".join(net.input))
    elif n:
        # A legacy caffemodel lists its inputs without shapes: dropping the field is enough.
        log.info("%s: dropped the deprecated input fields (%s), which carry no shape", source, ", ".join(net.input))
    net.ClearField("input")
    net.ClearField("input_shape")
    net.ClearField("input_dim")


# ---------------------------------------------------------------------------------------------
# BatchNorm param specs
# ---------------------------------------------------------------------------------------------
def upgrade_net_batchnorm(net: caffe_pb2.NetParameter, source: str = "<net>") -> None:
    """Zero lr_mult/decay_mult of BatchNorm layers declaring three param specs (their names are kept)."""
    for i, l in enumerate(net.layer):
        if l.type == "BatchNorm" and len(l.param) == 3:
            changed = any(p.lr_mult != 0 or p.decay_mult != 0 for p in l.param)
            for p in l.param:
                p.lr_mult = 0.0
                p.decay_mult = 0.0
            if changed:
                log.info("%s: %s: BatchNorm statistics are not learned; set lr_mult and decay_mult of its "
                         "3 param specs to 0", source, _layer_desc(l.name, i))


def _warn_ignored_transform_fields(net: caffe_pb2.NetParameter, source: str) -> None:
    # Caffe upgrades these fields only for V1 layers; a current-format data layer ignores them.
    for i, l in enumerate(net.layer):
        field = _V2_DATA_LAYER_PARAMS.get(l.type)
        if field and l.HasField(field):
            sub = getattr(l, field)
            for f in _TRANSFORM_FIELDS:
                if sub.HasField(f):
                    log.warning("%s: %s: %s.%s is a legacy field that Caffe ignores for current-format layers; "
                                "use transform_param.%s", source, _layer_desc(l.name, i), field, f, f)


# ---------------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------------
def upgrade_net(net: caffe_pb2.NetParameter, source: str = "<net>") -> caffe_pb2.NetParameter:
    """Upgrade ``net`` in place (V0/V1 layers, data transformation fields, input fields, BatchNorm
    param specs) exactly as Caffe does when it reads a net, and return it."""
    if net_needs_v0_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated V0LayerParameter: %s", source)
        upgrade_v0_net(net, source)
        log.info("Successfully upgraded file specified using deprecated V0LayerParameter")
    if net_needs_data_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated transformation parameters: %s",
                 source)
        upgrade_net_data_transformation(net, source)
        log.info("Successfully upgraded file specified using deprecated data transformation parameters.")
    if net_needs_v1_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated V1LayerParameter: %s", source)
        upgrade_v1_net(net, source)
        log.info("Successfully upgraded file specified using deprecated V1LayerParameter")
    if net_needs_input_upgrade(net):
        log.info("Attempting to upgrade input file specified using deprecated input fields: %s", source)
        upgrade_net_input(net, source)
        log.info("Successfully upgraded file specified using deprecated input fields.")
    if net_needs_batchnorm_upgrade(net):
        upgrade_net_batchnorm(net, source)
    _warn_ignored_transform_fields(net, source)
    return net


def upgrade_solver(solver: caffe_pb2.SolverParameter, source: str = "<solver>") -> caffe_pb2.SolverParameter:
    """Upgrade ``solver`` in place and return it: ``solver_type`` enum -> ``type`` string; when ``source``
    is a file path, also default ``snapshot_prefix`` as Caffe's ReadSolverParamsFromTextFileOrDie does."""
    if solver.HasField("solver_type"):
        if solver.HasField("type"):
            old = caffe_pb2.SolverParameter.SolverType.Name(solver.solver_type)
            raise ProtoParseError(
                f"{source}: Failed to upgrade solver: old solver_type field (enum) and new type field (string) "
                f"cannot be both specified (solver_type: {old}, type: \"{solver.type}\")")
        name = _SOLVER_TYPE_NAMES.get(solver.solver_type)
        if name is None:
            raise ProtoParseError(f"{source}: unknown solver_type {solver.solver_type}")
        solver.type = name
        solver.ClearField("solver_type")
        log.info("%s: upgraded deprecated solver_type (enum) to type: \"%s\"", source, name)
    if not (source.startswith("<") and source.endswith(">")):
        _upgrade_snapshot_prefix(solver, source)
    return solver


def _upgrade_snapshot_prefix(solver: caffe_pb2.SolverParameter, source: str) -> None:
    if not solver.HasField("snapshot_prefix"):
        solver.snapshot_prefix = os.path.splitext(source)[0]
        log.info("snapshot_prefix was not specified and is set to %s", solver.snapshot_prefix)
    elif solver.snapshot_prefix and os.path.isdir(solver.snapshot_prefix):
        stem = os.path.splitext(os.path.basename(source))[0]
        solver.snapshot_prefix = os.path.join(solver.snapshot_prefix, stem)
        log.info("snapshot_prefix was a directory and is replaced to %s", solver.snapshot_prefix)
