"""Fuzzing cct's readers with mutated inputs: every outcome must be success or one of cct's errors.

Six kinds of case, each a deterministic function of ``(kind, seed)`` so a failure can be replayed:

* ``prototxt``: a net prototxt (from ``models/``, the shared upstream nets when present, and a few
  built-in small nets) with text mutations: a number replaced by an extreme value (``2147483647``,
  ``4294967295``, ``-1``, ``1e38``, ``nan``...), a byte inserted (non-UTF-8 included), flipped or
  deleted, a line deleted/duplicated/swapped, a quoted name replaced by another from the file, the
  text truncated. The net is built for TEST (Python layers refused, a small memory budget); a small
  one runs forward and backward once.
* ``caffemodel``: the weights of a small net with structural mutations of a blob (data/diff/
  double_data/double_diff lengths, shape dims, legacy 4-D fields, layer names) or byte mutations of
  the serialized file, loaded with ``Net.copy_from``.
* ``hdf5``: Caffe-layout HDF5 weights with structural mutations (dataset shapes, dtypes, names,
  missing groups) or byte mutations of the file, loaded with ``Net.copy_from``.
* ``datum``, ``mean``, ``imagelist``: data records (:mod:`cct.fuzz_data`): LMDB Datum records, mean
  files and ImageData lists with absurd, inconsistent or damaged values, read by the data layers.

:func:`run_case` returns an outcome class: ``"ok"``, ``"cct:<ErrorType>"`` (fine), or
``"other:<ExceptionType>"`` / ``"timeout"`` (a bug: a bare exception or a hang). ``tests/test_fuzz.py``
runs a few hundred cases under hypothesis; ``tools/fuzz_inputs.py`` runs thousands in worker
processes with a hard per-case timeout and prints the counts.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import re
import signal
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import Config
from .errors import CctError
from .fuzz_data import DATA_KINDS
from .fuzz_data import make as make_data_case
from .fuzz_data import run as run_data_case
from .io.prototxt import parse_text
from .io.upgrade import upgrade_net
from .net import Net
from .paths import repo_root, shared_dir
from .proto import caffe_pb2

KINDS = ("prototxt", "caffemodel", "hdf5") + DATA_KINDS
EXTREME_NUMBERS = ("0", "1", "-1", "2", "3", "7", "65536", "100000", "2147483647", "2147483648", "4294967295",
                   "-2147483648", "9223372036854775807", "18446744073709551615", "1e38", "-1e38", "1e-38",
                   "nan", "inf", "-inf", "0.5", "-0.0")
ODD_BYTES = (b"\x00", b"\xff", b"\xfe", b"\x80", b"\xc3", b"\xe2\x82", b"\t", b"\n", b"{", b"}", b'"', b"\\",
             b":", b"#", b"'", b"\xed\xa0\x80")
# Nets small enough to run forward/backward under fuzzing (2 cores, seconds per case).
SMALL_NETS = {
    "mlp": """name: "mlp"
layer { name: "data" type: "Input" top: "data" top: "label"
  input_param { shape { dim: 4 dim: 3 dim: 6 dim: 6 } shape { dim: 4 } } }
layer { name: "conv" type: "Convolution" bottom: "data" top: "conv"
  convolution_param { num_output: 4 kernel_size: 3 stride: 1 pad: 1 weight_filler { type: "xavier" } } }
layer { name: "pool" type: "Pooling" bottom: "conv" top: "pool" pooling_param { pool: MAX kernel_size: 2 stride: 2 } }
layer { name: "relu" type: "ReLU" bottom: "pool" top: "pool" }
layer { name: "norm" type: "LRN" bottom: "pool" top: "norm" lrn_param { local_size: 3 } }
layer { name: "ip" type: "InnerProduct" bottom: "norm" top: "ip" inner_product_param { num_output: 5 } }
layer { name: "drop" type: "Dropout" bottom: "ip" top: "ip" dropout_param { dropout_ratio: 0.5 } }
layer { name: "loss" type: "SoftmaxWithLoss" bottom: "ip" bottom: "label" top: "loss" }
layer { name: "acc" type: "Accuracy" bottom: "ip" bottom: "label" top: "acc" }
""",
    "structure": """name: "structure"
