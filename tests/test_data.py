"""Data pipeline: databases, DataTransformer (Caffe's semantics), Data / ImageData / HDF5Data layers."""
import os
import sys
import threading

import h5py
import lmdb
import numpy as np
import pytest
from PIL import Image

from cct import rng as cct_rng
from cct.blob import Blob
from cct.data.db import OPEN_DATABASES, LMDBWriter, open_db, parse_datum
from cct.data.decode_pool import DecodePool
from cct.data.prefetch import Prefetcher
from cct.data.transformer import DataTransformer, array_to_datum, decode_image, encode_image, image_to_datum
from cct.errors import CctError
from cct.io.blobproto import array_to_blobproto, write_binaryproto
from cct.io.prototxt import parse_text
from cct.layers.data import Data, HDF5Data, ImageData
from cct.proto import caffe_pb2
from cct.tools.compute_image_mean import compute_image_mean
from cct.tools.convert_imageset import convert_imageset

TRAIN, TEST = caffe_pb2.TRAIN, caffe_pb2.TEST


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def make_layer(cls, text, phase=TRAIN, ntop=2, dtype=np.float32):
    p = parse_text(text, caffe_pb2.LayerParameter())
    p.phase = phase
    layer = cls(p)
    top = [Blob(dtype=dtype, name=n) for n in list(p.top)[:ntop]]
    layer.setup([], top)
    return layer, top


def batches(layer, top, n):
    out = []
    for _ in range(n):
        layer.forward([], top)
        out.append([t.data.copy() for t in top])
    return out


def write_images(tmp_path, n=5, h=6, w=7, gray=False, seed=0, ext="png"):
    """n random images as files + a list file; returns (root, listfile, bgr HxWxC arrays, labels)."""
    r = np.random.default_rng(seed)
    root = tmp_path / "imgs"
    root.mkdir()
    imgs, labels, lines = [], [], []
    for i in range(n):
        if gray:
            a = r.integers(0, 256, (h, w), dtype=np.uint8)
            Image.fromarray(a, "L").save(root / f"im{i}.{ext}")
            imgs.append(a[..., None])
        else:
            rgb = r.integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(rgb, "RGB").save(root / f"im{i}.{ext}")
            imgs.append(rgb[..., ::-1])  # OpenCV order
        labels.append(i % 3 + 1)
        lines.append(f"im{i}.{ext} {labels[-1]}")
    listfile = tmp_path / "list.txt"
    listfile.write_text("\n".join(lines) + "\n")
    return str(root) + "/", str(listfile), imgs, labels


def write_lmdb(path, arrays, labels=None, keys=None):
    with LMDBWriter(str(path)) as w:
        for i, a in enumerate(arrays):
            d = array_to_datum(a, 0 if labels is None else labels[i])
            w.put(keys[i] if keys else f"{i:08d}", d.SerializeToString())
    return str(path)


def data_layer_text(source, batch, extra="", transform=""):
    return f"""name: "d" type: "Data" top: "data" top: "label"
        data_param {{ source: "{source}" batch_size: {batch} backend: LMDB {extra} }}
        transform_param {{ {transform} }}"""


def naive_transform(x, mean, scale, h_off, w_off, crop, mirror):
    """Caffe's loop, literally (x: CxHxW, mean: CxHxW array, per-channel list or None)."""
    c, hh, ww = x.shape
    oh, ow = (crop, crop) if crop else (hh, ww)
    out = np.zeros((c, oh, ow), np.float32)
    for ch in range(c):
        for h in range(oh):
            for w in range(ow):
                v = np.float32(x[ch, h_off + h, w_off + w])
                if isinstance(mean, np.ndarray):
                    v = np.float32(v - np.float32(mean[ch, h_off + h, w_off + w]))
                elif mean is not None:
                    v = np.float32(v - np.float32(mean[ch if len(mean) > 1 else 0]))
                out[ch, h, ow - 1 - w if mirror else w] = np.float32(v * np.float32(scale))
    return out


