"""Caffe's DataTransformer, plus the image decoding it needs (Pillow standing in for OpenCV).

Transform of one image (Caffe's order, per element):

    out[c, h, w] = (x[c, h_off + h, w_off + w'] - mean) * scale

* ``crop_size``: TRAIN takes a random offset ``h_off = U{0..H-crop}``, ``w_off = U{0..W-crop}``;
  TEST takes the centre ``((H-crop)//2, (W-crop)//2)``.
* ``mirror``: with probability 1/2 the crop is flipped left-right (``w' = crop-1-w``). As in
  Caffe this is random in *both* phases when ``mirror: true`` (Caffe's ``param_.mirror() &&
  Rand(2)`` has no phase test); the upstream TEST data layers simply set ``mirror: false``.
* ``mean_file`` (a ``.binaryproto`` of the full, uncropped image size; it is cropped at the same
  offset and mirrored with the image) or ``mean_value`` (one value, or one per channel); both
  at once is an error.
* ``scale`` multiplies after the mean subtraction.

The random draws happen in Caffe's order (mirror coin, then h_off, then w_off) from the
transformer's generator: the one passed in (data layers give each prefetch thread its own, seeded from
their net's random source so runs are reproducible), else the current configuration's
(:func:`cct.config.current`).

Images are numpy arrays in OpenCV's layout: HxWxC uint8 in **BGR** order (gray: HxWx1).
Encoded Datums (JPEG/PNG) are decoded with Pillow to that layout, as ``cv::imdecode`` would.
"""
from __future__ import annotations

import io
import logging
import os
from collections.abc import Sequence

import numpy as np

from ..config import current
from ..errors import CctError
from ..io.blobproto import blobproto_to_array, read_binaryproto
from ..membudget import INT_MAX
from ..proto import caffe_pb2

log = logging.getLogger("cct")


# --------------------------------------------------------------------------------------------
# Image decoding / encoding (OpenCV conventions)
# --------------------------------------------------------------------------------------------
def _pil():
    from PIL import Image, ImageOps

    return Image, ImageOps


def bgr_to_gray(img: np.ndarray) -> np.ndarray:
    """OpenCV's 8-bit BGR->GRAY (fixed point: (1868 B + 9617 G + 4899 R + 2^13) >> 14), HxWx1."""
    b = img[..., 0].astype(np.uint32)
    g = img[..., 1].astype(np.uint32)
    r = img[..., 2].astype(np.uint32)
    gray = (b * 1868 + g * 9617 + r * 4899 + (1 << 13)) >> 14
    return gray.astype(np.uint8)[..., None]


def _pil_to_bgr(im, mode: str, what: str) -> np.ndarray:
    """Pillow image -> HxWxC uint8 BGR(A) array. mode: 'color' (3 ch), 'gray' (1 ch), 'native'."""
    m = im.mode
    if m in ("I;16", "I;16B", "I;16L", "I", "F"):
        if mode == "native":
            raise CctError(f"{what}: image data type must be unsigned byte (got Pillow mode {m})")
        arr16 = np.asarray(im)
        arr = (arr16.astype(np.uint32) >> 8).astype(np.uint8) if m.startswith("I;16") else \
            np.clip(arr16, 0, 255).astype(np.uint8)
        gray = arr[..., None]
        return np.repeat(gray, 3, axis=2) if mode == "color" else gray
    if m == "1":
        im = im.convert("L")
        m = "L"
    if m == "P" or m == "PA":
        im = im.convert("RGBA" if ("transparency" in im.info or m == "PA") else "RGB")
        m = im.mode
    if m == "CMYK" or m == "YCbCr" or m == "LAB" or m == "HSV":
        im = im.convert("RGB")
        m = "RGB"
    if mode == "native":
        if m == "L":
            return np.asarray(im)[..., None]
        if m == "LA":
            la = np.asarray(im)
            return np.stack([la[..., 0], la[..., 0], la[..., 0], la[..., 1]], axis=2)
        if m == "RGBA":
            rgba = np.asarray(im)
            return np.ascontiguousarray(rgba[..., [2, 1, 0, 3]])
        rgb = np.asarray(im.convert("RGB") if m != "RGB" else im)
        return np.ascontiguousarray(rgb[..., ::-1])
    if m in ("L", "LA"):
        gray = np.asarray(im.convert("L") if m != "L" else im)[..., None]
        return np.repeat(gray, 3, axis=2) if mode == "color" else np.ascontiguousarray(gray)
    rgb = np.asarray(im.convert("RGB") if m != "RGB" else im)
    bgr = np.ascontiguousarray(rgb[..., ::-1])
    return bgr if mode == "color" else bgr_to_gray(bgr)


