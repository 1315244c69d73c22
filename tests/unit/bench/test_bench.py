"""`image-edit-data bench` on tiny synthetic caches: every number present and sane, no timing thresholds."""

from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from support.caches import tiny_cache

import image_edit_data.bench.run as bench_run
from image_edit_data.bench.command import bench_main
from image_edit_data.bench.index_opens import forget_stored_index, stored_index_files
from image_edit_data.bench.measure import cpu_model, cpu_seconds
from image_edit_data.bench.synthetic import (
    INDEX_ONLY_SIGNATURES,
    synthetic_spec,
    write_hardlink_cache,
    write_index_only_cache,
    write_synthetic_cache,
)
from image_edit_data.dataset import ImageEditDataset
from image_edit_data.index.index import load_index
from image_edit_data.index.store import open_index
from image_edit_data.preprocess.tools.pack import pack_cache

TINY = ["--latent", "4x8x8", "--prompt", "8x16", "--memcpy-mib", "16"]


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def run_json(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[dict[str, Any], str]:
    out = tmp_path / "out.json"
    code = bench_main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return json.loads(out.read_text()), printed


@pytest.mark.slow  # a whole bench run: index opens in fresh processes, workers
def test_bench_reports_every_number_for_ours_naive_and_bare_loop(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["--make-synthetic", "40", "--out", str(tmp_path / "cache"), *TINY, "--batches", "5", "--warmup", "2"]
    results, printed = run_json(tmp_path, [*argv, "--num-workers", "0", "2", "--compare-naive"], capsys)

    machine = results["machine"]
    assert machine["cpu_model"] == cpu_model()
    assert positive(machine["cpu_count"]) and positive(machine["cpus_usable"])
    assert machine["torch_version"] == torch.__version__
    assert machine["torch_threads"] == torch.get_num_threads()
    assert machine["load_average_1m"] >= 0 and machine["load_average_1m_end"] >= 0
    facts = (machine["cpu_model"], f"{machine['cpu_count']} CPUs", f"torch {torch.__version__}", "get_num_threads()")
    for fact in facts:
        assert fact in printed

    parse, stored = results["index"]
    assert (parse["loader"], parse["open"], stored["loader"], stored["open"]) == ("ours", "parse", "ours", "stored")
    assert parse["from_store"] is False and stored["from_store"] is True
    for row in (parse, stored):
        for key in ("seconds", "traced_retained_bytes", "traced_peak_bytes", "retained_bytes_per_sample"):
            assert positive(row[key]), key
        assert row["samples"] == 40 and row["seconds_over_other"] is None
        assert row["index_array_bytes"] == load_index(tmp_path / "cache").nbytes
        assert isinstance(row["rss_growth_bytes"], int)  # may be 0 when the allocator had room already
    assert results["other"] is None

    memcpy = results["memcpy"]
    for key in ("mb_s", "single_thread_mb_s", "torch_mb_s", "buffer_bytes"):
        assert positive(memcpy[key]), key
    assert memcpy["mb_s"] == max(memcpy["single_thread_mb_s"], memcpy["torch_mb_s"])
    assert positive(results["page_cache"]["mb_s"]) and results["page_cache"]["files"] == 28  # 2 + 5 batches of 4
    assert "page-cache read rate" in printed

    assert results["cache"]["samples"] == 40 and results["cache"]["kept"] is True
    assert results["settings"]["measured_batches"] == 5
    runs = {(r["loader"], r["num_workers"]): r for r in results["runs"]}
    assert set(runs) == {("ours", 0), ("ours", 2), ("naive", 0), ("naive", 2), ("bare", None)}
    sample_bytes = (tmp_path / "cache" / "samples" / "sample_00000000.pt").stat().st_size
    for run in runs.values():
        assert run["batches"] == 5 and run["samples"] == 20
        assert run["payload_bytes"] == 20 * sample_bytes  # every loader is charged for the same files
        for key in ("seconds", "samples_s", "mb_s", "memcpy_fraction"):
            assert positive(run[key]), (run["loader"], key)
        assert run["memcpy_fraction"] <= 1 + 1e-6
        assert math.isclose(run["mb_s"], run["memcpy_fraction"] * memcpy["mb_s"])
        assert run["load_average_1m"] >= 0
    for workers in (0, 2):
        ours = runs[("ours", workers)]
        assert math.isclose(ours["ours_over_naive"], ours["samples_s"] / runs[("naive", workers)]["samples_s"])
        assert math.isclose(ours["ours_over_bare"], ours["samples_s"] / runs[("bare", None)]["samples_s"])
        assert ours["ours_over_other"] is None
    assert runs[("ours", 0)]["workers"] == [] and runs[("bare", None)]["workers"] == []
    for run in runs.values():
        assert positive(run["main_cpu_ms_per_sample"]) and positive(run["cpu_ms_per_sample"])
        if not run["num_workers"]:
            assert run["cpu_ms_per_sample"] == run["main_cpu_ms_per_sample"]
    for key in (("ours", 2), ("naive", 2)):  # the workers' CPU time is read while they are alive (ours: a live pool)
        assert runs[key]["worker_cpu_ms_per_sample"] >= 0
        ours = runs[key]
        assert math.isclose(
            ours["cpu_ms_per_sample"], ours["main_cpu_ms_per_sample"] + ours["worker_cpu_ms_per_sample"]
        )
    assert "CPU ms/sample" in printed
    for key in (("ours", 2), ("naive", 2)):
        workers = runs[key]["workers"]
        assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
        for worker in workers:
            assert positive(worker["uss_start_bytes"]) and positive(worker["uss_end_bytes"])
            assert worker["uss_growth_bytes"] == worker["uss_end_bytes"] - worker["uss_start_bytes"]


@pytest.mark.slow  # bench runs open the index in fresh processes
def test_bench_measures_an_existing_safetensors_cache_without_json(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = synthetic_spec("small", "4x8x8", "8x16", contexts=2, payload_format="safetensors")
    write_synthetic_cache(tmp_path / "cache", 24, spec)
    argv = [str(tmp_path / "cache"), "--batches", "3", "--warmup", "1", "--compare-naive", "--memcpy-mib", "16"]
    code = bench_main(argv)
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "24 samples" in printed and "safetensors payloads" in printed
    assert "bare load loop" in printed and "re-open (stored index)" in printed


def test_cpu_time_is_read_from_a_live_process_that_is_not_this_ones_reaped_child() -> None:
    spin = (
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
        "print('spun', flush=True)\ntime.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        _, alive = cpu_seconds([child.pid])  # still running: getrusage(RUSAGE_CHILDREN) would not count it yet
        assert alive is not None and 0.25 <= alive < 5
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds([child.pid])[1] is None  # gone: unknown, never a made-up number


@pytest.mark.slow  # bench runs open the index in fresh processes
def test_bench_reads_a_packed_cache_checked_and_unchecked_and_refuses_what_reads_files(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    spec = synthetic_spec("small", "4x8x8", "8x16", contexts=1, payload_format="safetensors")
    write_synthetic_cache(tmp_path / "files", 16, spec)
    pack_cache(tmp_path / "files", str(tmp_path / "packed"), shard_bytes=8192)
    index = open_index(tmp_path / "packed")
    argv = [str(tmp_path / "packed"), "--batches", "2", "--warmup", "1", "--memcpy-mib", "16"]
    for extra, checked in (([], True), (["--no-checksums"], False)):
        results, printed = run_json(tmp_path, [*argv, *extra], capsys)
        assert results["cache"]["member_checksums"] is checked and "safetensors (packed)" in printed
        (run,) = results["runs"]
        planned = [index.member(i)[2] for i in range(len(index))]
        assert run["samples"] == 8 and min(planned) * 8 <= run["payload_bytes"] <= max(planned) * 8
        assert positive(run["cpu_ms_per_sample"])
    assert bench_main([*argv, "--compare-naive"]) == 1
    assert "a packed cache, which --compare-naive cannot read (one file per sample)" in capsys.readouterr().out


@pytest.mark.slow  # bench runs open the index in fresh processes
def test_bench_on_a_relative_path_measures_the_cache_its_children_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The index opens run in child processes: they get the path resolved, and a child's error would come back whole."""
    tiny_cache(tmp_path / "cache", counts=(6, 6))
    monkeypatch.chdir(tmp_path)
    code = bench_main(["cache", "--batches", "2", "--warmup", "1", "--memcpy-mib", "16", "--json", "out.json"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    numbers = json.loads((tmp_path / "out.json").read_text())
    assert [row["open"] for row in numbers["index"]] == ["parse", "stored"]


@pytest.mark.slow  # a whole bench run: index opens in fresh processes, workers
def test_rounds_time_the_loaders_in_turns_and_report_each_ones_fastest_round(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []

    def recording(measure: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            run = measure(*args, **kwargs)
            order.append(f"{run.loader} {run.num_workers}")
            return run

        return timed

    monkeypatch.setattr(bench_run, "timed_batches", recording(bench_run.timed_batches))
    monkeypatch.setattr(bench_run, "bare_loop", recording(bench_run.bare_loop))
    argv = ["--make-synthetic", "24", *TINY, "--batches", "2", "--warmup", "1", "--compare-naive", "--rounds", "3"]
    results, printed = run_json(tmp_path, argv, capsys)
    assert order == ["ours 0", "naive 0", "bare None"] * 3
    assert len(results["runs"]) == 3
    for run in results["runs"]:
        assert len(run["rounds_samples_s"]) == 3 and all(positive(rate) for rate in run["rounds_samples_s"])
        assert math.isclose(run["samples_s"], max(run["rounds_samples_s"]))
        assert math.isclose(run["seconds"], run["samples"] / run["samples_s"])
    assert "fastest of 3 rounds" in printed and "slowest round" in printed


@pytest.mark.slow  # a whole bench run: index opens in fresh processes, workers
def test_index_only_writes_no_payloads_and_measures_the_parse_and_the_stored_reopen(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    cache = tmp_path / "cache"
    results, printed = run_json(tmp_path, ["--make-synthetic", "2500", "--index-only", "--out", str(cache)], capsys)
    assert sorted(p.name for p in cache.iterdir()) == [
        ".image_edit_data",
        "metadata.json",
        "metadata_shard_0000.json",
        "metadata_shard_0001.json",
        "metadata_shard_0002.json",
    ]
    assert results["mode"] == "index" and results["runs"] == [] and results["memcpy"] is None
    assert results["cache"] == {
        "path": str(cache.resolve()),
        "samples": 2500,
        "buckets": len(INDEX_ONLY_SIGNATURES),
        "synthetic": {**results["cache"]["synthetic"]},
        "kept": True,
    }
    parse, stored = results["index"]
    assert (parse["from_store"], stored["from_store"]) == (False, True)
    assert parse["samples"] == stored["samples"] == 2500
    assert stored["index_array_bytes"] == open_index(cache).nbytes
    assert "first open (parse)" in printed and "Loaders" not in printed


def test_index_only_records_carry_the_fields_of_a_real_cache(tmp_path: Path) -> None:
    write_index_only_cache(tmp_path, 1200, "safetensors")
    records = json.loads((tmp_path / "metadata_shard_0000.json").read_text())
    assert len(records) == 1000
    first = records[0]
    assert set(first) == {
        "cache_file",
        "compound_bucket_signature",
        "original_id",
        "row_index",
        "target_token_length",
        "context_token_lengths",
        "text_token_length",
    }
    assert first["cache_file"] == "samples/sample_00000000.safetensors" and first["row_index"] == 0
    for record in records:
        assert len(record["context_token_lengths"]) == len(record["compound_bucket_signature"]["contexts"])
    index = load_index(tmp_path)
    assert len(index) == 1200 and len(index.signatures) == len(INDEX_ONLY_SIGNATURES)
    assert not (tmp_path / "samples").exists()


def test_hardlink_cache_gives_every_record_its_own_path_to_one_payload(tmp_path: Path) -> None:
    write_hardlink_cache(tmp_path, 30)
    files = sorted((tmp_path / "samples").iterdir())
    assert len(files) == 30 and len({f.stat().st_ino for f in files}) == 1
    assert files[0].stat().st_nlink == 30
    dataset = ImageEditDataset(tmp_path)
    assert len(dataset) == 30
    assert [dataset[i]["metadata"]["original_ids"] for i in (0, 29)] == [{"id": "synthetic-0"}] * 2


def test_hardlink_cache_starts_a_new_copy_at_the_filesystems_link_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    link = os.link

    def limited_link(source: Path, target: Path) -> None:  # a filesystem allowing 10 links per file
        if Path(source).stat().st_nlink >= 10:
            raise OSError(errno.EMLINK, "Too many links")
        link(source, target)

    monkeypatch.setattr("image_edit_data.bench.synthetic.os.link", limited_link)
    write_hardlink_cache(tmp_path, 25)
    files = sorted((tmp_path / "samples").iterdir())
    assert sorted(f.stat().st_nlink for f in files) == [5] * 5 + [10] * 20
    assert len(ImageEditDataset(tmp_path)) == 25


@pytest.mark.slow  # a whole bench run: index opens in fresh processes, workers
def test_worker_memory_runs_one_whole_epoch_and_samples_each_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["--worker-memory-index", "60", "--batch-size", "2", "--warmup", "2"]
    results, printed = run_json(tmp_path, argv, capsys)
    assert results["mode"] == "worker-memory" and results["cache"]["samples"] == 60
    (epoch,) = results["epochs"]
    assert (epoch["loader"], epoch["num_workers"], epoch["batches"], epoch["samples"]) == ("ours", 2, 28, 56)
    assert positive(epoch["seconds"]) and positive(epoch["samples_s"])
    assert len(epoch["workers"]) == 2
    for worker in epoch["workers"]:
        assert positive(worker["uss_start_bytes"]) and positive(worker["uss_end_bytes"])
        assert worker["uss_max_bytes"] >= max(worker["uss_start_bytes"], worker["uss_end_bytes"])
    assert "Worker memory over one epoch of 60 records" in printed
    assert not Path(results["cache"]["path"]).exists()  # temporary, removed


def test_forgetting_the_stored_index_keeps_the_quarantine_list(tmp_path: Path) -> None:
    write_index_only_cache(tmp_path, 10, "pt")
    open_index(tmp_path)
    (stored,) = [p for p in stored_index_files(tmp_path) if p.is_file()]
    quarantine = tmp_path / ".image_edit_data" / "quarantine.jsonl"
    quarantine.write_text("{}\n")
    forget_stored_index(tmp_path)
    assert not stored.exists() and quarantine.read_text() == "{}\n"


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        ([], 2, "expected CACHE_DIR, or --make-synthetic N"),
        (["somewhere", "--make-synthetic", "4"], 2, "either CACHE_DIR or --make-synthetic"),
        (["--make-synthetic", "4", "--latent", "16x64"], 2, "--latent: expected 3 positive integers like 16x64x64"),
        (["cache", "--num-workers", "0", "-1"], 2, "--num-workers: expected an integer >= 0, got -1"),
        (["cache", "--batch-size", "0"], 2, "--batch-size: expected an integer >= 1, got 0"),
        (["cache", "--rounds", "0"], 2, "--rounds: expected an integer >= 1, got 0"),
        (["cache", "--torch-threads", "0"], 2, "--torch-threads: expected an integer >= 1, got 0"),
        (["cache", "--wait-load", "0"], 2, "--wait-load: expected a positive load average, got 0.0"),
        (
            ["cache", "--json", "no/such/dir/out.json"],
            2,
            "no/such/dir/out.json does not exist",
        ),
        (["--worker-memory-index", "8", "--num-workers", "0"], 2, "expected --num-workers >= 1, got 0"),
        (["cache", "--worker-memory-index", "8"], 2, "--worker-memory-index N writes its own cache"),
        (["no-such-cache"], 1, "no-such-cache: cache directory does not exist"),
        (
            ["--make-synthetic", "8", *TINY, "--warmup", "2"],
            1,
            "one epoch has 2 batches of 4, not more than --warmup 2",
        ),
    ],
)
def test_bench_refuses_bad_options_with_a_sentence(
    argv: list[str], code: int, message: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).parent)  # "no-such-cache" and "no/such/dir" are relative to here
    assert bench_main(argv) == code
    assert message in capsys.readouterr().out
