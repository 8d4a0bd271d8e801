"""WindowData: Caffe's R-CNN style data layer, warped windows sampled from a window file.

Window file (whitespace separated, repeated per image)::

    # image_index
    image_path            (prefixed by window_data_param.root_folder)
    channels height width
    num_windows
    class_index overlap x1 y1 x2 y2     (num_windows lines, inclusive pixel corners)

A window with ``overlap >= fg_threshold`` is foreground (its class must be > 0); one with
``overlap < bg_threshold`` is background (label and overlap forced to 0); the others are unused.
A window refers to the image whose ``# image_index`` equals its image's index (Caffe indexes its
image list by that number).

Each batch (Caffe's load_batch): ``num_fg = int(batch_size * fg_fraction)`` windows drawn uniformly
from the foreground set follow ``batch_size - num_fg`` from the background set (background first);
each draw is one 32-bit random number (index modulo the set size), then, with ``mirror``, one
more whose parity flips the window. The image is read in colour (BGR); the window is cut out and
warped (bilinear) to ``crop_size x crop_size``. With ``context_pad > 0`` or ``crop_mode: "square"``
the window is first grown (to a square around its centre for "square") so that after warping
``context_pad`` pixels of context surround it; parts outside the image are left 0, the clipped
region being warped to its share of the crop (mirrored padding when flipped). Pixels become
``(pixel - mean) * window_data_param.scale``, the mean from ``transform_param.mean_file`` (read at
``((mean_width - crop_size) / 2 + pad)`` offsets) or ``mean_value``. Tops: data
``(batch_size, channels, crop_size, crop_size)`` (channels as the window file gives for its last
image, which must be 3), label ``(batch_size,)``.

Randomness comes from the layer's own generator (seeded from its net's random source at setup), drawn in
Caffe's order; batches are prefetched like every data layer's.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..blob import Blob
from ..data.decode_pool import DecodePool
from ..data.stream import rng_state, set_rng_state
from ..data.transformer import DataTransformer, decode_image, read_image, resize_bilinear
from ..errors import CctError
from ..proto import caffe_pb2
from .base import log, register
from .data import PrefetchingDataLayer, child_rngs

# window layout (Caffe's WindowDataLayer enum)
IMAGE_INDEX, LABEL, OVERLAP, X1, Y1, X2, Y2 = range(7)
_LEGACY_FIELDS = ("crop_size", "mirror", "mean_file")


def _c_round(x: float) -> int:
    """C's round(): halves away from zero."""
    return int(math.copysign(math.floor(abs(float(x)) + 0.5), float(x)))


