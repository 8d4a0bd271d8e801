"""Filter and BatchReindex: select or reorder the items of a batch, gradients routed back."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from .base import register
from .structure_base import StructureLayer, index_add, top_diff_safe


@register("Filter")
class FilterLayer(StructureLayer):
    """Keep the items (axis 0) of bottoms[:-1] whose selector (last bottom) is nonzero.

    As in Caffe, the very first reshape (at setup, before any selector values exist) gives
    the tops the bottoms' full batch size; later reshapes use the selector.
    """

    min_num_bottom = 2
    min_num_top = 1

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if len(top) != len(bottom) - 1:
            raise self.error(f"needs one top per filtered bottom: {len(bottom) - 1} expected, got {len(top)}")
        self.first_reshape = True
        self.num_bottom = len(bottom)

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        sel = bottom[-1]
        if sel.num_axes < 1:
            raise self.error("the selector blob needs at least one axis")
        for i in range(1, sel.num_axes):
            if sel.shape[i] != 1:
                raise self.error(
                    f"Selector blob dimensions must be singletons (1), except the first; got {list(sel.shape)}")
        for i, b in enumerate(bottom[:-1]):
            if b.num_axes < 1 or b.shape[0] != sel.shape[0]:
                raise self.error(
                    f"Each bottom should have the same 0th dimension as the selector blob: bottom[{i}] shape "
                    f"{list(b.shape)}, selector shape {list(sel.shape)}")
        xp = sel.xp
        self.indices = xp.nonzero(sel.data.reshape(-1) != 0)[0]
        n = int(self.indices.shape[0])
        if self.first_reshape:
            n = bottom[0].shape[0]
            self.first_reshape = False
        for t, b in zip(top, bottom):
            t.reshape((n,) + tuple(b.shape[1:]))

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        for t, b in zip(top, bottom):
            t.data[...] = b.data[self.indices]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[-1]:
            raise self.error("Layer cannot backpropagate to filter index inputs")
        for i, t in enumerate(top):
            if propagate_down[i]:
                diff = top_diff_safe(t, bottom)
                bottom[i].diff[...] = 0
                bottom[i].diff[self.indices] = diff

    def allow_force_backward(self, bottom_index: int) -> bool:
        """The selector gets no gradient."""
        n = len(self.param.bottom) or getattr(self, "num_bottom", 0)
        return bottom_index != n - 1


@register("BatchReindex")
class BatchReindexLayer(StructureLayer):
    """top[i] = bottom[0][bottom[1][i]] along axis 0; backward accumulates; no gradient to the indices."""

    exact_num_bottom = 2
    exact_num_top = 1

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        if bottom[1].num_axes != 1:
            raise self.error(f"the index bottom must be 1-D, got shape {list(bottom[1].shape)}")
        if bottom[0].num_axes < 1:
            raise self.error("bottom[0] needs at least one axis")
        top[0].reshape((bottom[1].shape[0],) + tuple(bottom[0].shape[1:]))

    def _indices(self, bottom):
        xp = bottom[0].xp
        r = bottom[1].data
        num = bottom[0].shape[0]
        if r.size:
            if bool(xp.any(r < 0)):
                raise self.error("Index specified for reindex layer was negative.")
            if bool(xp.any(r >= num)):
                raise self.error(f"Index specified for reindex layer was greater than batch size ({num}).")
        return r.astype(np.int64)  # truncation toward zero, as Caffe's static_cast<int>

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        idx = self._indices(bottom)
        if top[0].count == 0:
            return
        top[0].data[...] = bottom[0].data[idx]

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        if propagate_down[1]:
            raise self.error("Cannot backprop to index.")
        if not propagate_down[0]:
            return
        idx = self._indices(bottom)
        diff = top_diff_safe(top[0], bottom)
        bottom[0].diff[...] = 0
        index_add(bottom[0].diff, idx, diff)

    def allow_force_backward(self, bottom_index: int) -> bool:
        """The index bottom gets no gradient."""
        return bottom_index != 1
