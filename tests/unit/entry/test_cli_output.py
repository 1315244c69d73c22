"""Claim: the commands print every message as it is: brackets in file names, sections and values survive.

Rich reads `[...]` as markup and drops it, so `dataset.toml: [general]: unknown key(s)` printed
through it read `dataset.toml: : unknown key(s)`, and `photo[v2].png` read `photo.png`. Each
command that prints data (cache build, validate, inspect, convert, pack, bench) runs here on files
and directories whose names hold brackets, in this process, and its output is read back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.caches import tiny_cache
from support.peers import build, image, manifest

from image_edit_data.bench.command import bench_main
from image_edit_data.preprocess.cli import cache_main

NAME = "photo[v2]"


@pytest.fixture
def bracketed_cache(tmp_path: Path) -> Path:
    """A sound cache in a directory named with brackets, whose first payload is `samples/photo[v2].pt`."""
    cache = tiny_cache(tmp_path / f"{NAME}-cache", counts=(2,))
    (cache / "samples/sample_00000000.pt").rename(cache / f"samples/{NAME}.pt")
    shard = cache / "metadata_shard_0000.json"
    shard.write_text(shard.read_text().replace("samples/sample_00000000.pt", f"samples/{NAME}.pt"))
    return cache


def printed(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    return captured.out + captured.err


def test_a_section_name_in_a_build_error_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "dataset.toml"
    config.write_text(f'[general]\ncolour = "red"\n\n[[datasets]]\nimage_directory = "{tmp_path}"\n')
    build(tmp_path / "out", "--musubi-config", str(config), expect=1)
    assert f"error: {config}: [general]: unknown key(s) ['colour']" in printed(capsys)


def test_a_missing_image_named_with_brackets_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    context = image(tmp_path / "in.png", 0)
    edits = manifest(tmp_path / "edits.jsonl", [("e1", "make it red", tmp_path / f"{NAME}.png", [context])])
    build(tmp_path / "out", "--manifest", str(edits), expect=1)
    out = printed(capsys)
    assert f"{NAME}.png" in out and out.startswith("bad sample: "), out


def test_validate_inspect_convert_and_pack_print_bracketed_paths(
    bracketed_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cache_main(["validate", str(bracketed_cache)]) == 0
    assert f"ok: 2 samples in {bracketed_cache} load and validate" in printed(capsys)
    assert cache_main(["inspect", str(bracketed_cache)]) == 0
    assert f"{bracketed_cache}: 2 samples in 1 buckets" in printed(capsys)
    converted = tmp_path / f"{NAME}-converted"
    assert cache_main(["convert", str(bracketed_cache), str(converted)]) == 0
    assert f"into {converted} as safetensors" in printed(capsys)
    packed = tmp_path / f"{NAME}-packed"
    assert cache_main(["pack", str(bracketed_cache), str(packed)]) == 0
    assert f"at {packed}" in printed(capsys)


def test_a_bad_payload_and_an_unreadable_index_named_with_brackets_are_printed(
    bracketed_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (bracketed_cache / f"samples/{NAME}.pt").write_bytes(b"not a payload")
    assert cache_main(["validate", str(bracketed_cache)]) == 1
    assert f"samples/{NAME}.pt: " in printed(capsys)
    missing = tmp_path / f"{NAME}-missing"
    for command in ("validate", "inspect"):
        assert cache_main([command, str(missing)]) == 2
        out = printed(capsys)
        assert out.startswith("index unreadable: ") and str(missing) in out, out


def test_bench_prints_a_bracketed_path_in_its_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / f"{NAME}-missing"
    assert bench_main([str(missing), "--index-only"]) == 1
    out = printed(capsys)
    assert out.startswith("error: ") and str(missing) in out, out
