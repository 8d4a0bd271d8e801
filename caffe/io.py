"""pycaffe's ``caffe.io``: image loading/resizing, Transformer, blob/datum conversions.

pycaffe uses scikit-image; cct uses Pillow and scipy.ndimage (same conventions: float images
in [0, 1], H x W x C, RGB; grey conversion with scikit-image's luminance weights).
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from cct.data.transformer import array_to_datum as _cct_array_to_datum
from cct.data.transformer import datum_to_array as _cct_datum_to_array
from cct.errors import CctError
from cct.io.blobproto import array_to_blobproto as _cct_array_to_blobproto
from cct.io.blobproto import blobproto_to_array as _cct_blobproto_to_array
from cct.proto import caffe_pb2

_GREY_WEIGHTS = np.array([0.2125, 0.7154, 0.0721])  # skimage.color.rgb2gray


# -- blobs and datums ------------------------------------------------------------------
# Thin float64 wrappers over cct's conversions (cct.io.blobproto, cct.data.transformer): pycaffe hands
# back float64 arrays (np.array of the proto's floats) and raises ValueError on bad shapes.
def blobproto_to_array(blob, return_diff: bool = False) -> np.ndarray:
    """A BlobProto's data (or diff) as a float64 array of its shape (legacy 4-D dims win; no shape at
    all is a blob with no axes, as Caffe reads it)."""
    try:
        return _cct_blobproto_to_array(blob, return_diff=return_diff).astype(np.float64)
    except CctError as e:
        raise ValueError(str(e)) from None


def array_to_blobproto(arr, diff=None) -> caffe_pb2.BlobProto:
    """A BlobProto holding ``arr`` (and ``diff``) as float32 with ``shape``."""
    return _cct_array_to_blobproto(np.asarray(arr), None if diff is None else np.asarray(diff))


def arraylist_to_blobprotovector_str(arraylist) -> bytes:
    vec = caffe_pb2.BlobProtoVector()
    vec.blobs.extend([array_to_blobproto(arr) for arr in arraylist])
    return vec.SerializeToString()


arraylist_to_blobprotovecor_str = arraylist_to_blobprotovector_str  # pycaffe's (misspelled) name


def blobprotovector_str_to_arraylist(s: bytes) -> list[np.ndarray]:
    vec = caffe_pb2.BlobProtoVector()
    vec.ParseFromString(s)
    return [blobproto_to_array(blob) for blob in vec.blobs]


def array_to_datum(arr, label=None) -> caffe_pb2.Datum:
    """A Datum from a C x H x W array: uint8 -> bytes, anything else -> float_data; no label field
    unless ``label`` is given (as pycaffe)."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise ValueError("Incorrect array shape.")
    datum = _cct_array_to_datum(arr, 0 if label is None else label)
    if label is None:
        datum.ClearField("label")
    return datum


def datum_to_array(datum) -> np.ndarray:
    """The C x H x W array of a Datum: uint8 for pixel bytes, float64 for float_data (a writable copy)."""
    arr = _cct_datum_to_array(datum)
    return arr.copy() if arr.dtype == np.uint8 else arr.astype(np.float64)


# -- images ----------------------------------------------------------------------------
def load_image(filename: str, color: bool = True) -> np.ndarray:
    """Load an image as float32 H x W x 3 (RGB) or H x W x 1 in [0, 1]."""
    with Image.open(filename) as im:
        if im.mode in ("I;16", "I"):
            arr = np.asarray(im, dtype=np.float64) / 65535.0
        else:
            arr = np.asarray(im.convert("RGBA" if im.mode in ("RGBA", "LA", "P") else "RGB" if im.mode != "L"
                                        else "L"), dtype=np.float64) / 255.0
    if arr.ndim == 3 and arr.shape[2] == 4:
        arr = arr[:, :, :3]
    if not color and arr.ndim == 3:
        arr = arr @ _GREY_WEIGHTS
    img = arr.astype(np.float32)
    if img.ndim == 2:
        img = img[:, :, np.newaxis]
        if color:
            img = np.tile(img, (1, 1, 3))
    return img


def resize_image(im: np.ndarray, new_dims, interp_order: int = 1) -> np.ndarray:
    """Resize an H x W x K image to ``new_dims`` (H', W') with spline order ``interp_order``.

    As pycaffe: 1- and 3-channel images are resampled at pixel centers (scikit-image's resize),
    other channel counts with ``scipy.ndimage.zoom``'s corner-aligned grid.
    """
    from scipy.ndimage import zoom  # imported here: scipy.ndimage takes a quarter second to import

    im = np.asarray(im)
    new_dims = tuple(int(d) for d in new_dims)
    scale = tuple(np.array(new_dims, dtype=float) / np.array(im.shape[:2]))
    if im.shape[-1] not in (1, 3):
        return zoom(im, scale + (1,), order=interp_order).astype(np.float32)
    im_min, im_max = im.min(), im.max()
    if im_max <= im_min:
        ret = np.empty((new_dims[0], new_dims[1], im.shape[-1]), dtype=np.float32)
        ret.fill(im_min)
        return ret
    resized = zoom(im.astype(np.float64), scale + (1,), order=interp_order, mode="nearest", grid_mode=True)
    return resized.astype(np.float32)


