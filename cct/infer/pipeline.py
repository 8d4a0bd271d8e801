"""Dense inference of a whole volume: plan, tile, run each patch, write each tile (``DenseInference``).

``DenseInference(net, ...)`` takes a built :class:`cct.Net` (TEST phase, weights loaded) whose input blob
is ``(N, C, *spatial)``. Calling it on an array ``(C, *spatial)`` (or ``spatial`` for one channel) returns
the dense output ``(C_out, *out)``; :meth:`DenseInference.run_files` streams a volume from a file to a
file tile by tile (never loading it whole), shows progress with voxels/s and ETA, and resumes an
interrupted run from the tiles already written.

On a GPU (ZNNi section VII): a net built on a GPU (``config=cct.infer.gpu_config(N)``) runs there whole,
each input patch uploaded by the device driver and each output tile downloaded into the output's buffer;
with ``host_ram=True`` and ``device=`` a GPU, a host net keeps its activations in host RAM and runs its
convolutions on the GPU in sub-layers that fit the device budget (:mod:`cct.infer.hostsplit`); with
``device=`` and ``pipeline=`` a host net runs the CPU-GPU pipeline (its first theta layers on the host, a copy
of the rest on the device, :mod:`cct.infer.stages`). A CuPy volume gives a CuPy output, a numpy one numpy.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..device.driver import Device, device_of, to_host
from ..distributed.comm import Comm, LocalComm
from ..errors import CctError
from ..progress import Progress
from .dense import METHODS, PatchRunner
from .geometry import NetGeometry, analyze, check_chain
from .placement import copy_to_device, gemm_speedup, target_of
from .plan import InferencePlan, choose_plan, parse_pipeline, plan_for_patch
from .stages import TwoStagePipeline
from .surgery import convert_inner_products
from .tiling import Tile, Tiling
from .volume_io import InputVolume, OutputVolume

log = logging.getLogger("cct")


class DenseInference:
    """The net's output at every window position of a 2-D or 3-D volume (see module docstring).

    ``patch``: input patch shape (None: chosen by the planner under ``budget``, default the net's
    ``config.memory_budget``); ``mode``: ``"valid"`` or ``"same"``; ``padding``: ``"zero"`` or
    ``"mirror"`` (``same`` mode); ``method``: ``"mpf"`` (max-pooling fragments), ``"shift"`` (dense output
    by shifted runs of the plain net, no MPF) or ``"strided"`` (the net's own strided output); ``mpf``:
    per pooling layer, with ``method="mpf"`` (default: the planner's choice, or all with ``patch``);
    ``blob``: the output blob (default the net's last output); ``pipeline``: ``"off"``, ``"auto"`` (the
    planner picks theta with the patch, by predicted throughput) or theta, the number of convolution/pooling
    layers of the first stage of the two-stage CPU pipeline (:mod:`cct.infer.stages`; same output).
    ``device``: where the convolutions run (default the net's device: a net built on a GPU runs there);
    ``host_ram``: GPU + host RAM (activations in host RAM, convolutions on ``device`` in sub-layers);
    ``device_budget``: the device's memory budget in bytes (default its free memory; the planner's budget on
    a GPU, the sub-layers' in GPU + host RAM). A host net with ``device`` and ``pipeline`` runs the CPU-GPU
    pipeline; ``device_speedup``: the device's speed over the host's its stage is priced at (default
    :func:`cct.infer.placement.gemm_speedup`, measured once here).
    """

    def __init__(self, net, patch: Sequence[int] | None = None, mode: str = "valid", padding: str = "zero",
                 method: str = "mpf", mpf: Sequence[bool] | None = None, blob: str | None = None,
                 budget: int | None = None, pipeline: str | int = "off", device: Device | None = None,
                 host_ram: bool = False, device_budget: int | None = None,
                 device_speedup: float | None = None) -> None:
        if method not in METHODS:
            raise CctError(f"unknown method '{method}' (use {', '.join(METHODS)})")
        net, self.notes = convert_inner_products(net)
        self.net = net
        self.geom: NetGeometry = analyze(net)
        check_chain(net, self.geom)
        if blob is not None and not net.has_blob(blob):
            raise CctError(f"the net has no blob '{blob}' (outputs: {', '.join(net.output_blob_names)})")
        self.blob = blob
        self.patch = tuple(int(p) for p in patch) if patch is not None else None
        self.mode, self.padding, self.method = mode, padding, method
        self.mpf = tuple(mpf) if mpf is not None else None
        self.pipeline = parse_pipeline(pipeline)
        self.target = target_of(net.device, device, host_ram, self.pipeline != "off")
        self.device: Device = device if device is not None else net.device
        self.device_net = None
        self.device_speedup = None
        if self.target == "cpu-gpu":  # the second stage's copy of the net, on the device
            self.device_net = copy_to_device(net, self.device)
            self.device_speedup = device_speedup if device_speedup is not None else gemm_speedup(self.device)
        self.device_budget = device_budget if device_budget is not None else self.device.free_bytes()
        self.stages: TwoStagePipeline | None = None
        self.budget = budget if budget is not None else net.config.memory_budget
        if self.target == "gpu":
            self.budget = self.device_budget
        self._device_patch = self._device_out = self._host_out = None
        self.channels = int(net.blobs[self.geom.input_blob].shape[1])
        self.plan: InferencePlan | None = None
        self.runner: PatchRunner | None = None
        self._prepared_for: tuple | None = None

    # -- setup ----------------------------------------------------------------------------
    def volume_layout(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The spatial shape of a volume of ``shape`` (``spatial`` or ``(C, *spatial)``); refuses a volume
        whose axes do not fit the net (a 2-D net on a 3-D volume, a wrong channel count)."""
        nd = self.geom.num_spatial
        shape = tuple(int(d) for d in shape)
        if len(shape) == nd and self.channels == 1:
            return shape
        if len(shape) == nd + 1 and shape[0] == self.channels:
            return shape[1:]
        want = f"{nd}-D images with {self.channels} channel(s): shape {'(C, ' if self.channels > 1 else '('}" \
               f"{', '.join('zyx'[3 - nd:])})"
        raise CctError(f"a volume of shape {list(shape)} does not fit the net, which takes {want}")

    def make_plan(self, spatial: Sequence[int]) -> InferencePlan:
        """The plan for a volume of ``spatial`` shape: the ``patch`` given, fitted, or the planner's choice."""
        geom = self.geom
        step = geom.stride if self.method == "strided" else (1,) * geom.num_spatial
        probe = Tiling(tuple(spatial), geom.field_of_view, geom.field_of_view, (1,) * geom.num_spatial, step,
                       self.mode, self.padding)
        unit = (1,) * geom.num_spatial if self.method == "strided" else geom.stride
        limit = tuple(-(-o // u) for o, u in zip(probe.output, unit))
        if self.patch is not None:
            return plan_for_patch(self.net, geom, self.patch, limit, self.method, self.mpf, self.budget,
                                  pipeline=self.pipeline, target=self.planner_target, device_budget=self.device_budget,
                                  device_speedup=self.device_speedup)
        return choose_plan(self.net, geom, self.budget, limit, self.method, mpf=self.mpf, pipeline=self.pipeline,
                           target=self.planner_target, device_budget=self.device_budget,
                           device_speedup=self.device_speedup)

    @property
    def planner_target(self) -> str:
        """Where :func:`cct.infer.plan.predict` puts the convolutions (the CPU-GPU pipeline: its host net)."""
        return "host" if self.target == "cpu-gpu" else self.target

    def prepare(self, spatial: Sequence[int]) -> Tiling:
        """Plan (:meth:`make_plan`), build the patch runner and the tiling for a volume of ``spatial`` shape."""
        spatial = tuple(spatial)
        if self._prepared_for != spatial:
            self.plan = self.make_plan(spatial)
            self.plan.notes = list(self.notes)
            log.debug("%s", self.plan.describe())
            self.runner = PatchRunner(self.net, self.geom, self.plan.grid, self.plan.mpf, self.method, self.blob,
                                      theta=self.plan.theta, splits=self.plan.splits,
                                      device=self.device if self.target == "gpu+host" else None,
                                      strategies=self.plan.strategies())
            second = None
            if self.target == "cpu-gpu":
                second = PatchRunner(self.device_net, self.geom, self.plan.grid, self.plan.mpf, self.method, self.blob,
                                     theta=self.plan.theta)
            self.stages = TwoStagePipeline(self.runner, self.plan.theta, second=second) if self.plan.theta else None
            if self.device.is_gpu and self.target == "cpu-gpu":
                self._host_out = np.empty((self.runner.channels,) + self.runner.out_shape, dtype=self.net.dtype)
            if self.target == "gpu":  # the patch and the output tile in device memory, allocated once
                self._device_patch = self.device.empty((self.channels,) + self.runner.patch_shape, self.net.dtype)
                self._device_out = self.runner.new_output()
                self._host_out = np.empty((self.runner.channels,) + self.runner.out_shape, dtype=self.net.dtype)
            self._prepared_for = spatial
        r = self.runner
        return Tiling(spatial, self.geom.field_of_view, r.patch_shape, r.out_shape, r.out_step, self.mode,
                      self.padding)

    # -- running ---------------------------------------------------------------------------
    def __call__(self, volume, out=None):
        """Dense output ``(C_out, *out)`` of an in-memory volume: a numpy volume gives a numpy array, a CuPy
        volume a CuPy array on its GPU; ``out``: the array to write it into (numpy or CuPy, that shape)."""
        home = device_of(volume)
        volume = volume if home.is_gpu else np.asarray(volume)
        spatial = self.volume_layout(volume.shape)
        vol = volume.reshape((self.channels,) + spatial)
        tiling = self.prepare(spatial)
        shape = (self.runner.channels,) + tiling.output
        if out is None:
            out = home.empty(shape, dtype=self.net.dtype)
        elif tuple(out.shape) != shape:
            raise CctError(f"out= has shape {list(out.shape)}; the dense output has {list(shape)}")
        dest = device_of(out)

        def read(box):
            return home.download(vol[(slice(None),) + tuple(box)])  # the host's: the tile is cut (and padded) there

        for tile, result in self._results(tiling, list(tiling), read):
            region = out[(slice(None),) + tuple(slice(s, s + n) for s, n in zip(tile.start, tile.size))]
            if dest.is_gpu and device_of(result).is_gpu:
                region[...] = result
            elif dest.is_gpu:
                dest.upload(result, out=region)
            else:
                device_of(result).download(result, out=region)
        return out

    def _results(self, tiling: Tiling, tiles: list[Tile], read: Callable) -> Iterator[tuple[Tile, np.ndarray]]:
        """Each tile with its output (the part inside the volume), in one stage or the two-stage pipeline."""
        def patch_of(tile: Tile):
            patch = tiling.read_patch(tile, read, self.channels, dtype=self.net.dtype)
            if self._device_patch is not None:
                return self.device.upload(patch, out=self._device_patch)
            return patch

        def inside(tile: Tile, result: np.ndarray) -> np.ndarray:
            return result[(slice(None),) + tuple(slice(0, n) for n in tile.size)]

        if self.stages is not None:
            for tile, result in self.stages.results(tiles, patch_of):
                yield tile, inside(tile, result)
            return
        for tile in tiles:
            yield tile, inside(tile, self.runner.run(patch_of(tile), out=self._device_out))

    def _on_host(self, result):
        """A tile's output in host memory (downloaded into the one host buffer when it is a device's)."""
        if not device_of(result).is_gpu:
            return result
        view = self._host_out[(slice(None),) + tuple(slice(0, n) for n in result.shape[1:])]
        return self.device.download(result, out=view)

    def signature(self, input_spec: str, shape: Sequence[int], extra: str = "") -> str:
        """What identifies a job for resuming: input, net weights, plan, mode and padding."""
        h = hashlib.sha256()
        for blobs in self.net.params.values():
            for b in blobs:
                h.update(np.ascontiguousarray(to_host(b.data)).tobytes())
        h.update(str(self.net.param).encode())
        r = self.runner
        return json.dumps({"input": input_spec, "shape": list(shape), "patch": list(r.patch_shape),
                           "mpf": list(r.mpf), "method": self.method, "mode": self.mode, "padding": self.padding,
                           "blob": r.blob, "net": h.hexdigest(), "extra": extra}, sort_keys=True)

    def run_files(self, input_spec: str, output_spec: str, resume: bool = True, progress: bool = True,
                  on_tile: Callable[[Tile], None] | None = None, comm: Comm | None = None) -> dict:
        """Stream ``input_spec`` (``vol.h5[:ds]``, ``.npy``, ``.tif``) through the net into ``output_spec``
        (``out.h5[:ds]``, ``.npy`` or ``.tif``), tile by tile. ``on_tile(tile)`` is called after each tile is
        written. Returns a summary (tiles, resumed tiles, voxels, seconds, voxels/s, method).

        ``comm`` (:func:`cct.distributed.world` under ``mpiexec -n N``): the tiles still to do are dealt out
        round-robin among the ranks, which compute in parallel and write their tiles into the one output
        file in rank order (rank 0 creates it; each rank opens it for its turn), so the result, its done
        record and resuming are those of a one-process run (resumable with any number of ranks)."""
        comm = comm if comm is not None else LocalComm()
        with InputVolume(input_spec) as src:
            spatial = self.volume_layout(src.shape)
            tiling = self.prepare(spatial)
            r = self.runner
            out_shape = (r.channels,) + tiling.output
            chunks = (r.channels,) + r.out_shape
            sig = self.signature(input_spec, src.shape)
            comm.agree(sig, "the inference jobs (input, net, plan)")
            done = resumed = sink = None
            if comm.rank == 0:
                sink = OutputVolume(output_spec, out_shape, chunks, len(tiling), sig, resume)
                done, resumed = sink.done.copy(), sink.resumed
                if resumed:
                    log.info("resuming %s: %d of %d tiles already written", sink.partial, resumed, len(tiling))
                if comm.size > 1:
                    sink.close()
            done, resumed = comm.bcast_obj((done, resumed))
            has_channels = len(src.shape) == len(spatial) + 1

            def read(box):
                data = src.read(((slice(None),) if has_channels else ()) + tuple(box))
                return data if has_channels else data[None]

            def turn(tile: Tile | None, result: np.ndarray | None) -> None:
                """Every rank's write of one round, in rank order (the only open of the file at a time)."""
                for k in range(comm.size):
                    if k == comm.rank and tile is not None:
                        if comm.size == 1:
                            sink.write(tile.index, tile.start, result)
                        else:
                            out = OutputVolume(output_spec, out_shape, chunks, len(tiling), sig, create=False)
                            try:
                                out.write(tile.index, tile.start, result)
                            finally:
                                out.close()
                    if comm.size > 1:
                        comm.barrier()

            todo = [t for t in tiling if not done[t.index]]
            mine = todo[comm.rank::comm.size]
            rounds = -(-len(todo) // comm.size)
            total = sum(int(np.prod(t.size)) for t in mine)
            t0, vox = time.perf_counter(), 0
            try:
                with Progress(total, desc="infer", unit="vox", enabled=progress and comm.rank == 0,
                              unit_scale=True) as bar:
                    for tile, result in self._results(tiling, mine, read):
                        turn(tile, self._on_host(result))
                        n = int(np.prod(tile.size))
                        vox += n
                        bar.update(n)
                        elapsed = time.perf_counter() - t0
                        rate = vox / elapsed if elapsed > 0 else 0.0
                        log.info("tile %d/%d: %.0f voxels/s, ETA %.0f s", tile.index + 1, len(tiling), rate,
                                 (total - vox) / rate if rate else 0.0)
                        if on_tile is not None:
                            on_tile(tile)
                    for _ in range(rounds - len(mine)):  # this rank has fewer tiles: keep the turns in step
                        turn(None, None)
                seconds = comm.allreduce_scalar(time.perf_counter() - t0, "max")
                vox = int(comm.allreduce_scalar(vox))
                summary = {"tiles": len(tiling), "resumed_tiles": resumed, "voxels": vox, "seconds": seconds,
                           "voxels_per_second": vox / seconds if seconds > 0 else 0.0, "method": self.method,
                           "mpf": [bool(m) for m in r.mpf], "patch": list(r.patch_shape), "mode": self.mode,
                           "padding": self.padding, "output_shape": list(out_shape),
                           "pipeline": self.plan.theta, "ranks": comm.size, "target": self.target}
                if comm.rank == 0:
                    if comm.size > 1:
                        sink = OutputVolume(output_spec, out_shape, chunks, len(tiling), sig, resume=True,
                                            create=False)
                    if not sink.done.all():
                        raise CctError(f"{output_spec}: {int((~sink.done).sum())} tiles were not written")
                    sink.set_attrs({"cct_infer_method": self.method, "cct_infer_mpf": json.dumps(summary["mpf"]),
                                    "cct_infer_mode": self.mode, "cct_infer_padding": self.padding,
                                    "cct_infer_patch": json.dumps(summary["patch"])})
                    sink.finish()
            finally:
                if sink is not None:
                    sink.close()
        if comm.size > 1:
            comm.barrier()
        return summary
