"""The rows of `bench versus-litdata`: per path, epoch and worker count, ours against litdata, with the target.

Each round measures every loader once; a row's ratio is the median over rounds of that round's
samples/s of ours divided by litdata's (the same round, worker count and local or S3 reads).
"Cold" is a fresh loader's first epoch, timed from building it (fresh local cache directories:
the index and, remote, every shard or chunk comes from the endpoint); "warm" the later epochs of
the same loader (remote: what the local cache kept). CPU per sample counts the whole process
tree, workers included; the S3 server's CPU is reported per epoch beside each remote rate, and as
the share of the epoch's wall time it kept the server busy. A row below its target while ours kept
the server busy nearly all the time (`SERVER_BOUND`) says so: the endpoint, not the client, set the
rate (moto reads a whole object to answer each ranged GET).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rich.table import Table

RANGE_TARGET = 0.75  # range mode fetches only the bytes each sample uses, one request per sample
# Server CPU seconds per wall second at which the endpoint, not the client, sets the rate: nearly one core,
# which is all moto has for its Python (one process, one GIL).
SERVER_BOUND = 0.9


@dataclass(frozen=True)
class RowSpec:
    """One row of the table: which of our layouts, which epoch, and the ratio it must reach."""

    path: str
    where: str
    layout: str
    epoch: str  # "cold" or "warm"
    target: float
    endpoint: str = ""  # S3 rows: the server read from


LOCAL_ROWS = (
    RowSpec("local files", "local", "files", "cold", 1.0),
    RowSpec("local files", "local", "files", "warm", 1.0),
    RowSpec("local packed", "local", "packed", "cold", 1.0),
    RowSpec("local packed", "local", "packed", "warm", 1.0),
)


def s3_rows(endpoint: str) -> tuple[RowSpec, ...]:
    """The rows read from one S3 endpoint."""
    return (
        RowSpec(f"S3 {endpoint} shard_cache", "s3", "shard_cache", "cold", 1.0, endpoint),
        RowSpec(f"S3 {endpoint} shard_cache", "s3", "shard_cache", "warm", 1.0, endpoint),
        RowSpec(f"S3 {endpoint} range", "s3", "range", "cold", RANGE_TARGET, endpoint),
    )


def epoch_numbers(result: Mapping[str, Any], epoch: str) -> dict[str, float] | None:
    """samples/s, CPU ms per sample, server CPU seconds per epoch and per wall second of a measurement's epochs."""
    epochs = result["epochs"][:1] if epoch == "cold" else result["epochs"][1:]
    if not epochs:
        return None
    samples = sum(e["samples"] for e in epochs)
    return {
        "samples_s": statistics.median(e["samples"] / e["seconds"] for e in epochs),
        "cpu_ms": 1000 * sum(e["cpu_seconds"] for e in epochs) / samples,
        "server_cpu_s": sum(e["server_cpu_seconds"] for e in epochs) / len(epochs),
        "server_busy": sum(e["server_cpu_seconds"] for e in epochs) / sum(e["seconds"] for e in epochs),
    }


def _median(values: Sequence[float]) -> float:
    return statistics.median(values)


def row(spec: RowSpec, workers: int, results: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The row's numbers over all rounds, or None when the run did not measure it."""
    by_round: dict[tuple[int, str], Mapping[str, Any]] = {}
    for result in results:
        m = result["measurement"]
        endpoint = (m.get("endpoint") or "moto") if m["where"] == "s3" else ""  # results from before endpoints: moto
        same_place = m["where"] == spec.where and endpoint == spec.endpoint
        if same_place and m["workers"] == workers and m["layout"] in (spec.layout, "litdata"):
            by_round[m["round"], m["system"]] = result
    pairs = []
    for (round_, system), result in sorted(by_round.items()):
        lit = by_round.get((round_, "litdata"))
        if system == "ours" and lit is not None:
            ours_numbers, lit_numbers = epoch_numbers(result, spec.epoch), epoch_numbers(lit, spec.epoch)
            if ours_numbers is not None and lit_numbers is not None:
                pairs.append((ours_numbers, lit_numbers))
    if not pairs:
        return None
    ratios = [o["samples_s"] / lit["samples_s"] for o, lit in pairs]
    ratio = _median(ratios)
    numbers = {
        f"{who}_{name}": _median([p[side][name] for p in pairs])
        for side, who in enumerate(("ours", "litdata"))
        for name in ("samples_s", "cpu_ms", "server_cpu_s", "server_busy")
    }
    return {
        "path": spec.path,
        "endpoint": spec.endpoint,
        "layout": spec.layout,
        "epoch": spec.epoch,
        "workers": workers,
        **numbers,
        "ratio": ratio,
        "round_ratios": ratios,
        "target": spec.target,
        "verdict": verdict(ratio, spec, numbers["ours_server_busy"]),
        "remote": spec.where == "s3",
    }


def verdict(ratio: float, spec: RowSpec, server_busy: float) -> str:
    """PASS at or past the target; below it, whether the endpoint's CPU was what held ours back."""
    if ratio >= spec.target:
        return "PASS"
    return "BELOW, server-bound" if spec.where == "s3" and server_busy >= SERVER_BOUND else "BELOW"


def rows(
    results: Sequence[Mapping[str, Any]], workers: Sequence[int], endpoints: Sequence[str] = ("moto",)
) -> list[dict[str, Any]]:
    """Every row the results hold, in table order, each worker count in turn."""
    specs = LOCAL_ROWS + tuple(spec for endpoint in endpoints for spec in s3_rows(endpoint))
    found = (row(spec, w, results) for spec in specs for w in workers)
    return [r for r in found if r is not None]


def render(table_rows: Sequence[Mapping[str, Any]], rounds: int) -> Table:
    """The rows as a table."""
    table = Table(title=f"ours ÷ litdata, samples/s (median of {rounds} alternating rounds)")
    columns: tuple[str, ...] = ("path", "epoch", "workers", "ours samples/s", "litdata samples/s", "ratio", "target")
    columns += ("", "CPU ms/sample ours", "litdata", "S3 server CPU s/epoch ours", "litdata", "server busy ours")
    for name in columns:
        table.add_column(name, justify="left" if name in ("path", "epoch", "") else "right", no_wrap=name == "path")
    for r in table_rows:
        server = ("", "", "")
        if r["remote"]:
            busy = f"{r['ours_server_busy']:.0%}" if "ours_server_busy" in r else ""  # JSON from before it: none
            server = (f"{r['ours_server_cpu_s']:.2f}", f"{r['litdata_server_cpu_s']:.2f}", busy)
        table.add_row(
            r["path"],
            r["epoch"],
            str(r["workers"]),
            f"{r['ours_samples_s']:.0f}",
            f"{r['litdata_samples_s']:.0f}",
            f"{r['ratio']:.2f}",
            f"≥ {r['target']:.2f}",
            r["verdict"],
            f"{r['ours_cpu_ms']:.2f}",
            f"{r['litdata_cpu_ms']:.2f}",
            *server,
        )
    return table
