"""Data-record fuzz cases for :mod:`cct.fuzz`: LMDB Datum records, mean files and image lists.

Each case is a set of named files (packed into the case's bytes with :func:`pack`): for ``datum`` the
records of an LMDB (``db/<key>``), for ``mean`` a valid LMDB plus a mutated ``mean.binaryproto``, for
``imagelist`` the images and the list file of an ImageData layer; ``@layer`` holds the data layer's
prototxt. Mutations: a Datum's channels/height/width absurd (0, negative, INT_MAX, 65536) or
inconsistent with its data or with the other records, ``data`` truncated, ``float_data`` of the
wrong length, ``encoded`` images that do not decode, a record's bytes damaged, an empty database;
mean files of the wrong shape or length or not a BlobProto; image lists with missing files, labels
that are not integers or overflow an int, images that do not decode or differ in size. The data
layer is built and run forward three times (every record, then a wrap-around).
"""
from __future__ import annotations

import io
import os
import random
import struct
from collections.abc import Callable

import numpy as np

from .io.blobproto import array_to_blobproto
from .io.prototxt import parse_text
from .net import Net
from .proto import caffe_pb2

DATA_KINDS = ("datum", "mean", "imagelist")
_N, _C, _H, _W = 4, 3, 6, 6  # records per database, their shape


# -- packing a case's files into bytes ---------------------------------------------------------------
def pack(files: dict[str, bytes]) -> bytes:
    """Length-prefixed (name, bytes) pairs."""
    out = bytearray()
    for name, data in files.items():
        raw = name.encode()
        out += struct.pack(">II", len(raw), len(data)) + raw + data
    return bytes(out)


def unpack(data: bytes) -> dict[str, bytes]:
    """The inverse of :func:`pack`."""
    files, pos = {}, 0
    while pos < len(data):
        n_name, n_data = struct.unpack_from(">II", data, pos)
        pos += 8
        files[data[pos:pos + n_name].decode()] = data[pos + n_name:pos + n_name + n_data]
        pos += n_name + n_data
    return files


