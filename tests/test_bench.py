"""`image-edit-data bench` on tiny synthetic caches: every number present and sane, no timing thresholds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from image_edit_data.bench import bench_main
from image_edit_data.bench_measure import cpu_model
from image_edit_data.bench_synthetic import synthetic_spec, write_synthetic_cache
from image_edit_data.index import load_index

TINY = ["--latent", "4x8x8", "--prompt", "8x16", "--memcpy-mib", "16"]


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_bench_reports_every_number_for_ours_naive_and_bare_loop(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out.json"
    argv = ["--make-synthetic", "40", "--out", str(tmp_path / "cache"), *TINY, "--batches", "5", "--warmup", "2"]
    code = bench_main([*argv, "--num-workers", "0", "2", "--compare-naive", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed

    results = json.loads(out.read_text())
    machine = results["machine"]
    assert machine["cpu_model"] == cpu_model()
    assert positive(machine["cpu_count"]) and positive(machine["cpus_usable"])
    assert machine["torch_version"] == torch.__version__
    assert machine["load_average_1m"] >= 0 and machine["load_average_1m_end"] >= 0
    for fact in (machine["cpu_model"], f"{machine['cpu_count']} CPUs", f"torch {torch.__version__}"):
        assert fact in printed

    index = results["index"]
    for key in ("open_first_s", "open_second_s", "nbytes", "bytes_per_sample", "peak_traced_bytes"):
        assert positive(index[key]), key
    assert index["nbytes"] == load_index(tmp_path / "cache").nbytes
    assert isinstance(index["rss_growth_bytes"], int)  # may be 0 when the allocator had room already

    memcpy = results["memcpy"]
    for key in ("mb_s", "single_thread_mb_s", "torch_mb_s", "buffer_bytes"):
        assert positive(memcpy[key]), key
    assert memcpy["mb_s"] == max(memcpy["single_thread_mb_s"], memcpy["torch_mb_s"])

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
    for workers in (0, 2):
        ours = runs[("ours", workers)]
        assert math.isclose(ours["ours_over_naive"], ours["samples_s"] / runs[("naive", workers)]["samples_s"])
        assert math.isclose(ours["ours_over_bare"], ours["samples_s"] / runs[("bare", None)]["samples_s"])
    assert runs[("ours", 0)]["workers"] == [] and runs[("bare", None)]["workers"] == []
    for key in (("ours", 2), ("naive", 2)):
        workers = runs[key]["workers"]
        assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
        for worker in workers:
            assert positive(worker["uss_start_bytes"]) and positive(worker["uss_end_bytes"])
            assert worker["uss_growth_bytes"] == worker["uss_end_bytes"] - worker["uss_start_bytes"]


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
    assert "bare load loop" in printed


@pytest.mark.parametrize(("preset", "megabytes"), [("small", 0.9), ("large", 3.3)])
def test_presets_write_samples_of_about_their_stated_size(tmp_path: Path, preset: str, megabytes: float) -> None:
    spec = synthetic_spec(preset, None, None, contexts=1, payload_format="pt")
    write_synthetic_cache(tmp_path, 1, spec)
    written = (tmp_path / "samples" / "sample_00000000.pt").stat().st_size
    assert abs(written / 1e6 - megabytes) < 0.05 * megabytes
    assert spec.tensor_bytes <= written < spec.tensor_bytes + 10_000


def test_synthetic_cache_opens_as_one_bucket_of_valid_samples(tmp_path: Path) -> None:
    from image_edit_data.dataset import ImageEditDataset

    write_synthetic_cache(tmp_path, 3, synthetic_spec("small", "4x8x8", "8x16", contexts=1, payload_format="pt"))
    dataset = ImageEditDataset(tmp_path)
    assert dataset.get_bucket_info() == {"total_buckets": 1, "buckets": {"target=4x8x8/contexts=[4x8x8]": 3}}
    assert [dataset[i]["target_latent"][0, 0, 0].item() for i in range(3)] == [0, 1, 2]


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        ([], 2, "expected CACHE_DIR, or --make-synthetic N"),
        (["somewhere", "--make-synthetic", "4"], 2, "either CACHE_DIR or --make-synthetic"),
        (["--make-synthetic", "4", "--latent", "16x64"], 2, "--latent: expected 3 positive integers like 16x64x64"),
        (["cache", "--num-workers", "0", "-1"], 2, "--num-workers: expected an integer >= 0, got -1"),
        (["cache", "--batch-size", "0"], 2, "--batch-size: expected an integer >= 1, got 0"),
        (
            ["cache", "--json", "no/such/dir/out.json"],
            2,
            "--json: the directory of no/such/dir/out.json does not exist",
        ),
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


def test_bench_will_not_write_a_synthetic_cache_into_a_non_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert bench_main(["--make-synthetic", "4", "--out", str(tmp_path), *TINY]) == 1
    assert "not an empty directory" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