layer { name: "in" type: "Input" top: "a" input_param { shape { dim: 2 dim: 4 dim: 3 dim: 2 } } }
layer { name: "slice" type: "Slice" bottom: "a" top: "s1" top: "s2" slice_param { axis: 1 slice_point: 2 } }
layer { name: "cat" type: "Concat" bottom: "s1" bottom: "s2" top: "c" concat_param { axis: 1 } }
layer { name: "elt" type: "Eltwise" bottom: "c" bottom: "a" top: "e" eltwise_param { operation: PROD } }
layer { name: "resh" type: "Reshape" bottom: "e" top: "r" reshape_param { shape { dim: 0 dim: -1 } } }
layer { name: "flat" type: "Flatten" bottom: "r" top: "f" }
layer { name: "bn" type: "BatchNorm" bottom: "f" top: "b" }
layer { name: "scale" type: "Scale" bottom: "b" top: "sc" scale_param { bias_term: true } }
layer { name: "red" type: "Reduction" bottom: "sc" top: "loss" reduction_param { axis: 1 operation: SUMSQ }
  loss_weight: 1 }
""",
    "tiny_lenet": """name: "tiny_lenet"
input: "data"
input_shape { dim: 2 dim: 1 dim: 12 dim: 12 }
layer { name: "conv1" type: "Convolution" bottom: "data" top: "conv1"
  convolution_param { num_output: 3 kernel_size: 5 weight_filler { type: "gaussian" std: 0.1 } } }
layer { name: "pool1" type: "Pooling" bottom: "conv1" top: "pool1"
  pooling_param { pool: AVE kernel_size: 2 stride: 2 } }
