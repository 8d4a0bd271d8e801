"""pycaffe's net specification: write nets in Python, get a NetParameter.

``layers`` (usually imported as ``L``) makes layers, ``params`` (``P``) gives enum constants::

    from caffe import layers as L, params as P
    n = caffe.NetSpec()
    n.data, n.label = L.Data(source="train_lmdb", backend=P.Data.LMDB, batch_size=64, ntop=2,
                             transform_param=dict(scale=1. / 255))
    n.conv1 = L.Convolution(n.data, kernel_size=5, num_output=20, weight_filler=dict(type="xavier"))
    n.loss = L.SoftmaxWithLoss(n.conv1, n.label)
    open("net.prototxt", "w").write(str(n.to_proto()))

Names follow pycaffe exactly: a top assigned to a NetSpec attribute is named after it; other tops
are named ``<Type><counter>`` (one counter per layer type, in the order the net is written out); a
layer takes the name of its first top (or ``<Type><counter>`` when it has none). Keyword arguments
``ntop`` (number of tops) and ``in_place`` (tops = bottoms) are special; a keyword ending in
``param`` sets that LayerParameter field; any other keyword goes to the layer's ``<type>_param``
message when that message has the field, else to the LayerParameter itself (``name``, ``include``,
``loss_weight``, ``propagate_down`` ...). Dicts become messages, lists repeated fields (a list of
dicts repeated messages) and a single value given for a repeated field becomes a one-element list.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

from cct.proto import caffe_pb2

__all__ = ["NetSpec", "Top", "Function", "layers", "params", "to_proto", "assign_proto", "param_name_dict"]


def param_name_dict() -> dict[str, str]:
    """Map each ``<Type>Parameter`` message name (less ``Parameter``) to its LayerParameter field (less ``_param``).

    This is how pycaffe finds the parameter message of a layer type: ``Convolution`` ->
    ``convolution``, ``InnerProduct`` -> ``inner_product``. Types whose parameter message is named
    differently (``Deconvolution`` uses ``convolution_param``) are not in the map, as in pycaffe.
    """
    out: dict[str, str] = {}
    for field in caffe_pb2.LayerParameter.DESCRIPTOR.fields:
        if not field.name.endswith("_param") or field.message_type is None:
            continue
        type_name = field.message_type.name
        if type_name.endswith("Parameter"):
            type_name = type_name[: -len("Parameter")]
        out[type_name] = field.name[: -len("_param")]
    return out


def to_proto(*tops: Top) -> caffe_pb2.NetParameter:
    """A NetParameter with every layer needed to compute ``tops`` (all tops auto-named)."""
    layers_: OrderedDict = OrderedDict()
    autonames: Counter = Counter()
    for top in tops:
        top.fn._to_proto(layers_, {}, autonames)
    net = caffe_pb2.NetParameter()
    net.layer.extend(layers_.values())
    return net


def assign_proto(proto: Any, name: str, val: Any) -> None:
    """Set field ``name`` of message ``proto`` from a Python value, recursively (pycaffe's rules).

    Lists fill repeated fields (a list of dicts adds one message per dict), dicts fill message
    fields, anything else is assigned; a non-list value for a repeated field is a one-element list.
    """
    is_repeated_field = hasattr(getattr(proto, name), "extend")
    if is_repeated_field and not isinstance(val, list):
        val = [val]
    if isinstance(val, list):
        if val and isinstance(val[0], dict):
            for item in val:
                proto_item = getattr(proto, name).add()
                for k, v in item.items():
                    assign_proto(proto_item, k, v)
        else:
            getattr(proto, name).extend(val)
    elif isinstance(val, dict):
        for k, v in val.items():
            assign_proto(getattr(proto, name), k, v)
    else:
        setattr(proto, name, val)


class Top:
    """One output blob of a layer (``fn`` is the layer's Function, ``n`` the top index)."""

    def __init__(self, fn: Function, n: int):
        self.fn = fn
        self.n = n

    def to_proto(self) -> caffe_pb2.NetParameter:
        """A NetParameter with every layer needed to compute this top."""
        return to_proto(self)

    def _to_proto(self, layers_, names, autonames):
        return self.fn._to_proto(layers_, names, autonames)


class Function:
    """One layer: its type, its input Tops and its keyword parameters."""

    def __init__(self, type_name: str, inputs: tuple, params_: dict):
        self.type_name = type_name
        for index, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                raise TypeError(f"{type_name} input {index} is not a Top (type is {type(inp)})")
        self.inputs = inputs
        self.params = params_
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, n) for n in range(self.ntop))

    def _get_name(self, names, autonames) -> str:
        if self not in names and self.ntop > 0:
            names[self] = self._get_top_name(self.tops[0], names, autonames)
        elif self not in names:
            autonames[self.type_name] += 1
            names[self] = self.type_name + str(autonames[self.type_name])
        return names[self]

    def _get_top_name(self, top: Top, names, autonames) -> str:
        if top not in names:
            autonames[top.fn.type_name] += 1
            names[top] = top.fn.type_name + str(autonames[top.fn.type_name])
        return names[top]

    def _to_proto(self, layers_, names, autonames) -> None:
        if self in layers_:
            return
        bottom_names = []
        for inp in self.inputs:
            inp._to_proto(layers_, names, autonames)
            bottom_names.append(layers_[inp.fn].top[inp.n])
        layer = caffe_pb2.LayerParameter()
        layer.type = self.type_name
        layer.bottom.extend(bottom_names)
        if self.in_place:
            layer.top.extend(layer.bottom)
        else:
            for top in self.tops:
                layer.top.append(self._get_top_name(top, names, autonames))
        layer.name = self._get_name(names, autonames)

        for k, v in self.params.items():
            if k.endswith("param"):  # generic *_param fields (and ``param``) of LayerParameter
                assign_proto(layer, k, v)
                continue
            try:
                assign_proto(getattr(layer, _param_names[self.type_name] + "_param"), k, v)
            except (AttributeError, KeyError):
                assign_proto(layer, k, v)
        layers_[self] = layer


