"""cct.Net: builds the layer graph of a NetParameter for one phase and runs it (Caffe's Net)."""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..blob import Blob
from ..config import Config, current, runs_in_own_config
from ..device.deferred import DeviceChecks
from ..device.driver import Device, HostDevice, to_host
from ..device.random import NetRandom
from ..errors import CctError, LayerError, MemoryBudgetError, NetError
from ..io.blobproto import array_to_blobproto
from ..io.caffemodel import is_hdf5, legacy_shape_equals, read_weights, weights_from_net_param, write_caffemodel
from ..io.hdf5 import write_hdf5_weights
from ..io.int_range import values_above_int_max
from ..io.prototxt import read_net_prototxt
from ..io.upgrade import upgrade_net
from ..layers import create_layer
from ..layers.base import Layer
from ..malloc import tune_malloc
from ..membudget import INT_MAX
from ..proto import caffe_pb2
from ..random_source import RandomSource
from .flat_params import FlatParams
from .graph import filter_net, insert_splits

log = logging.getLogger("cct")

PHASES = {"TRAIN": caffe_pb2.TRAIN, "TEST": caffe_pb2.TEST, "train": caffe_pb2.TRAIN, "test": caffe_pb2.TEST}


def _phase(phase) -> int:
    if isinstance(phase, str):
        if phase not in PHASES:
            raise CctError(f"unknown phase '{phase}' (use TRAIN or TEST)")
        return PHASES[phase]
    if phase not in (caffe_pb2.TRAIN, caffe_pb2.TEST):
        raise CctError(f"unknown phase {phase!r} (use cct.TRAIN or cct.TEST)")
    return int(phase)


def _layer_failure(name: str, type_: str, stage: str, e: Exception) -> LayerError | None:
    """The LayerError naming the layer and stage for an exception raised inside it, or None to let
    ``e`` pass unchanged: errors that already name their layer, cct's typed errors (data sources,
    solver), and a Python layer's own exceptions (they pass through as in pycaffe)."""
    if isinstance(e, LayerError):
        return None
    if isinstance(e, MemoryBudgetError) or type(e) is CctError:
        return LayerError(name, type_, f"{stage}: {e}")
    if isinstance(e, CctError) or type_ == "Python":
        return None
    return LayerError(name, type_, f"{stage}: {type(e).__name__}: {e}")


