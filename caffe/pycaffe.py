"""pycaffe's Net and Solver classes, adapting cct.Net and cct.solver (no logic of their own)."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

import cct
from cct.errors import CctError
from cct.layers.python_layer import PythonLayerWrapper
from cct.solver import get_solver as _get


def _py_layer(layer):
    """The user's PythonLayer object behind a ``type: "Python"`` layer, any other layer as is."""
    return layer.user if isinstance(layer, PythonLayerWrapper) else layer


class Net:
    """pycaffe's ``caffe.Net``: ``Net(prototxt, phase)``, ``Net(prototxt, weights, phase)`` or keywords."""

    def __init__(self, network_file, *args, phase=None, level=0, stages=None, weights=None, _net=None):
        if _net is not None:
            self._net = _net
            return
        if len(args) == 1:
            phase = args[0]
        elif len(args) == 2:  # deprecated pycaffe form: Net(file, weights, phase)
            weights, phase = args
        elif len(args) > 2:
            raise TypeError("Net(network_file, phase) or Net(network_file, weights, phase)")
        if phase is None:
            raise TypeError("Net() needs a phase (caffe.TRAIN or caffe.TEST)")
        self._net = cct.Net(network_file, phase, weights=weights, level=level, stages=stages or None)

    @classmethod
    def _wrap(cls, net: cct.Net) -> Net:
        return cls(None, _net=net)

    # -- pycaffe's attributes -------------------------------------------------------
    @property
    def blobs(self) -> OrderedDict[str, cct.Blob]:
        return OrderedDict(self._net.blobs)

    @property
    def blob_loss_weights(self) -> OrderedDict[str, float]:
        return OrderedDict((n, self._net.blob_loss_weights.get(n, 0.0)) for n in self._net.blobs)

    @property
    def layers(self) -> list:
        """The layers; a Python layer is the user's own object, as in pycaffe (``net.layers[0].set_roidb(...)``)."""
        return [_py_layer(layer) for layer in self._net.layers]

    @property
    def layer_dict(self) -> OrderedDict[str, object]:
        return OrderedDict(zip(self._net.layer_names, self.layers))

    @property
    def params(self) -> OrderedDict[str, list]:
        return self._net.params

    @property
    def _layer_names(self) -> list[str]:
        return list(self._net.layer_names)

    @property
    def _blob_names(self) -> list[str]:
        return list(self._net.blobs)

    @property
    def _blobs(self) -> list:
        return list(self._net.blobs.values())

    @property
    def inputs(self) -> list[str]:
        return list(self._net.input_blob_names)

    @property
    def outputs(self) -> list[str]:
        return list(self._net.output_blob_names)

    @property
    def top_names(self) -> OrderedDict[str, list[str]]:
        return OrderedDict(zip(self._net.layer_names, [list(t) for t in self._net.top_names]))

    @property
    def bottom_names(self) -> OrderedDict[str, list[str]]:
        return OrderedDict(zip(self._net.layer_names, [list(b) for b in self._net.bottom_names]))

    @property
    def phase(self) -> int:
        return self._net.phase

    # -- running --------------------------------------------------------------------
    def _layer_index(self, name: str) -> int:
        try:
            return self._net.layer_names.index(name)
        except ValueError:
            raise KeyError(f"Unknown layer name '{name}'") from None

    def _set_arrays(self, kwargs, names, field, what):
        if set(kwargs) != set(names):
            raise Exception(f"{what} arguments do not match net {'inputs' if field == 'data' else 'outputs'}.")
        for name, arr in kwargs.items():
            blob = self._net.blobs[name]
            arr = np.asarray(arr)
            if arr.ndim == 0 or blob.num_axes == 0 or arr.shape[0] != blob.shape[0]:
                raise Exception(f"{'Input' if field == 'data' else 'Diff'} is not batch sized: blob '{name}' "
                                f"has shape {list(blob.shape)}, the array has shape {list(arr.shape)}")
            if arr.shape != blob.shape:
                raise ValueError(f"blob '{name}' has shape {list(blob.shape)}; the array has shape "
                                 f"{list(arr.shape)} (reshape the blob and call net.reshape() first)")
            getattr(blob, field)[...] = arr

    def forward(self, blobs=None, start=None, end=None, **kwargs):
        """Forward; returns {output blob: data} (plus ``blobs``), as pycaffe."""
        blobs = list(blobs or [])
        start_ind = self._layer_index(start) if start is not None else 0
        if end is not None:  # start and end are layer names; the result holds the end layer's tops
            end_ind = self._layer_index(end)
            outputs = set(self._net.top_names[end_ind] + blobs)
        else:
            end_ind = len(self._net.layers) - 1
            outputs = set(self.outputs + blobs)
        if kwargs:
            self._set_arrays(kwargs, self.inputs, "data", "Input blob")
        self._net.forward_from_to(start_ind, end_ind)
        return {out: self._net.blob_by_name(out).data for out in outputs}

    def backward(self, diffs=None, start=None, end=None, **kwargs):
        """Backward; returns {input blob: diff} (plus ``diffs``), as pycaffe."""
        diffs = list(diffs or [])
        start_ind = self._layer_index(start) if start is not None else len(self._net.layers) - 1
        if end is not None:  # layer names; the result holds the end layer's bottoms
            end_ind = self._layer_index(end)
            outputs = set(self._net.bottom_names[end_ind] + diffs)
        else:
            end_ind = 0
            outputs = set(self.inputs + diffs)
        if kwargs:
            self._set_arrays(kwargs, self.outputs, "diff", "Top diff")
        self._net.backward(start_ind, end_ind)  # cct.Net.backward also completes a device scheduler's pass
        return {out: self._net.blob_by_name(out).diff for out in outputs}

    def _batch(self, blobs):
        num = len(next(iter(blobs.values())))
        batch_size = next(iter(self._net.blobs.values())).shape[0]
        remainder = num % batch_size
        num_batches = num // batch_size
        for b in range(num_batches):
            i = b * batch_size
            yield {name: blobs[name][i:i + batch_size] for name in blobs}
        if remainder > 0:
            padded = {}
            for name in blobs:
                pad_shape = (batch_size - remainder,) + tuple(np.shape(blobs[name])[1:])
                padded[name] = np.concatenate([blobs[name][-remainder:], np.zeros(pad_shape)])
            yield padded

    def forward_all(self, blobs=None, **kwargs):
        """Forward over a whole set of inputs in batches; returns {blob: all outputs}."""
        all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
        for batch in self._batch(kwargs):
            outs = self.forward(blobs=blobs, **batch)
            for out, out_blob in outs.items():
                all_outs[out].extend(out_blob.copy())
        pad = len(next(iter(all_outs.values()))) - len(next(iter(kwargs.values())))
        for out in all_outs:
            all_outs[out] = np.asarray(all_outs[out])
            if pad:
                all_outs[out] = all_outs[out][:-pad]
        return all_outs

    def forward_backward_all(self, blobs=None, diffs=None, **kwargs):
        """Forward and backward over a whole set of inputs/diffs in batches."""
        all_outs = {out: [] for out in set(self.outputs + list(blobs or []))}
        all_diffs = {diff: [] for diff in set(self.inputs + list(diffs or []))}
        forward_batches = self._batch({i: kwargs[i] for i in self.inputs if i in kwargs})
        backward_batches = self._batch({o: kwargs[o] for o in self.outputs if o in kwargs})
        for fb, bb in zip(forward_batches, backward_batches):
            for out, out_blob in self.forward(blobs=blobs, **fb).items():
                all_outs[out].extend(out_blob.copy())
            for d, d_blob in self.backward(diffs=diffs, **bb).items():
                all_diffs[d].extend(d_blob.copy())
        for store in (all_outs, all_diffs):
            for k in store:
                store[k] = np.asarray(store[k])
        pad = len(next(iter(all_outs.values()))) - len(next(iter(kwargs.values())))
        if pad:
            for store in (all_outs, all_diffs):
                for k in store:
                    store[k] = store[k][:-pad]
        return all_outs, all_diffs

    def _forward(self, start: int, end: int) -> float:
        return self._net.forward_from_to(start, end)

    def _backward(self, start: int, end: int) -> None:
        self._net.backward(start, end)

    def reshape(self) -> None:
        self._net.reshape()

    def copy_from(self, filename: str) -> None:
        self._net.copy_from(filename)

    def share_with(self, other: Net) -> None:
        self._net.share_weights_with(other._net)

    def save(self, filename: str) -> None:
        self._net.save(filename)

    def save_hdf5(self, filename: str) -> None:
        self._net.save_hdf5(filename)

    def load_hdf5(self, filename: str) -> None:
        """Copy weights from an HDF5 weights file, whatever it is called (CopyTrainedLayersFromHDF5)."""
        self._net.copy_from(filename, format="hdf5")

    def clear_param_diffs(self) -> None:
        self._net.clear_param_diffs()

    def set_input_arrays(self, data, labels) -> None:
        """Feed a MemoryData first layer (pycaffe's set_input_arrays)."""
        first = self._net.layers[0]
        if first.type != "MemoryData":
            raise CctError("set_input_arrays may only be called if the first layer is a MemoryDataLayer")
        first.set_input_arrays(data, labels)

    def __repr__(self) -> str:
        return f"<caffe.Net backed by {self._net!r}>"


