"""benchmarks/versus_nemo: the bench with NeMo Automodel's loader beside ours, its `.pt` twin of a safetensors cache."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.versus_nemo.command import versus_nemo_main
from benchmarks.versus_nemo.pt_twin import convert_payloads, pt_name, write_pt_twin_index
from image_edit_data.bench.synthetic import synthetic_spec, write_synthetic_cache
from image_edit_data.index.index import load_index
from image_edit_data.payload.payload import load_payload

TINY = ["--latent", "4x8x8", "--prompt", "8x16", "--memcpy-mib", "16"]
# Where NeMo Automodel may be unpacked (`pip download nemo-automodel`, unzip); it may also be installed.
REFERENCE_PATH = os.environ.get("IMAGE_EDIT_REFERENCE_PATH")
REFERENCE_ARGS = ["--reference-path", REFERENCE_PATH] if REFERENCE_PATH else []


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def run_json(tmp_path: Path, argv: list[str], capsys: pytest.CaptureFixture) -> tuple[dict[str, Any], str]:
    out = tmp_path / "out.json"
    code = versus_nemo_main([*argv, *REFERENCE_ARGS, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    return json.loads(out.read_text()), printed


def test_pt_twin_of_a_safetensors_cache_holds_the_same_tensors_and_only_their_bytes(tmp_path: Path) -> None:
    spec = synthetic_spec("small", "4x16x16", "8x64", contexts=1, payload_format="safetensors")
    index = load_index(write_synthetic_cache(tmp_path / "cache", 6, spec))
    twin = tmp_path / "twin"
    write_pt_twin_index(index, twin)
    convert_payloads(index, twin, [1, 4])
    assert sorted(p.name for p in (twin / "samples").iterdir()) == ["sample_00000001.pt", "sample_00000004.pt"]
    twin_index = load_index(twin)
    assert [twin_index.relative_path(i) for i in range(6)] == [pt_name(index.relative_path(i)) for i in range(6)]
    original = load_payload(index.payload_path(4), "original")
    copy = load_payload(twin / "samples" / "sample_00000004.pt", "copy")
    assert torch.equal(copy["target_latent"], original["target_latent"])
    assert torch.equal(copy["prompt_embeddings"], original["prompt_embeddings"])
    assert copy["metadata"] == original["metadata"]
    # Views of the mapped file were copied out: the .pt holds each tensor once, not the whole file per tensor.
    assert (twin / "samples" / "sample_00000004.pt").stat().st_size < spec.tensor_bytes + 10_000


def test_it_says_how_to_install_nemo_automodel_when_it_cannot_be_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Not importable, whatever is installed or was imported by earlier tests.
    for name in [name for name in sys.modules if name.startswith("nemo_automodel.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "nemo_automodel", None)
    assert versus_nemo_main(["--make-synthetic", "8", "--out", str(tmp_path / "cache")]) == 2
    printed = capsys.readouterr().out
    assert "cannot import NeMo Automodel's loader" in printed and "pip install --no-deps nemo-automodel" in printed
    assert "--reference-path DIR" in printed
    assert not (tmp_path / "cache").exists()  # refused before writing anything


def test_a_reference_path_that_is_no_directory_is_refused(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(Path(__file__).parent)
    assert versus_nemo_main(["cache", "--reference-path", "no/such/dir"]) == 2
    assert "no/such/dir is not a directory" in capsys.readouterr().out


@pytest.mark.slow  # a whole bench run: index opens in fresh processes, workers
def test_it_measures_nemos_loader_on_a_pt_twin_of_a_safetensors_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    argv = ["--make-synthetic", "32", "--format", "safetensors", *TINY, "--batches", "4", "--warmup", "1"]
    results, printed = run_json(tmp_path, [*argv, "--rounds", "2"], capsys)
    assert results["other"]["name"] == "NeMo Automodel" and results["other"]["version"]
    assert "other loader: NeMo Automodel" in printed and "ours/other" in printed
    assert all(len(run["rounds_samples_s"]) == 2 for run in results["runs"])
    *ours, nemo = results["index"]
    assert nemo["loader"] == "NeMo Automodel" and nemo["samples"] == 32
    for row in ours:
        assert math.isclose(row["seconds_over_other"], row["seconds"] / nemo["seconds"])
    runs = {(r["loader"], r["num_workers"]): r for r in results["runs"]}
    assert set(runs) == {("ours", 0), ("NeMo Automodel", 0)}
    assert runs["NeMo Automodel", 0]["samples"] == 16 and positive(runs["NeMo Automodel", 0]["samples_s"])
    ratio = runs["ours", 0]["ours_over_other"]
    assert math.isclose(ratio, runs["ours", 0]["samples_s"] / runs["NeMo Automodel", 0]["samples_s"])


@pytest.mark.slow  # a whole bench run: index opens in fresh processes, workers
def test_it_measures_nemos_index_open_and_worker_memory(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    results, _ = run_json(tmp_path, ["--make-synthetic", "1500", "--index-only"], capsys)
    assert [(r["loader"], r["open"]) for r in results["index"]] == [
        ("ours", "parse"),
        ("ours", "stored"),
        ("NeMo Automodel", "parse"),
    ]
    assert results["index"][2]["samples"] == 1500 and results["index"][2]["index_array_bytes"] is None
    results, _ = run_json(tmp_path, ["--worker-memory-index", "40", "--batch-size", "2", "--warmup", "2"], capsys)
    assert [(e["loader"], e["batches"]) for e in results["epochs"]] == [("ours", 18), ("NeMo Automodel", 18)]
    assert all(len(e["workers"]) == 2 for e in results["epochs"])