class Net:
    """A Caffe net built for one phase: ordered layers, named blobs, learnable params.

    ``Net(prototxt_or_NetParameter, phase, weights=None, level=0, stages=())``. Layers run
    in prototxt order; ``forward()`` returns the total loss, ``backward()`` fills diffs.
    ``config`` (a :class:`cct.config.Config`; default :func:`cct.config.current`) is kept as
    ``net.config``: its engine settings plan the convolutions, its devices split the batches, its
    BLAS choice runs the GEMMs, also when the net runs later outside any ``using_config`` block.
    ``random`` (a :class:`cct.random_source.RandomSource`; default the config's, ``config.random``) is kept
    as ``net.random_source`` and handed to every layer before its setup: the fillers, the data layers'
    shuffles and crops and the key of the net's device random streams (``net.random``) draw from it.

    ``backward_hooks``: functions called as ``hook(i)`` right after layer ``i``'s backward (its
    parameter diffs are then final for this pass) and ``hook(None)`` when the whole backward is done;
    with a device scheduler attached only ``hook(None)`` marks final diffs. Distributed training
    starts its gradient all-reduce from such a hook (:mod:`cct.distributed.gradsync`).

    ``checks`` (a :class:`cct.device.deferred.DeviceChecks`) runs the layers' checks on device data
    (label ranges): at once on a numpy net, recorded on the device and raised at the end of
    :meth:`forward` or by :meth:`raise_deferred_errors` on a device net. ``forward(device_loss=True)``
    returns the loss as a device scalar and leaves both reads to the caller (the solver's path).
    """

    def __init__(
        self,
        net: str | os.PathLike | caffe_pb2.NetParameter,
        phase: int | str | None = None,
        weights: str | os.PathLike | Sequence[str] | None = None,
        level: int | None = None,
        stages: Iterable[str] | None = None,
        dtype=np.float32,
        config: Config | None = None,
        random: RandomSource | None = None,
    ):
        if isinstance(net, caffe_pb2.NetParameter):
            param = caffe_pb2.NetParameter()
            param.CopyFrom(net)
            param = upgrade_net(param, source=f"<NetParameter {param.name}>")
            self.source = None
        else:
            self.source = os.fspath(net)
            param = read_net_prototxt(self.source)
        if phase is not None:
            param.state.phase = _phase(phase)
        if level is not None:
            param.state.level = int(level)
        if stages is not None:
            del param.state.stage[:]
            param.state.stage.extend(stages)
        self.dtype = np.dtype(dtype)
        self.config = config if config is not None else current()
        self.random_source = random if random is not None else self.config.random
        tune_malloc()  # once per process: freed work arrays stay in the heap (see cct.malloc)
        # Runs each layer's forward/backward; the device scheduler replaces it to split batches.
        self.executor = None
        devices = self.config.devices  # --devices / cct.set_devices: split batches over several devices
        # A single GPU holds the whole net: every blob and parameter lives in its memory (xp = cupy).
        resident = devices.resident_device() if devices is not None else None
        self.device: Device = resident.memory if resident is not None else HostDevice()
        self.xp = self.device.xp
        if resident is not None:
            resident.make_current()
            resident.set_tf32(self.config.gpu.tf32)
        self.backward_hooks: list[Callable[[int | None], None]] = []
        self.checks = DeviceChecks(self.xp, deferred=self.device.is_gpu)
        self._init(param)
        if weights is not None:
            for w in [weights] if isinstance(weights, (str, os.PathLike)) else weights:
                self.copy_from(w)
        if devices is not None and resident is None:
            devices.attach(self, strict=False)

    # -- construction --------------------------------------------------------------
    @runs_in_own_config
    def _init(self, in_param: caffe_pb2.NetParameter) -> None:
        self.phase = in_param.state.phase
        filtered = filter_net(in_param, in_param.state)
        log.info("Initializing net from parameters: %s (phase %s)", in_param.name,
                 caffe_pb2.Phase.Name(self.phase))
        param = insert_splits(filtered)
        self.param = param
        self.name = param.name
        self.debug_info = param.debug_info

        self.layers: list[Layer] = []
        self.layer_names: list[str] = []
        self.blobs: OrderedDict[str, Blob] = OrderedDict()
        self.bottom_vecs: list[list[Blob]] = []
        self.top_vecs: list[list[Blob]] = []
        self.bottom_names: list[list[str]] = []
        self.top_names: list[list[str]] = []
        self.bottom_need_backward: list[list[bool]] = []
        self.layer_need_backward: list[bool] = []
        self.blob_need_backward: dict[str, bool] = {}
        self.blob_loss_weights: dict[str, float] = {}
        self.input_blob_names: list[str] = []
        # the net's random streams (Dropout, stochastic pooling): one key per net, one stream per such layer
        self.random = NetRandom(self.random_source.generator, self.device)
        # parameters
        # every layer param blob, shared ones repeated (Caffe's params_); ``params`` is pycaffe's dict
        self._all_params: list[Blob] = []
        self.param_owners: list[int] = []
        self.param_layer_indices: list[tuple[int, int]] = []
        self.param_display_names: list[str] = []
        self.learnable_params: list[Blob] = []
        self.learnable_param_ids: list[int] = []
        self.params_lr: list[float] = []
        self.params_weight_decay: list[float] = []
        self._has_lr: list[bool] = []
        self._has_decay: list[bool] = []
        self._param_names_index: dict[str, int] = {}
        #: the flat data/diff buffers of the learnable params once :meth:`flatten_params` made them
        self.flat_params: FlatParams | None = None

        available: set[str] = set()
        memory = 0
        for layer_id, lp_src in enumerate(param.layer):
            lp = caffe_pb2.LayerParameter()
            lp.CopyFrom(lp_src)
            if not lp.HasField("phase"):
                lp.phase = self.phase
            if lp.propagate_down and len(lp.propagate_down) != len(lp.bottom):
                raise LayerError(lp.name, lp.type, "propagate_down must be specified either 0 or bottom_size times")
            for field, value in values_above_int_max(lp):
                raise LayerError(lp.name, lp.type, f"{self.source or '<NetParameter>'}: {field} = {value} is above "
                                 f"INT_MAX ({INT_MAX}); Caffe reads it into a signed int")
            log.info("Creating Layer %s", lp.name)
            try:
                layer = create_layer(lp)  # Python layers: modules from sys.path only, as in Caffe
            except Exception as e:
                failure = _layer_failure(lp.name, lp.type, "create", e)
                if failure is None:
                    raise
                raise failure from e
            layer.checks = self.checks
            layer.random_source = self.random_source
            self.layers.append(layer)
            self.layer_names.append(lp.name)
            bottoms, bottom_need = [], []
            need_backward = False
            for j, bname in enumerate(lp.bottom):
                if bname not in self.blobs or bname not in available:
                    raise NetError(f"Unknown bottom blob '{bname}' (layer '{lp.name}', bottom index {j})")
                log.info("%s <- %s", lp.name, bname)
                blob_need = self.blob_need_backward[bname]
                if lp.propagate_down:
                    blob_need = bool(lp.propagate_down[j])
                bottoms.append(self.blobs[bname])
                bottom_need.append(blob_need)
                need_backward |= self.blob_need_backward[bname]
                available.discard(bname)
            tops = []
            for j, tname in enumerate(lp.top):
                in_place = j < len(lp.bottom) and lp.bottom[j] == tname
                if in_place:
                    log.info("%s -> %s (in-place)", lp.name, tname)
                    tops.append(self.blobs[tname])
                elif tname in self.blobs:
                    raise NetError(f"Top blob '{tname}' produced by multiple sources (layer '{lp.name}')")
                else:
                    log.info("%s -> %s", lp.name, tname)
                    blob = Blob((), dtype=self.dtype, device=self.device, name=tname)
                    self.blobs[tname] = blob
                    self.blob_need_backward[tname] = False
                    tops.append(blob)
                available.add(tname)
                if lp.type == "Input":
                    self.input_blob_names.append(tname)
            top_names = list(lp.top)
            if not lp.top and layer.is_loss:
                # Loss layers create their (anonymous) loss top when none is given, as Caffe does.
                tname = f"({lp.name} loss)"
                blob = Blob((), dtype=self.dtype, device=self.device, name=tname)
                self.blobs[tname] = blob
                self.blob_need_backward[tname] = False
                tops.append(blob)
                top_names.append(tname)
                available.add(tname)
            self.bottom_vecs.append(bottoms)
            self.top_vecs.append(tops)
            self.bottom_names.append(list(lp.bottom))
            self.top_names.append(top_names)
            self.bottom_need_backward.append(bottom_need)
            # lets a conv layer price only the passes it runs (force_backward brings every gradient back)
            layer.bottom_need_backward = [b or bool(param.force_backward) for b in bottom_need]
            if layer.draws_random():
                layer.random = self.random.stream(layer_id, lp.name)

            log.info("Setting up %s", lp.name)
            try:
                layer.setup(bottoms, tops)
            except ValueError as e:
                if lp.type == "Python":
                    raise  # user layers' own errors pass through unchanged, as in pycaffe
                raise LayerError(lp.name, lp.type, str(e)) from e
            except Exception as e:
                failure = _layer_failure(lp.name, lp.type, "setup", e)
                if failure is None:
                    raise
                raise failure from e
            for j, (tname, top) in enumerate(zip(top_names, tops)):
                w = layer.loss_weight(j)
                if w:
                    self.blob_loss_weights[tname] = w
                    top.diff[...] = w
                log.info("Top shape: %s", top.shape_string())
                if w:
                    log.info("    with loss weight %g", w)
                memory += top.count
            # learnable parameters (Caffe's AppendParam and the need-backward rule)
            n_params = len(layer.blobs)
            if len(lp.param) > n_params:
                raise LayerError(lp.name, lp.type,
                                 f"too many params specified: {len(lp.param)} param specs for {n_params} blob(s)")
            for pid in range(n_params):
                spec = lp.param[pid] if pid < len(lp.param) else caffe_pb2.ParamSpec()
                param_need = spec.lr_mult != 0
                need_backward |= param_need
                while len(layer.param_propagate_down) <= pid:
                    layer.param_propagate_down.append(True)
                layer.param_propagate_down[pid] = param_need
                self._append_param(layer_id, pid)
            self.layer_need_backward.append(need_backward)
            if need_backward:
                for tname in top_names:
                    self.blob_need_backward[tname] = True
        log.info("Memory required for data: %d", memory * self.dtype.itemsize)

        self._prune_backward(param.force_backward)
        self.output_blob_names = sorted(available)
        self._share_weights()
        self._layer_index = {n: i for i, n in enumerate(self.layer_names)}
        log.info("Network initialization done.")

    def _append_param(self, layer_id: int, param_id: int) -> None:
        layer = self.layers[layer_id]
        lp = layer.param  # the layer's own copy: layers such as BatchNorm pin lr_mult there
        spec = lp.param[param_id] if param_id < len(lp.param) else caffe_pb2.ParamSpec()
        pname = spec.name if param_id < len(lp.param) else ""
        self.param_display_names.append(pname or str(param_id))
        net_param_id = len(self._all_params)
        self._all_params.append(layer.blobs[param_id])
        self.param_layer_indices.append((layer_id, param_id))
        if not pname or pname not in self._param_names_index:
            self.param_owners.append(-1)
            if pname:
                self._param_names_index[pname] = net_param_id
            self.learnable_param_ids.append(len(self.learnable_params))
            self.learnable_params.append(layer.blobs[param_id])
            self._has_lr.append(spec.HasField("lr_mult"))
            self._has_decay.append(spec.HasField("decay_mult"))
            self.params_lr.append(spec.lr_mult)
            self.params_weight_decay.append(spec.decay_mult)
            return
        owner_id = self._param_names_index[pname]
        self.param_owners.append(owner_id)
        owner_layer, owner_pid = self.param_layer_indices[owner_id]
        log.info("Sharing parameters '%s' owned by layer '%s', param index %d",
                 pname, self.layer_names[owner_layer], owner_pid)
        this_blob = layer.blobs[param_id]
        owner_blob = self.layers[owner_layer].blobs[owner_pid]
        if spec.share_mode == caffe_pb2.ParamSpec.PERMISSIVE:
            if this_blob.count != owner_blob.count:
                raise NetError(
                    f"Cannot share param '{pname}' owned by layer '{self.layer_names[owner_layer]}' with layer "
                    f"'{layer.name}'; count mismatch. Owner layer param shape is {owner_blob.shape_string()}; "
                    f"sharing layer shape is {this_blob.shape_string()}")
        elif this_blob.shape != owner_blob.shape:
            raise NetError(
                f"Cannot share param '{pname}' owned by layer '{self.layer_names[owner_layer]}' with layer "
                f"'{layer.name}'; shape mismatch. Owner layer param shape is {owner_blob.shape_string()}; "
                f"sharing layer expects shape {this_blob.shape_string()}")
        lid = self.learnable_param_ids[owner_id]
        self.learnable_param_ids.append(lid)
        if spec.HasField("lr_mult"):
            if self._has_lr[lid] and spec.lr_mult != self.params_lr[lid]:
                raise NetError(f"Shared param '{pname}' has mismatched lr_mult (layer '{layer.name}')")
            self._has_lr[lid] = True
            self.params_lr[lid] = spec.lr_mult
        if spec.HasField("decay_mult"):
            if self._has_decay[lid] and spec.decay_mult != self.params_weight_decay[lid]:
                raise NetError(f"Shared param '{pname}' has mismatched decay_mult (layer '{layer.name}')")
            self._has_decay[lid] = True
            self.params_weight_decay[lid] = spec.decay_mult

    def flatten_params(self) -> FlatParams:
        """Lay the learnable parameters' data and diffs end to end in flat buffers (one per dtype) and make
        every parameter Blob, and the weight-shared copies of it, views into them (values kept; the
        solver calls this at setup). Returns :attr:`flat_params`; a second call with the views intact
        returns the same layout."""
        if self.flat_params is not None and self.flat_params.intact():
            return self.flat_params
        self.flat_params = FlatParams(self.learnable_params)
        self._share_weights()
        return self.flat_params

    def _share_weights(self) -> None:
        for i, owner in enumerate(self.param_owners):
            if owner < 0:
                continue
            blob, src = self._all_params[i], self._all_params[owner]
            blob.share_data(src, shape=blob.shape)
            blob.share_diff(src, shape=blob.shape)

    def _prune_backward(self, force_backward: bool) -> None:
        under_loss: set[str] = set()
        skip_backp: set[str] = set()
        for lid in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[lid]
            contributes = False
            skip = True
            for j, tname in enumerate(self.top_names[lid]):
                if layer.loss_weight(j) or tname in under_loss:
                    contributes = True
                if tname not in skip_backp:
                    skip = False
                if contributes and not skip:
                    break
            if self.layer_need_backward[lid] and skip:
                self.layer_need_backward[lid] = False
                self.bottom_need_backward[lid] = [False] * len(self.bottom_vecs[lid])
            if not contributes:
                self.layer_need_backward[lid] = False
            log.info("%s %s backward computation.", self.layer_names[lid],
                     "needs" if self.layer_need_backward[lid] else "does not need")
            for j, bname in enumerate(self.bottom_names[lid]):
                if contributes:
                    under_loss.add(bname)
                else:
                    self.bottom_need_backward[lid][j] = False
                if not self.bottom_need_backward[lid][j]:
                    skip_backp.add(bname)
        if force_backward:
            for lid, layer in enumerate(self.layers):
                self.layer_need_backward[lid] = True
                for j, bname in enumerate(self.bottom_names[lid]):
                    need = self.bottom_need_backward[lid][j] or layer.allow_force_backward(j)
                    self.bottom_need_backward[lid][j] = need
                    self.blob_need_backward[bname] = self.blob_need_backward.get(bname, False) or need
                layer.param_propagate_down = [True] * len(layer.blobs)

    # -- lookup ----------------------------------------------------------------------
    def layer_by_name(self, name: str) -> Layer:
        if name not in self._layer_index:
            raise KeyError(f"Unknown layer name '{name}' in net '{self.name}'")
        return self.layers[self._layer_index[name]]

    def blob_by_name(self, name: str) -> Blob:
        if name not in self.blobs:
            raise KeyError(f"Unknown blob name '{name}' in net '{self.name}'")
        return self.blobs[name]

    def has_blob(self, name: str) -> bool:
        return name in self.blobs

    def has_layer(self, name: str) -> bool:
        return name in self._layer_index

    @property
    def input_blobs(self) -> list[Blob]:
        return [self.blobs[n] for n in self.input_blob_names]

    @property
    def output_blobs(self) -> list[Blob]:
        return [self.blobs[n] for n in self.output_blob_names]

    def output_values(self) -> list[tuple[str, np.float32]]:
        """Every element of every output blob as (blob name, float32 value), in Caffe's order
        (what ``caffe test`` and the solver's test pass accumulate)."""
        return [(name, np.float32(v)) for name in self.output_blob_names
                for v in np.asarray(to_host(self.blobs[name].data), dtype=np.float32).ravel()]

    @property
    def params(self) -> OrderedDict[str, list[Blob]]:
        """Layer name -> its parameter blobs, for layers that have any, in layer order (pycaffe's
        ``net.params``). The flat list of the blobs the solver updates is :attr:`learnable_params`."""
        return OrderedDict((n, l.blobs) for n, l in zip(self.layer_names, self.layers) if l.blobs)

    layer_params = params  # older name of the same dict

    def _index(self, name_or_index: str | int | None, default: int) -> int:
        if name_or_index is None:
            return default
        if isinstance(name_or_index, str):
            if name_or_index not in self._layer_index:
                raise KeyError(f"Unknown layer name '{name_or_index}' in net '{self.name}'")
            return self._layer_index[name_or_index]
        return int(name_or_index)

    # -- running -----------------------------------------------------------------------
    @runs_in_own_config
    def forward_from_to(self, start: int, end: int, device_loss: bool = False):
        """Run layers start..end inclusive; return the loss they contribute (a float).

        ``device_loss=True``: return it as a 0-d float64 array of the net's array module (a numpy scalar
        on a numpy net) without reading device memory and without raising the failures of deferred
        checks (call :meth:`raise_deferred_errors` at the next boundary)."""
        if not (0 <= start <= end < len(self.layers)):
            raise CctError(f"forward range {start}..{end} is outside the net's {len(self.layers)} layers")
        loss = None
        i, stage = start, "reshape"
        try:
            for i in range(start, end + 1):
                stage = "reshape"
                layer, bottom, top = self.layers[i], self.bottom_vecs[i], self.top_vecs[i]
                layer.reshape(bottom, top)
                stage = "forward"
                if self.executor is None:
                    layer.forward(bottom, top)
                else:
                    self.executor.forward(i, layer, bottom, top)
                loss = self._add_loss_of(i, top, loss)
                if self.debug_info:
                    self._forward_debug_info(i)
        except Exception as e:
            failure = _layer_failure(self.layer_names[i], self.layers[i].type, stage, e)
            if failure is None:
                raise
            raise failure from e
        if loss is None:
            loss = self.xp.zeros((), dtype=np.float64)
        if device_loss:
            return loss
        self.raise_deferred_errors()
        return float(loss)

    def _add_loss_of(self, i: int, top: list[Blob], loss):
        """Seed the loss tops' diffs with their weights; ``loss`` (a 0-d float64 array or None) plus the
        weighted loss of layer ``i``'s tops, summed on the device in double precision."""
        for j, (tname, t) in enumerate(zip(self.top_names[i], top)):
            w = self.blob_loss_weights.get(tname)
            if w and self.top_names[i].index(tname) == j:
                t.diff[...] = w
                term = t.data.sum().astype(np.float64) * w
                loss = term if loss is None else loss + term
        return loss

    def raise_deferred_errors(self, context: str | None = None) -> None:
        """Raise the first failure the net's deferred checks recorded since the last call (a device read:
        call between iterations). ``context`` is appended to the message after being formatted with the
        ``iteration`` the failure happened in (e.g. ``"train net, iteration {iteration}"``)."""
        failure = self.checks.take_failure()
        if failure is None:
            return
        if context is None:
            raise failure.error
        raise failure.error.in_context(context.format(iteration=failure.iteration))

    def forward(self, start: str | int | None = None, end: str | int | None = None, device_loss: bool = False):
        """Forward over all layers (or from/to a named layer); returns the total loss (a float, or with
        ``device_loss`` a device scalar: see :meth:`forward_from_to`)."""
        return self.forward_from_to(self._index(start, 0), self._index(end, len(self.layers) - 1),
                                    device_loss=device_loss)

    @runs_in_own_config
    def backward_from_to(self, start: int, end: int) -> None:
        """Backward from layer ``start`` down to ``end`` (inclusive), skipping layers that need none."""
        if not (0 <= end <= start < len(self.layers)):
            raise CctError(f"backward range {start}..{end} is outside the net's {len(self.layers)} layers")
        i, in_layer = start, False
        try:
            for i in range(start, end - 1, -1):
                if self.layer_need_backward[i]:
                    in_layer = True
                    if self.executor is None:
                        self.layers[i].backward(self.top_vecs[i], self.bottom_need_backward[i], self.bottom_vecs[i])
                    else:
                        self.executor.backward(i, self.layers[i], self.top_vecs[i], self.bottom_need_backward[i],
                                               self.bottom_vecs[i])
                    if self.debug_info:
                        self._backward_debug_info(i)
                    in_layer = False
                    for hook in self.backward_hooks:
                        hook(i)
        except Exception as e:
            failure = _layer_failure(self.layer_names[i], self.layers[i].type, "backward", e) if in_layer else None
            if failure is None:
                raise
            raise failure from e

    def backward(self, start: str | int | None = None, end: str | int | None = None) -> None:
        """Backward over all layers (or from/to a named layer)."""
        self.backward_from_to(self._index(start, len(self.layers) - 1), self._index(end, 0))
        if self.executor is not None:
            self.executor.finish_backward()
        for hook in self.backward_hooks:
            hook(None)

    def forward_backward(self, device_loss: bool = False):
        """Forward then backward over all layers; the loss as :meth:`forward` returns it."""
        loss = self.forward(device_loss=device_loss)
        self.backward()
        return loss

    @runs_in_own_config
    def reshape(self) -> None:
        """Propagate changed input shapes through every layer."""
        for layer, bottom, top, names in zip(self.layers, self.bottom_vecs, self.top_vecs, self.top_names):
            try:
                layer.reshape(bottom, top)
            except Exception as e:
                failure = _layer_failure(layer.name, layer.type, "reshape", e)
                if failure is None:
                    raise
                raise failure from e
            for tname, t in zip(names, top):
                w = self.blob_loss_weights.get(tname)
                if w:
                    t.diff[...] = w

    def clear_param_diffs(self) -> None:
        """Zero every learnable parameter's diff: one fill per flat buffer while the params are its views."""
        flat = self.flat_params
        if flat is not None and flat.intact():
            for group in flat.groups:
                group.diff.fill(0)  # the alignment gaps between parameters are zeros anyway
            return
        for p in self.learnable_params:
            p.diff[...] = 0

    def update(self) -> None:
        """data -= diff for every learnable parameter (Caffe's Net::Update)."""
        for p in self.learnable_params:
            p.data -= p.diff

    # -- weights ------------------------------------------------------------------------
    def to_proto(self, write_diff: bool = False) -> caffe_pb2.NetParameter:
        """The net with its weights as a NetParameter (what a .caffemodel holds)."""
        out = caffe_pb2.NetParameter()
        out.name = self.name
        for layer in self.layers:
            lp = out.layer.add()
            lp.CopyFrom(layer.param)
            del lp.blobs[:]
            for b in layer.blobs:
                lp.blobs.add().CopyFrom(
                    array_to_blobproto(to_host(b.data), to_host(b.diff) if write_diff else None))
        return out

    def save(self, path: str | os.PathLike, write_diff: bool = False) -> None:
        """Write the weights as a binary .caffemodel (atomically)."""
        write_caffemodel(path, self.to_proto(write_diff))

    def save_hdf5(self, path: str | os.PathLike, write_diff: bool = False) -> None:
        """Write the weights in Caffe's HDF5 format."""
        # Caffe's ToHDF5 stores only owned params: a weight-shared layer writes nothing for its copy.
        layers = [(n, [None if self.param_owners[self._net_param_id(i, j)] >= 0 else to_host(b.data)
                       for j, b in enumerate(l.blobs)])
                  for i, (n, l) in enumerate(zip(self.layer_names, self.layers))]
        diffs = None
        if write_diff:
            diffs = [(n, [to_host(b.diff) for b in l.blobs]) for n, l in zip(self.layer_names, self.layers)]
        write_hdf5_weights(path, layers, diffs)

    def copy_from(self, path_or_param: str | os.PathLike | caffe_pb2.NetParameter,
                  format: str | None = None) -> None:
        """Copy weights by layer name from a binary .caffemodel, an HDF5 weights file (recognised by its
        content, whatever its name) or a NetParameter (Caffe's CopyTrainedLayersFrom).

        Layers absent from the net are ignored (logged); a blob count or shape mismatch is an error.
        ``format`` (``"hdf5"`` / ``"binaryproto"``) insists on one file format (pycaffe's ``load_hdf5``).
        """
        if isinstance(path_or_param, caffe_pb2.NetParameter):
            source, is_h5 = "<NetParameter>", False
            weights = weights_from_net_param(path_or_param)
        else:
            source = os.fspath(path_or_param)
            is_h5 = format == "hdf5" or (format is None and is_hdf5(source))
            weights = read_weights(source, format)
        for name, arrays in weights.items():
            if name not in self._layer_index:
                log.info("Ignoring source layer %s", name)
                continue
            lid = self._layer_index[name]
            layer = self.layers[lid]
            log.info("Copying source layer %s", name)
            # HDF5 files omit params a weight-shared layer does not own (Caffe allows fewer there).
            too_many = len(arrays) > len(layer.blobs) if is_h5 else len(arrays) != len(layer.blobs)
            if too_many:
                raise NetError(f"{source}: Incompatible number of blobs for layer {name}: "
                               f"the file has {len(arrays)}, the net has {len(layer.blobs)}")
            for j, target in enumerate(layer.blobs):
                arr = arrays[j] if j < len(arrays) else None
                if arr is None:
                    if self.param_owners[self._net_param_id(lid, j)] >= 0:
                        continue
                    raise NetError(f"{source}: Incompatible number of blobs for layer {name}")
                if arr.shape != target.shape and (is_h5 or not legacy_shape_equals(arr.shape, target.shape)):
                    raise NetError(
                        f"{source}: Cannot copy param {j} weights from layer '{name}'; shape mismatch. "
                        f"Source param shape is {' '.join(map(str, arr.shape))} ({arr.size}); target param "
                        f"shape is {target.shape_string()}. To learn this layer's parameters from scratch "
                        f"rather than copying from a saved net, rename the layer.")
                target.device.upload(arr.reshape(target.shape), out=target.data)

    def share_weights_with(self, other: Net) -> None:
        """Make this net's params views of ``other``'s by layer name (Caffe's ShareTrainedLayersWith)."""
        for name, layer in zip(other.layer_names, other.layers):
            if name not in self._layer_index:
                log.info("Ignoring source layer %s", name)
                continue
            target = self.layers[self._layer_index[name]]
            if len(target.blobs) != len(layer.blobs):
                raise NetError(f"Incompatible number of blobs for layer {name}")
            for j, (t, s) in enumerate(zip(target.blobs, layer.blobs)):
                if t.shape != s.shape:
                    raise NetError(f"Cannot share param {j} weights from layer '{name}'; shape mismatch. "
                                   f"Source param shape is {s.shape_string()}; target param shape is "
                                   f"{t.shape_string()}")
                t.share_data(s)

    def close(self) -> None:
        """Stop background work (data prefetch threads) of every layer that has any."""
        for layer in self.layers:
            close = getattr(layer, "close", None)
            if close is not None:
                close()

    # -- debug info ---------------------------------------------------------------------
    def _forward_debug_info(self, i: int) -> None:
        for tname, t in zip(self.top_names[i], self.top_vecs[i]):
            log.info("    [Forward] Layer %s, top blob %s data: %.6g", self.layer_names[i], tname, _abs_mean(t.data))
        for j, b in enumerate(self.layers[i].blobs):
            nid = self._net_param_id(i, j)
            log.info("    [Forward] Layer %s, param blob %s data: %.6g", self.layer_names[i],
                     self.param_display_names[nid], _abs_mean(b.data))

    def _backward_debug_info(self, i: int) -> None:
        for j, (bname, b) in enumerate(zip(self.bottom_names[i], self.bottom_vecs[i])):
            if self.bottom_need_backward[i][j]:
                log.info("    [Backward] Layer %s, bottom blob %s diff: %.6g", self.layer_names[i], bname,
                         _abs_mean(b.diff))
        for j, b in enumerate(self.layers[i].blobs):
            if self.layers[i].param_propagate_down[j]:
                log.info("    [Backward] Layer %s, param blob %d diff: %.6g", self.layer_names[i], j,
                         _abs_mean(b.diff))

    def update_debug_info(self) -> None:
        for nid, b in enumerate(self._all_params):
            if self.param_owners[nid] >= 0:
                continue
            lid, _ = self.param_layer_indices[nid]
            log.info("    [Update] Layer %s, param %s data: %.6g; diff: %.6g", self.layer_names[lid],
                     self.param_display_names[nid], _abs_mean(b.data), _abs_mean(b.diff))

    def _net_param_id(self, layer_id: int, param_id: int) -> int:
        return self.param_layer_indices.index((layer_id, param_id))

    def __repr__(self) -> str:
        return f"<cct.Net '{self.name}' phase={caffe_pb2.Phase.Name(self.phase)} layers={len(self.layers)}>"


def _abs_mean(a) -> float:
    return float(abs(a).mean()) if a.size else 0.0