def oversample(images, crop_dims) -> np.ndarray:
    """Ten crops per image: four corners and the center, and their mirrors."""
    im_shape = np.array(images[0].shape)
    crop_dims = np.array(crop_dims)
    im_center = im_shape[:2] / 2.0
    h_indices = (0, im_shape[0] - crop_dims[0])
    w_indices = (0, im_shape[1] - crop_dims[1])
    crops_ix = np.empty((5, 4), dtype=int)
    curr = 0
    for i in h_indices:
        for j in w_indices:
            crops_ix[curr] = (i, j, i + crop_dims[0], j + crop_dims[1])
            curr += 1
    crops_ix[4] = np.tile(im_center, (1, 2)) + np.concatenate([-crop_dims / 2.0, crop_dims / 2.0])
    crops_ix = np.tile(crops_ix, (2, 1))
    crops = np.empty((10 * len(images), crop_dims[0], crop_dims[1], im_shape[-1]), dtype=np.float32)
    ix = 0
    for im in images:
        for crop in crops_ix:
            crops[ix] = im[crop[0]:crop[2], crop[1]:crop[3], :]
            ix += 1
        crops[ix - 5:ix] = crops[ix - 5:ix, :, ::-1, :]
    return crops


class Transformer:
    """Preprocessing from images (H x W x K, RGB, [0,1]) to net input (K x H x W, as trained)."""

    def __init__(self, inputs: dict):
        self.inputs = inputs
        self.transpose: dict = {}
        self.channel_swap: dict = {}
        self.raw_scale: dict = {}
        self.mean: dict = {}
        self.input_scale: dict = {}

    def __check_input(self, in_):
        if in_ not in self.inputs:
            raise Exception(f"{in_} is not one of the net inputs: {self.inputs}")

    def preprocess(self, in_, data) -> np.ndarray:
        """Resize, transpose, swap channels, scale, subtract the mean, scale again."""
        self.__check_input(in_)
        caffe_in = np.asarray(data).astype(np.float32, copy=False)
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        in_dims = tuple(self.inputs[in_][2:])
        if caffe_in.shape[:2] != in_dims:
            caffe_in = resize_image(caffe_in, in_dims)
        if transpose is not None:
            caffe_in = caffe_in.transpose(transpose)
        if channel_swap is not None:
            caffe_in = caffe_in[channel_swap, :, :]
        if raw_scale is not None:
            caffe_in = caffe_in * raw_scale
        if mean is not None:
            caffe_in = caffe_in - mean
        if input_scale is not None:
            caffe_in = caffe_in * input_scale
        return caffe_in.astype(np.float32, copy=False)  # float32 as pycaffe's (in-place) arithmetic keeps it

    def deprocess(self, in_, data) -> np.ndarray:
        """Invert preprocess (except the resize)."""
        self.__check_input(in_)
        decaf_in = np.array(data, copy=True).squeeze()
        transpose = self.transpose.get(in_)
        channel_swap = self.channel_swap.get(in_)
        raw_scale = self.raw_scale.get(in_)
        mean = self.mean.get(in_)
        input_scale = self.input_scale.get(in_)
        if input_scale is not None:
            decaf_in /= input_scale
        if mean is not None:
            decaf_in += mean
        if raw_scale is not None:
            decaf_in /= raw_scale
        if channel_swap is not None:
            decaf_in = decaf_in[np.argsort(channel_swap), :, :]
        if transpose is not None:
            decaf_in = decaf_in.transpose(np.argsort(transpose))
        return decaf_in

    def set_transpose(self, in_, order) -> None:
        self.__check_input(in_)
        if len(order) != len(self.inputs[in_]) - 1:
            raise Exception("Transpose order needs to have the same number of dimensions as the input.")
        self.transpose[in_] = order

    def set_channel_swap(self, in_, order) -> None:
        self.__check_input(in_)
        if len(order) != self.inputs[in_][1]:
            raise Exception("Channel swap needs to have the same number of dimensions as the input channels.")
        self.channel_swap[in_] = order

    def set_raw_scale(self, in_, scale) -> None:
        self.__check_input(in_)
        self.raw_scale[in_] = scale

    def set_mean(self, in_, mean) -> None:
        """Per-channel (1-D) or elementwise (C x H x W, resized if needed) mean."""
        self.__check_input(in_)
        mean = np.asarray(mean)
        ms = mean.shape
        if mean.ndim == 1:
            if ms[0] != self.inputs[in_][1]:
                raise ValueError("Mean channels incompatible with input.")
            mean = mean[:, np.newaxis, np.newaxis]
        else:
            if len(ms) == 2:
                ms = (1,) + ms
            if len(ms) != 3:
                raise ValueError("Mean shape invalid")
            if ms != tuple(self.inputs[in_][1:]):
                in_shape = self.inputs[in_][1:]
                m_min, m_max = mean.min(), mean.max()
                normal_mean = (mean - m_min) / (m_max - m_min)
                mean = resize_image(normal_mean.transpose((1, 2, 0)), in_shape[1:]).transpose((2, 0, 1)) * (
                    m_max - m_min) + m_min
        self.mean[in_] = mean

    def set_input_scale(self, in_, scale) -> None:
        self.__check_input(in_)
        self.input_scale[in_] = scale


def image_transformer(input_name: str, input_shape, mean=None, input_scale=None, raw_scale=None,
                      channel_swap=None) -> Transformer:
    """A Transformer for H x W x K images into a net input, as Classifier and Detector configure it."""
    t = Transformer({input_name: input_shape})
    t.set_transpose(input_name, (2, 0, 1))
    if mean is not None:
        t.set_mean(input_name, mean)
    if input_scale is not None:
        t.set_input_scale(input_name, input_scale)
    if raw_scale is not None:
        t.set_raw_scale(input_name, raw_scale)
    if channel_swap is not None:
        t.set_channel_swap(input_name, channel_swap)
    return t