# -- valid bases -------------------------------------------------------------------------------------
def _png(img: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    return buf.getvalue()


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and holds none (a decompression-bomb header)."""
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def _images(rng: random.Random) -> list[np.ndarray]:
    g = np.random.default_rng(rng.randrange(1 << 30))
    return [g.integers(0, 256, (_H, _W, _C), dtype=np.uint8) for _ in range(_N)]


def _datums(rng: random.Random, style: str) -> list:
    out = []
    for i, img in enumerate(_images(rng)):
        d = caffe_pb2.Datum(label=i)
        if style == "encoded":
            d.encoded, d.data = True, _png(img)
        else:
            d.channels, d.height, d.width = _C, _H, _W
            chw = img.transpose(2, 0, 1)
            if style == "float":
                d.float_data.extend((chw.astype(np.float32) / 255).ravel().tolist())
            else:
                d.data = chw.tobytes()
        out.append(d)
    return out


def _data_layer(extra: str = "") -> bytes:
    return (f'layer {{ name: "data" type: "Data" top: "data" top: "label" data_param {{ source: "@DIR@/db" '
            f'batch_size: 2 backend: LMDB }} transform_param {{ {extra} }} }}').encode()


# -- mutations ---------------------------------------------------------------------------------------
def _mutate_datum(d, rng: random.Random) -> str:
    op = rng.choice(("dims", "dims", "swap_dims", "truncate", "float_len", "both", "garbage_encoded",
                     "encoded_off", "encoded_on", "nan"))
    if op == "dims":
        field = rng.choice(("channels", "height", "width"))
        setattr(d, field, rng.choice((0, -1, 1, 65536, 2147483647, -2147483648)))
        return f"{field}={getattr(d, field)}"
    if op == "swap_dims" and not d.encoded:
        d.channels, d.height, d.width = d.height, d.channels * 2, d.width // 2  # same count, another shape
    elif op == "truncate" and d.data:
        d.data = d.data[:rng.randrange(len(d.data))]
    elif op == "float_len":
        if d.float_data:
            d.float_data.append(0.5) if rng.random() < 0.5 else d.float_data.pop()
        else:
            d.float_data.extend([0.5] * rng.choice((1, _C * _H * _W - 1, _C * _H * _W + 1)))
    elif op == "both" and d.data and not d.encoded:
        d.float_data.extend([0.25] * len(d.data))
    elif op == "garbage_encoded":
        d.encoded = True
        d.data = rng.choice((b"", b"\x89PNG\r\n\x1a\n", bytes(rng.randrange(256) for _ in range(40)),
                             d.data[:max(1, len(d.data) // 2)], _png_claiming(40000, 40000),
                             _png_claiming(10000, 10000), _png_claiming(0, 5)))
    elif op == "encoded_off" and d.encoded:
        d.encoded = False
    elif op == "encoded_on" and not d.encoded:
        d.encoded = True
    elif op == "nan" and d.float_data:
        d.float_data[rng.randrange(len(d.float_data))] = float("nan")
    else:
        d.label = rng.choice((-1, 2147483647, -2147483648))
        return f"label={d.label}"
    return op


def _datum_case(rng: random.Random, mutate_bytes: Callable) -> tuple[dict[str, bytes], str]:
    style = rng.choice(("raw", "raw", "float", "encoded"))
    datums = _datums(rng, style)
    records = {f"db/{i:08d}": d.SerializeToString() for i, d in enumerate(datums)}
    key = f"db/{rng.randrange(_N):08d}"
    how = rng.random()
    if how < 0.65:
        i = int(key[3:])
        note = _mutate_datum(datums[i], rng)
        records[key] = datums[i].SerializeToString()
    elif how < 0.95:
        records[key], note = mutate_bytes(records[key], rng)
    else:
        records, note = {}, "empty"
    crop = rng.choice(("", "", "crop_size: 4", "scale: 0.5"))
    records["@layer"] = _data_layer(crop)
    return records, f"{style}:{key[3:]}:{note}" + (f":{crop}" if crop else "")


def _mean_case(rng: random.Random, mutate_bytes: Callable) -> tuple[dict[str, bytes], str]:
    records = {f"db/{i:08d}": d.SerializeToString() for i, d in enumerate(_datums(rng, "raw"))}
    shape = [1, _C, _H, _W]
    op = rng.choice(("channels", "height", "ndim", "length", "bytes", "garbage", "ok", "with_value"))
    if op == "channels":
        shape[1] = rng.choice((1, 2, 4))
    elif op == "height":
        shape[2] = rng.choice((1, 5, 7, 12))
    elif op == "ndim":
        shape = rng.choice(([_C, _H, _W], [_H, _W], [2, _C, _H, _W], [1, 1, _C, _H, _W]))
    proto = array_to_blobproto(np.full(shape, 100.0, np.float32))
    if op == "length":
        proto.data.append(1.0) if rng.random() < 0.5 else proto.data.pop()
    data = proto.SerializeToString()
    if op == "bytes":
        data, op = mutate_bytes(data, rng)
    elif op == "garbage":
        data = rng.choice((b"", b"not a blob", bytes(rng.randrange(256) for _ in range(64))))
    records["mean.binaryproto"] = data
    extra = 'mean_file: "@DIR@/mean.binaryproto"' + (" mean_value: 1" if op == "with_value" else "")
    if rng.random() < 0.3:
        extra += " crop_size: 4"
    records["@layer"] = _data_layer(extra)
    return records, f"mean:{op}:{shape}"


def _imagelist_case(rng: random.Random, mutate_bytes: Callable) -> tuple[dict[str, bytes], str]:
    images = _images(rng)
    files = {f"img/{i}.png": _png(img) for i, img in enumerate(images)}
    lines = [f"{i}.png {i}" for i in range(_N)]
    i = rng.randrange(_N)
    op = rng.choice(("missing", "label", "label", "no_label", "garbage", "truncated", "size", "gray", "empty_file",
                     "bytes", "empty_list", "odd_line", "bomb"))
    if op == "missing":
        lines[i] = f"nothere{i}.png {i}"
    elif op == "label":
        lines[i] = f"{i}.png {rng.choice(('x', '1.5', '-', '99999999999', '2147483648', '-2147483649', '1e3'))}"
    elif op == "no_label":
        lines[i] = f"{i}.png"
    elif op == "garbage":
        files[f"img/{i}.png"] = bytes(rng.randrange(256) for _ in range(50))
    elif op == "truncated":
        files[f"img/{i}.png"] = files[f"img/{i}.png"][:rng.randrange(8, 60)]
    elif op == "size":
        files[f"img/{i}.png"] = _png(np.zeros((_H + 2, _W, _C), np.uint8))
    elif op == "gray":
        files[f"img/{i}.png"] = _png(np.zeros((_H, _W), np.uint8))
    elif op == "empty_file":
        files[f"img/{i}.png"] = b""
    elif op == "bytes":
        files[f"img/{i}.png"], op = mutate_bytes(files[f"img/{i}.png"], rng)
    elif op == "empty_list":
        lines = []
    elif op == "bomb":
        files[f"img/{i}.png"] = _png_claiming(*rng.choice(((40000, 40000), (10000, 10000), (1, 0))))
    else:
        lines.insert(i, rng.choice(("", "   ", "\t", "a b c", "\xff.png 1")))
    files["list.txt"] = ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
    resize = rng.choice(("", "", "new_height: 4 new_width: 5"))
    files["@layer"] = (f'layer {{ name: "data" type: "ImageData" top: "data" top: "label" image_data_param {{ '
                       f'source: "@DIR@/list.txt" root_folder: "@DIR@/img/" batch_size: 2 {resize} }} }}').encode()
    return files, f"{op}:line {i}" + (f":{resize}" if resize else "")


def make(kind: str, rng: random.Random, mutate_bytes: Callable) -> tuple[bytes, str, str]:
    """The case's bytes, origin and mutation for data kind ``kind``."""
    build = {"datum": _datum_case, "mean": _mean_case, "imagelist": _imagelist_case}[kind]
    files, how = build(rng, mutate_bytes)
    return pack(files), f"{kind} (4 records of {_C}x{_H}x{_W})", how


# -- running -----------------------------------------------------------------------------------------
def run(data: bytes, workdir: str, config) -> None:
    """Write the case's files under ``workdir`` (records into an LMDB) and run its data layer forward 3 times."""
    import lmdb


    files = unpack(data)
    layer = files.pop("@layer").decode().replace("@DIR@", workdir)
    records = {k[3:].encode(): v for k, v in files.items() if k.startswith("db/")}
    db_path = os.path.join(workdir, "db")
    env = lmdb.open(db_path, map_size=1 << 24)
    with env.begin(write=True) as txn:
        for key, value in records.items():
            txn.put(key, value)
    env.close()
    for name, content in files.items():
        if not name.startswith("db/"):
            path = os.path.join(workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content)
    net = Net(_net_param(layer), caffe_pb2.TEST, config=config)
    try:
        for _ in range(3):
            net.forward()
    finally:
        net.close()


def _net_param(layer: str):

    return parse_text(f'name: "fuzz_data"\n{layer}\n', caffe_pb2.NetParameter(), source="<fuzz data layer>")
