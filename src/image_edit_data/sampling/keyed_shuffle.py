"""A permutation of [0, n) chosen by a key, read at any positions without building it.

Large domains use a balanced Feistel network on the smallest power of four that holds n, walked
in cycles until the value falls inside [0, n) (each step is a bijection of the larger domain, so
the walk from a value in range always returns to the range, and the result is a bijection of
[0, n)). Reading m positions then costs O(m) time and memory whatever n is. Small domains, where a
Feistel network of few-bit halves reaches only a biased set of orders, are shuffled exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

EXACT_UP_TO = 4096  # domains this small are permuted exactly: building them costs less than a few draws
ROUNDS = 6  # Feistel rounds; four already make a keyed permutation hard to tell from a random one
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finaliser constants
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
        self.half = (int(n - 1).bit_length() + 1) // 2  # bits of each half: 4**half >= n
        self.mask = np.uint64((1 << self.half) - 1)
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

    def _round(self, half: np.ndarray, key: np.uint64) -> np.ndarray:
        z = half ^ key
        z = (z ^ (z >> np.uint64(30))) * _MIX_1
        z = (z ^ (z >> np.uint64(27))) * _MIX_2
        return (z ^ (z >> np.uint64(31))) & self.mask

    def _encrypt(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = values >> shift, values & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << shift) | right

    def _decrypt(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half)
        left, right = values >> shift, values & self.mask
        for key in self.keys[::-1]:
            left, right = right ^ self._round(left, key), left
        return (left << shift) | right
