"""The lines a refused resume prints: the differing fingerprint keys, and sources matched by cache and name."""

from __future__ import annotations

from typing import Any

from image_edit_data.sampling.mismatch import fingerprint_changes

BASE = {"seed": 42, "world_size": 1}


def mixture(*sources: tuple[str | None, str | None, float], draw: int | None = 2) -> dict[str, Any]:
    """A mixture's fingerprint from (data, name, weight) per source; `draw=None` as earlier versions wrote it."""
    keys: dict[str, Any] = {**BASE, "sources": len(sources)}
    if draw is not None:
        keys["mixture_draw"] = draw
    for i, (data, name, weight) in enumerate(sources):
        keys |= {f"sources[{i}].data": data, f"sources[{i}].weight": weight}
        if name is not None:
            keys[f"sources[{i}].name"] = name
    return keys


def test_the_draw_is_compared_only_when_both_sides_draw_and_an_absent_key_is_draw_1() -> None:
    single = {**BASE, "data": "a"}
    two = mixture(("a", "edits", 1.0), ("b", "t2i", 1.0))
    assert fingerprint_changes(mixture(("a", "edits", 1.0), ("b", "t2i", 1.0), draw=None), two, set()) == [
        "mixture_draw: checkpoint 1, now 2 (this image-edit-data draws a mixture's epochs otherwise than the one "
        "that wrote the checkpoint (each sample floor or ceil of its source's quota over its size), so the saved "
        "position would name other samples)"
    ]
    assert fingerprint_changes(single, two, set()) == ["sources: checkpoint 1, now 2", "sources[1] 't2i' is new"]
    assert fingerprint_changes(two, single, set()) == [
        "sources: checkpoint 2, now 1",
        "sources[1] 't2i' of the checkpoint is gone",
    ]
    assert fingerprint_changes(two, two, set()) == []


def test_unnamed_sources_match_by_place_and_a_renamed_one_by_its_cache() -> None:
    saved = mixture(("a", None, 1.0), ("b", None, 1.0))
    assert fingerprint_changes(saved, mixture(("a", None, 1.0), ("c", None, 1.0)), set()) == [
        "sources[1].data: checkpoint 'b', now 'c'"
    ]
    named = mixture(("a", "edits", 1.0), ("b", "t2i", 1.0))
    assert fingerprint_changes(named, mixture(("a", "edits", 1.0), ("b", "text", 1.0)), set()) == []
    assert fingerprint_changes(named, mixture(("a", "edits", 1.0), ("b2", "t2i", 1.0)), set()) == [
        "sources[1].data ('t2i'): checkpoint 'b', now 'b2'"
    ]
    assert fingerprint_changes(named, mixture(("a", "edits", 1.0), ("b", "t2i", 2.0)), {"sources[1].weight"}) == []
