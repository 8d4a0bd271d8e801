"""Parameter: a learnable blob as the layer's top (shared storage)."""
from __future__ import annotations

from collections.abc import Sequence

from ..blob import Blob
from ..errors import CctError
from .base import register
from .structure_base import StructureLayer


@register("Parameter")
class ParameterLayer(StructureLayer):
    """One learnable blob of ``parameter_param.shape`` exposed as the top (data and diff shared)."""

    param_fields = ("parameter_param",)
    exact_num_bottom = 0
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        shape = tuple(int(d) for d in self.param.parameter_param.shape.dim)
        if self.params_given(1):
            if self.blobs[0].shape != shape:
                raise self.error(f"parameter blob has shape {list(self.blobs[0].shape)}, expected {list(shape)}")
        else:
            try:
                self.blobs = [self.make_param(shape, None, like=top[0])]
            except CctError as e:
                raise self.error(str(e)) from e
        self.param_propagate_down = [True]

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].share_data(self.blobs[0])
        top[0].share_diff(self.blobs[0])

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].share_data(self.blobs[0])
        top[0].share_diff(self.blobs[0])

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        pass
