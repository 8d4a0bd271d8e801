"""make_digits: a built-in, learnable 28x28 grayscale digit dataset (no download needed).

Usage: ``make_digits OUTDIR [--train 60000] [--test 10000] [--seed 1] [--backend lmdb]`` writes
``OUTDIR/digits_train_lmdb`` and ``OUTDIR/digits_test_lmdb`` laid out exactly like Caffe's MNIST
LMDBs (raw uint8 Datum, 1 x 28 x 28, label 0-9, keys ``"%08d"``), so the upstream LeNet
prototxt works with only its ``source`` paths changed.

How the digits are made. Templates (64x64) come from two sources: Pillow's bundled scalable
font rendered at several stroke widths, and hand-written stroke skeletons (polylines/arcs per
digit) drawn with jittered control points, random bends, aspect and pen width. Each image picks
a template of its label and goes through a random affine map (rotation, anisotropic scale,
shear, translation) sampled bilinearly at 28x28, a random blur, random contrast and Gaussian
noise. Labels are balanced (N/10 each, shuffled). The train and test splits are drawn
independently from different seeds derived from ``--seed`` (their templates too), so the test
set checks generalisation, not memorisation. Everything is vectorized over images: 70k images
take a few seconds.
"""
from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np

from ..errors import CctError
from ..flags import FlagParser
from ..progress import Progress
from . import add_flag, run_tool, tool_parser
from .convert_mnist import write_images_db

log = logging.getLogger("cct")

SIZE = 28
T = 64  # template resolution
_CHUNK = 8192


# --------------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------------
def _arc(cx, cy, rx, ry, a0, a1, n=24):
    a = np.deg2rad(np.linspace(a0, a1, n))
    return np.stack([cx + rx * np.cos(a), cy + ry * np.sin(a)], axis=1)


def _line(*pts):
    return np.asarray(pts, dtype=np.float64)