def parse_window_file(source: str, root_folder: str, fg_threshold: float, bg_threshold: float):
    """Parse a window file: ``(images, fg_windows, bg_windows)``.

    ``images`` maps image_index to ``(path, [channels, height, width])``, in file order; each window
    is a row ``[image_index, label, overlap, x1, y1, x2, y2]`` (float64; background rows have label
    and overlap 0). Overlaps are compared with the thresholds in float32, as Caffe does.
    """
    try:
        with open(source, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CctError(f"Failed to open window file '{source}': {e.strerror}") from None
    tokens = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        tokens.extend((tok, lineno) for tok in line.split())
    if len(tokens) < 2:
        raise CctError(f"Window file '{source}' is empty")
    pos = 0

    def take(kind, what):
        nonlocal pos
        if pos >= len(tokens):
            last = tokens[-1][1]
            raise CctError(f"{source}:{last}: window file ends early: expected {what}")
        tok, lineno = tokens[pos]
        pos += 1
        try:
            return kind(tok), lineno
        except ValueError:
            raise CctError(f"{source}:{lineno}: expected {what}, got '{tok}'") from None

    f_fg, f_bg = np.float32(fg_threshold), np.float32(bg_threshold)
    images: dict[int, tuple[str, list[int]]] = {}
    fg, bg = [], []
    while pos < len(tokens):
        hashtag, lineno = take(str, "'#'")
        if hashtag != "#":
            raise CctError(f"{source}:{lineno}: expected '# image_index', got '{hashtag}'")
        index, _ = take(int, "an image index after '#'")
        path, _ = take(str, "an image path")
        size = [take(int, what)[0] for what in ("the image's channels", "its height", "its width")]
        images[index] = (root_folder + path, size)
        num_windows, _ = take(int, "the number of windows")
        for _ in range(num_windows):
            label, lineno = take(int, "a window's class index")
            overlap = np.float32(take(float, "a window's overlap")[0])
            x1, y1, x2, y2 = (take(int, "a window corner")[0] for _ in range(4))
            if overlap >= f_fg:
                if label <= 0:
                    raise CctError(f"{source}:{lineno}: foreground window (overlap {overlap} >= fg_threshold "
                                   f"{fg_threshold}) has class {label}; classes of objects must be > 0")
                fg.append([index, label, overlap, x1, y1, x2, y2])
            elif overlap < f_bg:
                bg.append([index, 0, 0, x1, y1, x2, y2])
        if index % 100 == 0:
            log.info("num: %d %s %d %d %d windows to process: %d", index, root_folder + path, *size,
                     num_windows)
    return images, np.array(fg, dtype=np.float64).reshape(-1, 7), np.array(bg, dtype=np.float64).reshape(-1, 7)


def window_geometry(box: Sequence[int], img_h: int, img_w: int, crop_size: int, context_pad: int,
                    square: bool, mirror: bool, dtype=np.float32):
    """Caffe's window warping geometry: ``((x1, y1, x2, y2), (out_h, out_w), pad_h, pad_w)``.

    The inclusive source box to cut, the size to warp it to, and where the warped box goes in the
    ``crop_size`` square. Arithmetic in ``dtype`` (the net's Dtype) and C rounding, as Caffe.
    """
    x1, y1, x2, y2 = (int(v) for v in box)
    out_h = out_w = crop_size
    pad_h = pad_w = 0
    if context_pad > 0 or square:
        dt = np.dtype(dtype).type
        context_scale = dt(crop_size) / dt(crop_size - 2 * context_pad)
        half_h = dt((y2 - y1 + 1) / 2.0)
        half_w = dt((x2 - x1 + 1) / 2.0)
        cx = dt(x1) + half_w
        cy = dt(y1) + half_h
        if square:
            if half_h > half_w:
                half_w = half_h
            else:
                half_h = half_w
        x1 = _c_round(cx - half_w * context_scale)
        x2 = _c_round(cx + half_w * context_scale)
        y1 = _c_round(cy - half_h * context_scale)
        y2 = _c_round(cy + half_h * context_scale)
        unclipped_h, unclipped_w = y2 - y1 + 1, x2 - x1 + 1
        pad_x1, pad_y1 = max(0, -x1), max(0, -y1)
        pad_x2, pad_y2 = max(0, x2 - img_w + 1), max(0, y2 - img_h + 1)
        x1, x2, y1, y2 = x1 + pad_x1, x2 - pad_x2, y1 + pad_y1, y2 - pad_y2
        scale_x = dt(crop_size) / dt(unclipped_w)
        scale_y = dt(crop_size) / dt(unclipped_h)
        out_w = _c_round(dt(x2 - x1 + 1) * scale_x)
        out_h = _c_round(dt(y2 - y1 + 1) * scale_y)
        pad_x1, pad_x2 = _c_round(dt(pad_x1) * scale_x), _c_round(dt(pad_x2) * scale_x)
        pad_y1 = _c_round(dt(pad_y1) * scale_y)
        pad_h = pad_y1
        pad_w = pad_x2 if mirror else pad_x1
        out_h = min(out_h, crop_size - pad_h)
        out_w = min(out_w, crop_size - pad_w)
    return (x1, y1, x2, y2), (out_h, out_w), pad_h, pad_w


class _WindowLoader:
    """Samples and warps the windows of one batch (see the module docstring)."""

    def __init__(self, layer: WindowData, images, fg, bg, rng: np.random.Generator, dtype):
        p = layer.param.window_data_param
        tp = layer.tparam
        self.name = layer.name
        self.images, self.fg, self.bg, self.rng = images, fg, bg, rng
        self.dtype = np.dtype(dtype)
        self.batch_size = int(p.batch_size)
        self.channels = layer.channels
        self.crop_size = int(tp.crop_size)
        self.mirror = bool(tp.mirror)
        self.context_pad = int(p.context_pad)
        self.square = p.crop_mode == "square"
        self.scale = self.dtype.type(p.scale)
        self.num_fg = int(np.float32(self.batch_size) * np.float32(p.fg_fraction))
        self.mean = layer.mean
        self.mean_values = layer.mean_values
        self.decode = DecodePool()  # the windows of a batch are read and warped side by side
        self.cache: dict[int, bytes] | None = None
        if p.cache_images:
            self.cache = {}
            for index, (path, _) in images.items():
                try:
                    with open(path, "rb") as f:
                        self.cache[index] = f.read()
                except OSError as e:
                    raise CctError(f"Could not open or find file {path}: {e.strerror}") from None

    def state(self) -> dict:
        return {"rng": rng_state(self.rng)}

    def close(self) -> None:
        """Stop the decoding threads."""
        self.decode.close()

    def set_state(self, state: dict) -> None:
        set_rng_state(self.rng, state["rng"])

    def _draw(self) -> int:
        return int(self.rng.integers(0, 2**32))

    def _image(self, index: int) -> np.ndarray:
        path = self.images[index][0]
        if self.cache is not None:
            return decode_image(self.cache[index], "color", f"'{path}'")
        return read_image(path, is_color=True)

    def _warp(self, item) -> tuple[np.ndarray, int, int]:
        window, do_mirror = item
        img = self._image(int(window[IMAGE_INDEX]))
        img_h, img_w = img.shape[:2]
        (x1, y1, x2, y2), (out_h, out_w), pad_h, pad_w = window_geometry(
            window[X1:Y2 + 1], img_h, img_w, self.crop_size, self.context_pad, self.square, do_mirror,
            self.dtype)
        if not (0 <= x1 <= x2 < img_w and 0 <= y1 <= y2 < img_h) or out_h <= 0 or out_w <= 0:
            raise CctError(f"window {[int(v) for v in window[X1:Y2 + 1]]} does not fit image "
                           f"'{self.images[int(window[IMAGE_INDEX])][0]}' of size {img_w}x{img_h} "
                           f"(cut {x1},{y1}..{x2},{y2}, warped to {out_w}x{out_h})")
        warped = resize_bilinear(np.ascontiguousarray(img[y1:y2 + 1, x1:x2 + 1]), out_h, out_w)
        if do_mirror:
            warped = warped[:, ::-1]
        return warped, pad_h, pad_w

    def load(self, buf: list[np.ndarray] | None) -> list[np.ndarray]:
        bs, cs, dt = self.batch_size, self.crop_size, self.dtype
        data = buf[0] if buf is not None else np.empty((bs, self.channels, cs, cs), dt)
        labels = buf[1] if buf is not None else np.empty((bs,), dt)
        data[...] = 0
        items = []
        for is_fg, count in ((0, bs - self.num_fg), (1, self.num_fg)):
            pool = self.fg if is_fg else self.bg
            for _ in range(count):
                window = pool[self._draw() % len(pool)]
                do_mirror = self.mirror and self._draw() % 2 == 1
                items.append((window, do_mirror))
        warped = self.decode.map(self._warp, items)
        for i, ((window, _), (img, pad_h, pad_w)) in enumerate(zip(items, warped)):
            h, w = img.shape[:2]
            pix = img.transpose(2, 0, 1).astype(dt)
            if self.mean is not None:
                mo = (self.mean.shape[2] - cs) // 2
                mean = self.mean[:, mo + pad_h:mo + pad_h + h, mo + pad_w:mo + pad_w + w]
                if mean.shape[1:] != (h, w) or mo + pad_h < 0 or mo + pad_w < 0:
                    raise CctError(f"mean file of shape {list(self.mean.shape)} is too small for crop_size {cs}")
                pix = (pix - mean.astype(dt)) * self.scale
            elif self.mean_values is not None:
                pix = (pix - self.mean_values.astype(dt)[:, None, None]) * self.scale
            else:
                pix = pix * self.scale
            data[i, :, pad_h:pad_h + h, pad_w:pad_w + w] = pix
            labels[i] = window[LABEL]
        return [data, labels]


@register("WindowData")
class WindowData(PrefetchingDataLayer):
    """Caffe's WindowData layer (tops: data, label); see the module docstring."""

    param_fields = ("window_data_param", "transform_param")
    exact_num_top = 2

    def layer_setup(self, bottom: Sequence[Blob], top: Sequence[Blob]) -> None:
        p = self.param.window_data_param
        tp = caffe_pb2.TransformationParameter()
        tp.CopyFrom(self.param.transform_param)
        for f in _LEGACY_FIELDS:
            if p.HasField(f):
                if tp.HasField(f):
                    raise self.error(f"window_data_param.{f} (legacy) and transform_param.{f} are both set")
                setattr(tp, f, getattr(p, f))
                log.warning("layer '%s': legacy window_data_param.%s moved to transform_param", self.name, f)
        for f in ("scale", "force_color", "force_gray"):
            if tp.HasField(f):
                hint = " (WindowData scales by window_data_param.scale)" if f == "scale" else ""
                raise self.unsupported(f"transform_param.{f} in a WindowData layer{hint}")
        self.tparam = tp
        log.info("Window data layer:\n  foreground (object) overlap threshold: %g\n  background (non-object) "
                 "overlap threshold: %g\n  foreground sampling fraction: %g\n  cache_images: %d\n  root_folder: %s",
                 p.fg_threshold, p.bg_threshold, p.fg_fraction, p.cache_images, p.root_folder)
        if not p.source:
            raise self.error("window_data_param.source is not set")
        if p.batch_size <= 0:
            raise self.error("window_data_param.batch_size must be positive")
        if tp.crop_size <= 0:
            raise self.error("transform_param.crop_size must be positive (the warped window size)")
        if p.crop_mode not in ("warp", "square"):
            raise self.unsupported(f"crop_mode '{p.crop_mode}' (Caffe knows \"warp\" and \"square\")")
        if 2 * p.context_pad >= tp.crop_size:
            raise self.error(f"context_pad {p.context_pad} leaves no room in crop_size {tp.crop_size}")
        try:
            images, fg, bg = parse_window_file(p.source, p.root_folder, p.fg_threshold, p.bg_threshold)
            transformer = DataTransformer(tp, self.phase, name=self.name)
        except CctError as e:
            raise self.error(str(e)) from None
        last_index = list(images)[-1]
        log.info("Number of images: %d", last_index + 1)
        counts = {0: len(bg)}
        for label in fg[:, LABEL]:
            counts[int(label)] = counts.get(int(label), 0) + 1
        for label in sorted(counts):
            log.info("class %d has %d samples", label, counts[label])
        log.info("Amount of context padding: %d", p.context_pad)
        log.info("Crop mode: %s", p.crop_mode)
        for rows in (fg, bg):
            missing = sorted({int(i) for i in rows[:, IMAGE_INDEX]} - set(images))
            if missing:
                raise self.error(f"{p.source}: windows refer to image index {missing[0]}, which the file "
                                 f"does not list")
        if len(fg) == 0 or len(bg) == 0:
            raise self.error(f"{p.source}: {len(fg)} foreground and {len(bg)} background windows at thresholds "
                             f"fg {p.fg_threshold} / bg {p.bg_threshold}; each batch needs both")
        self.channels = images[last_index][1][0]
        if self.channels != 3:
            raise self.error(f"{p.source}: the last image lists {self.channels} channels; WindowData reads "
                             f"images in colour (3 channels)")
        self.mean = transformer.mean
        self.mean_values = None
        if transformer.mean_values:
            mv = transformer.mean_values
            if len(mv) not in (1, self.channels):
                raise self.error(f"Specify either 1 mean_value or as many as channels: {self.channels}")
            self.mean_values = np.array(mv * self.channels if len(mv) == 1 else mv, dtype=np.float64)
        _, rng = child_rngs(self.host_random().generator, True)
        try:
            loader = _WindowLoader(self, images, fg, bg, rng, top[0].dtype)
        except CctError as e:
            raise self.error(str(e)) from None
        cs = int(tp.crop_size)
        top[0].reshape((int(p.batch_size), self.channels, cs, cs))
        top[1].reshape((int(p.batch_size),))
        log.info("output data size: %d,%d,%d,%d", *top[0].shape)
        self._start(loader, 4)


__all__ = ["WindowData", "parse_window_file", "window_geometry"]
