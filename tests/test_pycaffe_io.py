"""caffe.io: datum and blobproto conversions, image loading and resizing, oversampling, Transformer."""
import numpy as np
import pytest
from PIL import Image

import caffe
from caffe.proto import caffe_pb2


# -- datums -------------------------------------------------------------------------------------------
def test_datum_uint8_round_trip():
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    datum = caffe.io.array_to_datum(arr, label=7)
    assert (datum.channels, datum.height, datum.width, datum.label) == (2, 3, 4, 7)
    assert datum.data == arr.tobytes() and len(datum.float_data) == 0
    back = caffe.io.datum_to_array(datum)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, arr)
    back[0, 0, 0] = 99  # a writable copy, as pycaffe's np.fromstring gives
    parsed = caffe_pb2.Datum()
    parsed.ParseFromString(datum.SerializeToString())
    np.testing.assert_array_equal(caffe.io.datum_to_array(parsed), arr)


def test_datum_float_round_trip_and_errors():
    arr = np.linspace(-1, 1, 12).reshape(3, 2, 2)
    datum = caffe.io.array_to_datum(arr)
    assert not datum.HasField("label") and len(datum.data) == 0
    np.testing.assert_allclose(datum.float_data, arr.ravel().astype(np.float32), rtol=1e-7)
    back = caffe.io.datum_to_array(datum)
    assert back.dtype == np.float64 and back.shape == (3, 2, 2)
    np.testing.assert_allclose(back, arr, rtol=1e-6)
    with pytest.raises(ValueError, match="Incorrect array shape"):
        caffe.io.array_to_datum(np.zeros((2, 2)))


# -- blobprotos ---------------------------------------------------------------------------------------
def test_blobproto_round_trips():
    arr = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    diff = -arr
    blob = caffe.io.array_to_blobproto(arr, diff)
    assert list(blob.shape.dim) == [2, 3, 4]
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob), arr)
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(blob, return_diff=True), diff)
    # legacy 4-D fields (what old mean.binaryproto files hold)
    legacy = caffe_pb2.BlobProto(num=1, channels=3, height=2, width=2, data=list(range(12)))
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(legacy), np.arange(12).reshape(1, 3, 2, 2))
    # a file as written by compute_image_mean, read the way the classification examples do
    parsed = caffe_pb2.BlobProto()
    parsed.ParseFromString(blob.SerializeToString())
    np.testing.assert_array_equal(caffe.io.blobproto_to_array(parsed), arr)

    arrays = [arr, np.ones((5,), np.float32), np.zeros((1, 1, 2, 2), np.float32)]
    s = caffe.io.arraylist_to_blobprotovector_str(arrays)
    assert isinstance(s, bytes)
    assert caffe.io.arraylist_to_blobprotovecor_str(arrays) == s  # pycaffe's misspelled name works too
    back = caffe.io.blobprotovector_str_to_arraylist(s)
    assert [b.shape for b in back] == [a.shape for a in arrays]
    for a, b in zip(arrays, back):
        np.testing.assert_array_equal(a, b)


# -- images ------------------------------------------------------------------------------------------
def test_load_image_color_grey_and_alpha(tmp_path):
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    Image.fromarray(rgb[:, :, 0]).save(tmp_path / "grey.png")
    Image.fromarray(np.dstack([rgb, np.full((5, 7), 128, np.uint8)])).save(tmp_path / "rgba.png")

    im = caffe.io.load_image(str(tmp_path / "rgb.png"))
    assert im.shape == (5, 7, 3) and im.dtype == np.float32
    np.testing.assert_allclose(im, rgb / 255.0, atol=1e-6)
    g = caffe.io.load_image(str(tmp_path / "grey.png"))
    assert g.shape == (5, 7, 3)  # grey tiled to 3 channels when color=True
    np.testing.assert_allclose(g[:, :, 2], rgb[:, :, 0] / 255.0, atol=1e-6)
    g1 = caffe.io.load_image(str(tmp_path / "grey.png"), color=False)
    assert g1.shape == (5, 7, 1)
    a = caffe.io.load_image(str(tmp_path / "rgba.png"))
    assert a.shape == (5, 7, 3)  # alpha dropped
    np.testing.assert_allclose(a, rgb / 255.0, atol=1e-6)
    lum = caffe.io.load_image(str(tmp_path / "rgb.png"), color=False)
    assert lum.shape == (5, 7, 1)
    np.testing.assert_allclose(lum[:, :, 0], rgb / 255.0 @ [0.2125, 0.7154, 0.0721], atol=1e-5)


