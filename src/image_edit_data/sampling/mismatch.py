"""What differs between a checkpoint's sampler fingerprint and the current one, one line per change.

A mixture's sources are matched across the two by their data (each cache's index fingerprint) and
their names, so a removed, added or reordered source is named by its name in the checkpoint and
its name now, not taken for whichever source now holds its place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CHECKSUMS = "member_checksums"  # present, as False, only for a packed cache without member checksums
NOTES = {
    CHECKSUMS: "the cache is now packed without member checksums, so its reads would go unchecked where the "
    "checkpoint's were checked; `image-edit-data cache pack` writes them",
    "mixture_draw": "this image-edit-data draws a mixture's epochs otherwise than the one that wrote the "
    "checkpoint (each sample floor or ceil of its source's quota over its size), so the saved position "
    "would name other samples",
}


def fingerprint_changes(saved: Mapping[str, Any], current: Mapping[str, Any], allowed: set[str]) -> list[str]:
    """One line per difference between the fingerprints that is not in `allowed` (empty: the position fits)."""
    saved, current = dict(saved), dict(current)
    align_draws(saved, current)
    if "sources" not in saved and "sources" not in current:
        return checksum_changes(saved, current, CHECKSUMS, allowed) + describe_changes(saved, current, allowed)
    saved, current = comparable(saved), comparable(current)  # a mixture on either side: compare source by source
    old, new = per_source(saved), per_source(current)
    matched = match_sources(old, new)
    overall = {key: value for key, value in saved.items() if not key.startswith("sources[")}
    now = {key: value for key, value in current.items() if not key.startswith("sources[")}
    lines = describe_changes(overall, now, allowed)
    for j, source in enumerate(old):
        if j not in matched.values():
            lines.append(f"sources[{j}]{label(source)} of the checkpoint is gone")
    for i, source in enumerate(new):
        if i not in matched:
            lines.append(f"sources[{i}]{label(source)} is new")
            continue
        lines += source_changes(i, matched[i], old[matched[i]], source, allowed)
    return lines


def source_changes(i: int, j: int, was: Mapping[str, Any], source: Mapping[str, Any], allowed: set[str]) -> list[str]:
    """Lines for the source now at `sources[i]`, at `sources[j]` in the checkpoint: where it moved, what changed."""
    name, was_name = source.get("name"), was.get("name")
    parts = ([repr(name)] if name is not None else []) + (
        [f"checkpoint {was_name!r}"] if was_name not in (None, name) else []
    )
    tag = ", ".join(parts)
    lines = []
    if j != i:
        who = f"{parts[0]} ({parts[1]})" if len(parts) == 2 else tag or "a source"
        lines.append(f"{who} moved from sources[{j}] to sources[{i}]")
    lines += checksum_changes(dict(was), dict(source), f"sources[{i}].{CHECKSUMS}", allowed, CHECKSUMS, tag)
    # Fields one side lacks (a single cache has no weight) say nothing about the source.
    shown = {f"sources[{i}].{field}": field for field in set(was) & set(source) if field not in ("name", CHECKSUMS)}
    return lines + describe_changes(
        {key: was.get(field) for key, field in shown.items()},
        {key: source.get(field) for key, field in shown.items()},
        allowed,
        {f"sources[{i}]": tag} if tag else None,
    )


def checksum_changes(
    saved: dict[str, Any], current: dict[str, Any], key: str, allowed: set[str], field: str | None = None, tag: str = ""
) -> list[str]:
    """A line when the data's reads would now go unchecked where the checkpoint's were checked (`field` is popped).

    Only `False` is ever recorded (a packed cache without member checksums), so a checkpoint without
    the key read checked data, or unpacked data, whose data key changes anyway when it is packed. Data
    that gained checksums resumes any checkpoint: its reads are checked more, never less.
    """
    field = field or key
    was, now = saved.pop(field, True), current.pop(field, True)
    if now is not False or was is False or key in allowed:
        return []
    shown = f" ({tag})" if tag else ""
    return [f"{key}{shown}: checkpoint {was!r}, now {now!r} ({NOTES[CHECKSUMS]})"]


def draws(fingerprint: Mapping[str, Any]) -> bool:
    """Whether the fingerprint is of a mixture's draw (several sources, or one at another length than its size)."""
    return "samples_per_epoch" in fingerprint or fingerprint.get("sources", 1) > 1


def align_draws(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Compare the draw only when both sides draw (a checkpoint without `mixture_draw` took draw 1)."""
    if draws(saved) and draws(current):
        saved.setdefault("mixture_draw", 1)
    else:  # one side reads each sample once: its other keys already say what changed
        saved.pop("mixture_draw", None)
        current.pop("mixture_draw", None)


def comparable(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """A fingerprint in the mixture's terms, so a single cache compares with a mixture source by source."""
    result = dict(fingerprint)
    if "sources" not in result:
        result["sources"] = 1
        result["sources[0].data"] = result.pop("data", None)
        if CHECKSUMS in result:
            result[f"sources[0].{CHECKSUMS}"] = result.pop(CHECKSUMS)
    return result


def per_source(fingerprint: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each source's keys (`data`, `weight`, `name`, ...) from a mixture fingerprint's `sources[i].<key>`."""
    sources: list[dict[str, Any]] = [{} for _ in range(int(fingerprint["sources"]))]
    for key, value in fingerprint.items():
        if key.startswith("sources["):
            index, _, field = key.removeprefix("sources[").partition("].")
            if field and index.isdigit() and int(index) < len(sources):
                sources[int(index)][field] = value
    return sources


def match_sources(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[int, int]:
    """Current source index -> the checkpoint's index of the same source.

    Sources match by data and name, then by data alone (a renamed source), then by name alone (a
    rebuilt cache); unnamed sources left over match by place. Among equal candidates the same place wins.
    """
    matched: dict[int, int] = {}
    for fields in (("data", "name"), ("data",), ("name",)):
        for i, source in enumerate(new):
            wanted = tuple(source.get(field) for field in fields)
            if i in matched or None in wanted:
                continue
            taken = set(matched.values())
            same = [j for j, was in enumerate(old) if j not in taken and tuple(was.get(f) for f in fields) == wanted]
            if same:
                matched[i] = i if i in same else same[0]
    for i, source in enumerate(new):
        unnamed = i < len(old) and source.get("name") is None and old[i].get("name") is None
        if unnamed and i not in matched and i not in matched.values():
            matched[i] = i
    return matched


def label(source: Mapping[str, Any]) -> str:
    """` 'name'` for a named source, nothing for an unnamed one."""
    return f" {source['name']!r}" if source.get("name") is not None else ""


def describe_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any], allowed: set[str], labels: Mapping[str, str] | None = None
) -> list[str]:
    """One `key: checkpoint X, now Y` line per differing fingerprint key not in `allowed`.

    A key of a mixture's source (`sources[1].weight`) is followed by the source's name from `labels`.
    """
    lines = []
    for key in sorted(set(saved) | set(current)):
        if key not in allowed and not key.endswith("].name") and saved.get(key) != current.get(key):
            source = key.partition("]")[0] + "]" if key.startswith("sources[") else ""
            tag = f" ({labels[source]})" if labels and source in labels else ""
            note = f" ({NOTES[key]})" if key in NOTES else ""
            lines.append(f"{key}{tag}: checkpoint {saved.get(key)!r}, now {current.get(key)!r}{note}")
    return lines
