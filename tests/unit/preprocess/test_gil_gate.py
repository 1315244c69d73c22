"""Claims about `GilGate`: when the build's helpers may start a step that holds the GIL for a while, and that no helper
waits past its bounds. Times are lower bounds (a wait lasts at least this long) with wide upper ones, so a busy
machine cannot fail them."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from support.builds import DEMO_SPECS, write_manifest

from image_edit_data.preprocess.run.build_cache import BuildOptions, build_cache
from image_edit_data.preprocess.run.gil_gate import GilGate
from image_edit_data.preprocess.run.resize import ResizePolicy
from image_edit_data.preprocess.sources.manifest import JsonlManifestSource

LONG = 30.0  # a bound no test may reach
RESIZE = ResizePolicy("max_pixels", max_pixels=32 * 32, spatial_alignment=16, upscale=True)


def timed_wait(gate: GilGate) -> float:
    started = time.perf_counter()
    gate.wait()
    return time.perf_counter() - started


def gate_with_a_call_of(kind: str, seconds: float, **bounds: float) -> GilGate:
    """A gate that has seen one call of `kind` last `seconds`."""
    gate = GilGate(**bounds)
    now = time.perf_counter()
    gate.call_started(now - seconds, kind)
    gate.call_ended(now, kind)
    return gate


def test_a_helper_goes_at_once_before_any_call_and_in_a_call_with_time_left() -> None:
    gate = GilGate(step=0.003, patience=LONG, longest_wait=LONG)
    assert timed_wait(gate) < LONG / 2  # no call yet
    gate.call_started(time.perf_counter(), "image")
    assert timed_wait(gate) < LONG / 2  # the first call of its kind: its length is unknown
    gate.call_ended(time.perf_counter(), "image")
    gate = gate_with_a_call_of("image", 60.0, step=0.003, patience=LONG, longest_wait=LONG)
    gate.call_started(time.perf_counter(), "image")  # expected to last a minute
    assert timed_wait(gate) < LONG / 2


def test_a_call_too_short_to_hide_a_step_holds_no_helper_back() -> None:
    gate = gate_with_a_call_of("image", 0.004, step=0.003, patience=LONG, longest_wait=LONG)
    gate.call_started(time.perf_counter() - 0.004, "image")  # at its expected end, but it could not hide the step
    assert timed_wait(gate) < LONG / 2


def test_a_helper_near_the_end_of_a_call_waits_for_the_next_call_to_start() -> None:
    gate = gate_with_a_call_of("prompts", 0.010, step=0.003, patience=LONG, longest_wait=LONG)
    gate.call_started(time.perf_counter() - 0.009, "prompts")  # 1 ms left: less than the step needs
    events: list[str] = []

    def helper() -> None:
        gate.wait()
        events.append("helper went")

    thread = threading.Thread(target=helper)
    thread.start()
    time.sleep(0.2)
    events.append("next call")
    gate.call_ended(time.perf_counter(), "prompts")
    gate.call_started(time.perf_counter(), "image")
    thread.join(LONG)
    assert events == ["next call", "helper went"]


def test_between_calls_a_helper_waits_out_the_patience_then_goes() -> None:
    gate = GilGate(step=0.003, patience=0.3, longest_wait=LONG)
    ended = time.perf_counter()
    gate.call_started(ended - 0.010, "image")
    gate.call_ended(ended, "image")
    # Just returned from a call: the encoders' thread may call again at once; `patience` after the call ended it
    # is taken to be waiting for the helpers, and they go.
    assert timed_wait(gate) < LONG / 2
    assert time.perf_counter() - ended >= 0.3


def test_no_helper_waits_longer_than_the_longest_wait() -> None:
    gate = gate_with_a_call_of("image", 0.010, step=0.003, patience=LONG, longest_wait=0.2)
    gate.call_started(time.perf_counter() - 0.010, "image")  # past its expected end, and it never ends
    assert 0.2 <= timed_wait(gate) < LONG / 2


def test_a_build_makes_every_images_pixels_and_saves_every_payload_through_the_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = 10
    waits: Counter[str] = Counter()
    original = GilGate.wait

    def wait(self: GilGate) -> None:
        waits[threading.current_thread().name.rpartition("_")[0]] += 1
        original(self)

    monkeypatch.setattr(GilGate, "wait", wait)
    source = JsonlManifestSource(write_manifest(tmp_path / "raw", rows=rows))
    report = build_cache(tmp_path / "c", source, *DEMO_SPECS, BuildOptions(resize=RESIZE, batch_size=2))
    images = sum(1 + len(source.read(p).sample.contexts) for p in range(rows))
    assert report.written == rows
    assert waits == {"build-pixels": images, "build-io": rows}
    # A build that overlaps nothing has no helper to hold back.
    waits.clear()
    build_cache(tmp_path / "serial", source, *DEMO_SPECS, BuildOptions(resize=RESIZE, batch_size=2, read_ahead=0))
    assert not waits
