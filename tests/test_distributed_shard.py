"""Sharding of the data layers (Caffe's Skip()): rank r of N keeps records r, r+N, r+2N, ... of the
stream, so N ranks at batch b read, batch by batch, exactly what one process reads at batch N*b, and
every record once per epoch. Run in one process (the shard is a layer setting; no MPI needed)."""
import h5py
import numpy as np
import pytest
from PIL import Image

from cct.blob import Blob
from cct.data.db import LMDBWriter
from cct.data.transformer import array_to_datum
from cct.io.prototxt import parse_text
from cct.layers.data import Data, HDF5Data, ImageData
from cct.proto import caffe_pb2

RECORDS = 12


def _lmdb(tmp_path):
    path = tmp_path / "db"
    with LMDBWriter(str(path)) as w:
        for i in range(RECORDS):
            w.put(f"{i:08d}", array_to_datum(np.full((1, 2, 2), i, np.uint8), i).SerializeToString())
    return lambda b: (Data, f'''name: "d" type: "Data" top: "data" top: "label"
        data_param {{ source: "{path}" batch_size: {b} backend: LMDB }}''')


def _hdf5(tmp_path):
    names = []
    for k, rows in enumerate((range(0, 5), range(5, RECORDS))):  # two files: the stream crosses files
        f = tmp_path / f"part{k}.h5"
        with h5py.File(f, "w") as h:
            h["data"] = np.array([[r, r] for r in rows], np.float32)
            h["label"] = np.array(list(rows), np.float32)
        names.append(str(f))
    (tmp_path / "list.txt").write_text("\n".join(names) + "\n")
    return lambda b: (HDF5Data, f'''name: "d" type: "HDF5Data" top: "data" top: "label"
        hdf5_data_param {{ source: "{tmp_path / 'list.txt'}" batch_size: {b} }}''')


def _images(tmp_path):
    lines = []
    for i in range(RECORDS):
        Image.fromarray(np.full((2, 2), i, np.uint8), "L").save(tmp_path / f"im{i}.png")
        lines.append(f"im{i}.png {i}")
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    return lambda b: (ImageData, f'''name: "d" type: "ImageData" top: "data" top: "label"
        image_data_param {{ source: "{tmp_path / 'list.txt'}" root_folder: "{tmp_path}/" batch_size: {b}
        is_color: false }}''')


SOURCES = {"Data(LMDB)": _lmdb, "HDF5Data": _hdf5, "ImageData": _images}


def _layer(spec, rank=0, size=1):
    cls, text = spec
    p = parse_text(text, caffe_pb2.LayerParameter())
    p.phase = caffe_pb2.TRAIN
    layer = cls(p)
    top = [Blob(name="data"), Blob(name="label")]
    layer.setup([], top)
    if size > 1:
        layer.set_shard(rank, size)
    return layer, top


def _labels(layer, top, n):
    out = []
    for _ in range(n):
        layer.forward([], top)
        out.append(top[1].data.astype(int).tolist())
    return out


@pytest.mark.parametrize("source", sorted(SOURCES))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_shards_cover_every_record_once_per_epoch_and_match_one_process(tmp_path, source, size):
    make = SOURCES[source](tmp_path)
    b = 2 if size == 3 else 3
    batches = 2 * RECORDS // (size * b)  # two epochs
    ranks = [_layer(make(b), r, size) for r in range(size)]
    try:
        per_rank = [_labels(layer, top, batches) for layer, top in ranks]
    finally:
        for layer, _ in ranks:
            layer.close()
    for r in range(size):  # rank r takes stream positions r, r+N, ... (labels = record index)
        assert sum(per_rank[r], []) == [(k * size + r) % RECORDS for k in range(batches * b)]
    taken = sorted(sum((sum(x, []) for x in per_rank), []))
    assert taken == sorted(list(range(RECORDS)) * 2)  # each record once per epoch
    single, top = _layer(make(size * b))
    try:
        for i, batch in enumerate(_labels(single, top, batches)):
            assert sorted(batch) == sorted(sum((per_rank[r][i] for r in range(size)), []))
    finally:
        single.close()


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_shard_state_round_trip_and_uneven_stream(tmp_path, source):
    """Sharded reads continue exactly from a saved read state (what a snapshot stores per rank), and
    a record count the ranks do not divide (12 at N = 5) deals records round robin across the end of
    the data (the offset counter never wraps)."""
    make = SOURCES[source](tmp_path)
    layer, top = _layer(make(2), 1, 5)
    try:
        first = _labels(layer, top, 2)
        assert sum(first, []) == [1, 6, 11, 16 % 12]
        state = layer.get_read_state()
        assert state["offset"] == 17  # the shared record counter: stream position after the last record taken
        ahead = _labels(layer, top, 3)
        layer.set_read_state(state)
        assert layer.shard == (1, 1, 5)
        assert _labels(layer, top, 3) == ahead == [[21 % 12, 26 % 12], [31 % 12, 36 % 12], [41 % 12, 46 % 12]]
    finally:
        layer.close()
    with pytest.raises(Exception, match="shard rank 5"):
        layer2, _ = _layer(make(2))
        try:
            layer2.set_shard(5, 5)
        finally:
            layer2.close()


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_block_shards_for_unequal_batch_shares(tmp_path, source):
    """Shares 3 + 1 of a global batch of 4: rank 0 reads records 4i..4i+2, rank 1 record 4i+3."""
    make = SOURCES[source](tmp_path)
    ranks = []
    for start, count in ((0, 3), (3, 1)):
        layer, top = _layer(make(2))
        layer.set_shard(0, 4, block=(start, count))
        ranks.append((layer, top))
    try:
        a, b = (_labels(layer, top, 6) for layer, top in ranks)
    finally:
        for layer, _ in ranks:
            layer.close()
    assert a == [[(4 * i + j) % RECORDS for j in range(3)] for i in range(6)]
    assert b == [[(4 * i + 3) % RECORDS] for i in range(6)]


def test_proportional_shares():
    from cct.distributed.parallel import proportional_shares

    assert proportional_shares([1.0, 1.0], 4) == [2, 2]
    assert proportional_shares([3.0, 1.0], 8) == [6, 2]
    assert proportional_shares([100.0, 1.0], 4) == [3, 1]  # every rank keeps at least one record
    assert sum(proportional_shares([0.3, 0.5, 0.2], 7)) == 7
