"""What a solver writes and reads back between runs: snapshots (Caffe's ``.caffemodel`` + ``.solverstate``, binary
proto or HDF5, atomic writes) with cct's ``.cctstate`` beside them (random generator states, the data layers' read
positions, the device random streams, per rank under MPI), and resuming from them. A mixin of
:class:`cct.solver.solver.Solver`."""
from __future__ import annotations

import logging
import os

from ..device.driver import device_of
from ..distributed.parallel import shared_counter_states
from ..errors import CctError, SolverError
from ..io.atomic import remove_stale_temps
from ..net import Net
from ..proto import caffe_pb2
from . import snapshot

log = logging.getLogger("cct")


class SolverState:
    """Snapshots and resume of a :class:`~cct.solver.solver.Solver` (its ``param``, ``net``, ``test_nets``,
    ``history``, ``iter`` and ``current_step``)."""

    def _check_snapshot_write_permissions(self) -> None:
        if not self.param.snapshot:
            return
        if not self.param.HasField("snapshot_prefix"):
            raise SolverError(f"{self.source}: In solver params, snapshot is specified but snapshot_prefix is not")
        probe = snapshot.snapshot_filename(self.param.snapshot_prefix, self.iter, ".tempfile")
        error = None
        if self.is_root:  # only the root writes snapshots
            try:
                self._make_snapshot_dir()
                with open(probe, "w"):
                    pass
                os.remove(probe)
                prefix = self.param.snapshot_prefix
                for tmp in remove_stale_temps(os.path.dirname(prefix) or ".", os.path.basename(prefix)):
                    log.info("Removed %s (a snapshot left half-written by a killed run)", tmp)
            except OSError as e:
                error = (f"{self.source}: Cannot write to snapshot prefix '{self.param.snapshot_prefix}'. "
                         f"Make sure that the directory exists and is writable ({e.strerror}).")
        if self.comm is not None and self.comm.size > 1:
            error = self.comm.bcast_obj(error)
        if error:
            raise SolverError(error)

    def _make_snapshot_dir(self) -> None:
        d = os.path.dirname(self.param.snapshot_prefix)
        if d and not os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            log.info("Created snapshot directory %s", d)

    def snapshot_filename(self, extension: str) -> str:
        """``<snapshot_prefix>_iter_<iter><extension>``."""
        return snapshot.snapshot_filename(self.param.snapshot_prefix, self.iter, extension)

    def snapshot(self) -> str:
        """Write the weights, the solver state and cct's ``.cctstate``; returns the weights' path.

        Distributed: a collective (every rank's read position goes into the ``.cctstate``); the root
        alone writes the files."""
        p = self.param
        hdf5 = p.snapshot_format == caffe_pb2.SolverParameter.HDF5
        for gather in self.parallel.share_slices if self.parallel is not None else ():
            gather()
        extra = self._cct_state()
        if not self.is_root:
            self._last_snapshot_iter = self.iter
            return self.snapshot_filename(".caffemodel.h5" if hdf5 else ".caffemodel")
        self._make_snapshot_dir()
        if hdf5:
            model = self.snapshot_filename(".caffemodel.h5")
            log.info("Snapshotting to HDF5 file %s", model)
            self.net.save_hdf5(model, write_diff=p.snapshot_diff)
            state_file = self.snapshot_filename(".solverstate.h5")
            log.info("Snapshotting solver state to HDF5 file %s", state_file)
        else:
            model = self.snapshot_filename(".caffemodel")
            log.info("Snapshotting to binary proto file %s", model)
            self.net.save(model, write_diff=p.snapshot_diff)
            state_file = self.snapshot_filename(".solverstate")
            log.info("Snapshotting solver state to binary proto file %s", state_file)
        snapshot.write_solverstate(state_file, self.iter, model, self.current_step, self.history, hdf5=hdf5)
        snapshot.write_cctstate(snapshot.cctstate_path(state_file), extra)
        self._last_snapshot_iter = self.iter
        return model

    def _cct_state(self) -> dict:
        def read_states(net: Net) -> dict:
            out = {}
            for name, layer in zip(net.layer_names, net.layers):
                getter = getattr(layer, "get_read_state", None)
                if getter is not None:
                    s = getter()
                    if s is not None:
                        out[name] = s
            return out

        train = read_states(self.net)
        state = {
            "iter": self.iter,
            "solver_type": self.type,
            "rng": self.random_source.state(),
            "train_net": train,
            "test_nets": [read_states(n) for n in self.test_nets],
            # the device random streams (Dropout, stochastic pooling): key and position per layer
            "random_streams": {"train_net": self.net.random.state(),
                               "test_nets": [n.random.state() for n in self.test_nets]},
        }
        if self.parallel is not None:  # every rank's read position and random stream, on the root
            state["ranks"] = self.parallel.size
            state["train_net_ranks"] = self.parallel.gather_read_states(train)
            state["rng_ranks"] = self.parallel.gather_rng_states()
            state["random_streams_ranks"] = self.parallel.comm.gather_obj(self.net.random.state(), root=0)
            if self.parallel.shares is not None:
                state["shares"] = self.parallel.shares
        return state

    def restore(self, state_file: str | os.PathLike) -> None:
        """Resume from a ``.solverstate`` / ``.solverstate.h5`` (plus its ``.cctstate`` if present)."""
        path = os.fspath(state_file)
        state = snapshot.read_solverstate(path)
        self.iter = state["iter"]
        learned = state["learned_net"]
        if learned:
            if not os.path.exists(learned):
                beside = os.path.join(os.path.dirname(path), os.path.basename(learned))
                if os.path.exists(beside):
                    learned = beside
            self.net.copy_from(learned)
        self.current_step = state["current_step"]
        history = state["history"]
        if len(history) != len(self.history):
            raise SolverError(f"{path}: Incorrect length of history blobs: the file has {len(history)}, "
                              f"the {self.type} solver for this net needs {len(self.history)}")
        log.info("%sSolver: restoring history", self.type)
        for i, (h, arr) in enumerate(zip(self.history, history)):
            if h.size != arr.size:
                raise SolverError(f"{path}: history blob {i} holds {arr.size} values, the parameter has {h.size}")
            device_of(h).upload(arr.reshape(h.shape), out=h)
        extra = snapshot.cctstate_path(path)
        if os.path.exists(extra):
            self._restore_cct_state(extra)
        else:
            log.info("No %s beside %s: the RNG and data-layer read positions start afresh (as in Caffe).",
                     os.path.basename(extra), path)

    def _restore_cct_state(self, path: str) -> None:
        state = snapshot.read_cctstate(path)
        saved_ranks = int(state.get("ranks", 1))
        ranks = 1 if self.parallel is None else self.parallel.size
        rank = 0 if self.parallel is None else self.parallel.rank
        train_states = state.get("train_net", {})
        if self.parallel is not None and state.get("shares") != self.parallel.shares:
            saved_ranks = -1  # other batch shares: the ranks' positions do not carry over
        if saved_ranks == ranks and ranks > 1:
            train_states = state["train_net_ranks"][rank]
            if "rng_ranks" in state:
                self.random_source.restore(state["rng_ranks"][rank])
        elif "rng" in state:
            self.random_source.restore(state["rng"])
        self._restore_random_streams(state, path, saved_ranks == ranks, rank)

        def set_states(net: Net, states: dict, what: str) -> None:
            for name, s in states.items():
                if not net.has_layer(name):
                    log.warning("%s: layer '%s' of the %s is not in the net; its read state is ignored",
                                path, name, what)
                    continue
                setter = getattr(net.layer_by_name(name), "set_read_state", None)
                if setter is None:
                    log.warning("%s: layer '%s' cannot restore a read state; ignored", path, name)
                    continue
                setter(s)

        if saved_ranks != ranks:
            shared = shared_counter_states(state.get("train_net_ranks") or [train_states])
            counters = ", ".join(f"{n} at record {int(s.get('offset', 0))}" for n, s in sorted(shared.items()))
            if self.is_root:
                before = f"{saved_ranks} rank(s)" if saved_ranks > 0 else "other batch shares"
                log.info("%s was written by %s, this run has %d: the data read positions restart from "
                         "the shared record counter (%s)", path, before, ranks, counters or "no data layers")
            if self.parallel is not None:
                self.parallel._seed_rank_streams()
                self.parallel.shard_data(shared)
            else:
                set_states(self.net, shared, "train net")
        else:
            set_states(self.net, train_states, "train net")
        for i, (net, states) in enumerate(zip(self.test_nets, state.get("test_nets", []))):
            set_states(net, states, f"test net #{i}")
        log.info("Restored RNG state and data read positions from %s", path)

    def _restore_random_streams(self, state: dict, path: str, same_ranks: bool, rank: int) -> None:
        """The nets' device random streams continue where the snapshot left them (keys too, unless the
        rank count changed: then each rank keeps its own key and takes the saved positions)."""
        saved = state.get("random_streams")
        if saved is None:
            return
        train = saved.get("train_net", {})
        if same_ranks and "random_streams_ranks" in state:
            train = state["random_streams_ranks"][rank]
        nets = [(self.net, train, "train net")]
        nets += [(n, s, f"test net #{i}") for i, (n, s) in enumerate(zip(self.test_nets, saved.get("test_nets", [])))]
        for net, states, what in nets:
            try:
                unknown = net.random.set_state(states, keys=same_ranks)
            except CctError as e:
                raise SolverError(f"{path}: {what}: {e}") from e
            for name in unknown:
                log.warning("%s: layer '%s' of the %s draws no random numbers in this net; its random stream "
                            "state is ignored", path, name, what)
