"""Counter-based random numbers on the device: Philox4x32-10 (Salmon et al., SC'11; Random123, cuRAND).

A :class:`CounterRandom` is one stream of 32-bit words: word ``j`` of stream ``s`` under key ``k`` is lane
``j % 4`` of the Philox4x32-10 block with counter ``(j // 4 low, j // 4 high, s low, s high)`` and key ``k``.
Each draw takes the next words of the stream, so consecutive draws concatenate to one long draw (a batch
split in slices draws what the whole batch draws). The read position lives in a one-element uint64 array
of the generator's array module (device memory on a GPU) and the draw advances it with an in-place
elementwise op: a draw never reads the device from the host, so a captured CUDA graph replays it and the
counter moves on without the host. Only :meth:`CounterRandom.state` reads it (a boundary operation).

All arithmetic is unsigned integer (the 32x32->64 multiply in uint64), so numpy and CuPy give the same
bits for the same key, stream and position; on numpy arrays a draw is one compiled pass
(:mod:`cct.kernels.philox`, the same bits). A stream is made by its device (:meth:`cct.device.driver.Device.
random_stream`) and asks that device where arrays live and whether the host kernels may run, so this module
imports nothing of the driver (the driver imports it). Keys are host constants (baked into a captured graph): they
change only between iterations (``set_state`` on resume, ``NetRandom.rekey`` for another rank).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import kernels
from ..errors import CctError

if TYPE_CHECKING:  # the driver makes the streams (Device.random_stream), so this module takes its device as given
    from .driver import Device

PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # Weyl key increments
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF
_U32_TO_UNIT_F32 = np.float32(2.0 ** -24)  # top 24 bits -> [0, 1), exact in float32
_TWO_26 = 2.0 ** 26
_U53_TO_UNIT_F64 = 2.0 ** -53


def round_keys(key: tuple[int, int]) -> list[tuple[np.uint32, np.uint32]]:
    """The key of each of the ten rounds (the key bumped by the Weyl constants before each later round)."""
    k0, k1 = int(key[0]) & _MASK32, int(key[1]) & _MASK32
    keys = []
    for _ in range(PHILOX_ROUNDS):
        keys.append((np.uint32(k0), np.uint32(k1)))
        k0, k1 = (k0 + PHILOX_W[0]) & _MASK32, (k1 + PHILOX_W[1]) & _MASK32
    return keys


def _mulhilo(xp, a, multiplier: np.uint64):
    """(high, low) 32-bit halves of ``multiplier * a`` for a uint32 array or host scalar ``a`` (a scalar,
    such as a stream word in the first round, stays on the host: nothing is uploaded inside a draw)."""
    if isinstance(a, np.generic):
        product = int(a) * int(multiplier)
        return np.uint32(product >> 32), np.uint32(product & _MASK32)
    product = a.astype(xp.uint64) * multiplier
    return (product >> np.uint64(32)).astype(xp.uint32), product.astype(xp.uint32)


def philox4x32_10(xp, counter: tuple[Any, Any, Any, Any], keys: list[tuple[np.uint32, np.uint32]]) -> tuple:
    """Philox4x32-10 of the counter words (uint32 arrays or scalars, broadcast) under ``round_keys(key)``."""
    c0, c1, c2, c3 = counter
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for k0, k1 in keys:
        hi0, lo0 = _mulhilo(xp, c0, m0)
        hi1, lo1 = _mulhilo(xp, c2, m1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def key_from_host(host: np.random.Generator) -> tuple[int, int]:
    """A Philox key (two 32-bit words) derived from the run's seeded host generator.

    The key comes from a seed sequence spawned off ``host`` (``Generator.spawn``): the host stream itself
    is not advanced, so fillers, shuffles and crops draw what they drew before, while a run with a
    ``random_seed`` gets the same keys every time and an unseeded run gets new ones (``Generator.spawn``:
    numpy 1.25 or later)."""
    words = host.spawn(1)[0].bit_generator.seed_seq.generate_state(2, np.uint32)
    return int(words[0]), int(words[1])


class CounterRandom:
    """One Philox4x32-10 stream (``key``, ``stream``) whose read position lives in ``device``'s memory
    (made by :meth:`cct.device.driver.Device.random_stream`; ``xp`` is the device's array module).

    ``uniform_(out)`` fills a float32/float64 array with values in [0, 1); ``bernoulli_(out, p, scale)``
    writes ``scale`` where a float32 uniform is below ``p`` and 0 elsewhere. ``state()`` /
    ``set_state()`` snapshot and restore key, stream and position (host reads: call them between
    iterations only)."""

    def __init__(self, key: tuple[int, int], stream: int, device: Device):
        self.device = device
        self.xp = device.xp
        self.key = (int(key[0]) & _MASK32, int(key[1]) & _MASK32)
        if not 0 <= int(stream) < 2 ** 64:
            raise CctError(f"random stream {stream} is outside [0, 2^64)")
        self.stream = int(stream)
        self._keys = round_keys(self.key)
        self._stream_words = (np.uint32(self.stream & _MASK32), np.uint32(self.stream >> 32))
        self.position = device.zeros(1, dtype=np.uint64)  # the next word to hand out (device memory on a GPU)

    # -- drawing ------------------------------------------------------------------------------------
    def words(self, n: int):
        """The next ``n`` uint32 words of the stream (an array of the generator's module); advances the
        position by ``n`` in place on the device."""
        xp = self.xp
        n_blocks = n // 4 + 2  # enough blocks for any start lane
        block = xp.arange(n_blocks, dtype=xp.uint64)
        block += self.position >> np.uint64(2)
        counter = (block.astype(xp.uint32), (block >> np.uint64(32)).astype(xp.uint32)) + self._stream_words
        lanes = philox4x32_10(xp, counter, self._keys)
        stacked = xp.empty((n_blocks, 4), dtype=xp.uint32)
        for i, lane in enumerate(lanes):
            stacked[:, i] = lane
        index = xp.arange(n, dtype=xp.int64)
        index += (self.position & np.uint64(3)).astype(xp.int64)
        out = xp.take(stacked.reshape(-1), index)
        self.position += np.uint64(n)  # in place: a replayed graph moves the counter on by itself
        return out

    def uniform_(self, out) -> None:
        """Fill ``out`` (C-contiguous float32 or float64) with uniforms in [0, 1) from the next words:
        float32 takes one word per value (its top 24 bits times 2^-24), float64 two (53 bits times 2^-53)."""
        if out.dtype in (np.float32, np.float64) and (km := self._kernels(out)) is not None:
            words = out.size * (1 if out.dtype == np.float32 else 2)
            km.uniform(out.reshape(-1), int(self.position[0]), self.key, self.stream)
            self.position += np.uint64(words)
        elif out.dtype == np.float32:
            self._fill(out, self._uniform32)
        elif out.dtype == np.float64:
            self._fill(out, self._uniform64)
        else:
            raise CctError(f"uniform_ fills float32 or float64 arrays, not {out.dtype}")

    def bernoulli_(self, out, p: float, scale: float = 1.0) -> None:
        """``out = scale`` where a float32 uniform (one word per element) is below float32(``p``), else 0.

        The same words give the same mask for a float32 and a float64 ``out``."""
        p32 = float(np.float32(p))
        # u = k * 2^-24 < p32  <=>  k < ceil(p32 * 2^24) for the integer k = word >> 8 (p32 * 2^24 is exact)
        threshold = np.uint32(min(math.ceil(p32 * 2.0 ** 24), 2 ** 24))

        def draw(flat):
            km = self._kernels(flat)
            if km is not None:
                km.bernoulli(flat, int(self.position[0]), int(threshold), scale, self.key, self.stream)
                self.position += np.uint64(flat.size)
                return
            keep = (self.words(flat.size) >> np.uint32(8)) < threshold
            self.xp.multiply(keep, flat.dtype.type(scale), out=flat)

        self._fill(out, draw)

    def _uniform32(self, flat) -> None:
        self.xp.multiply((self.words(flat.size) >> np.uint32(8)).astype(np.float32), _U32_TO_UNIT_F32, out=flat)

    def _uniform64(self, flat) -> None:
        w = self.words(2 * flat.size).reshape(-1, 2)
        high = (w[:, 0] >> np.uint32(5)).astype(np.float64)
        low = (w[:, 1] >> np.uint32(6)).astype(np.float64)
        self.xp.multiply(high * _TWO_26 + low, _U53_TO_UNIT_F64, out=flat)

    def _kernels(self, out):
        """:mod:`cct.kernels.philox` for a C-contiguous numpy float array drawn by a numpy generator
        (the same bits in one compiled pass), else None."""
        if self.device.runs_host_kernels(out, contiguous=True):
            return kernels.get("philox")
        return None

    def _fill(self, out, draw) -> None:
        """Run ``draw(flat)`` on ``out`` seen flat; an array of another module (a scheduler slice on
        another device) is drawn here and copied over."""
        if not out.flags.c_contiguous:
            raise CctError("a random draw needs a C-contiguous output array")
        mine = self.device
        theirs = mine.locate(out)
        if theirs == mine:
            draw(out.reshape(-1))
        else:
            here = mine.empty(out.size, dtype=out.dtype)
            draw(here)
            theirs.upload(mine.download(here), out=out.reshape(-1))

    # -- snapshots (boundary operations) --------------------------------------------------------------
    def state(self) -> dict:
        """Key, stream and position as plain ints (reads the device position)."""
        return {"key": list(self.key), "stream": self.stream, "position": int(self.position[0])}

    def set_state(self, state: dict) -> None:
        """Continue from a ``state()``: the key is taken over, the stream must match."""
        try:
            key, stream, position = state["key"], int(state["stream"]), int(state["position"])
        except (KeyError, TypeError, ValueError) as e:
            raise CctError(f"malformed random-stream state {state!r}: {e}") from e
        if stream != self.stream:
            raise CctError(f"random-stream state is for stream {stream}, this generator draws stream {self.stream}")
        if not 0 <= position < 2 ** 64:
            raise CctError(f"random-stream position {position} is outside [0, 2^64)")
        self.key = (int(key[0]) & _MASK32, int(key[1]) & _MASK32)
        self._keys = round_keys(self.key)
        self.position[...] = np.uint64(position)

    def __repr__(self) -> str:
        return f"<CounterRandom Philox4x32-10 key=({self.key[0]:#010x}, {self.key[1]:#010x}) stream={self.stream}>"


class NetRandom:
    """The random streams a net owns: one key per net, one :class:`CounterRandom` per layer that draws
    (its stream number: the layer's index in the net), made by the net's ``device``. The key is taken from
    the host generator when the first stream is asked for, so a net without random layers leaves it untouched."""

    def __init__(self, host: np.random.Generator, device: Device):
        self.host = host
        self.device = device
        self.key: tuple[int, int] | None = None
        self.streams: dict[str, CounterRandom] = {}  # layer name -> its generator

    def stream(self, index: int, name: str) -> CounterRandom:
        """The generator of the layer ``name`` at ``index`` in the net."""
        if self.key is None:
            self.key = key_from_host(self.host)
        gen = self.device.random_stream(self.key, index)
        self.streams[name] = gen
        return gen

    def rekey(self, key: tuple[int, int]) -> None:
        """Draw every stream under ``key`` from now on (another rank's masks); positions are kept."""
        self.key = (int(key[0]) & _MASK32, int(key[1]) & _MASK32)
        for gen in self.streams.values():
            gen.set_state({**gen.state(), "key": list(self.key)})

    def state(self) -> dict:
        """``{layer name: CounterRandom.state()}`` (reads the device positions: a boundary operation)."""
        return {name: gen.state() for name, gen in self.streams.items()}

    def set_state(self, states: dict, keys: bool = True) -> list[str]:
        """Continue every stream from ``states`` (``keys=False``: positions only, this net's key kept);
        returns the names in ``states`` that no stream of this net has."""
        unknown = []
        for name, s in states.items():
            gen = self.streams.get(name)
            if gen is None:
                unknown.append(name)
                continue
            try:
                gen.set_state(s if keys else {**s, "key": list(gen.key)})
            except CctError as e:
                raise CctError(f"layer '{name}': {e}") from e
        return unknown
