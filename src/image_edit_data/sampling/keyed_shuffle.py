"""A permutation of [0, n) chosen by a key, read at any positions without building it.

Large domains use a Feistel network on the smallest power of two that holds n, walked in cycles
until the value falls inside [0, n): each step is a bijection of the larger domain, so the walk
from a value in range always comes back to the range, and the result is a bijection of [0, n).
The network splits a value's bits into two halves of (nearly) equal width and alternately xors one
half with a keyed hash of the other, so the domain is at most twice n and a walk takes two steps
on average. Reading m positions then costs O(m) time and memory whatever n is. Small domains are
shuffled exactly: there a permutation costs less than a few reads of the network.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

EXACT_UP_TO = 1 << 14  # domains this small are permuted exactly (cheaper than the network's per-call cost)
ROUNDS = 4  # two per half: four Feistel rounds of a good keyed hash make a permutation hard to tell from a random one
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)  # odd multipliers from splitmix64's finaliser
_MIX_2 = np.uint64(0x94D049BB133111EB)


class KeyedShuffle:
    """A permutation of [0, n) from `key` (a sequence of non-negative ints): `at(i)` is its i-th element."""

    def __init__(self, n: int, key: Sequence[int]) -> None:
        if n < 1:
            raise ValueError(f"a shuffle needs a positive size, got {n}")
        self.n = n
        self._order: np.ndarray | None = None
        self._position: np.ndarray | None = None
        if n <= EXACT_UP_TO:
            self._order = np.random.default_rng(list(key)).permutation(n)  # [n]
            return
        bits = max(2, int(n - 1).bit_length())  # 2**bits >= n > 2**(bits - 1)
        self.low = bits // 2  # the low half's width; the high half has the rest
        self.masks = (np.uint64((1 << (bits - self.low)) - 1), np.uint64((1 << self.low) - 1))  # high, low
        self.keys = np.random.SeedSequence(list(key)).generate_state(ROUNDS, dtype=np.uint64)  # [ROUNDS]

    def at(self, positions: np.ndarray) -> np.ndarray:
        """[m] int64 the elements at `positions` (each in [0, n))."""
        if self._order is not None:
            return self._order[positions]
        return self._walk(np.asarray(positions, dtype=np.uint64), self._encrypt)

    def position_of(self, elements: np.ndarray) -> np.ndarray:
        """[m] int64 where each of `elements` (each in [0, n)) stands: the inverse of `at`."""
        if self._order is not None:
            if self._position is None:
                self._position = np.empty(self.n, dtype=np.int64)
                self._position[self._order] = np.arange(self.n)
            return self._position[elements]
        return self._walk(np.asarray(elements, dtype=np.uint64), self._decrypt)

    def _walk(self, values: np.ndarray, step: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        values = step(values)
        outside = np.flatnonzero(values >= self.n)
        while outside.size:  # each pass re-steps the values still outside; most leave on the first
            values[outside] = step(values[outside])
            outside = outside[values[outside] >= self.n]
        return values.astype(np.int64)

    def _hash(self, half: np.ndarray, key: np.uint64) -> np.ndarray:
        # Multiply, fold the high bits down, multiply again: every output bit depends on every input bit.
        z = (half ^ key) * _MIX_1
        z ^= z >> np.uint64(32)
        z *= _MIX_2
        return z ^ (z >> np.uint64(29))

    def _rounds(self, values: np.ndarray, rounds: range) -> np.ndarray:
        # Even rounds xor the high half with a hash of the low one, odd rounds the other way: each round
        # undoes itself, so the inverse is the same rounds in reverse order.
        shift = np.uint64(self.low)
        high, low = values >> shift, values & self.masks[1]
        for i in rounds:
            if i % 2 == 0:
                high ^= self._hash(low, self.keys[i]) & self.masks[0]
            else:
                low ^= self._hash(high, self.keys[i]) & self.masks[1]
        return (high << shift) | low

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        return self._rounds(values, range(ROUNDS))

    def _decrypt(self, values: np.ndarray) -> np.ndarray:
        return self._rounds(values, range(ROUNDS - 1, -1, -1))
