"""Omnivore's physical map on a net (5.1, E.2): which layers are data, conv phase, merged FC tail.

The FC tail starts at the first InnerProduct layer after the last convolution and runs to the end
(the loss); it is found from the layer types and the blob graph, never from layer names. A net
with no convolution, or no InnerProduct after its last convolution, has no FC tail: Omnivore then
falls back to plain data parallelism (every group runs the whole net; the server keeps the model).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import NetError

_CONV_TYPES = ("Convolution", "Deconvolution")


@dataclass(frozen=True)
class NetSplit:
    """Layer ranges of one net: ``[0, data_end)`` data layers (no bottoms), ``[data_end, fc_start)`` the
    conv phase, ``[fc_start, n_layers)`` the FC tail (``fc_start is None``: no tail, data parallel).

    ``fc_inputs``: blobs the tail reads that earlier layers write (the conv output, the labels), in
    first-use order; ``fc_grads``: those of them whose gradient goes back to the conv phase.
    ``data_tops``: the blobs the data layers write (split over a group's ranks along axis 0).
    """

    n_layers: int
    data_end: int
    fc_start: int | None
    data_tops: tuple[str, ...] = ()
    fc_inputs: tuple[str, ...] = ()
    fc_grads: tuple[str, ...] = ()
    conv_layers: tuple[int, ...] = field(default=())

    @property
    def has_fc_tail(self) -> bool:
        return self.fc_start is not None

    @property
    def conv_end(self) -> int:
        """One past the last layer a compute group runs."""
        return self.fc_start if self.fc_start is not None else self.n_layers

    def describe(self, layer_names) -> str:
        """One line naming the split, for the log."""
        if self.fc_start is None:
            return (f"no FC tail (no InnerProduct after the last convolution): data parallel over "
                    f"layers {layer_names[self.data_end]}..{layer_names[-1]}")
        return (f"conv phase {layer_names[self.data_end]}..{layer_names[self.fc_start - 1]}, FC tail "
                f"{layer_names[self.fc_start]}..{layer_names[-1]} (inputs {', '.join(self.fc_inputs)})")


def split_net(layer_types, bottom_names, top_names, bottom_need_backward=None) -> NetSplit:
    """Split a net given per-layer types, bottom blob names and top blob names (as :class:`cct.net.Net`
    holds them: ``net.layers[i].type``, ``net.bottom_names``, ``net.top_names``, ``net.bottom_need_backward``)."""
    n = len(layer_types)
    if n == 0:
        raise NetError("Omnivore: the net has no layers")
    data_end = 0
    while data_end < n and not bottom_names[data_end]:
        data_end += 1
    if data_end == n:
        raise NetError("Omnivore: the net has only data layers; nothing to train")
    data_tops = tuple(t for i in range(data_end) for t in top_names[i])
    convs = [i for i, t in enumerate(layer_types) if t in _CONV_TYPES]
    fc_start = None
    if convs:
        fc_start = next((i for i in range(convs[-1] + 1, n) if layer_types[i] == "InnerProduct"), None)
    if fc_start is None:
        return NetSplit(n, data_end, None, data_tops, conv_layers=tuple(convs))
    written_before: dict[str, int] = {}
    for i in range(fc_start):
        for t in top_names[i]:
            written_before[t] = i
    inputs: list[str] = []
    grads: list[str] = []
    for i in range(fc_start, n):
        for j, b in enumerate(bottom_names[i]):
            if b in written_before and b not in inputs:
                inputs.append(b)
                producer = written_before[b]
                needs = bottom_need_backward[i][j] if bottom_need_backward is not None else True
                if producer >= data_end and needs:
                    grads.append(b)
        for t in top_names[i]:
            written_before.pop(t, None)  # an in-place top rewritten by the tail is the tail's own blob
    return NetSplit(n, data_end, fc_start, data_tops, tuple(inputs), tuple(grads), tuple(convs))


def split_of(net) -> NetSplit:
    """:func:`split_net` for a built :class:`cct.net.Net`."""
    return split_net([layer.type for layer in net.layers], net.bottom_names, net.top_names,
                     net.bottom_need_backward)