def _skeletons(d: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Polylines (unit box, y down) of one hand-written digit, with a little style variation."""
    v = rng.random()
    if d == 0:
        return [_arc(0.5, 0.5, 0.42, 0.5, -80, 290 + 20 * v, 40)]
    if d == 1:
        strokes = [_line((0.55 - 0.25 * v, 0.2 * v + 0.05), (0.55, 0.0), (0.55, 1.0))]
        if rng.random() < 0.3:
            strokes.append(_line((0.3, 1.0), (0.8, 1.0)))
        return strokes
    if d == 2:
        top = _arc(0.5, 0.3, 0.42, 0.3, 190, 380, 20)
        return [np.concatenate([top, _line((0.05, 1.0), (1.0, 0.98 + 0.04 * v))])]
    if d == 3:
        return [np.concatenate([_arc(0.5, 0.26, 0.38, 0.26, 200, 450, 18), _arc(0.5, 0.73, 0.45, 0.27, 270, 515, 18)])]
    if d == 4:
        if v < 0.5:
            return [_line((0.7, 1.0), (0.7, 0.0), (0.0, 0.68), (1.0, 0.68))]
        return [_line((0.25, 0.0), (0.1, 0.6), (0.95, 0.6)), _line((0.72, 0.2), (0.72, 1.0))]
    if d == 5:
        lead = _line((0.9, 0.0), (0.2, 0.0), (0.14, 0.47))
        return [np.concatenate([lead, _arc(0.5, 0.69, 0.42, 0.31, 215, 515, 22)])]
    if d == 6:
        lead = _line((0.8, 0.0), (0.45, 0.12), (0.2, 0.38), (0.08, 0.7))
        return [np.concatenate([lead, _arc(0.5, 0.72, 0.42, 0.28, 180, 540, 30)])]
    if d == 7:
        strokes = [_line((0.0, 0.0), (1.0, 0.0), (0.35 + 0.15 * v, 1.0))]
        if rng.random() < 0.25:
            strokes.append(_line((0.35, 0.52), (0.85, 0.52)))
        return strokes
    if d == 8:
        return [_arc(0.5, 0.25, 0.34, 0.25, 90, 450, 30), _arc(0.5, 0.74, 0.42, 0.26, -90, 270, 30)]
    # 9
    return [np.concatenate([_arc(0.5, 0.28, 0.4, 0.28, 0, 360, 30),
                            _line((0.9, 0.28), (0.86, 0.62), (0.6 + 0.2 * v, 1.0))])]


def _stroke_templates(d: int, n: int, rng: np.random.Generator) -> list[np.ndarray]:
    from PIL import Image, ImageDraw

    out = []
    for _ in range(n):
        strokes = _skeletons(d, rng)
        height = rng.uniform(40, 48)
        width = height * rng.uniform(0.5, 0.75) * (0.6 if d == 1 else 1.0)
        bend_amp, bend_freq, bend_ph = rng.uniform(0, 0.06), rng.uniform(1, 3), rng.uniform(0, 2 * np.pi)
        slant = rng.uniform(-0.15, 0.15)
        pen = int(rng.integers(3, 8))
        im = Image.new("L", (T, T), 0)
        draw = ImageDraw.Draw(im)
        for s in strokes:
            p = s + rng.normal(0, 0.025, size=s.shape)
            p[:, 0] += bend_amp * np.sin(bend_freq * np.pi * p[:, 1] + bend_ph) + slant * (0.5 - p[:, 1])
            xs = T / 2 + (p[:, 0] - 0.5) * width
            ys = T / 2 + (p[:, 1] - 0.5) * height
            pts = list(zip(xs.tolist(), ys.tolist()))
            draw.line(pts, fill=255, width=pen, joint="curve")
            r = pen / 2
            for x, y in (pts[0], pts[-1]):
                draw.ellipse((x - r, y - r, x + r, y + r), fill=255)
        out.append(np.asarray(im, dtype=np.float32) / 255.0)
    return out


def _font_templates(d: int) -> list[np.ndarray]:
    from PIL import Image, ImageDraw, ImageFont

    out = []
    for size, stroke in ((50, 0), (48, 1), (46, 2), (44, 3)):
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1: no scalable default font
            return []
        im = Image.new("L", (T, T), 0)
        draw = ImageDraw.Draw(im)
        l, t, r, b = draw.textbbox((0, 0), str(d), font=font, stroke_width=stroke)
        draw.text(((T - (r - l)) / 2 - l, (T - (b - t)) / 2 - t), str(d), fill=255, font=font,
                  stroke_width=stroke, stroke_fill=255)
        out.append(np.asarray(im, dtype=np.float32) / 255.0)
    return out


def make_templates(rng: np.random.Generator, per_digit: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """(templates (K, 64, 64) float32 in [0, 1], their labels (K,)), anti-aliased."""
    from scipy.ndimage import gaussian_filter

    tmpl, labels = [], []
    for d in range(10):
        ts = _font_templates(d) + _stroke_templates(d, per_digit, rng)
        tmpl += ts
        labels += [d] * len(ts)
    arr = gaussian_filter(np.stack(tmpl), sigma=(0, 0.9, 0.9))
    arr /= arr.reshape(len(arr), -1).max(axis=1)[:, None, None]
    return arr.astype(np.float32), np.asarray(labels)


# --------------------------------------------------------------------------------------------
# Images
# --------------------------------------------------------------------------------------------
def _render(tmpl: np.ndarray, tidx: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random affine warp of templates ``tidx`` to 28x28, blur, contrast, noise -> uint8 (n, 28, 28)."""
    from scipy.ndimage import gaussian_filter

    n = len(tidx)
    theta = np.deg2rad(rng.uniform(-15, 15, n))
    scale = rng.uniform(0.8, 1.12, n) * (20.0 / 44.0)
    aspect = np.exp(rng.uniform(-0.12, 0.12, n))
    shear = rng.uniform(-0.3, 0.3, n)
    shift = rng.uniform(-2.0, 2.0, (n, 2))
    # forward map template -> image: A = s * R(theta) @ Shear @ diag(aspect, 1/aspect)
    c, s = np.cos(theta), np.sin(theta)
    a11, a12 = aspect, shear / aspect
    a21, a22 = np.zeros(n), 1.0 / aspect
    m11 = scale * (c * a11 - s * a21)
    m12 = scale * (c * a12 - s * a22)
    m21 = scale * (s * a11 + c * a21)
    m22 = scale * (s * a12 + c * a22)
    det = m11 * m22 - m12 * m21
    i11, i12, i21, i22 = m22 / det, -m12 / det, -m21 / det, m11 / det
    grid = np.arange(SIZE, dtype=np.float64) - (SIZE - 1) / 2
    ox = grid[None, None, :] - shift[:, 0, None, None]
    oy = grid[None, :, None] - shift[:, 1, None, None]
    tx = i11[:, None, None] * ox + i12[:, None, None] * oy + (T - 1) / 2
    ty = i21[:, None, None] * ox + i22[:, None, None] * oy + (T - 1) / 2
    x0 = np.floor(tx).astype(np.int64)
    y0 = np.floor(ty).astype(np.int64)
    fx = (tx - x0).astype(np.float32)
    fy = (ty - y0).astype(np.float32)
    padded = np.pad(tmpl, ((0, 0), (2, 2), (2, 2)))  # out-of-range samples read zeros
    x0 = np.clip(x0 + 2, 0, T + 2)
    y0 = np.clip(y0 + 2, 0, T + 2)
    k = tidx[:, None, None]
    img = (padded[k, y0, x0] * (1 - fx) + padded[k, y0, x0 + 1] * fx) * (1 - fy) + \
          (padded[k, y0 + 1, x0] * (1 - fx) + padded[k, y0 + 1, x0 + 1] * fx) * fy
    # blur in a few levels (vectorized per level)
    level = rng.integers(0, 4, n)
    for lv, sigma in ((1, 0.5), (2, 0.75), (3, 1.0)):
        sel = level == lv
        if sel.any():
            img[sel] = gaussian_filter(img[sel], sigma=(0, sigma, sigma))
    img /= np.maximum(img.reshape(n, -1).max(axis=1), 1e-6)[:, None, None]
    contrast = rng.uniform(0.65, 1.0, n).astype(np.float32) * 255.0
    img *= contrast[:, None, None]
    noise = rng.standard_normal(img.shape, dtype=np.float32) * rng.uniform(0, 14, n).astype(np.float32)[:, None, None]
    img += noise
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def make_split(n: int, seed_seq: np.random.SeedSequence, progress: Progress | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images (n, 28, 28) uint8 and balanced labels (n,) from one seed sequence (``progress``:
    advanced per rendered chunk)."""
    rng = np.random.default_rng(seed_seq)
    tmpl, tlabels = make_templates(rng)
    by_digit = [np.flatnonzero(tlabels == d) for d in range(10)]
    labels = rng.permutation(np.arange(n) % 10).astype(np.int64)
    counts = np.array([len(b) for b in by_digit])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    tidx = starts[labels] + (rng.random(n) * counts[labels]).astype(np.int64)
    images = np.empty((n, SIZE, SIZE), np.uint8)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        images[a:b] = _render(tmpl, tidx[a:b], rng)
        if progress is not None:
            progress.update(b - a)
    return images, labels


def make_digits(outdir: str, n_train: int = 60000, n_test: int = 10000, seed: int = 1,
                backend: str = "lmdb", progress: bool = False) -> tuple[str, str]:
    """Generate and write both splits; returns the two database paths.

    ``progress``: a progress bar per split on a terminal (images rendered, then written)."""
    if n_train < 0 or n_test < 0:
        raise CctError("--train and --test must be >= 0")
    os.makedirs(outdir, exist_ok=True)
    paths = (os.path.join(outdir, f"digits_train_{backend}"), os.path.join(outdir, f"digits_test_{backend}"))
    for p in paths:
        if os.path.exists(p):
            raise CctError(f"database '{p}' already exists (remove it first)")
    train_ss, test_ss = np.random.SeedSequence([int(seed), 0x5EED]).spawn(2)
    for path, n, ss, what in ((paths[0], n_train, train_ss, "train"), (paths[1], n_test, test_ss, "test")):
        t0 = time.perf_counter()
        with Progress(n, f"{what}: render", unit="img", enabled=progress) as bar:
            images, labels = make_split(n, ss, bar)
        t1 = time.perf_counter()
        with Progress(n, f"{what}: write", unit="img", enabled=progress) as bar:
            write_images_db(path, images, labels, backend, progress=bar)
        log.info("%s: %d images (generated in %.1f s, written in %.1f s) -> %s",
                 what, n, t1 - t0, time.perf_counter() - t1, path)
    return paths


def build_parser() -> FlagParser:
    """The argument parser."""
    p = tool_parser("make_digits", "Generate a synthetic 28x28 digit dataset as MNIST-style Caffe LMDBs")
    p.add_argument("outdir", metavar="OUTDIR")
    add_flag(p, "train", type=int, default=60000, help="number of training images")
    add_flag(p, "test", type=int, default=10000, help="number of test images")
    add_flag(p, "seed", type=int, default=1, help="random seed")
    add_flag(p, "backend", default="lmdb", choices=["lmdb", "leveldb"], help="database backend")
    return p


def run(a: argparse.Namespace) -> int:
    """``cct make_digits`` on parsed flags."""
    make_digits(a.outdir, a.train, a.test, a.seed, a.backend, progress=a.progress)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    return run_tool(run, build_parser(), argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
