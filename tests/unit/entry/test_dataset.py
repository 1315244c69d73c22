"""The reader accepts NeMo Automodel caches unchanged and refuses every contract violation clearly."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from support.caches import make_payload, record_for, tiny_cache, write_cache

from image_edit_data import CacheFormatError, ImageEditDataset, ImageEditDatasetConfig


def test_dataset_reads_every_sample_with_contract_fields(tmp_path: Path) -> None:
    dataset = ImageEditDataset(str(tiny_cache(tmp_path)))
    assert len(dataset) == 12
    sample = dataset[0]
    assert set(sample) >= {
        "target_latent",
        "context_latents",
        "prompt_embeddings",
        "prompt_attention_mask",
        "conditioning_tensors",
        "metadata",
    }
    assert torch.equal(sample["target_latent"], torch.zeros(4, 8, 8))
    assert sample["conditioning_tensors"] == {}
    meta = sample["metadata"]
    assert meta["original_ids"] == {"id": "s0"}
    assert meta["target_token_length"] == 64  # H * W when absent
    assert meta["context_token_lengths"] == [64]
    assert meta["text_token_length"] == 3  # S when absent


def test_bucket_info_counts_samples_per_compound_signature(tmp_path: Path) -> None:
    info = ImageEditDatasetConfig(cache_dir=str(tiny_cache(tmp_path))).build().get_bucket_info()
    assert info == {
        "total_buckets": 3,
        "buckets": {
            "target=4x8x8/contexts=[4x8x8]": 5,
            "target=4x8x12/contexts=[4x8x12]": 4,
            "target=4x12x8/contexts=[4x12x8,4x8x8]": 3,
        },
    }


def test_shards_are_read_in_manifest_order(tmp_path: Path) -> None:
    dataset = ImageEditDataset(tiny_cache(tmp_path, shards=3))
    ids = [dataset[i]["metadata"]["original_ids"]["id"] for i in range(len(dataset))]
    assert sorted(ids) == sorted(f"s{i}" for i in range(12))
    assert ids[:4] == ["s0", "s3", "s6", "s9"]


def test_safetensors_payloads_read_like_pt_payloads(tmp_path: Path) -> None:
    cond = {"image_grid_thw": torch.tensor([[1, 4, 4]])}
    payloads = [make_payload(i, conditioning=cond) for i in range(3)]
    pt = ImageEditDataset(write_cache(tmp_path / "pt", payloads))
    st = ImageEditDataset(write_cache(tmp_path / "st", payloads, suffix=".safetensors"))
    for i in range(3):
        a, b = pt[i], st[i]
        assert torch.equal(a["target_latent"], b["target_latent"])
        assert torch.equal(a["prompt_embeddings"], b["prompt_embeddings"])
        assert torch.equal(a["conditioning_tensors"]["image_grid_thw"], b["conditioning_tensors"]["image_grid_thw"])
        assert a["metadata"] == b["metadata"]


def test_missing_manifest_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="metadata.json"):
        ImageEditDataset(tmp_path)


@pytest.mark.parametrize("quantization", [0, -64, True])
def test_quantization_must_be_positive(tmp_path: Path, quantization: Any) -> None:
    with pytest.raises(ValueError, match="quantization"):
        ImageEditDataset(tiny_cache(tmp_path), quantization=quantization)


def write_one(tmp_path: Path, payload: dict[str, Any] | None = None, **record: Any) -> Path:
    """A one-sample cache whose index record gets `record` merged in (None deletes a key)."""
    payload = payload or make_payload(0)
    pristine = record_for("", make_payload(0))["compound_bucket_signature"]

    def edit(_: int, rec: dict[str, Any]) -> None:
        rec["compound_bucket_signature"] = pristine
        for key, value in record.items():
            if value is None:
                rec.pop(key, None)
            else:
                rec[key] = value

    return write_cache(tmp_path, [payload], edit_record=edit)


INDEX_VIOLATIONS = [
    ({"cache_file": None}, r"metadata_shard_0000.json: \[0\]\.cache_file: missing"),
    ({"cache_file": ""}, r"\[0\]\.cache_file: expected a non-empty path"),
    ({"compound_bucket_signature": None}, r"\[0\]\.compound_bucket_signature: expected an object"),
    (
        {"compound_bucket_signature": {"target": [4, 8], "contexts": [[4, 8, 8]]}},
        r"signature\.target: must contain exactly 3 dimensions",
    ),
    ({"compound_bucket_signature": {"target": [4, 8, 0], "contexts": [[4, 8, 8]]}}, r"\.target: expected positive"),
    ({"compound_bucket_signature": {"target": [4, 8, True], "contexts": [[4, 8, 8]]}}, r"\.target: expected positive"),
    ({"compound_bucket_signature": {"target": [4, 8, 8], "contexts": None}}, r"\.contexts: expected a list of \[C"),
    ({"compound_bucket_signature": {"target": [4, 8, 8], "contexts": [[4, 8]]}}, r"\.contexts\[0\]: must contain"),
    ({"target_token_length": -1}, r"\[0\]\.target_token_length: expected a non-negative integer"),
    ({"context_token_lengths": [1, 2]}, r"\[0\]\.context_token_lengths: expected 1 integers"),
]


@pytest.mark.parametrize(("record", "message"), INDEX_VIOLATIONS)
def test_index_violations_name_shard_and_field(tmp_path: Path, record: dict[str, Any], message: str) -> None:
    with pytest.raises(CacheFormatError, match=message):
        ImageEditDataset(write_one(tmp_path, **record))


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ("[]", "metadata.json: manifest: expected a JSON object"),
        ('{"shards": "a.json"}', "metadata.json: shards: expected a list"),
        ('{"shards": [""]}', r"metadata.json: shards\[0\]: expected a non-empty path"),
        ('{"shards": [1]}', r"metadata.json: shards\[0\]: expected a non-empty path"),
        ("{not json", "metadata.json: json: invalid JSON"),
        (b"\xff\xfe{}", "metadata.json: encoding: expected UTF-8"),
    ],
)
def test_manifest_violations_are_value_errors(tmp_path: Path, manifest: str | bytes, message: str) -> None:
    root = tiny_cache(tmp_path)
    data = manifest if isinstance(manifest, bytes) else manifest.encode()
    (root / "metadata.json").write_bytes(data)
    with pytest.raises(ValueError, match=message):
        ImageEditDataset(root)


def test_shard_that_is_not_a_list_is_refused(tmp_path: Path) -> None:
    root = tiny_cache(tmp_path)
    (root / "metadata_shard_0000.json").write_text("{}")
    with pytest.raises(ValueError, match="metadata_shard_0000.json: records: expected a JSON list"):
        ImageEditDataset(root)


def test_duplicate_cache_files_are_refused(tmp_path: Path) -> None:
    root = write_cache(
        tmp_path,
        [make_payload(0), make_payload(1)],
        edit_record=lambda i, r: r.update(cache_file="samples/sample_00000000.pt"),
    )
    with pytest.raises(ValueError, match=r"\[1\]\.cache_file: 'samples/sample_00000000.pt' is listed twice"):
        ImageEditDataset(root)


def test_path_with_dotdot_is_outside_cache_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside cache directory"):
        ImageEditDataset(write_one(tmp_path / "c", cache_file="../secret.pt"))


def test_absolute_path_outside_is_refused_and_inside_is_accepted(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="outside cache directory"):
        ImageEditDataset(write_one(tmp_path / "a", cache_file=str(tmp_path / "elsewhere.pt")))
    inside = tmp_path / "b"
    dataset = ImageEditDataset(write_one(inside, cache_file=str(inside / "samples/sample_00000000.pt")))
    assert dataset[0]["metadata"]["original_ids"] == {"id": "s0"}


def test_symlinked_payload_leaving_the_cache_is_refused_on_load(tmp_path: Path) -> None:
    outside = tmp_path / "outside.pt"
    torch.save(make_payload(0), outside)
    root = write_one(tmp_path / "c")
    target = root / "samples/sample_00000000.pt"
    target.unlink()
    target.symlink_to(outside)
    dataset = ImageEditDataset(root)
    with pytest.raises(ValueError, match="outside cache directory"):
        dataset[0]


def test_symlinked_directory_leaving_the_cache_is_refused_on_open(tmp_path: Path) -> None:
    root = write_one(tmp_path / "c")
    os.rename(root / "samples", tmp_path / "real_samples")
    (root / "samples").symlink_to(tmp_path / "real_samples")
    with pytest.raises(ValueError, match="outside cache directory"):
        ImageEditDataset(root)


def test_symlinked_shard_leaving_the_cache_is_refused(tmp_path: Path) -> None:
    root = write_one(tmp_path / "c")
    os.rename(root / "metadata_shard_0000.json", tmp_path / "shard.json")
    (root / "metadata_shard_0000.json").symlink_to(tmp_path / "shard.json")
    with pytest.raises(ValueError, match="outside cache directory"):
        ImageEditDataset(root)


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch pwned",))


def test_pickle_that_runs_code_is_refused_and_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = write_one(tmp_path / "c")
    torch.save({"target_latent": Boom()}, root / "samples/sample_00000000.pt")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="sample_00000000.pt: payload: refused by the weights-only loader"):
        ImageEditDataset(root)[0]
    assert not (tmp_path / "pwned").exists()
    (root / "samples/sample_00000000.pt").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(ValueError, match="sample_00000000.pt: payload"):
        ImageEditDataset(root)[0]
    assert not (tmp_path / "pwned").exists()


def broken(mutate: Any) -> dict[str, Any]:
    payload = make_payload(0)
    mutate(payload)
    return payload


def set_meta(key: str, value: Any) -> Any:
    return lambda p: p["metadata"].__setitem__(key, value)


PAYLOAD_VIOLATIONS = [
    (lambda p: p.pop("target_latent"), "target_latent: expected a tensor"),
    (lambda p: p.__setitem__("target_latent", torch.zeros(8, 8)), r"target_latent: expected shape \[channels"),
    (
        lambda p: p.__setitem__("target_latent", torch.zeros(4, 8, 8, dtype=torch.long)),
        "target_latent: expected a floating",
    ),
    (
        lambda p: p.__setitem__("context_latents", []),
        r"compound_bucket_signature: tensor shapes target=4x8x8/contexts=\[\] "
        r"do not match metadata shard signature target=4x8x8/contexts=\[4x8x8\]",
    ),
    (
        lambda p: p.__setitem__("context_latents", [torch.zeros(4, 8, 8, dtype=torch.int32)]),
        r"context_latents\[0\]: expected a floating",
    ),
    (lambda p: p.__setitem__("target_latent", torch.zeros(4, 8, 12)), "compound_bucket_signature: tensor shapes"),
    (
        lambda p: p.__setitem__("prompt_embeddings", torch.zeros(5)),
        r"prompt_embeddings: expected a floating tensor \[sequence",
    ),
    (
        lambda p: p.__setitem__("prompt_attention_mask", torch.ones(3)),
        r"prompt_attention_mask: prompt_attention_mask must have shape \[sequence\] matching",
    ),
    (
        lambda p: p.__setitem__("prompt_attention_mask", torch.ones(5)),
        "prompt_attention_mask: expected a bool or integer",
    ),
    (lambda p: p.__setitem__("conditioning_tensors", [1]), "conditioning_tensors: expected a mapping"),
    (lambda p: p.__setitem__("conditioning_tensors", {"": torch.zeros(1)}), "conditioning_tensors: expected non-empty"),
    (lambda p: p.__setitem__("conditioning_tensors", {"x": 3}), "conditioning_tensors.x: expected a tensor"),
    (lambda p: p.__setitem__("metadata", []), "metadata: expected a mapping"),
    (set_meta("original_ids", {}), "metadata.original_ids: expected a non-empty mapping"),
    (set_meta("original_ids", {"id": True}), "metadata.original_ids: expected non-empty names"),
    (set_meta("target_spatial_shape", [8, 9]), r"metadata.target_spatial_shape: expected \[8, 8\]"),
    (lambda p: p["metadata"].pop("target_spatial_shape"), "metadata.target_spatial_shape: must contain exactly 2"),
    (set_meta("context_spatial_shapes", [[8, 9]]), r"metadata.context_spatial_shapes: expected \[\[8, 8\]\]"),
    (
        set_meta("compound_bucket_signature", {"target": [4, 8, 8], "contexts": [[4, 8, 8], [4, 8, 8]]}),
        "metadata.compound_bucket_signature: declares",
    ),
    (set_meta("conditioning_shapes", {"extra": [1]}), "metadata.conditioning_shapes: names"),
    (set_meta("target_token_length", -3), "metadata.target_token_length: expected a non-negative"),
    (set_meta("context_token_lengths", [1, 2]), "metadata.context_token_lengths: expected 1 integers"),
    (set_meta("text_token_length", 6), "metadata.text_token_length: 6 exceeds the prompt sequence length 5"),
    (set_meta("source_revision", ""), "metadata.source_revision: expected a non-empty string"),
]


@pytest.mark.parametrize(("mutate", "message"), PAYLOAD_VIOLATIONS)
def test_payload_violations_name_file_and_field(tmp_path: Path, mutate: Any, message: str) -> None:
    dataset = ImageEditDataset(write_one(tmp_path, broken(mutate)))
    with pytest.raises(CacheFormatError, match=f"samples/sample_00000000.pt: {message}"):
        dataset[0]


def test_conditioning_shape_must_match_its_declaration(tmp_path: Path) -> None:
    payload = make_payload(0, conditioning={"grid": torch.zeros(1, 3, dtype=torch.long)})
    payload["metadata"]["conditioning_shapes"] = {"grid": [1, 4]}
    with pytest.raises(ValueError, match=r"metadata.conditioning_shapes.grid: declares \[1, 4\], tensor is \[1, 3\]"):
        ImageEditDataset(write_one(tmp_path, payload))[0]


def test_zero_sized_conditioning_dims_are_allowed(tmp_path: Path) -> None:
    payload = make_payload(0, conditioning={"empty": torch.zeros(0, 3)})
    sample = ImageEditDataset(write_one(tmp_path, payload))[0]
    assert sample["metadata"]["conditioning_shapes"] == {"empty": [0, 3]}


def test_payload_revision_must_match_the_manifest(tmp_path: Path) -> None:
    root = write_one(tmp_path, broken(set_meta("source_revision", "abc")))
    manifest = json.loads((root / "metadata.json").read_text())
    (root / "metadata.json").write_text(json.dumps({**manifest, "dataset_revision": "def"}))
    with pytest.raises(ValueError, match="metadata.source_revision: 'abc' differs from the manifest's 'def'"):
        ImageEditDataset(root)[0]


@pytest.mark.parametrize(
    ("content", "message"), [(b"", "file: is empty"), (b"PK\x03\x04garbage", "payload: not a readable torch.save")]
)
def test_truncated_payloads_are_clear_errors(tmp_path: Path, content: bytes, message: str) -> None:
    root = write_one(tmp_path)
    (root / "samples/sample_00000000.pt").write_bytes(content)
    with pytest.raises(ValueError, match=f"sample_00000000.pt: {message}"):
        ImageEditDataset(root)[0]


def test_missing_payload_file_is_a_clear_error(tmp_path: Path) -> None:
    root = write_one(tmp_path)
    (root / "samples/sample_00000000.pt").unlink()
    with pytest.raises(ValueError, match="sample_00000000.pt: file: cannot be read"):
        ImageEditDataset(root)[0]


def test_index_record_with_original_fields_passes_through(tmp_path: Path) -> None:
    payload = make_payload(0)
    payload["metadata"]["manifest_metadata"] = {"edit": "recolor"}
    root = write_cache(
        tmp_path, [payload], edit_record=lambda i, r: r.update(original_id="x", row_index=0, text_token_length=5)
    )
    assert record_for("a", payload)["cache_file"] == "a"
    assert ImageEditDataset(root)[0]["metadata"]["manifest_metadata"] == {"edit": "recolor"}
