"""Which members of one (source, bucket) stratum an epoch draws, and how often.

A stratum of `n` members draws `q` times per epoch: every member `f = q // n` times and `r = q % n`
of them once more. The `r` extra draws (or, when `r > n / 2`, the `n - r` draws left out, so that
the rotating set is never more than half the stratum) are a *window* of `k` distinct members:
epoch `e` takes positions `[e*k, (e+1)*k)` of an endless sequence of passes, each pass an order
of all `n` members. So each epoch draws every member `f` or `f + 1` times, and counting from epoch
0 no member is drawn an extra time more than once before every member has been (the windows go
through whole passes), which for a subsampled stratum (`f = 0`) is: no member is drawn twice
before every member has been drawn once.

A window that crosses from pass `p` into pass `p + 1` holds the *tail* of pass `p` and the *head*
of pass `p + 1`, which must not share a member. Both come from one keyed order of the members for
that boundary: the head is its first members, the tail its next members that are not in pass `p`'s
own head (a pass holds each member once). Each pass's *interior*, the members between its head and
its tail, follows the pass's own keyed order; the boundary's order is another, so the members that
end one pass fall anywhere in the next. Orders are read at positions (`KeyedShuffle`), so a window
costs O(k) whatever `n` is; `2k <= n` leaves the tail enough members to choose from.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .keyed_shuffle import KeyedShuffle

_PASS, _BOUNDARY = 0, 1  # the two kinds of keyed order: a pass's interior, a boundary's head and tail


def draw_positions(n: int, quota: int, epoch: int, key: tuple[int, ...]) -> np.ndarray:
    """[quota] ascending positions in a stratum of `n` members, each as often as epoch `epoch` draws it."""
    base, extra = divmod(quota, n)
    if extra == 0:
        return np.repeat(np.arange(n, dtype=np.int64), base)
    if 2 * extra <= n:
        window = Rotation(n, extra, key).window(epoch)  # [extra] drawn once more
        if base == 0:
            return np.sort(window)  # subsampled: only the window, whatever n is
        counts = np.full(n, base, dtype=np.int64)
        counts[window] += 1
    else:
        window = Rotation(n, n - extra, key).window(epoch)  # [n - extra] drawn once less
        counts = np.full(n, base + 1, dtype=np.int64)
        counts[window] -= 1
    return np.repeat(np.arange(n, dtype=np.int64), counts)


@dataclass(frozen=True)
class Rotation:
    """Windows of `k` distinct members out of `n` (`2k <= n`), epoch after epoch, through a sequence of passes."""

    n: int
    k: int
    key: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 < 2 * self.k <= self.n:
            raise ValueError(f"a rotation needs 0 < 2k <= n, got k={self.k}, n={self.n}")

    def window(self, epoch: int) -> np.ndarray:
        """[k] the members epoch `epoch` takes: positions `[epoch*k, (epoch+1)*k)` of the passes."""
        start = epoch * self.k
        p, offset = divmod(start, self.n)  # the pass the window starts in, and where
        if offset + self.k > self.n:
            return np.concatenate([self.tail(p + 1), self.head(p + 1)])
        skip = self.head_size(p)  # the window lies in pass p's interior
        return self.interior(p, offset - skip, offset - skip + self.k)

    def tail_size(self, b: int) -> int:
        """Members of pass `b - 1` in the window that crosses boundary `b` (0: a window starts at it)."""
        return (b * self.n) % self.k if b > 0 else 0

    def head_size(self, b: int) -> int:
        """Members of pass `b` in the window that crosses boundary `b`."""
        tail = self.tail_size(b)
        return self.k - tail if tail else 0

    def order(self, kind: int, index: int) -> KeyedShuffle:
        return KeyedShuffle(self.n, (*self.key, kind, index))

    def head(self, b: int) -> np.ndarray:
        """[head_size(b)] pass `b`'s first members."""
        size = self.head_size(b)
        if size == 0:
            return np.zeros(0, dtype=np.int64)
        return self.order(_BOUNDARY, b).at(np.arange(size))

    def tail(self, b: int, taken: np.ndarray | None = None) -> np.ndarray:
        """[tail_size(b)] pass `b - 1`'s last members: after boundary `b`'s head, skipping pass `b - 1`'s head.

        `taken` is pass `b - 1`'s head when the caller has it already.
        """
        size = self.tail_size(b)
        if size == 0:
            return np.zeros(0, dtype=np.int64)
        taken = self.head(b - 1) if taken is None else taken
        begin = self.head_size(b)
        candidates = self.order(_BOUNDARY, b).at(np.arange(begin, begin + size + taken.size))  # within n: 2k <= n
        return candidates[~np.isin(candidates, taken)][:size]

    def interior(self, p: int, begin: int, end: int) -> np.ndarray:
        """[end - begin] members `begin` to `end` of pass `p`'s interior: its keyed order, without head and tail."""
        order = self.order(_PASS, p)
        head = self.head(p)
        ends = np.sort(order.position_of(np.concatenate([head, self.tail(p + 1, head)])))  # [h + t]
        wanted = np.arange(begin, end, dtype=np.int64)
        # The i-th position not in `ends` is i plus the number of ends at or before it.
        free = wanted + np.searchsorted(ends - np.arange(ends.size), wanted, side="right")
        return order.at(free)
