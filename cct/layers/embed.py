"""Embed: a lookup table (one-hot InnerProduct) from integer indices to learned vectors."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from .base import register
from .structure_base import StructureLayer, index_add


@register("Embed")
class EmbedLayer(StructureLayer):
    """Look up rows of a ``(input_dim, num_output)`` weight by integer indices (stored as floats).

    Top shape = bottom shape + ``(num_output,)``; optional bias. Indices must be integers in
    ``[0, input_dim)``. No gradient to the index bottom; weight gradients accumulate over
    repeated indices.
    """

    param_fields = ("embed_param",)
    exact_num_bottom = 1
    exact_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.embed_param
        self.N = int(p.num_output)
        if self.N <= 0:
            raise self.error("EmbedLayer num_output must be positive.")
        self.K = int(p.input_dim)
        if self.K <= 0:
            raise self.error("EmbedLayer input_dim must be positive.")
        self.bias_term = bool(p.bias_term)
        n_params = 2 if self.bias_term else 1
        if self.params_given(n_params):
            if self.blobs[0].shape != (self.K, self.N):
                raise self.error(f"weight blob has shape {list(self.blobs[0].shape)}, expected {[self.K, self.N]}")
            if self.bias_term and self.blobs[1].shape != (self.N,):
                raise self.error(f"bias blob has shape {list(self.blobs[1].shape)}, expected {[self.N]}")
        else:
            self.blobs = [self.make_param((self.K, self.N), p.weight_filler, like=bottom[0])]
            if self.bias_term:
                self.blobs.append(self.make_param((self.N,), p.bias_filler, like=bottom[0]))
        self.param_propagate_down = [True] * len(self.blobs)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        top[0].reshape(tuple(bottom[0].shape) + (self.N,))

    def _indices(self, bottom: Blob):
        xp = bottom.xp
        data = bottom.data.reshape(-1)
        idx = data.astype(np.int64)
        bad = (idx < 0) | (idx >= self.K) | (idx.astype(data.dtype) != data)
        if bool(xp.any(bad)):
            first = int(xp.argmax(bad))
            raise self.error(
                f"index {float(data[first])!r} at position {first} is not an integer in [0, input_dim={self.K})")
        return idx

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        idx = self._indices(bottom[0])
        out = top[0].data.reshape(-1, self.N)
        out[...] = self.blobs[0].data[idx]
        if self.bias_term:
            out += self.blobs[1].data

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[0]:
            raise self.error("Can't backpropagate to EmbedLayer input.")
        g = top[0].diff.reshape(-1, self.N)
        if self.param_propagate_down[0]:
            idx = self._indices(bottom[0])
            index_add(self.blobs[0].diff, idx, g)
        if self.bias_term and self.param_propagate_down[1]:
            self.blobs[1].diff += g.sum(axis=0)

    def allow_force_backward(self, bottom_index: int) -> bool:
        """The index bottom cannot get a gradient."""
        return False