class _SolverBase:
    """pycaffe's solver interface over a cct solver."""

    _type = "SGD"

    def __init__(self, filename=None, _solver=None):
        if _solver is None:
            _solver = _get(filename, solver_type=self._type)
        self._solver = _solver
        self._net = Net._wrap(_solver.net)
        self._test_nets = [Net._wrap(n) for n in _solver.test_nets]

    @property
    def net(self) -> Net:
        return self._net

    @property
    def test_nets(self) -> list[Net]:
        return self._test_nets

    @property
    def iter(self) -> int:
        return self._solver.iter

    @property
    def param(self):
        return self._solver.param

    @property
    def type(self) -> str:
        return self._solver.type

    @property
    def lr(self) -> float:
        return self._solver.lr

    def step(self, iters: int) -> None:
        self._solver.step(iters)

    def solve(self, resume_file=None) -> None:
        self._solver.solve(resume_file)

    def restore(self, filename: str) -> None:
        self._solver.restore(filename)

    def snapshot(self) -> None:
        self._solver.snapshot()

    def apply_update(self) -> None:
        self._solver.apply_update()

    def add_callback(self, on_start, on_gradients_ready) -> None:
        self._solver.add_callback(on_start, on_gradients_ready)

    def share_weights(self, net: Net) -> None:
        net._net.share_weights_with(self._solver.net)


class SGDSolver(_SolverBase):
    _type = "SGD"


class NesterovSolver(_SolverBase):
    _type = "Nesterov"


class AdaGradSolver(_SolverBase):
    _type = "AdaGrad"


class RMSPropSolver(_SolverBase):
    _type = "RMSProp"


class AdaDeltaSolver(_SolverBase):
    _type = "AdaDelta"


class AdamSolver(_SolverBase):
    _type = "Adam"


def get_solver(filename) -> _SolverBase:
    """A solver of the type the solver prototxt names (pycaffe's caffe.get_solver)."""
    s = _get(filename)
    cls = {c._type: c for c in _SolverBase.__subclasses__()}.get(s.type, _SolverBase)
    return cls(_solver=s)