def _open_pil(fp, what: str, mode: str):
    Image, ImageOps = _pil()
    try:
        im = Image.open(fp)
        if mode == "gray" and im.format == "JPEG" and im.mode in ("RGB", "YCbCr"):
            im.draft("L", im.size)  # libjpeg decodes straight to luma, as OpenCV's IMREAD_GRAYSCALE
        im.load()
        if mode != "native":  # cv::imread/imdecode apply the EXIF orientation except for IMREAD_UNCHANGED
            im = ImageOps.exif_transpose(im, in_place=True) or im
    except CctError:
        raise
    except Exception as e:
        raise CctError(f"could not decode image {what}: {e}") from None
    return im


def decode_image(data: bytes, mode: str = "native", what: str = "<bytes>") -> np.ndarray:
    """Decode JPEG/PNG/... bytes to HxWxC uint8 BGR ('color': 3 ch, 'gray': 1 ch, 'native': as stored)."""
    im = _open_pil(io.BytesIO(data), what, mode)
    return _pil_to_bgr(im, mode, what)


def resize_bilinear(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize with OpenCV's INTER_LINEAR geometry (half-pixel centres, edge clamp), uint8 out.

    Same sampling positions and weights as ``cv::resize``; OpenCV's fixed-point rounding can
    differ from this float computation by 1 grey level at some pixels.
    """
    src_h, src_w = img.shape[:2]
    if (src_h, src_w) == (height, width):
        return img

    def axis(n_src: int, n_dst: int):
        scale = n_src / n_dst
        f = (np.arange(n_dst, dtype=np.float64) + 0.5) * scale - 0.5
        f = f.astype(np.float32).astype(np.float64)
        i0 = np.floor(f).astype(np.int64)
        frac = f - i0
        lo = i0 < 0
        frac[lo] = 0.0
        i0[lo] = 0
        hi = i0 >= n_src - 1
        frac[hi] = 0.0
        i0[hi] = n_src - 1
        i1 = np.minimum(i0 + 1, n_src - 1)
        return i0, i1, frac

    y0, y1, fy = axis(src_h, height)
    x0, x1, fx = axis(src_w, width)
    src = img.astype(np.float32)
    fx32 = fx.astype(np.float32)[None, :, None]
    rows = src[:, x0] * (1 - fx32) + src[:, x1] * fx32
    fy32 = fy.astype(np.float32)[:, None, None]
    out = rows[y0] * (1 - fy32) + rows[y1] * fy32
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def read_image(path: str | os.PathLike, height: int = 0, width: int = 0, is_color: bool = True) -> np.ndarray:
    """Caffe's ReadImageToCVMat: HxWx3 BGR (``is_color``) or HxWx1 gray, resized when both sizes > 0."""
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CctError(f"could not open or find image file '{path}': {e.strerror}") from None
    with f:
        mode = "color" if is_color else "gray"
        im = _open_pil(f, f"'{path}'", mode)
        img = _pil_to_bgr(im, mode, f"'{path}'")
    if height > 0 and width > 0:
        img = resize_bilinear(img, height, width)
    return img


def read_image_list(source: str) -> list[tuple[str, int]]:
    """Parse Caffe's image list: each line "path label" (the label after the last space)."""
    return [(path, label) for path, label, _ in read_numbered_image_list(source)]


def read_numbered_image_list(source: str) -> list[tuple[str, int, int]]:
    """:func:`read_image_list` with each entry's line number: (path, label, line)."""
    try:
        # Bytes as Caffe reads them: a non-UTF-8 path still names its file (surrogateescape, like os.fsdecode).
        with open(source, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
    except OSError as e:
        raise CctError(f"cannot read image list '{source}': {e.strerror}") from None
    lines: list[tuple[str, int, int]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        pos = line.rfind(" ")
        if pos < 0:
            raise CctError(f"{source}:{lineno}: expected 'path label', got '{line}'")
        try:
            label = int(line[pos + 1:].strip())
        except ValueError:
            raise CctError(f"{source}:{lineno}: label '{line[pos + 1:]}' is not an integer") from None
        if not -INT_MAX - 1 <= label <= INT_MAX:
            raise CctError(f"{source}:{lineno}: label {label} is outside the int range (Caffe reads it into an int)")
        lines.append((line[:pos], label, lineno))
    if not lines:
        raise CctError(f"image list '{source}' is empty")
    return lines


def encode_image(img: np.ndarray, ext: str) -> bytes:
    """Encode an HxWxC BGR (or HxWx1 gray) uint8 image like ``cv::imencode('.' + ext)``."""
    Image, _ = _pil()
    ext = ext.lower().lstrip(".")
    fmt = {"jpg": "JPEG", "jpeg": "JPEG", "jpe": "JPEG", "png": "PNG", "bmp": "BMP", "tif": "TIFF",
           "tiff": "TIFF", "ppm": "PPM", "pgm": "PPM", "pbm": "PPM", "webp": "WEBP"}.get(ext)
    if fmt is None:
        raise CctError(f"unsupported encode type '{ext}'")
    if img.ndim == 2 or img.shape[2] == 1:
        pim = Image.fromarray(np.ascontiguousarray(img.reshape(img.shape[0], img.shape[1])), "L")
    elif img.shape[2] == 3:
        pim = Image.fromarray(np.ascontiguousarray(img[..., ::-1]), "RGB")
    elif img.shape[2] == 4:
        pim = Image.fromarray(np.ascontiguousarray(img[..., [2, 1, 0, 3]]), "RGBA")
    else:
        raise CctError(f"cannot encode an image with {img.shape[2]} channels")
    buf = io.BytesIO()
    kwargs = {"quality": 95} if fmt == "JPEG" else {}  # OpenCV's default JPEG quality
    if fmt == "PNG":
        kwargs = {"compress_level": 1}  # OpenCV's default PNG compression (Z_BEST_SPEED)
    pim.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# Datum <-> arrays
# --------------------------------------------------------------------------------------------
def image_to_datum(img: np.ndarray, label: int = 0) -> caffe_pb2.Datum:
    """Caffe's CVMatToDatum: HxWxC uint8 -> raw CHW Datum."""
    if img.ndim == 2:
        img = img[..., None]
    if img.dtype != np.uint8:
        raise CctError(f"image data type must be uint8, got {img.dtype}")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = img.shape[2], img.shape[0], img.shape[1]
    datum.data = np.ascontiguousarray(img.transpose(2, 0, 1)).tobytes()
    datum.label = int(label)
    datum.encoded = False
    return datum


def array_to_datum(arr: np.ndarray, label: int = 0) -> caffe_pb2.Datum:
    """CxHxW array -> Datum (uint8 -> ``data`` bytes, anything else -> ``float_data``)."""
    arr = np.asarray(arr)
    if arr.ndim != 3:
        raise CctError(f"array_to_datum needs a CxHxW array, got shape {arr.shape}")
    datum = caffe_pb2.Datum()
    datum.channels, datum.height, datum.width = arr.shape
    if arr.dtype == np.uint8:
        datum.data = np.ascontiguousarray(arr).tobytes()
    else:
        datum.float_data.extend(np.asarray(arr, dtype=np.float32).ravel().tolist())
    datum.label = int(label)
    return datum


def datum_to_array(datum: caffe_pb2.Datum, force_color: bool = False, force_gray: bool = False) -> np.ndarray:
    """CxHxW array of a Datum: uint8 for ``data`` (decoded if ``encoded``), float32 for ``float_data``."""
    if datum.encoded:
        if force_color and force_gray:
            raise CctError("cannot set both force_color and force_gray")
        mode = "color" if force_color else ("gray" if force_gray else "native")
        img = decode_image(datum.data, mode, "in encoded Datum")
        return img.transpose(2, 0, 1)
    shape = (datum.channels, datum.height, datum.width)
    if datum.data:
        return np.frombuffer(datum.data, dtype=np.uint8).reshape(shape)
    return np.asarray(datum.float_data, dtype=np.float32).reshape(shape)


# --------------------------------------------------------------------------------------------
# DataTransformer
# --------------------------------------------------------------------------------------------
def _mean_array(proto: caffe_pb2.BlobProto, path: str) -> np.ndarray:
    arr = blobproto_to_array(proto)
    if arr.ndim > 4:
        raise CctError(f"mean file '{path}' has shape {list(arr.shape)}; expected (1, C, H, W)")
    # Caffe reads the mean through the legacy 4-D view (missing trailing axes are 1) and uses its first
    # item: a (C, H, W) blob is num C, channels H, height W, width 1 there, and so mismatches the data
    legacy = arr.reshape(arr.shape + (1,) * (4 - arr.ndim))
    return np.ascontiguousarray(legacy[0], dtype=np.float32)


class DataTransformer:
    """Caffe's DataTransformer for one ``TransformationParameter`` and phase (see module docstring)."""

    def __init__(self, param: caffe_pb2.TransformationParameter | None = None, phase: int = caffe_pb2.TRAIN,
                 rng: np.random.Generator | None = None, name: str = ""):
        self.param = param if param is not None else caffe_pb2.TransformationParameter()
        self.phase = phase
        self.rng = rng
        self.name = name
        p = self.param
        self.crop_size = int(p.crop_size)
        self.scale = float(p.scale)
        self.mirror = bool(p.mirror)
        self.force_color = bool(p.force_color)
        self.force_gray = bool(p.force_gray)
        self.mean: np.ndarray | None = None
        self.mean_file = p.mean_file if p.HasField("mean_file") else ""
        self.mean_values = [float(v) for v in p.mean_value]
        if p.HasField("mean_file") and self.mean_values:
            raise self._err("cannot specify mean_file and mean_value at the same time")
        if p.HasField("mean_file"):
            log.info("Loading mean file from: %s", p.mean_file)
            self.mean = _mean_array(read_binaryproto(p.mean_file), p.mean_file)
        self._mean_cache: dict = {}
        self._warned_force = False

    def _err(self, msg: str) -> CctError:
        return CctError(f"{self.name}: {msg}" if self.name else msg)

    @property
    def needs_rand(self) -> bool:
        """Whether transforms draw random numbers (Caffe's InitRand condition)."""
        return self.mirror or (self.phase == caffe_pb2.TRAIN and self.crop_size > 0)

    def _gen(self) -> np.random.Generator:
        return self.rng if self.rng is not None else current().random.generator

    # -- sources ---------------------------------------------------------------
    def datum_array(self, datum: caffe_pb2.Datum) -> np.ndarray:
        """The CxHxW pixels of a Datum (decoded with force_color/force_gray when encoded)."""
        if not datum.encoded and (self.force_color or self.force_gray) and not self._warned_force:
            log.error("force_color and force_gray only for encoded datum")
            self._warned_force = True
        try:
            return datum_to_array(datum, self.force_color, self.force_gray)
        except CctError as e:
            raise self._err(str(e)) from None

    def infer_shape(self, chw: np.ndarray) -> tuple[int, int, int]:
        """Shape (C, H', W') of the transformed CxHxW image (Caffe's InferBlobShape)."""
        c, h, w = chw.shape
        crop = self.crop_size
        if c <= 0:
            raise self._err("image has no channels")
        if h < crop or w < crop:
            raise self._err(f"crop_size {crop} is larger than the image ({h}x{w})")
        return (c, crop, crop) if crop else (c, h, w)

    # -- the transform -----------------------------------------------------------
    def _mean_as(self, dtype) -> np.ndarray | None:
        key = np.dtype(dtype)
        m = self._mean_cache.get(key)
        if m is None and self.mean is not None:
            m = self.mean.astype(key)
            self._mean_cache[key] = m
        return m

    def transform(self, chw: np.ndarray, out: np.ndarray) -> None:
        """Transform one CxHxW image (uint8 or float) into ``out`` (C x H' x W', a float array)."""
        c, h_in, w_in = chw.shape
        oc, oh, ow = self.infer_shape(chw)
        if out.shape != (oc, oh, ow):
            raise self._err(f"image of shape {list(chw.shape)} gives {[oc, oh, ow]}, "
                            f"but the batch holds {list(out.shape)} (all images of a batch must match)")
        do_mirror = self.mirror and bool(self._gen().integers(2))
        crop = self.crop_size
        h_off = w_off = 0
        if crop:
            if self.phase == caffe_pb2.TRAIN:
                g = self._gen()
                h_off = int(g.integers(h_in - crop + 1))
                w_off = int(g.integers(w_in - crop + 1))
            else:
                h_off = (h_in - crop) // 2
                w_off = (w_in - crop) // 2
        self._apply(chw, out, h_off, w_off, do_mirror)

    def transform_batch(self, chws: Sequence[np.ndarray], out: np.ndarray) -> bool:
        """Transform a batch of CxHxW images of one shape into ``out`` (N x C x H' x W') with one sweep
        per operation instead of one per image, when the transform draws no random numbers (no
        mirror, no training crop): element by element the same arithmetic as :meth:`transform`, so
        the same bits. Returns False (``out`` untouched) when it does not apply."""
        if self.needs_rand or not chws or any(a.shape != chws[0].shape for a in chws):
            return False
        c, h_in, w_in = chws[0].shape
        oc, oh, ow = self.infer_shape(chws[0])
        if out.shape != (len(chws), oc, oh, ow):
            return False
        crop = self.crop_size
        h_off, w_off = ((h_in - crop) // 2, (w_in - crop) // 2) if crop else (0, 0)
        self._apply(np.stack(chws), out, h_off, w_off, False)
        return True

    def _apply(self, x: np.ndarray, out: np.ndarray, h_off: int, w_off: int, do_mirror: bool) -> None:
        """Crop at (h_off, w_off), mirror, subtract the mean and scale ``x`` (CxHxW, or NxCxHxW with one
        offset for all) into ``out``."""
        c, h_in, w_in = x.shape[-3:]
        oh, ow = out.shape[-2:]
        dt = out.dtype
        src = x[..., h_off:h_off + oh, w_off:w_off + ow]
        if do_mirror:
            src = src[..., ::-1]
        if self.mean is not None:
            if self.mean.shape != (c, h_in, w_in):
                raise self._err(
                    f"mean file '{self.mean_file}' is {'x'.join(map(str, self.mean.shape))} (CxHxW) but the "
                    f"data is {c}x{h_in}x{w_in}")
            m = self._mean_as(dt)[:, h_off:h_off + oh, w_off:w_off + ow]
            if do_mirror:
                m = m[:, :, ::-1]
            np.subtract(src, m, out=out, casting="unsafe")
        elif self.mean_values:
            mv = self.mean_values
            if len(mv) != 1 and len(mv) != c:
                raise self._err(f"specify either 1 mean_value or as many as channels: {c} (got {len(mv)})")
            mean_c = np.asarray(mv if len(mv) == c else mv * c, dtype=dt).reshape(c, 1, 1)
            np.subtract(src, mean_c, out=out, casting="unsafe")
        else:
            out[...] = src
        if self.scale != 1.0:
            out *= dt.type(self.scale)

    def __call__(self, chw: np.ndarray, dtype=np.float32) -> np.ndarray:
        """Transform a CxHxW image into a new array of ``dtype``."""
        out = np.empty(self.infer_shape(chw), dtype=dtype)
        self.transform(chw, out)
        return out