# ------------------------------------------------------------------------------------------------
# images -> convert_imageset -> LMDB -> Data layer
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("encoded", [False, True])
def test_convert_imageset_then_data_layer_gives_original_pixels(tmp_path, encoded):
    root, listfile, imgs, labels = write_images(tmp_path)
    db = str(tmp_path / "db")
    assert convert_imageset(root, listfile, db, encoded=encoded) == 5
    with open_db(db) as d:
        items = list(d.items())
    assert [k.decode() for k, _ in items] == [f"{i:08d}_im{i}.png" for i in range(5)]
    assert all(parse_datum(v).encoded == encoded for _, v in items)
    layer, top = make_layer(Data, data_layer_text(db, 5), TEST)
    other, other_top = make_layer(Data, data_layer_text(db, 5), TRAIN)  # same LMDB opened twice
    assert top[0].shape == (5, 3, 6, 7) and top[1].shape == (5,)
    (data, label), = batches(layer, top, 1)
    np.testing.assert_array_equal(batches(other, other_top, 1)[0][0], data)
    other.close()
    expect = np.stack([im.transpose(2, 0, 1) for im in imgs]).astype(np.float32)
    np.testing.assert_array_equal(data, expect)
    np.testing.assert_array_equal(label, labels)
    layer.close()


def test_encode_type_png_from_jpeg_list_and_gray(tmp_path):
    root, listfile, imgs, _ = write_images(tmp_path, gray=True)
    db = str(tmp_path / "db")
    convert_imageset(root, listfile, db, gray=True, encode_type="png")
    layer, top = make_layer(Data, data_layer_text(db, 5), TEST)
    (data, _), = batches(layer, top, 1)
    np.testing.assert_array_equal(data, np.stack([im.transpose(2, 0, 1) for im in imgs]))
    layer.close()


def test_force_color_and_force_gray_on_encoded(tmp_path):
    r = np.random.default_rng(3)
    bgr = r.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    png = encode_image(bgr, "png")
    np.testing.assert_array_equal(decode_image(png, "native"), bgr)
    d = caffe_pb2.Datum(data=png, encoded=True, label=1)
    db = str(tmp_path / "db")
    with LMDBWriter(db) as w:
        w.put("0", d.SerializeToString())
    layer, top = make_layer(Data, data_layer_text(db, 1, transform="force_gray: true"), TEST)
    (data, _), = batches(layer, top, 1)
    b, g, rr = (bgr[..., i].astype(np.int64) for i in range(3))
    gray = (b * 1868 + g * 9617 + rr * 4899 + (1 << 13)) >> 14  # OpenCV's BGR2GRAY
    assert data.shape == (1, 1, 4, 5)
    np.testing.assert_array_equal(data[0, 0], gray)
    layer.close()
    gimg = r.integers(0, 256, (4, 5, 1), dtype=np.uint8)
    d2 = caffe_pb2.Datum(data=encode_image(gimg, "png"), encoded=True)
    db2 = str(tmp_path / "db2")
    with LMDBWriter(db2) as w:
        w.put("0", d2.SerializeToString())
    layer, top = make_layer(Data, data_layer_text(db2, 1, transform="force_color: true"), TEST)
    (data, _), = batches(layer, top, 1)
    np.testing.assert_array_equal(data[0], np.repeat(gimg.transpose(2, 0, 1), 3, axis=0))
    layer.close()
    with pytest.raises(CctError, match="force_color and force_gray"):
        make_layer(Data, data_layer_text(db2, 1, transform="force_color: true force_gray: true"), TEST)


# ------------------------------------------------------------------------------------------------
# DataTransformer: Caffe's exact arithmetic and geometry
# ------------------------------------------------------------------------------------------------
def _tp(text):
    return parse_text(text, caffe_pb2.TransformationParameter())