layer { name: "ip1" type: "InnerProduct" bottom: "pool1" top: "ip1" inner_product_param { num_output: 4 } }
layer { name: "sig" type: "Sigmoid" bottom: "ip1" top: "ip1" }
layer { name: "prob" type: "Softmax" bottom: "ip1" top: "prob" }
""",
}
# Nets whose weights are fuzzed (built once, saved, mutated).
WEIGHT_NET = SMALL_NETS["tiny_lenet"]
RUN_LIMIT_BYTES = 64 << 20     # nets whose blobs (data + diff) take more are only built, not run
FUZZ_MEMORY_BUDGET = 512 << 20  # the memory budget fuzzed nets are built under


class CaseTimeout(BaseException):
    """Raised by the per-case alarm (a BaseException so that ``except Exception`` cannot swallow it)."""


@dataclass(frozen=True)
class Case:
    """One fuzz input: ``kind``, the bytes, and where it came from (for replay and reports)."""

    kind: str
    seed: int
    data: bytes
    origin: str
    mutation: str


# -- corpora ------------------------------------------------------------------------------------
def prototxt_corpus(include_shared: bool = True) -> list[tuple[str, bytes]]:
    """(name, bytes) of the seed prototxts: the built-in small nets, ``models/``, the shared nets."""
    out = [(f"builtin:{k}", v.encode()) for k, v in SMALL_NETS.items()]
    dirs = [repo_root() / "models"]
    if include_shared:
        dirs.append(shared_dir() / "caffe-models")
    for d in dirs:
        if d.is_dir():
            for p in sorted(d.rglob("*.prototxt")):
                text = p.read_bytes()
                if b"layer" in text and "solver" not in p.name:  # nets, not solvers
                    out.append((str(p.relative_to(d.parent)), text))
    return out


class BaseWeights:
    """The serialized weights (``caffemodel`` or ``hdf5``) of :data:`WEIGHT_NET` that the weight cases
    mutate, each built on first use and kept by whoever fuzzes (a test module, a fuzz worker) for its cases.
    The values are fixed (not drawn from cct's generator), so a case is the same in every process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[str, bytes] = {}

    def get(self, fmt: str) -> bytes:
        """The weights in format ``fmt`` (``"caffemodel"`` or ``"hdf5"``)."""
        with self._lock:
            if fmt not in self._bytes:

                net = Net(_net_param(WEIGHT_NET), caffe_pb2.TEST)
                values = np.random.default_rng(0)  # fixed weights: a case is the same in every process (replays)
                for blobs in net.params.values():
                    for blob in blobs:
                        blob.data[...] = values.standard_normal(blob.shape) * 0.1
                with tempfile.TemporaryDirectory(prefix="cct-fuzz-") as d:
                    path = os.path.join(d, "w.caffemodel" + (".h5" if fmt == "hdf5" else ""))
                    if fmt == "hdf5":
                        net.save_hdf5(path)
                    else:
                        net.save(path)
                    self._bytes[fmt] = Path(path).read_bytes()
            return self._bytes[fmt]


def _net_param(text: str):

    return upgrade_net(parse_text(text, caffe_pb2.NetParameter()), source="<fuzz>")


# -- mutations ----------------------------------------------------------------------------------
_NUMBER = re.compile(rb"(?<=:)\s*-?\d+(\.\d+)?(e-?\d+)?")
_QUOTED = re.compile(rb'"[^"\n]*"')


def mutate_text(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One to three random text mutations of a prototxt; returns the bytes and their description."""
    notes = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.choice(("number", "number", "number", "byte", "flip", "delete_byte", "line", "quoted",
                         "truncate", "dup_field"))
        if op == "number":
            nums = list(_NUMBER.finditer(data))
            if nums:
                m = rng.choice(nums)
                new = rng.choice(EXTREME_NUMBERS).encode()
                data = data[:m.start()] + b" " + new + data[m.end():]
                notes.append(f"number@{m.start()}={new.decode()}")
                continue
            op = "byte"
        if op == "byte":
            pos = rng.randrange(len(data) + 1)
            b = rng.choice(ODD_BYTES) if rng.random() < 0.7 else bytes([rng.randrange(256)])
            data = data[:pos] + b + data[pos:]
            notes.append(f"insert@{pos}={b!r}")
        elif op == "flip" and data:
            pos = rng.randrange(len(data))
            data = data[:pos] + bytes([data[pos] ^ (1 << rng.randrange(8))]) + data[pos + 1:]
            notes.append(f"flip@{pos}")
        elif op == "delete_byte" and data:
            pos = rng.randrange(len(data))
            data = data[:pos] + data[pos + 1:]
            notes.append(f"delete@{pos}")
        elif op == "line":
            lines = data.split(b"\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            how = rng.choice(("delete", "duplicate", "swap"))
            if how == "delete":
                del lines[i]
            elif how == "duplicate":
                lines.insert(j, lines[i])
            else:
                lines[i], lines[j] = lines[j], lines[i]
            data = b"\n".join(lines)
            notes.append(f"line-{how}:{i},{j}")
        elif op == "quoted":
            quoted = list(_QUOTED.finditer(data))
            if len(quoted) > 1:
                m, other = rng.choice(quoted), rng.choice(quoted)
                data = data[:m.start()] + other.group() + data[m.end():]
                notes.append(f"quoted@{m.start()}={other.group()[:30]!r}")
        elif op == "truncate" and data:
            pos = rng.randrange(len(data))
            data = data[:pos]
            notes.append(f"truncate@{pos}")
        elif op == "dup_field":
            nums = list(_NUMBER.finditer(data))
            if nums:  # repeat a numeric field: "dim: 3" -> "dim: 3 dim: 3"-like growth of repeated fields
                m = rng.choice(nums)
                line_start = data.rfind(b"\n", 0, m.start()) + 1
                field = data[line_start:m.end()].strip().split(b" ")[-2:]
                data = data[:m.end()] + b" " + b" ".join(field) + data[m.end():]
                notes.append(f"dup@{m.start()}")
    return data, ";".join(notes) or "none"


def mutate_bytes(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """Byte-level mutation of a binary file: flips, overwritten runs, truncation, insertion."""
    op = rng.choice(("flip", "flip", "overwrite", "truncate", "insert", "zero_run"))
    b = bytearray(data)
    if op == "flip":
        n = rng.choice((1, 2, 4, 16))
        for _ in range(n):
            pos = rng.randrange(len(b))
            b[pos] ^= 1 << rng.randrange(8)
        return bytes(b), f"flip x{n}"
    if op == "overwrite":
        pos, n = rng.randrange(len(b)), rng.choice((1, 4, 8))
        b[pos:pos + n] = bytes(rng.randrange(256) for _ in range(n))
        return bytes(b), f"overwrite@{pos}x{n}"
    if op == "truncate":
        pos = rng.randrange(len(b))
        return bytes(b[:pos]), f"truncate@{pos}"
    if op == "zero_run":
        pos, n = rng.randrange(len(b)), rng.choice((8, 64, 512))
        b[pos:pos + n] = bytes(len(b[pos:pos + n]))
        return bytes(b), f"zero@{pos}x{n}"
    pos = rng.randrange(len(b) + 1)
    ins = bytes(rng.randrange(256) for _ in range(rng.choice((1, 3, 17))))
    return bytes(b[:pos]) + ins + bytes(b[pos:]), f"insert@{pos}x{len(ins)}"


def _mutate_blob(blob, rng: random.Random) -> str:
    """A structural mutation of one BlobProto (in place)."""
    count = len(blob.data)
    op = rng.choice(("diff_len", "double_diff_len", "double_data_len", "data_len", "dim", "legacy", "add_axis",
                     "drop_shape", "diff_ok"))
    if op == "diff_len":
        blob.diff.extend([0.5] * max(count + rng.choice((-1, 1, 5)), 0))
    elif op == "double_diff_len":
        blob.double_diff.extend([0.5] * max(count + rng.choice((-1, 1)), 0))
    elif op == "double_data_len":
        blob.double_data.extend([0.25] * max(count + rng.choice((-1, 0, 1)), 0))
    elif op == "data_len":
        if rng.random() < 0.5 and count:
            del blob.data[-1]
        else:
            blob.data.append(1.0)
    elif op == "dim" and len(blob.shape.dim):
        i = rng.randrange(len(blob.shape.dim))
        blob.shape.dim[i] = int(rng.choice(EXTREME_NUMBERS[:13]).replace("18446744073709551615", "-5"))
    elif op == "legacy":
        blob.num, blob.channels, blob.height, blob.width = (rng.choice((0, 1, 2, -1, 2147483647)) for _ in range(4))
    elif op == "add_axis":
        blob.shape.dim.append(rng.choice((1, 0, 2)))
    elif op == "drop_shape":
        blob.ClearField("shape")
    else:
        blob.diff.extend([0.0] * count)
    return op


def mutate_caffemodel(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A structural (parsed) or byte-level mutation of a serialized caffemodel."""
    if rng.random() < 0.35:
        return mutate_bytes(data, rng)
    net = caffe_pb2.NetParameter()
    net.ParseFromString(data)
    with_blobs = [lp for lp in net.layer if len(lp.blobs)]
    lp = rng.choice(with_blobs)
    op = rng.choice(("blob", "blob", "blob", "extra_blob", "drop_blob", "rename", "v1"))
    if op == "blob":
        how = _mutate_blob(rng.choice(lp.blobs), rng)
        return net.SerializeToString(), f"{lp.name}:{how}"
    if op == "extra_blob":
        lp.blobs.add().CopyFrom(lp.blobs[0])
    elif op == "drop_blob":
        del lp.blobs[-1]
    elif op == "rename":
        other = rng.choice(with_blobs)
        lp.name = other.name
    else:  # legacy V1 layers field holding the same blobs
        v1 = net.layers.add()
        v1.name = lp.name
        v1.type = caffe_pb2.V1LayerParameter.INNER_PRODUCT
        v1.blobs.extend(lp.blobs)
    return net.SerializeToString(), f"{lp.name}:{op}"


def mutate_hdf5(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    """A structural mutation (rewritten with h5py) or a byte-level mutation of HDF5 weights."""
    if rng.random() < 0.4:
        return mutate_bytes(data, rng)
    import h5py

    with tempfile.TemporaryDirectory(prefix="cct-fuzz-") as d:
        path = os.path.join(d, "w.h5")
        Path(path).write_bytes(data)
        with h5py.File(path, "r+") as f:
            layers = [k for k in f["data"] if len(f["data"][k])]
            name = rng.choice(layers)
            g = f["data"][name]
            key = rng.choice(sorted(g))
            op = rng.choice(("shape", "dtype", "rename", "delete_group", "scalar", "string", "extra", "axes"))
            arr = g[key][()]
            if op == "shape":
                del g[key]
                g.create_dataset(key, data=np.zeros((arr.size + rng.choice((-1, 1)),) if arr.size > 1 else (3,),
                                                    np.float32))
            elif op == "dtype":
                del g[key]
                g.create_dataset(key, data=arr.astype(rng.choice((np.float64, np.int32, np.uint8, np.bool_))))
            elif op == "rename":
                g.move(key, rng.choice(("x", "-1", "99", "1 ")))
            elif op == "delete_group":
                del f["data"]
            elif op == "scalar":
                del g[key]
                g.create_dataset(key, data=np.float32(1))
            elif op == "string":
                del g[key]
                g.create_dataset(key, data=b"not a float array")
            elif op == "extra":
                g.create_dataset(str(len(g) + rng.choice((0, 3))), data=np.zeros(2, np.float32))
            else:
                del g[key]
                g.create_dataset(key, data=arr.reshape((1,) * rng.choice((1, 3, 28)) + arr.shape))
        return Path(path).read_bytes(), f"{name}/{key}:{op}"


def make_case(kind: str, seed: int, corpus: list[tuple[str, bytes]] | None = None,
              weights: BaseWeights | None = None) -> Case:
    """The deterministic case ``(kind, seed)``: a mutation of a net from ``corpus`` (default
    :func:`prototxt_corpus`), of ``weights`` (default: built for this case) or of a data record."""
    rng = random.Random(f"{kind}:{seed}")
    if kind == "prototxt":
        corpus = corpus if corpus is not None else prototxt_corpus()
        origin, text = rng.choice(corpus)
        data, how = mutate_text(text, rng)
    elif kind == "caffemodel":
        origin = "tiny_lenet.caffemodel"
        data, how = mutate_caffemodel((weights or BaseWeights()).get("caffemodel"), rng)
    elif kind == "hdf5":
        origin = "tiny_lenet.caffemodel.h5"
        data, how = mutate_hdf5((weights or BaseWeights()).get("hdf5"), rng)
    elif kind in DATA_KINDS:
        data, origin, how = make_data_case(kind, rng, mutate_bytes)
    else:
        raise CctError(f"unknown fuzz kind '{kind}' (one of {', '.join(KINDS)})")
    return Case(kind, seed, data, origin, how)


# -- running ------------------------------------------------------------------------------------
@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise :class:`CaseTimeout` after ``seconds`` (main thread, POSIX; elsewhere no limit)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise CaseTimeout(f"case took more than {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _fill_inputs(net) -> None:
    rng = np.random.default_rng(0)
    for name in net.input_blob_names:
        blob = net.blobs[name]
        blob.data[...] = rng.integers(0, 3, size=blob.shape) if "label" in name else rng.standard_normal(blob.shape)


def _run_prototxt(path: str, config) -> None:

    net = Net(path, caffe_pb2.TEST, config=config)
    total = sum(b.count for b in net.blobs.values()) + sum(b.count for layer in net.layers for b in layer.blobs)
    if 2 * total * net.dtype.itemsize <= RUN_LIMIT_BYTES:
        _fill_inputs(net)
        net.forward()
        net.backward()


def _run_weights(path: str, config) -> None:

    net = Net(_net_param(WEIGHT_NET), caffe_pb2.TEST, config=config)
    net.copy_from(path)
    net.forward()


def run_in(case: Case, directory: str, config) -> None:
    """Write ``case`` under ``directory`` and run it (raises whatever the run raises)."""
    if case.kind in DATA_KINDS:
        run_data_case(case.data, directory, config)
        return
    suffix = {"prototxt": ".prototxt", "caffemodel": ".caffemodel", "hdf5": ".caffemodel.h5"}[case.kind]
    path = os.path.join(directory, "case" + suffix)
    Path(path).write_bytes(case.data)
    (_run_prototxt if case.kind == "prototxt" else _run_weights)(path, config)


def run_case(case: Case, timeout: float = 20.0, workdir: str | None = None) -> str:
    """Run one case; the outcome class (see module docstring). Exceptions other than cct's are
    reported, never raised (``CaseTimeout`` too)."""
    config = Config(python_layers=False, memory_budget=FUZZ_MEMORY_BUDGET)
    with tempfile.TemporaryDirectory(prefix="cct-fuzz-", dir=workdir) as d:
        cct_log = logging.getLogger("cct")
        level, cct_log.level = cct_log.level, logging.CRITICAL + 1
        try:
            with alarm(timeout), np.errstate(all="ignore"), contextlib.redirect_stderr(io.StringIO()):
                run_in(case, d, config)
        except CaseTimeout:
            return "timeout"
        except CctError as e:
            return f"cct:{type(e).__name__}"
        except Exception as e:  # noqa: BLE001 - classifying is the point
            return f"other:{type(e).__name__}"
        finally:
            cct_log.level = level
    return "ok"


def describe(case: Case, outcome: str, error: str = "") -> str:
    """One line for a report."""
    return f"{case.kind} seed={case.seed} origin={case.origin} mutation={case.mutation} -> {outcome} {error}".rstrip()


__all__ = ["DATA_KINDS", "KINDS", "BaseWeights", "Case", "CaseTimeout", "alarm", "describe", "make_case",
           "mutate_bytes", "mutate_caffemodel", "mutate_hdf5", "mutate_text", "prototxt_corpus", "run_case", "run_in"]
