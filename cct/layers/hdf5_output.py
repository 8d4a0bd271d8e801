"""HDF5Output: writes its two bottoms to an HDF5 file, as Caffe's HDF5OutputLayer does.

* Setup creates (truncates) ``hdf5_output_param.file_name``.
* Forward writes bottom[0] as dataset ``data`` and bottom[1] as ``label``, each with Caffe's
  legacy 4-D shape (num, channels, height, width): missing axes are 1, so a ``(N,)`` label is
  stored as ``(N, 1, 1, 1)``; the bottoms must have the same num and at most 4 axes. float32
  nets write float32 datasets, float64 nets float64.
* Caffe creates the two datasets with ``H5LTmake_dataset``, which fails once they exist, so a
  second forward into the same file aborts; cct raises a clean error there instead. The file is
  closed after every write, so it is readable as soon as the forward returns.
* No tops, no backward (the bottoms receive no gradient).
"""
from __future__ import annotations

from collections.abc import Sequence

from ..blob import Blob
from ..device.driver import to_host
from ..errors import CctError
from .base import Layer, log, register

DATA_DATASET = "data"
LABEL_DATASET = "label"


@register("HDF5Output")
class HDF5OutputLayer(Layer):
    """Caffe's HDF5Output layer (bottoms: data, label; no tops)."""

    capturable = False
    capture_blocker = "writes its bottoms to an HDF5 file on the host"

    param_fields = ("hdf5_output_param",)
    exact_num_bottom = 2
    exact_num_top = 0

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        import h5py

        self.file_name = self.param.hdf5_output_param.file_name
        if not self.file_name:
            raise self.error("hdf5_output_param.file_name is not set")
        try:
            h5py.File(self.file_name, "w").close()
        except OSError as e:
            raise self.error(f"Failed to open HDF5 file {self.file_name}: {e}") from None

    def reshape(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        """Nothing to shape: the layer has no tops."""

    def _legacy_shape(self, blob: Blob, index: int) -> tuple[int, int, int, int]:
        try:
            return (blob.num, blob.channels, blob.height, blob.width)
        except CctError:
            raise self.error(f"bottom[{index}] has shape {list(blob.shape)}; HDF5Output writes blobs of at "
                             f"most 4 axes (Caffe's num, channels, height, width)") from None

    def forward(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        import h5py

        shapes = [self._legacy_shape(b, i) for i, b in enumerate(bottom)]
        if shapes[0][0] != shapes[1][0]:
            raise self.error(f"data blob and label blob must have the same batch size: bottom shapes "
                             f"{list(bottom[0].shape)} and {list(bottom[1].shape)}")
        log.info("Saving HDF5 file %s", self.file_name)
        try:
            with h5py.File(self.file_name, "a") as f:
                for name, blob, shape in zip((DATA_DATASET, LABEL_DATASET), bottom, shapes):
                    if name in f:
                        raise self.error(
                            f"Failed to make {blob.dtype.name} dataset '{name}' in {self.file_name}: it was "
                            f"written by an earlier forward (Caffe's HDF5Output writes one batch per file)")
                    f.create_dataset(name, data=to_host(blob.data).reshape(shape))
        except OSError as e:
            raise self.error(f"cannot write HDF5 file {self.file_name}: {e}") from None
        log.info("Successfully saved %d rows", shapes[0][0])

    def backward(self, top: Sequence[Blob], propagate_down: Sequence[bool], bottom: Sequence[Blob]) -> None:
        """No gradient (Caffe's Backward_cpu returns at once): requested bottom diffs are zero."""
        for b, prop in zip(bottom, propagate_down):
            if prop:
                b.diff[...] = 0
