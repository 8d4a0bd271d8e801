"""Dense inference of a whole volume: plan, tile, run each patch, write each tile (``DenseInference``).

``DenseInference(net, ...)`` takes a built :class:`cct.Net` (TEST phase, weights loaded) whose input blob
is ``(N, C, *spatial)``. Calling it on an array ``(C, *spatial)`` (or ``spatial`` for one channel) returns
the dense output ``(C_out, *out)``; :meth:`DenseInference.run_files` streams a volume from a file to a
file tile by tile (never loading it whole), shows progress with voxels/s and ETA, and resumes an
interrupted run from the tiles already written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from ..distributed.comm import Comm, LocalComm
from ..errors import CctError
from ..progress import Progress
from .dense import METHODS, PatchRunner
from .geometry import NetGeometry, analyze, check_chain
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
    """

    def __init__(self, net, patch: Sequence[int] | None = None, mode: str = "valid", padding: str = "zero",
                 method: str = "mpf", mpf: Sequence[bool] | None = None, blob: str | None = None,
                 budget: int | None = None, pipeline: str | int = "off") -> None:
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
        self.stages: TwoStagePipeline | None = None
        self.budget = budget if budget is not None else net.config.memory_budget
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
                                  pipeline=self.pipeline)
        return choose_plan(self.net, geom, self.budget, limit, self.method, mpf=self.mpf, pipeline=self.pipeline)

    def prepare(self, spatial: Sequence[int]) -> Tiling:
        """Plan (:meth:`make_plan`), build the patch runner and the tiling for a volume of ``spatial`` shape."""
        spatial = tuple(spatial)
        if self._prepared_for != spatial:
            self.plan = self.make_plan(spatial)
            self.plan.notes = list(self.notes)
            log.debug("%s", self.plan.describe())
            self.runner = PatchRunner(self.net, self.geom, self.plan.grid, self.plan.mpf, self.method, self.blob,
                                      theta=self.plan.theta)
            self.stages = TwoStagePipeline(self.runner, self.plan.theta) if self.plan.theta else None
            self._prepared_for = spatial
        r = self.runner
        return Tiling(spatial, self.geom.field_of_view, r.patch_shape, r.out_shape, r.out_step, self.mode,
                      self.padding)

    # -- running ---------------------------------------------------------------------------
    def __call__(self, volume) -> np.ndarray:
        """Dense output ``(C_out, *out)`` of an in-memory volume (numpy array)."""
        volume = np.asarray(volume)
        spatial = self.volume_layout(volume.shape)
        vol = volume.reshape((self.channels,) + spatial)
        tiling = self.prepare(spatial)
        out = np.empty((self.runner.channels,) + tiling.output, dtype=self.net.dtype)
        for tile, result in self._results(tiling, list(tiling), lambda box: vol[(slice(None),) + tuple(box)]):
            out[(slice(None),) + tuple(slice(s, s + n) for s, n in zip(tile.start, tile.size))] = result
        return out

    def _results(self, tiling: Tiling, tiles: list[Tile], read: Callable) -> Iterator[tuple[Tile, np.ndarray]]:
        """Each tile with its output (the part inside the volume), in one stage or the two-stage pipeline."""
        def patch_of(tile: Tile) -> np.ndarray:
            return tiling.read_patch(tile, read, self.channels, dtype=self.net.dtype)

        def inside(tile: Tile, result: np.ndarray) -> np.ndarray:
            return result[(slice(None),) + tuple(slice(0, n) for n in tile.size)]

        if self.stages is not None:
            for tile, result in self.stages.results(tiles, patch_of):
                yield tile, inside(tile, result)
            return
        for tile in tiles:
            yield tile, inside(tile, self.runner.run(patch_of(tile)))

    def signature(self, input_spec: str, shape: Sequence[int], extra: str = "") -> str:
        """What identifies a job for resuming: input, net weights, plan, mode and padding."""
        h = hashlib.sha256()
        for blobs in self.net.params.values():
            for b in blobs:
                h.update(np.ascontiguousarray(b.data).tobytes())
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
                        turn(tile, result)
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
                           "pipeline": self.plan.theta, "ranks": comm.size}
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