def test_transform_mean_file_center_crop_scale_matches_caffe_loop(tmp_path):
    r = np.random.default_rng(1)
    x = r.integers(0, 256, (3, 9, 8), dtype=np.uint8)
    mean = r.uniform(0, 255, (3, 9, 8)).astype(np.float32)
    mf = str(tmp_path / "mean.binaryproto")
    write_binaryproto(mf, array_to_blobproto(mean[None], legacy_4d=True))
    t = DataTransformer(_tp(f'mean_file: "{mf}" crop_size: 5 scale: 0.017'), TEST)
    got = t(x)
    ref = naive_transform(x, mean, np.float32(0.017), (9 - 5) // 2, (8 - 5) // 2, 5, False)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("mv", [[100.0], [10.0, 120.5, 200.25]])
def test_transform_mean_value_and_scale(mv):
    x = np.random.default_rng(2).integers(0, 256, (3, 4, 5), dtype=np.uint8)
    text = " ".join(f"mean_value: {v}" for v in mv) + " scale: 0.5"
    got = DataTransformer(_tp(text), TEST)(x)
    np.testing.assert_array_equal(got, naive_transform(x, mv, 0.5, 0, 0, 0, False))


def test_transform_float64_output_uses_double_arithmetic():
    x = np.random.default_rng(2).integers(0, 256, (1, 3, 3), dtype=np.uint8)
    got = DataTransformer(_tp("mean_value: 0.1 scale: 0.3"), TEST)(x, dtype=np.float64)
    np.testing.assert_array_equal(got, (x.astype(np.float64) - float(np.float32(0.1))) * float(np.float32(0.3)))


@pytest.mark.parametrize("text", ["", "scale: 0.00390625", "mean_value: 100 scale: 0.5",
                                  "mean_value: 1 mean_value: 2 mean_value: 3 crop_size: 5", "MEANFILE crop_size: 6"])
def test_batch_transform_equals_image_by_image(tmp_path, text):
    r = np.random.default_rng(7)
    xs = [r.integers(0, 256, (3, 9, 8), dtype=np.uint8) for _ in range(5)]
    mf = str(tmp_path / "mean.binaryproto")
    write_binaryproto(mf, array_to_blobproto(r.uniform(0, 255, (1, 3, 9, 8)).astype(np.float32), legacy_4d=True))
    t = DataTransformer(_tp(text.replace("MEANFILE", f'mean_file: "{mf}"')), TEST)
    out = np.full((5,) + t.infer_shape(xs[0]), np.nan, np.float32)
    assert t.transform_batch(xs, out)
    np.testing.assert_array_equal(out, np.stack([t(x) for x in xs]))  # the same bits


def test_batch_transform_declines_random_or_mixed_batches():
    xs = [np.zeros((1, 6, 6), np.uint8)] * 3
    out = np.zeros((3, 1, 4, 4), np.float32)
    assert not DataTransformer(_tp("crop_size: 4"), TRAIN, rng=np.random.default_rng(0)).transform_batch(xs, out)
    assert not DataTransformer(_tp("mirror: true"), TEST, rng=np.random.default_rng(0)).transform_batch(
        xs, np.zeros((3, 1, 6, 6), np.float32))
    mixed = xs[:2] + [np.zeros((1, 6, 5), np.uint8)]
    assert not DataTransformer(_tp(""), TEST).transform_batch(mixed, np.zeros((3, 1, 6, 6), np.float32))
    assert DataTransformer(_tp("crop_size: 4"), TEST).transform_batch(xs, out)


def test_train_crop_is_random_within_bounds_and_mirror_flips(tmp_path):
    r = np.random.default_rng(4)
    x = r.integers(0, 256, (2, 8, 9), dtype=np.uint8)
    mean = r.uniform(0, 255, (2, 8, 9)).astype(np.float32)
    mf = str(tmp_path / "mean.binaryproto")
    write_binaryproto(mf, array_to_blobproto(mean[None], legacy_4d=True))
    t = DataTransformer(_tp(f'mean_file: "{mf}" crop_size: 4 mirror: true scale: 2'), TRAIN,
                        rng=np.random.default_rng(0))
    assert t.needs_rand
    seen = set()
    for _ in range(200):
        got = t(x)
        found = None
        for ho in range(8 - 4 + 1):
            for wo in range(9 - 4 + 1):
                for m in (False, True):
                    if np.array_equal(got, naive_transform(x, mean, 2.0, ho, wo, 4, m)):
                        found = (ho, wo, m)
        assert found is not None, "output is not a (mirrored) crop of (x - mean) * scale"
        seen.add(found)
    assert {m for _, _, m in seen} == {False, True}
    assert len({(h, w) for h, w, _ in seen}) > 15  # offsets spread over the 5x6 possibilities
    assert {h for h, _, _ in seen} == set(range(5)) and {w for _, w, _ in seen} == set(range(6))


def test_test_phase_crop_is_centre_and_deterministic():
    x = np.arange(2 * 7 * 6, dtype=np.uint8).reshape(2, 7, 6)
    t = DataTransformer(_tp("crop_size: 3"), TEST)
    assert not t.needs_rand
    np.testing.assert_array_equal(t(x), x[:, 2:5, 1:4])


def test_transform_errors():
    with pytest.raises(CctError, match="mean_file and mean_value"):
        DataTransformer(_tp('mean_file: "x" mean_value: 1'), TEST)
    t = DataTransformer(_tp("mean_value: 1 mean_value: 2"), TEST)
    with pytest.raises(CctError, match="1 mean_value or as many as channels"):
        t(np.zeros((3, 2, 2), np.uint8))
    with pytest.raises(CctError, match="crop_size 5"):
        DataTransformer(_tp("crop_size: 5"), TEST)(np.zeros((1, 4, 9), np.uint8))
    with pytest.raises(CctError, match="cannot read binaryproto"):
        DataTransformer(_tp('mean_file: "/nonexistent/mean.binaryproto"'), TEST)


def test_float_data_datum():
    x = np.random.default_rng(5).standard_normal((2, 3, 4)).astype(np.float32)
    d = array_to_datum(x, 3)
    assert not d.data and len(d.float_data) == 24
    got = DataTransformer(_tp("scale: 2"), TEST)(DataTransformer().datum_array(d))
    np.testing.assert_array_equal(got, x * np.float32(2))


# ------------------------------------------------------------------------------------------------
# compute_image_mean -> mean_file
# ------------------------------------------------------------------------------------------------
def test_compute_image_mean_loads_as_mean_file(tmp_path):
    r = np.random.default_rng(6)
    arrs = [r.integers(0, 256, (3, 5, 6), dtype=np.uint8) for _ in range(7)]
    db = write_lmdb(tmp_path / "db", arrs, list(range(7)))
    mf = str(tmp_path / "mean.binaryproto")
    mean = compute_image_mean(db, mf)
    expect = np.zeros((3, 5, 6), np.float32)
    for a in arrs:
        expect += a
    expect /= np.float32(7)
    np.testing.assert_array_equal(mean[0], expect)
    np.testing.assert_allclose(mean[0], np.mean(arrs, axis=0), rtol=1e-6)
    layer, top = make_layer(Data, data_layer_text(db, 7, transform=f'mean_file: "{mf}"'), TEST)
    (data, label), = batches(layer, top, 1)
    np.testing.assert_array_equal(data, np.stack(arrs).astype(np.float32) - expect)
    np.testing.assert_array_equal(label, np.arange(7))
    layer.close()


# ------------------------------------------------------------------------------------------------
# Data layer: order, wrap-around, rand_skip, determinism, errors
# ------------------------------------------------------------------------------------------------
def test_data_layer_wraps_around_and_logs_restart(tmp_path, caplog):
    arrs = [np.full((1, 2, 2), i, np.uint8) for i in range(3)]
    db = write_lmdb(tmp_path / "db", arrs, [10, 11, 12])
    caplog.set_level("INFO", logger="cct")
    layer, top = make_layer(Data, data_layer_text(db, 2), TEST)
    got = [b[1].tolist() for b in batches(layer, top, 3)]
    assert got == [[10, 11], [12, 10], [11, 12]]
    layer.close()
    assert "Restarting data prefetching from start." in caplog.text


def test_data_layer_single_top_and_keys_in_lexicographic_order(tmp_path):
    arrs = [np.full((1, 1, 1), v, np.uint8) for v in (2, 0, 1)]
    db = write_lmdb(tmp_path / "db", arrs, keys=["c", "a", "b"])  # stored out of order
    layer, top = make_layer(Data, f"""name: "d" type: "Data" top: "data"
        data_param {{ source: "{db}" batch_size: 3 backend: LMDB }}""", TEST, ntop=1)
    (data,), = batches(layer, top, 1)
    assert data.ravel().tolist() == [0, 1, 2]
    assert layer.allow_force_backward(0) is False
    layer.close()


def test_rand_skip_skips_fewer_than_rand_skip_records(tmp_path):
    arrs = [np.zeros((1, 1, 1), np.uint8)] * 20
    db = write_lmdb(tmp_path / "db", arrs, list(range(20)))
    firsts = set()
    for seed in range(8):
        cct_rng.set_random_seed(seed)
        layer, top = make_layer(Data, data_layer_text(db, 4, "rand_skip: 6"), TEST)
        (_, label), = batches(layer, top, 1)
        layer.close()
        start = int(label[0])
        assert 0 <= start < 6
        assert label.tolist() == [(start + i) % 20 for i in range(4)]
        firsts.add(start)
    assert len(firsts) > 1


def test_data_layer_reproducible_for_a_seed(tmp_path):
    r = np.random.default_rng(7)
    arrs = [r.integers(0, 256, (3, 10, 10), dtype=np.uint8) for _ in range(6)]
    db = write_lmdb(tmp_path / "db", arrs)
    runs = []
    for _ in range(2):
        cct_rng.set_random_seed(42)
        layer, top = make_layer(Data, data_layer_text(db, 4, transform="crop_size: 7 mirror: true"), TRAIN)
        runs.append(np.concatenate([b[0] for b in batches(layer, top, 5)]))
        layer.close()
    np.testing.assert_array_equal(runs[0], runs[1])


def test_data_layer_float64_tops_and_legacy_transform_fields(tmp_path):
    arrs = [np.full((1, 2, 2), 3, np.uint8)]
    db = write_lmdb(tmp_path / "db", arrs)
    layer, top = make_layer(Data, data_layer_text(db, 1, "scale: 0.5"), TEST, dtype=np.float64)
    (data, _), = batches(layer, top, 1)
    assert data.dtype == np.float64 and np.all(data == 1.5)
    layer.close()
    with pytest.raises(CctError, match="both set"):
        make_layer(Data, data_layer_text(db, 1, "scale: 0.5", "scale: 2"), TEST)


def test_missing_and_empty_sources_name_the_path(tmp_path):
    missing = str(tmp_path / "nope_lmdb")
    with pytest.raises(CctError, match="nope_lmdb"):
        make_layer(Data, data_layer_text(missing, 2), TEST)
    empty = str(tmp_path / "empty_lmdb")
    LMDBWriter(empty).close()
    with pytest.raises(CctError, match="empty_lmdb.*empty"):
        make_layer(Data, data_layer_text(empty, 2), TEST)
    with pytest.raises(CctError, match="missing_list.txt"):
        make_layer(ImageData, 'name: "i" type: "ImageData" top: "data" top: "label" '
                   f'image_data_param {{ source: "{tmp_path}/missing_list.txt" batch_size: 1 }}', TEST)
    (tmp_path / "empty_list.txt").write_text("\n")
    with pytest.raises(CctError, match="empty_list.txt.*empty"):
        make_layer(ImageData, 'name: "i" type: "ImageData" top: "data" top: "label" '
                   f'image_data_param {{ source: "{tmp_path}/empty_list.txt" batch_size: 1 }}', TEST)
    with pytest.raises(CctError, match="missing_h5.txt"):
        make_layer(HDF5Data, 'name: "h" type: "HDF5Data" top: "data" '
                   f'hdf5_data_param {{ source: "{tmp_path}/missing_h5.txt" batch_size: 1 }}', TEST, ntop=1)
    (tmp_path / "h5list.txt").write_text(str(tmp_path / "absent.h5") + "\n")
    with pytest.raises(CctError, match="absent.h5"):
        make_layer(HDF5Data, 'name: "h" type: "HDF5Data" top: "data" '
                   f'hdf5_data_param {{ source: "{tmp_path}/h5list.txt" batch_size: 1 }}', TEST, ntop=1)


def test_corrupt_record_names_the_key(tmp_path):
    good = array_to_datum(np.zeros((1, 2, 2), np.uint8), 1).SerializeToString()
    db = str(tmp_path / "db")
    with LMDBWriter(db) as w:
        w.put("00000000", good)
        w.put("00000001", b"\xff\xfe this is not a Datum")
        w.put("00000002", caffe_pb2.Datum(channels=1, height=2, width=2, data=b"\0").SerializeToString())
    layer, top = make_layer(Data, data_layer_text(db, 1), TEST)
    batches(layer, top, 1)
    with pytest.raises(CctError, match="00000001"):
        layer.forward([], top)
    with pytest.raises(CctError, match="00000001"):  # the failure sticks
        layer.forward([], top)
    layer.close()
    with pytest.raises(CctError, match="00000002.*corrupt"):
        parse_datum(caffe_pb2.Datum(channels=1, height=2, width=2, data=b"\0").SerializeToString(), b"00000002")


def test_leveldb_backend_without_plyvel_says_how_to_install(tmp_path, monkeypatch):
    db = write_lmdb(tmp_path / "db", [np.zeros((1, 1, 1), np.uint8)])
    monkeypatch.setitem(sys.modules, "plyvel", None)  # import plyvel -> ImportError
    text = f'name: "d" type: "Data" top: "data" data_param {{ source: "{db}" batch_size: 1 }}'  # LEVELDB default
    with pytest.raises(CctError, match=r"cct\[leveldb\].*LMDB"):
        make_layer(Data, text, TEST, ntop=1)


def test_leveldb_roundtrip(tmp_path):
    pytest.importorskip("plyvel")
    root, listfile, imgs, labels = write_images(tmp_path)
    db = str(tmp_path / "ldb")
    convert_imageset(root, listfile, db, backend="leveldb")
    text = data_layer_text(db, 5).replace("backend: LMDB", "backend: LEVELDB")
    layer, top = make_layer(Data, text, TEST)
    layer2, top2 = make_layer(Data, text, TRAIN)  # a TRAIN and a TEST net may read one database
    (data, label), = batches(layer, top, 1)
    np.testing.assert_array_equal(batches(layer2, top2, 1)[0][0], data)
    layer.close()
    layer2.close()
    np.testing.assert_array_equal(data, np.stack([im.transpose(2, 0, 1) for im in imgs]))
    np.testing.assert_array_equal(label, labels)
    np.testing.assert_allclose(compute_image_mean(db, backend="leveldb")[0], data.mean(axis=0), rtol=1e-6)


def test_lmdb_writer_grows_the_map(tmp_path):
    db = str(tmp_path / "db")
    w = LMDBWriter(db, map_size=1 << 16, commit_every=50)
    big = bytes(10000)
    for i in range(100):
        w.put(f"{i:04d}", big)
    w.close()
    env = lmdb.open(db, readonly=True, lock=False)
    assert env.stat()["entries"] == 100 and env.info()["map_size"] > 1 << 16
    env.close()
    with pytest.raises(CctError, match="already exists"):
        LMDBWriter(db)


# ------------------------------------------------------------------------------------------------
# ImageData
# ------------------------------------------------------------------------------------------------
def test_image_data_reads_resizes_and_shuffles_each_epoch(tmp_path):
    root, listfile, imgs, labels = write_images(tmp_path, n=6, h=8, w=10)
    text = ('name: "i" type: "ImageData" top: "data" top: "label" '
            f'image_data_param {{ source: "{listfile}" root_folder: "{root}" batch_size: 3 }}')
    layer, top = make_layer(ImageData, text, TEST)
    b = batches(layer, top, 2)
    layer.close()
    np.testing.assert_array_equal(np.concatenate([x[0] for x in b]),
                                  np.stack([im.transpose(2, 0, 1) for im in imgs]))
    np.testing.assert_array_equal(np.concatenate([x[1] for x in b]), labels)
    # resize: 8x10 -> 4x5 (exact 2x downscale: bilinear at half-pixel centres = mean of each 2x2 block)
    text_r = text.replace("batch_size: 3", "batch_size: 2 new_height: 4 new_width: 5 is_color: false")
    layer, top = make_layer(ImageData, text_r, TEST)
    assert top[0].shape == (2, 1, 4, 5)
    (data, _), = batches(layer, top, 1)
    layer.close()
    gray = np.asarray(Image.open(root + "im0.png").convert("RGB"))[..., ::-1]
    b_, g_, r_ = (gray[..., i].astype(np.int64) for i in range(3))
    g = ((b_ * 1868 + g_ * 9617 + r_ * 4899 + (1 << 13)) >> 14).astype(np.float64)
    blocks = g.reshape(4, 2, 5, 2).mean(axis=(1, 3))
    assert np.max(np.abs(data[0, 0] - np.rint(blocks))) <= 1
    # shuffle: every epoch is a permutation of the list, and epochs differ
    with pytest.raises(CctError, match="new_height and new_width"):
        make_layer(ImageData, text.replace("batch_size: 3", "batch_size: 3 new_height: 4"), TEST)
    cct_rng.set_random_seed(3)
    layer, top = make_layer(ImageData, text.replace("batch_size: 3", "batch_size: 6 shuffle: true"), TRAIN)
    epochs = [b[1].tolist() for b in batches(layer, top, 4)]
    layer.close()
    for e in epochs:
        assert sorted(e) == sorted(labels)
    first_pixels = []
    cct_rng.set_random_seed(3)
    layer, top = make_layer(ImageData, text.replace("batch_size: 3", "batch_size: 6 shuffle: true"), TRAIN)
    for b in batches(layer, top, 4):
        first_pixels.append(tuple(b[0][:, 0, 0, 0].tolist()))
    layer.close()
    assert len(set(first_pixels)) > 1


def test_image_data_missing_image_is_reported(tmp_path):
    (tmp_path / "l.txt").write_text("does_not_exist.png 1\n")
    with pytest.raises(CctError, match="does_not_exist.png"):
        make_layer(ImageData, 'name: "i" type: "ImageData" top: "data" top: "label" '
                   f'image_data_param {{ source: "{tmp_path}/l.txt" root_folder: "{tmp_path}/" }}', TEST)


# ------------------------------------------------------------------------------------------------
# HDF5Data
# ------------------------------------------------------------------------------------------------
def _h5(path, data, label):
    with h5py.File(path, "w") as f:
        f["data"] = data
        f["label"] = label


def test_hdf5_data_wraps_row_by_row_across_batches_and_files(tmp_path):
    _h5(tmp_path / "a.h5", np.arange(5 * 2, dtype=np.float32).reshape(5, 1, 2), np.arange(5, dtype=np.float32))
    _h5(tmp_path / "b.h5", 100 + np.arange(3 * 2, dtype=np.float32).reshape(3, 1, 2), 100 + np.arange(3.0))
    (tmp_path / "one.txt").write_text("a.h5\n")  # relative to the list file
    text = ('name: "h" type: "HDF5Data" top: "data" top: "label" '
            f'hdf5_data_param {{ source: "{tmp_path}/one.txt" batch_size: 2 }}')
    layer, top = make_layer(HDF5Data, text, TRAIN)
    assert top[0].shape == (2, 1, 2) and top[1].shape == (2,)
    got = [b[1].tolist() for b in batches(layer, top, 4)]
    layer.close()
    assert got == [[0, 1], [2, 3], [4, 0], [1, 2]]
    (tmp_path / "two.txt").write_text(f"{tmp_path}/a.h5 {tmp_path}/b.h5")
    layer, top = make_layer(HDF5Data, text.replace("one.txt", "two.txt").replace("batch_size: 2", "batch_size: 3"))
    got = [b[1].tolist() for b in batches(layer, top, 4)]
    data = batches(layer, top, 1)[0][0]
    layer.close()
    assert got == [[0, 1, 2], [3, 4, 100], [101, 102, 0], [1, 2, 3]]
    np.testing.assert_array_equal(data.reshape(3, 2), [[8, 9], [100, 101], [102, 103]])


def test_hdf5_shuffle_permutes_rows_and_missing_dataset_is_named(tmp_path):
    _h5(tmp_path / "a.h5", np.zeros((6, 2), np.float32), np.arange(6, dtype=np.float32))
    (tmp_path / "l.txt").write_text(f"{tmp_path}/a.h5\n")
    cct_rng.set_random_seed(1)
    layer, top = make_layer(HDF5Data, 'name: "h" type: "HDF5Data" top: "data" top: "label" '
                            f'hdf5_data_param {{ source: "{tmp_path}/l.txt" batch_size: 6 shuffle: true }}')
    epochs = [b[1].tolist() for b in batches(layer, top, 3)]
    layer.close()
    assert all(sorted(e) == list(range(6)) for e in epochs)
    assert any(e != list(range(6)) for e in epochs)
    with pytest.raises(CctError, match="no dataset 'weights'"):
        make_layer(HDF5Data, 'name: "h" type: "HDF5Data" top: "data" top: "weights" '
                   f'hdf5_data_param {{ source: "{tmp_path}/l.txt" batch_size: 2 }}')
    with pytest.raises(CctError, match="does not transform"):
        make_layer(HDF5Data, 'name: "h" type: "HDF5Data" top: "data" transform_param { scale: 2 } '
                   f'hdf5_data_param {{ source: "{tmp_path}/l.txt" batch_size: 2 }}', ntop=1)


# ------------------------------------------------------------------------------------------------
# Prefetcher
# ------------------------------------------------------------------------------------------------
def test_prefetcher_order_exception_and_clean_shutdown():
    state = {"i": 0}

    def produce(buf):
        state["i"] += 1
        if state["i"] == 4:
            raise ValueError("boom at 4")
        return state["i"]

    p = Prefetcher(produce, depth=2)
    assert [p.get(), p.get(), p.get()] == [1, 2, 3]
    with pytest.raises(ValueError, match="boom at 4"):
        p.get()
    with pytest.raises(ValueError, match="boom at 4"):
        p.get()
    p.close()
    before = threading.active_count()
    q = Prefetcher(lambda buf: np.zeros(3), depth=3)
    a = q.get()
    q.recycle(a)
    q.close()
    assert not q._thread.is_alive()
    assert threading.active_count() <= before


def _decode_threads() -> int:
    return sum(t.name.startswith("cct-decode") for t in threading.enumerate())


def test_decode_pool_keeps_order_and_errors_and_close_stops_its_threads():
    pool = DecodePool(workers=2)
    seen = set()

    def square(x):
        seen.add(threading.current_thread().name)
        return x * x

    assert pool.map(square, list(range(50))) == [x * x for x in range(50)]
    assert seen and all(name.startswith("cct-decode") for name in seen)  # decoded on the pool's threads
    assert pool.map(square, [3], parallel=True) == [9] and pool.map(square, [1, 2], parallel=False) == [1, 4]

    def fail_at_7(x):
        if x == 7:
            raise CctError(f"record {x} is corrupt")
        return x

    with pytest.raises(CctError, match="record 7 is corrupt"):
        pool.map(fail_at_7, list(range(20)))
    before = _decode_threads()
    pool.close()
    assert _decode_threads() <= before - 1  # this pool's threads ended
    assert pool.map(square, [2, 3]) == [4, 9]  # a later batch starts them again
    pool.close()
    assert DecodePool(workers=1).map(square, [1, 2, 3]) == [1, 4, 9]  # one worker: no thread at all


def test_data_layer_owns_its_decode_pool(tmp_path):
    root, listfile, imgs, labels = write_images(tmp_path)
    db = str(tmp_path / "db")
    convert_imageset(root, listfile, db, encoded=True)
    before = _decode_threads()
    layer, top = make_layer(Data, data_layer_text(db, 5), TEST)
    other, other_top = make_layer(Data, data_layer_text(db, 5), TEST)
    a, b = batches(layer, top, 1)[0][0], batches(other, other_top, 1)[0][0]
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, np.stack([im.transpose(2, 0, 1) for im in imgs]))
    if DecodePool().workers > 1:  # encoded records were decoded on threads: each layer's own
        assert _decode_threads() >= before + 2
    layer.close()
    other.close()
    assert _decode_threads() == before  # closing a layer stops its decoding threads


def test_open_databases_share_one_handle_per_path_and_close_with_the_last_reader(tmp_path):
    path = write_lmdb(tmp_path / "db", [np.zeros((1, 2, 2), np.uint8)] * 3)
    key = os.path.realpath(path)
    a, b = open_db(path), open_db(path)  # e.g. a TRAIN and a TEST net
    assert OPEN_DATABASES.readers("lmdb", key) == 2 and len(a) == len(b) == 3
    with pytest.raises(lmdb.Error, match="already open"):  # why the registry is per process
        lmdb.open(key, readonly=True, lock=False)
    a.close()
    assert OPEN_DATABASES.readers("lmdb", key) == 1
    assert [k for k, _ in b.items()] == [b"00000000", b"00000001", b"00000002"]
    b.close()
    assert OPEN_DATABASES.readers("lmdb", key) == 0
    lmdb.open(key, readonly=True, lock=False).close()  # closed with the last reader: free to open again


def test_image_to_datum_layout():
    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)  # HxWxC
    d = image_to_datum(img, 4)
    assert (d.channels, d.height, d.width, d.label) == (3, 2, 3, 4)
    np.testing.assert_array_equal(np.frombuffer(d.data, np.uint8).reshape(3, 2, 3), img.transpose(2, 0, 1))
