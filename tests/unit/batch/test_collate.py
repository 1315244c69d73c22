"""Collate returns exactly the batch contract and refuses batches that mix signatures."""

from __future__ import annotations

import pytest
import torch
from support.caches import make_payload

from image_edit_data import collate_image_edit
from image_edit_data.contract.batch import Batch, BatchMetadata, Sample
from image_edit_data.contract.signature import Signature
from image_edit_data.contract.validate import payload as validate_payload


def sample(index: int, **kwargs: object) -> dict:
    raw = make_payload(index, **kwargs)  # type: ignore[arg-type]
    meta = raw["metadata"]["compound_bucket_signature"]
    sig = Signature(tuple(meta["target"]), tuple(tuple(c) for c in meta["contexts"]))  # type: ignore[arg-type]
    return validate_payload(raw, sig, f"s{index}.pt", None) | {"sample_index": index}


def test_batch_has_contract_keys_shapes_and_padding() -> None:
    batch = collate_image_edit([sample(0, sequence=3), sample(1, sequence=5), sample(2, sequence=4)])
    assert batch["image_latents"].shape == (3, 4, 8, 8)
    assert [c.shape for c in batch["context_latents"]] == [(3, 4, 8, 8)]
    assert batch["text_embeddings"].shape == (3, 5, 6)
    assert batch["text_attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch["text_attention_mask"].dtype == torch.long
    assert torch.all(batch["text_embeddings"][0, 3:] == 0)
    assert batch["data_type"] == "image"
    assert batch["conditioning_tensors"] == {}
    assert batch["metadata"]["sample_indices"] == [0, 1, 2]


def test_token_counts_are_plain_ints_summed_over_contexts() -> None:
    contexts = ((4, 8, 8), (4, 4, 4))
    batch = collate_image_edit([sample(0, contexts=contexts, sequence=3), sample(1, contexts=contexts, sequence=2)])
    meta = batch["metadata"]
    assert meta["batch_size"] == 2
    assert meta["target_token_counts"] == [64, 64]
    assert meta["context_token_counts"] == [80, 80]
    assert meta["text_token_counts"] == [3, 2]
    assert meta["total_token_counts"] == [147, 146]
    assert (meta["target_token_count"], meta["context_token_count"]) == (128, 160)
    assert (meta["text_token_count"], meta["total_token_count"]) == (5, 293)
    assert all(type(v) is int for v in meta["total_token_counts"])
    assert type(meta["total_token_count"]) is int
    assert [c.shape[2:] for c in batch["context_latents"]] == [(8, 8), (4, 4)]


def test_conditioning_tensors_are_stacked_by_name() -> None:
    cond = {"image_grid_thw": torch.tensor([[1, 4, 4]])}
    batch = collate_image_edit([sample(0, conditioning=cond), sample(1, conditioning=cond)])
    assert batch["conditioning_tensors"]["image_grid_thw"].shape == (2, 1, 3)


def test_mixed_target_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="one compound signature: target_latent"):
        collate_image_edit([sample(0), sample(1, target=(4, 8, 12))])


def test_mixed_context_orders_are_refused() -> None:
    a = sample(0, contexts=((4, 8, 8), (4, 4, 4)))
    b = sample(1, contexts=((4, 4, 4), (4, 8, 8)))
    with pytest.raises(ValueError, match="ordered context_latents"):
        collate_image_edit([a, b])


def test_mismatched_conditioning_names_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="conditioning_tensors names differ"):
        collate_image_edit([sample(0, conditioning={"a": torch.zeros(2)}), sample(1)])
    with pytest.raises(ValueError, match="conditioning tensor 'a' shape/dtype"):
        collate_image_edit(
            [sample(0, conditioning={"a": torch.zeros(2)}), sample(1, conditioning={"a": torch.zeros(3)})]
        )


def test_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="empty batch"):
        collate_image_edit([])


def test_a_mixed_batch_error_shows_both_samples_values_in_full() -> None:
    base = sample(0, contexts=((4, 8, 8), (4, 4, 4)))
    swapped = sample(1, contexts=((4, 4, 4), (4, 8, 8)))
    expected = (
        "a batch must hold one compound signature: ordered context_latents shapes/dtypes of sample 2 is "
        "[4, 4, 4] float32, [4, 8, 8] float32, sample 0 has [4, 8, 8] float32, [4, 4, 4] float32"
    )
    with pytest.raises(ValueError) as refused:
        collate_image_edit([base, base, swapped])
    assert str(refused.value) == expected

    wide = sample(1) | {"prompt_embeddings": torch.zeros(4, 7)}
    with pytest.raises(ValueError) as refused:
        collate_image_edit([sample(0), wide])
    assert str(refused.value).endswith("prompt hidden size/dtype of sample 1 is 7 float32, sample 0 has 6 float32")

    int_mask = sample(1) | {"prompt_attention_mask": torch.ones(4, dtype=torch.int32)}
    with pytest.raises(ValueError) as refused:
        collate_image_edit([sample(0), int_mask])
    assert str(refused.value).endswith("prompt_attention_mask dtype of sample 1 is int32, sample 0 has int64")


def test_samples_and_batches_hold_exactly_the_keys_the_contract_types_name() -> None:
    samples = [sample(0), sample(1)]
    assert all(set(s) == set(Sample.__annotations__) for s in samples)
    batch = collate_image_edit(samples, position=(0, 0), skipped=[], sources=["a", "b"])
    assert set(batch) == set(Batch.__annotations__) == Batch.__required_keys__
    assert set(batch["metadata"]) == set(BatchMetadata.__annotations__)
    assert set(collate_image_edit(samples)["metadata"]) == BatchMetadata.__required_keys__ | {"sample_indices"}


def test_position_and_skips_reach_the_metadata_as_arguments_not_through_the_first_sample() -> None:
    skipped = [{"index": 5, "file": "s5.pt", "field": "payload", "reason": "truncated"}]
    batch = collate_image_edit([sample(0), sample(1)], position=(3, 7), skipped=skipped)  # type: ignore[list-item]
    assert batch["metadata"]["position"] == [3, 7]
    assert (batch["metadata"]["skipped"], batch["metadata"]["skipped_samples"]) == (1, skipped)
    assert collate_image_edit([sample(0)], skipped=[])["metadata"]["skipped"] == 0
    carrying = sample(0) | {"position": [9, 9], "skipped": skipped}
    assert not {"position", "skipped", "skipped_samples"} & set(collate_image_edit([carrying])["metadata"])
