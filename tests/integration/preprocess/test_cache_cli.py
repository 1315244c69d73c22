"""Claims about the cache CLI: resume after a kill, multi-rank builds, validate, inspect, demo-cache."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.builds import (
    build_args,
    cli_command,
    cli_env,
    index_files,
    parquet_rows,
    reference_cache,
    run_cli,
    write_lines,
    write_manifest,
    write_parquet,
)

from image_edit_data import ImageEditDataset
from image_edit_data.payload.payload import load_payload
from image_edit_data.preprocess.cli import cache_main, demo_cache_main


def assert_same_cache(a: Path, b: Path) -> None:
    assert index_files(a) == index_files(b)
    names = sorted(p.name for p in (a / "samples").iterdir())
    assert names == sorted(p.name for p in (b / "samples").iterdir())
    for name in names:
        first, second = load_payload(a / "samples" / name, name), load_payload(b / "samples" / name, name)
        assert torch.equal(first["target_latent"], second["target_latent"])
        assert all(torch.equal(x, y) for x, y in zip(first["context_latents"], second["context_latents"]))
        assert torch.equal(first["prompt_embeddings"], second["prompt_embeddings"])
        assert first["metadata"] == second["metadata"]


def journal_lines(cache: Path) -> int:
    journal = cache / "progress" / "rank-00000.jsonl"
    return journal.read_bytes().count(b"\n") if journal.exists() else 0


@pytest.fixture
def manifest(tmp_path: Path) -> Path:
    return write_manifest(tmp_path / "raw", rows=20)


@pytest.mark.slow
def test_a_killed_build_rerun_with_the_same_command_equals_an_uninterrupted_one(tmp_path: Path, manifest: Path) -> None:
    """A real process, killed mid-build: the journal and the payloads must survive a death no handler sees."""
    cache = tmp_path / "killed"
    args = build_args(manifest, cache, delay="0.05")
    process = subprocess.Popen(cli_command(*args), env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while journal_lines(cache) < 8 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done = journal_lines(cache)
    assert 8 <= done < 20, "the build should have been killed between windows"
    assert not (cache / "metadata.json").exists()
    # What a kill in the middle of writing leaves: a payload temporary and a torn journal line.
    (cache / "samples" / ".sample_00000019.pt.abc123.tmp").write_bytes(b"half a payload")
    with (cache / "progress" / "rank-00000.jsonl").open("ab") as journal:
        journal.write(b'{"position": 19, "rec')

    rerun = run_cli(*args)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"wrote {20 - done} payloads ({done} of 20 already done)" in rerun.stdout
    assert not list((cache / "samples").glob(".*.tmp"))
    assert_same_cache(cache, reference_cache(manifest, tmp_path / "reference", delay=0.05))
    assert len(ImageEditDataset(cache)) == 20


@pytest.mark.slow
def test_two_ranks_build_the_same_index_as_one(tmp_path: Path, manifest: Path) -> None:
    """Real processes: two ranks, each with its journal, and rank 0's merge."""
    cache = tmp_path / "two"
    # One image per encoder call on both sides: the ranks see other sets of images than one process does, and a
    # matmul over another number of rows may take another BLAS kernel, whose last bits differ.
    # An hour between looks: rank 0 is woken by rank 1's journal lines, not by a clock.
    options = ["--world-size", "2", "--poll-interval", "3600", "--batch-size", "1"]
    ranks = [
        subprocess.Popen(
            cli_command(*build_args(manifest, cache, "--rank", str(r), *options)),
            env=cli_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (1, 0)
    ]
    outputs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    assert "rank 1/2: wrote 10 payloads" in outputs[0][0]
    assert "20 samples in 1 index shard(s)" in outputs[1][0]
    assert sorted(p.name for p in (cache / "progress").glob("rank-*.jsonl")) == ["rank-00000.jsonl", "rank-00001.jsonl"]
    assert_same_cache(cache, reference_cache(manifest, tmp_path / "one", batch_size=1))


def test_torchrun_environment_selects_the_rank(
    tmp_path: Path, manifest: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    args = build_args(manifest, tmp_path / "env", "--merge-timeout", "0", "--num-samples", "4")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cache_main(args) == 0
    assert "rank 1/2: wrote 2 payloads" in capsys.readouterr().out
    assert cache_main([*args, "--rank", "0", "--merge-only"]) == 1  # the options win over the environment
    assert "2 of 4 samples are not done yet" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cache_main(args) == 0
    assert "4 samples in 1 index shard(s)" in capsys.readouterr().out


def test_a_rank_that_stops_on_a_bad_sample_stops_the_merge(
    tmp_path: Path, manifest: Path, capsys: pytest.CaptureFixture
) -> None:
    lines = manifest.read_text().splitlines()
    bad = json.loads(lines[1]) | {"prompt": ""}
    broken = write_lines(manifest.parent / "broken.jsonl", [lines[0], bad, *lines[2:4]])
    cache = tmp_path / "stop"
    assert cache_main(build_args(broken, cache, "--rank", "1", "--world-size", "2")) == 1
    out = capsys.readouterr().out
    assert "bad sample:" in out and "broken.jsonl line 2: prompt: expected non-empty text, got ''" in out
    assert cache_main(build_args(broken, cache, "--rank", "0", "--world-size", "2", "--poll-interval", "0.05")) == 1
    assert "rank 1 stopped, so the index was not merged" in capsys.readouterr().out


def test_resuming_with_other_settings_is_refused_naming_the_setting(
    tmp_path: Path, manifest: Path, capsys: pytest.CaptureFixture
) -> None:
    cache = tmp_path / "c"
    assert cache_main(build_args(manifest, cache, "--num-samples", "4")) == 0
    changed = build_args(manifest, cache, "--num-samples", "4", "--format", "safetensors", "--max-pixels", "4096")
    capsys.readouterr()
    assert cache_main(changed) == 1
    out = capsys.readouterr().out
    assert 'format: cache built with "pt", now "safetensors"' in out
    assert "preprocessing_config.resize.max_pixels: cache built with 1024, now 4096" in out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert cache_main(build_args(manifest, tmp_path / "other")) == 1
    assert "not empty and not a build of this tool" in capsys.readouterr().out


def test_skipped_samples_are_summarised_by_the_cli(
    tmp_path: Path, manifest: Path, capsys: pytest.CaptureFixture
) -> None:
    lines = manifest.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["media"][0]["file_name"] = "images/missing.png"
    edited = write_lines(manifest.parent / "some_bad.jsonl", [lines[0], lines[1], bad, lines[0]])
    assert cache_main(build_args(edited, tmp_path / "c", "--on-bad-sample", "skip")) == 0
    out = capsys.readouterr().out
    assert "2 skipped: duplicate id x1, missing image x1" in out
    assert "2 bad samples skipped (duplicate id x1, missing image x1)" in out


def test_validate_reports_every_corrupted_payload_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "demo"
    assert demo_cache_main([str(cache), "--num-samples", "6", "--quiet"]) == 0
    assert cache_main(["validate", str(cache), "--check-finite"]) == 0
    assert "ok: 6 samples" in capsys.readouterr().out
    (cache / "samples" / "sample_00000002.pt").write_bytes(b"garbage")
    payload = torch.load(cache / "samples" / "sample_00000004.pt", weights_only=True)
    payload["prompt_attention_mask"] = payload["prompt_attention_mask"][:1]
    torch.save(payload, cache / "samples" / "sample_00000004.pt")
    payload = torch.load(cache / "samples" / "sample_00000005.pt", weights_only=True)
    payload["target_latent"][0, 0, 0] = float("nan")
    torch.save(payload, cache / "samples" / "sample_00000005.pt")
    assert cache_main(["validate", str(cache), "--check-finite"]) == 1
    out = capsys.readouterr().out
    assert "3 of 6 samples are bad" in out
    assert "samples/sample_00000002.pt: payload: " in out
    assert "samples/sample_00000004.pt: prompt_attention_mask: prompt_attention_mask must have shape [sequence]" in out
    assert "samples/sample_00000005.pt: target_latent: contains 1 NaN and 0 Inf values" in out
    assert cache_main(["validate", str(cache)]) == 1  # the NaN alone passes without --check-finite
    assert "2 of 6 samples are bad" in capsys.readouterr().out


def test_validate_exits_2_when_the_index_is_unreadable(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "demo"
    assert demo_cache_main([str(cache), "--num-samples", "2", "--quiet"]) == 0
    (cache / "metadata_shard_0000.json").write_text("[{")
    assert cache_main(["validate", str(cache)]) == 2
    assert "index unreadable" in capsys.readouterr().out
    assert cache_main(["validate", str(tmp_path / "nowhere")]) == 2


def test_inspect_prints_the_bucket_table_and_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "demo"
    assert demo_cache_main([str(cache), "--num-samples", "40", "--format", "safetensors", "--quiet"]) == 0
    png = tmp_path / "plots" / "buckets.png"
    assert cache_main(["inspect", str(cache), "--histogram", str(png)]) == 0
    out = capsys.readouterr().out
    assert "40 samples in" in out and "target=8x8x8/contexts=[8x8x8]" in out and "share %" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_inspect_histogram_without_matplotlib_names_the_plots_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "demo"
    assert demo_cache_main([str(cache), "--num-samples", "4", "--quiet"]) == 0
    capsys.readouterr()
    for name in [name for name in sys.modules if name == "matplotlib" or name.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)  # not importable, whether installed or imported before
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    png = tmp_path / "buckets.png"
    assert cache_main(["inspect", str(cache), "--histogram", str(png)]) == 1
    printed = capsys.readouterr().out
    assert 'pip install "image-edit-data[plots]"' in printed and "samples in" not in printed
    assert not png.exists()


def test_demo_cache_builds_through_the_same_path_and_reloads(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "demo"
    assert (
        demo_cache_main([str(cache), "--num-samples", "12", "--seed", "3", "--format", "safetensors", "--quiet"]) == 0
    )
    out = capsys.readouterr().out
    assert "wrote 12 payloads" in out and "12 samples in 1 index shard(s)" in out
    assert re.search(r"encoders busy \d+% of the [\d.]+ s of encoding \([\d.]+ samples/s\)", out), out
    dataset = ImageEditDataset(cache)
    assert len(dataset) == 12 and dataset[0]["metadata"]["manifest_metadata"]["seed"] == 3
    assert (
        demo_cache_main([str(cache), "--num-samples", "12", "--seed", "3", "--format", "safetensors", "--quiet"]) == 0
    )
    assert "wrote 0 payloads (12 of 12 already done)" in capsys.readouterr().out


def test_bad_options_exit_2_and_a_missing_source_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cache_main(["build", str(tmp_path / "c"), "--format", "zip"]) == 2
    assert cache_main(["build", str(tmp_path / "c"), *build_args(tmp_path / "m.jsonl", tmp_path / "c")[4:]]) == 1
    assert "source: give exactly one of --manifest" in capsys.readouterr().out


def test_build_reads_a_parquet_data_set_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parquet = write_parquet(tmp_path / "pq" / "train.parquet", parquet_rows(6), image_columns=("source_img",))
    args = build_args(tmp_path / "unused.jsonl", tmp_path / "c")
    manifest_at = args.index("--manifest")
    del args[manifest_at : manifest_at + 2]
    dataset_args = ["--dataset", str(parquet.parent), "--id-column", "img_id", "--hf-cache-dir", str(tmp_path / "hf")]
    assert cache_main([*args, *dataset_args, "--context-columns", "[source_img]", "--format", "safetensors"]) == 0
    assert "6 samples in 1 index shard(s)" in capsys.readouterr().out
    dataset = ImageEditDataset(tmp_path / "c")
    assert [dataset[i]["metadata"]["original_ids"]["id"] for i in range(6)] == [f"m{i:03d}" for i in range(6)]