def test_resize_image():
    # 3 channels: resampled at pixel centers (interior values are exact linear interpolations)
    im = np.tile(np.arange(4, dtype=np.float32)[None, :, None], (4, 1, 3))  # columns 0 1 2 3
    half = caffe.io.resize_image(im, (2, 2))
    assert half.shape == (2, 2, 3) and half.dtype == np.float32
    np.testing.assert_allclose(half[0, :, 0], [0.5, 2.5], atol=1e-6)
    up = caffe.io.resize_image(im[:2, :2], (4, 4))
    np.testing.assert_allclose(up[0, 1:3, 1], [0.25, 0.75], atol=1e-6)
    same = caffe.io.resize_image(im, (4, 4))
    np.testing.assert_allclose(same, im, atol=1e-6)
    # constant image: no division by zero
    const = caffe.io.resize_image(np.full((3, 3, 1), 0.7, np.float32), (5, 2))
    assert const.shape == (5, 2, 1)
    np.testing.assert_allclose(const, 0.7)
    # other channel counts: scipy.ndimage.zoom's corner-aligned grid
    im2 = np.zeros((2, 2, 2), np.float32)
    im2[:, 1, :] = 1.0
    z = caffe.io.resize_image(im2, (2, 4))
    np.testing.assert_allclose(z[0, :, 0], [0, 1 / 3, 2 / 3, 1], atol=1e-6)
    # order 0 keeps the values
    nn = caffe.io.resize_image(im, (8, 8), interp_order=0)
    assert set(np.unique(nn)) <= {0.0, 1.0, 2.0, 3.0}


def test_oversample_ten_crops():
    im = np.arange(6 * 8 * 2, dtype=np.float32).reshape(6, 8, 2)
    crops = caffe.io.oversample([im, im + 1000], (4, 4))
    assert crops.shape == (20, 4, 4, 2)
    expected = [im[0:4, 0:4], im[0:4, 4:8], im[2:6, 0:4], im[2:6, 4:8], im[1:5, 2:6]]
    for k, e in enumerate(expected):
        np.testing.assert_array_equal(crops[k], e)
        np.testing.assert_array_equal(crops[5 + k], e[:, ::-1])  # mirrors
        np.testing.assert_array_equal(crops[10 + k], e + 1000)


# -- Transformer ---------------------------------------------------------------------------------------
def test_transformer_preprocess_deprocess():
    shape = (1, 3, 4, 5)
    t = caffe.io.Transformer({"data": shape})
    t.set_transpose("data", (2, 0, 1))
    t.set_channel_swap("data", (2, 1, 0))
    t.set_raw_scale("data", 255)
    t.set_mean("data", np.array([10.0, 20.0, 30.0]))
    t.set_input_scale("data", 0.5)
    img = np.random.default_rng(2).random((4, 5, 3)).astype(np.float32)
    x = t.preprocess("data", img)
    assert x.shape == (3, 4, 5) and x.dtype == np.float32
    expected = (img.transpose(2, 0, 1)[[2, 1, 0]] * 255 - np.array([10, 20, 30.])[:, None, None]) * 0.5
    np.testing.assert_allclose(x, expected, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(t.deprocess("data", x), img, rtol=1e-5, atol=1e-5)
    # images of another size are resized to the input size first
    big = np.random.default_rng(3).random((8, 10, 3)).astype(np.float32)
    assert t.preprocess("data", big).shape == (3, 4, 5)
    # an elementwise mean of the input's shape
    t.set_mean("data", np.ones((3, 4, 5)))
    np.testing.assert_allclose(t.preprocess("data", img), (img.transpose(2, 0, 1)[[2, 1, 0]] * 255 - 1) * 0.5,
                               rtol=1e-5, atol=1e-4)


def test_transformer_errors():
    t = caffe.io.Transformer({"data": (1, 3, 4, 5)})
    with pytest.raises(Exception, match="nope is not one of the net inputs"):
        t.set_transpose("nope", (2, 0, 1))
    with pytest.raises(Exception, match="Transpose order"):
        t.set_transpose("data", (1, 0))
    with pytest.raises(Exception, match="Channel swap"):
        t.set_channel_swap("data", (1, 0))
    with pytest.raises(ValueError, match="Mean channels incompatible"):
        t.set_mean("data", np.zeros(4))
    with pytest.raises(ValueError, match="Mean shape invalid"):
        t.set_mean("data", np.zeros((1, 3, 4, 5)))


# -- python/caffe/test/test_io.py's cases --------------------------------------------------------------
def test_pycaffe_blobproto_formats():
    data = np.zeros((10, 10))
    old = caffe_pb2.BlobProto()
    old.data.extend(list(data.flatten()))
    old.num, old.channels, old.height, old.width = (1, 1, 10, 10)
    assert caffe.io.blobproto_to_array(old).shape == (1, 1, 10, 10)
    new = caffe_pb2.BlobProto()
    new.data.extend(list(data.flatten()))
    new.shape.dim.extend(list(data.shape))
    assert caffe.io.blobproto_to_array(new).shape == (10, 10)
    no_shape = caffe_pb2.BlobProto()
    no_shape.data.extend(list(data.flatten()))
    with pytest.raises(ValueError):
        caffe.io.blobproto_to_array(no_shape)
    scalar = caffe_pb2.BlobProto()
    scalar.data.extend([123.0])
    assert caffe.io.blobproto_to_array(scalar) == 123


def test_pycaffe_datum_label_none_size():
    d1 = caffe.io.array_to_datum(np.ones((10, 10, 3)), label=1)
    d2 = caffe.io.array_to_datum(np.ones((10, 10, 3)))
    assert len(d1.SerializeToString()) > len(d2.SerializeToString())