class _NoSuchTop(AttributeError, KeyError):
    """A NetSpec has no top of that name (a KeyError as in pycaffe, an AttributeError for hasattr)."""


class NetSpec:
    """Named tops: assign ``n.name = L.Type(...)``; ``n.to_proto()`` writes every layer they need."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name: str, value: Any) -> None:
        self.tops[name] = value

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["tops"][name]
        except KeyError:
            raise _NoSuchTop(name) from None

    def __setitem__(self, key: str, value: Any) -> None:
        self.__setattr__(key, value)

    def __getitem__(self, item: str) -> Any:
        return self.tops[item]

    def __delitem__(self, name: str) -> None:
        del self.tops[name]

    def keys(self) -> list[str]:
        """The assigned names, in assignment order."""
        return list(self.tops.keys())

    def vals(self) -> list:
        """The assigned tops, in assignment order."""
        return list(self.tops.values())

    def to_proto(self) -> caffe_pb2.NetParameter:
        """A NetParameter with every layer needed to compute the assigned tops, using their names."""
        names = {v: k for k, v in self.tops.items()}
        autonames: Counter = Counter()
        layers_: OrderedDict = OrderedDict()
        for top in self.tops.values():
            top._to_proto(layers_, names, autonames)
        net = caffe_pb2.NetParameter()
        net.layer.extend(layers_.values())
        return net


class Layers:
    """The ``layers`` pseudo-module: ``layers.Convolution(bottom, kernel_size=3)`` makes a layer.

    Returns its Top (one top), a tuple of Tops (``ntop`` > 1) or the Function (``ntop=0``).
    """

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def layer_fn(*args, **kwargs):
            fn = Function(name, args, kwargs)
            if fn.ntop == 0:
                return fn
            if fn.ntop == 1:
                return fn.tops[0]
            return fn.tops

        return layer_fn


class Parameters:
    """The ``params`` pseudo-module: ``params.Pooling.MAX`` is ``PoolingParameter.MAX``."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        class Param:
            def __getattr__(self, param_name):
                return getattr(getattr(caffe_pb2, name + "Parameter"), param_name)

        return Param()


_param_names = param_name_dict()
layers = Layers()
params = Parameters()
