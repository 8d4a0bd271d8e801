"""numba kernels of the device random streams' draws on the CPU (:mod:`cct.device.random`), one pass each.

Each fills a C-contiguous numpy array from words ``start ..`` of a Philox4x32-10 stream (key, stream
number), computing each block once, with the bits of the array-module path: :func:`bernoulli` (one word
per element, kept where ``word >> 8`` is below the threshold) and :func:`uniform` (float32: ``(word >> 8) *
2^-24``; float64: two words per value, 53 bits). The caller advances the stream's position.
"""
from __future__ import annotations

import numba as nb
import numpy as np

from . import launch

_OPTS = dict(nogil=True, cache=True, error_model="numpy")
_CHUNK = 1 << 14  # elements per task (a multiple of 4: every task but the first starts on a block)

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)
_S32, _S2, _LANE = np.uint64(32), np.uint64(2), np.uint64(3)


@nb.njit(inline="always", **_OPTS)
def _block(b, s0, s1, k0, k1):  # pragma: no cover (compiled)
    """Philox4x32-10 of the counter (b low, b high, s0, s1) under key (k0, k1), in uint64 lanes."""
    c0, c1, c2, c3 = b & _LOW, b >> _S32, s0, s1
    for _ in range(10):
        p0 = c0 * _M0
        p1 = c2 * _M1
        c0, c1, c2, c3 = (p1 >> _S32) ^ c1 ^ k0, p1 & _LOW, (p0 >> _S32) ^ c3 ^ k1, p0 & _LOW
        k0 = (k0 + _W0) & _LOW
        k1 = (k1 + _W1) & _LOW
    return c0, c1, c2, c3


@nb.njit(inline="always", **_OPTS)
def _lane(c0, c1, c2, c3, lane):  # pragma: no cover (compiled)
    if lane == 0:
        return c0
    if lane == 1:
        return c1
    if lane == 2:
        return c2
    return c3


@nb.njit(inline="always", **_OPTS)
def _value(w, bernoulli, threshold, scale, zero):  # pragma: no cover (compiled)
    """A mask value (``scale`` where ``w >> 8`` is below ``threshold``, else ``zero``) or a float32 uniform."""
    if bernoulli:
        return scale if (w >> np.uint64(8)) < threshold else zero
    return np.float32(w >> np.uint64(8)) * np.float32(2.0 ** -24)


@nb.njit(inline="always", **_OPTS)
def _unit64(high, low):  # pragma: no cover (compiled)
    return (np.float64(high >> np.uint64(5)) * 67108864.0 + np.float64(low >> np.uint64(6))) * (2.0 ** -53)


# Each task works on a slice of ``out`` indexed from 0: with a computed start index the loops do not
# vectorize (10x slower).


@nb.njit(**_OPTS)
def _one_word_each(piece, pieces, out, start, bernoulli, threshold, scale, zero, s0, s1, k0, k1):  # pragma: no cover
    """``out[i] = _value(word(start + i))``: Bernoulli masks and float32 uniforms."""
    n = out.size
    tasks = (n + _CHUNK - 1) // _CHUNK
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        lo = t * _CHUNK
        o = out[lo:min(n, lo + _CHUNK)]
        j = start + np.uint64(lo)
        i = 0
        while i < o.size and (j & _LANE) != 0:  # a start mid-block
            c0, c1, c2, c3 = _block(j >> _S2, s0, s1, k0, k1)
            o[i] = _value(_lane(c0, c1, c2, c3, j & _LANE), bernoulli, threshold, scale, zero)
            i += 1
            j += np.uint64(1)
        o = o[i:]
        b = j >> _S2
        whole = o.size // 4
        for q in range(whole):
            c0, c1, c2, c3 = _block(b + np.uint64(q), s0, s1, k0, k1)
            o[4 * q] = _value(c0, bernoulli, threshold, scale, zero)
            o[4 * q + 1] = _value(c1, bernoulli, threshold, scale, zero)
            o[4 * q + 2] = _value(c2, bernoulli, threshold, scale, zero)
            o[4 * q + 3] = _value(c3, bernoulli, threshold, scale, zero)
        if o.size > 4 * whole:
            c0, c1, c2, c3 = _block(b + np.uint64(whole), s0, s1, k0, k1)
            for lane in range(o.size - 4 * whole):
                o[4 * whole + lane] = _value(_lane(c0, c1, c2, c3, lane), bernoulli, threshold, scale, zero)


@nb.njit(**_OPTS)
def _uniform64(piece, pieces, out, start, s0, s1, k0, k1):  # pragma: no cover
    n = out.size
    tasks = (n + _CHUNK - 1) // _CHUNK
    for t in range(tasks * piece // pieces, tasks * (piece + 1) // pieces):
        lo = t * _CHUNK
        o = out[lo:min(n, lo + _CHUNK)]
        j = start + np.uint64(2 * lo)
        i = 0
        # word by word until a block boundary (always, from an odd word: then values straddle blocks)
        while i < o.size and ((j & _LANE) != 0 or (start & np.uint64(1)) != 0):
            c0, c1, c2, c3 = _block(j >> _S2, s0, s1, k0, k1)
            high = _lane(c0, c1, c2, c3, j & _LANE)
            j += np.uint64(1)
            c0, c1, c2, c3 = _block(j >> _S2, s0, s1, k0, k1)
            o[i] = _unit64(high, _lane(c0, c1, c2, c3, j & _LANE))
            j += np.uint64(1)
            i += 1
        o = o[i:]
        b = j >> _S2
        whole = o.size // 2
        for q in range(whole):  # two values per block
            c0, c1, c2, c3 = _block(b + np.uint64(q), s0, s1, k0, k1)
            o[2 * q] = _unit64(c0, c1)
            o[2 * q + 1] = _unit64(c2, c3)
        if o.size > 2 * whole:
            c0, c1, c2, c3 = _block(b + np.uint64(whole), s0, s1, k0, k1)
            o[2 * whole] = _unit64(c0, c1)


def _stream_args(start: int, key: tuple[int, int], stream: int) -> tuple:
    return (np.uint64(start), np.uint64(stream & 0xFFFFFFFF), np.uint64(stream >> 32),
            np.uint64(key[0]), np.uint64(key[1]))


def bernoulli(flat: np.ndarray, start: int, threshold: int, scale: float, key: tuple[int, int],
              stream: int) -> None:
    """``flat[i] = scale if (word(start + i) >> 8) < threshold else 0``."""
    t = flat.dtype.type
    s, s0, s1, k0, k1 = _stream_args(start, key, stream)
    launch(_one_word_each, flat, s, True, np.uint64(threshold), t(scale), t(0), s0, s1, k0, k1, work=flat.size)


def uniform(flat: np.ndarray, start: int, key: tuple[int, int], stream: int) -> None:
    """Uniforms in [0, 1): float32 from one word each, float64 from two (the array-module path's bits)."""
    s, s0, s1, k0, k1 = _stream_args(start, key, stream)
    if flat.dtype == np.float32:
        launch(_one_word_each, flat, s, False, np.uint64(0), np.float32(0), np.float32(0), s0, s1, k0, k1,
               work=flat.size)
    else:
        launch(_uniform64, flat, s, s0, s1, k0, k1, work=flat.size)
