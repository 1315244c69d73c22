"""When the build's helper threads may take the GIL for a while without keeping the encoders' thread waiting.

A few helper steps hold the GIL for about a millisecond in C: PIL's `tobytes` behind `np.asarray` of an image,
and `torch.save` copying a payload into its buffer. One that starts just before an encoder call returns keeps
the encoders' thread waiting for the GIL when it wakes, and one that starts between two calls delays the next.
Holding them back took a build at batch 1 with 20 ms calls on two cores from 1.045-1.049 times its encoders' time
to 1.032-1.038 (`docs/building-caches.md`, "Build speed").
Helpers call `GilGate.wait()` before such a step. It returns at once while the encoders' thread is inside a
call with time left for the step (a call is expected to last as long as the last one of its kind: the same
encoder and batch length), or inside any call too short to hide such a step, or when that thread has made no call
for `patience` seconds (it is waiting for the helpers, or no call is coming); otherwise when the next call starts.
No helper waits longer than `longest_wait`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable

# Time a gated step needs inside a call: several helpers may go at once, each holding the GIL about 1-2 ms.
STEP_SECONDS = 0.003
# Without a call for this long after one, the encoders' thread is taken to be waiting (for pixels, reads, writes).
PATIENCE_SECONDS = 0.002
# A helper goes ahead after this long whatever the encoders' thread does: a slow gate costs time, never progress.
LONGEST_WAIT_SECONDS = 0.02


class GilGate:
    """Told by the encoders' thread when each encoder call starts and ends (`Stopwatch(gate=...)`); asked by
    helpers, before a step that holds the GIL long, whether now is a good time (`wait`)."""

    def __init__(
        self,
        step: float = STEP_SECONDS,
        patience: float = PATIENCE_SECONDS,
        longest_wait: float = LONGEST_WAIT_SECONDS,
    ) -> None:
        self.step = step
        self.patience = patience
        self.longest_wait = longest_wait
        self._changed = threading.Condition()
        self._call_started: float | None = None  # time.perf_counter() of the call in progress
        self._last_ended: float | None = None  # of the call before it
        self._expected: float | None = None  # length of the call in progress, if one of its kind was made before
        self._lengths: dict[Hashable, float] = {}  # of the last call of each kind

    def call_started(self, now: float, kind: Hashable) -> None:
        """The encoders' thread enters an encoder call of `kind` (`now`: time.perf_counter())."""
        with self._changed:
            self._call_started, self._expected = now, self._lengths.get(kind)
            self._changed.notify_all()

    def call_ended(self, now: float, kind: Hashable) -> None:
        """... and returns from it."""
        if self._call_started is not None:
            self._lengths[kind] = now - self._call_started
        self._last_ended = now  # before the call is cleared: a helper that sees no call sees when it ended
        self._call_started = None

    def _open_or_retry_at(self, now: float) -> float | None:
        """None if a gated step may start now, else when to look again (without a call starting meanwhile)."""
        started, expected, ended = self._call_started, self._expected, self._last_ended
        if started is not None:
            if expected is None or expected < 2 * self.step:  # no telling when it ends, or too short to hide a step
                return None
            expected_end = started + expected
            return None if now + self.step <= expected_end else max(now, expected_end) + self.patience
        if ended is None or now >= ended + self.patience:
            return None
        return ended + self.patience

    def wait(self) -> None:
        """Return once a step holding the GIL for a while hurts the encoders' thread least (see the module)."""
        now = time.perf_counter()
        retry_at = self._open_or_retry_at(now)
        if retry_at is None:
            return
        give_up = now + self.longest_wait
        with self._changed:
            while retry_at is not None and now < give_up:
                self._changed.wait(min(retry_at, give_up) - now)
                now = time.perf_counter()
                retry_at = self._open_or_retry_at(now)
