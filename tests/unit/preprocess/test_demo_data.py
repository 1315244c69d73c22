"""Claims about the procedural demo source and the built-in demo encoders."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
import torch
from PIL import Image

from image_edit_data.preprocess.encoders.base import ImageDecoder, ImageEncoder, TextEncoder
from image_edit_data.preprocess.encoders.demo import (
    DEMO_LATENT_CHANNELS,
    DEMO_TEXT_DIM,
    DemoImageEncoder,
    DemoTextEncoder,
    pil_to_tensor,
    tensor_to_pil,
)
from image_edit_data.preprocess.sources.demo import DemoSource
from image_edit_data.preprocess.sources.records import RawEditSample


def _fingerprint(sample: RawEditSample) -> tuple[object, ...]:
    images = (sample.target, *sample.contexts)
    return (
        sample.sample_id,
        sample.prompt,
        dict(sample.metadata),
        *(im.size for im in images),
        *(im.tobytes() for im in images),
    )


def _layout(sample: RawEditSample) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
    return sample.target.size, tuple(c.size for c in sample.contexts)


def _batch(images: list[Image.Image]) -> torch.Tensor:
    return torch.stack([pil_to_tensor(im) for im in images])


# --- the generator ---


def test_a_sample_depends_only_on_seed_and_index() -> None:
    small, large = DemoSource(num_samples=60, seed=3), DemoSource(num_samples=5000, seed=3)
    assert _fingerprint(small[57]) == _fingerprint(large[57]) == _fingerprint(DemoSource(60, seed=3)[57])


def test_iterating_yields_the_same_samples_as_indexing() -> None:
    source = DemoSource(num_samples=20, seed=1)
    assert [_fingerprint(s) for s in source] == [_fingerprint(source[i]) for i in range(len(source))]


def test_different_seeds_give_different_samples() -> None:
    first, second = DemoSource(50, seed=0), DemoSource(50, seed=1)
    differing = sum(_fingerprint(a)[1:] != _fingerprint(b)[1:] for a, b in zip(first, second))
    assert differing >= 45


def test_negative_indexes_count_from_the_end_and_out_of_range_raises() -> None:
    source = DemoSource(10)
    assert _fingerprint(source[-1]) == _fingerprint(source[9])
    with pytest.raises(IndexError, match="index 10 is out of range for 10 samples"):
        source[10]


def test_a_negative_sample_count_is_refused() -> None:
    with pytest.raises(ValueError, match="num_samples: expected a count >= 0, got -1"):
        DemoSource(num_samples=-1)


def test_500_samples_cover_several_size_layouts_including_two_contexts() -> None:
    layouts = Counter(_layout(s) for s in DemoSource(500))
    assert len(layouts) >= 3
    assert any(len(contexts) == 2 for _, contexts in layouts)


def test_about_a_quarter_of_samples_have_two_contexts() -> None:
    share = sum(len(s.contexts) == 2 for s in DemoSource(1000)) / 1000
    assert 0.2 <= share <= 0.3


def test_samples_are_rgb_multiples_of_16_with_ids_and_json_metadata() -> None:
    for sample in DemoSource(300, seed=5):
        assert re.fullmatch(r"demo-\d{6}", sample.sample_id)
        assert sample.prompt and 1 <= len(sample.contexts) <= 2
        for image in (sample.target, *sample.contexts):
            assert image.mode == "RGB"
            assert image.width % 16 == 0 and image.height % 16 == 0
        if len(sample.contexts) == 1:
            assert sample.contexts[0].size == sample.target.size
        json.dumps(dict(sample.metadata))
        assert sample.metadata["source"] == "demo"


def test_every_instruction_changes_the_scene() -> None:
    for sample in DemoSource(300, seed=2):
        assert sample.target.tobytes() != sample.contexts[0].tobytes(), sample.prompt


def test_every_edit_kind_appears_with_its_kind_of_instruction() -> None:
    words = {"recolor": ("make", "turn", "change"), "move": ("move",), "remove": ("remove", "delete", "take")}
    words |= {"resize": ("make",), "insert": ("put", "add")}
    seen: Counter[str] = Counter()
    for sample in DemoSource(300):
        kind = sample.metadata["edit"]
        assert sample.prompt.split()[0] in words[kind], sample.prompt
        seen[kind] += 1
    assert set(seen) == set(words)


# --- the image encoder ---


def test_encoders_satisfy_the_protocols() -> None:
    assert isinstance(DemoImageEncoder(), ImageEncoder)
    assert isinstance(DemoImageEncoder(), ImageDecoder)
    assert isinstance(DemoTextEncoder(), TextEncoder)


def test_image_encoder_gives_float32_latents_one_eighth_the_size() -> None:
    encoder = DemoImageEncoder()
    latents = encoder.encode(torch.rand(2, 3, 64, 96) * 2 - 1)
    assert encoder.spatial_factor == 8
    assert latents.shape == (2, DEMO_LATENT_CHANNELS, 8, 12) and latents.dtype == torch.float32
    assert encoder.decode(latents).shape == (2, 3, 64, 96)


def test_an_image_gets_the_same_latents_bit_for_bit_whatever_is_encoded_beside_it() -> None:
    """Builds group images differently (one process against ranks, batch sizes): the demo cache must not change.
    Small images are where a float32 kernel's summation order followed the patch count of the call."""
    encoder = DemoImageEncoder()
    generator = torch.Generator().manual_seed(0)
    for height, width in ((8, 8), (16, 16), (16, 32), (32, 16), (40, 24)):
        images = torch.rand(8, 3, height, width, generator=generator) * 2 - 1
        alone = [encoder.encode(images[i : i + 1])[0] for i in range(len(images))]
        for count in range(2, len(images) + 1):
            together = encoder.encode(images[:count])
            assert all(torch.equal(alone[i], together[i]) for i in range(count)), (height, width, count)


def test_decoding_demo_latents_gives_back_images_close_to_the_originals() -> None:
    # Flat patches come back exactly; only 8x8 patches that cross a shape edge are blurred. On the
    # [-1, 1] scale the mean absolute error over a demo image is about 0.03 and at worst about 0.11,
    # so 0.15 per image and 0.05 on average leave margin while still catching a broken basis or scale.
    encoder = DemoImageEncoder()
    errors = []
    for sample in DemoSource(100, seed=4):
        for image in (sample.target, *sample.contexts):
            x = pil_to_tensor(image)[None]
            errors.append((encoder.decode(encoder.encode(x)) - x).abs().mean().item())
    assert max(errors) < 0.15
    assert sum(errors) / len(errors) < 0.05


def test_a_flat_colour_image_survives_encoding_exactly() -> None:
    encoder = DemoImageEncoder()
    x = pil_to_tensor(Image.new("RGB", (64, 96), (200, 30, 90)))[None]
    assert torch.allclose(encoder.decode(encoder.encode(x)), x, atol=1e-5)


def test_demo_latents_have_roughly_unit_variance() -> None:
    encoder = DemoImageEncoder()
    latents = [encoder.encode(_batch([s.target])).flatten() for s in DemoSource(300)]
    assert 0.7 < torch.cat(latents).std().item() < 1.4


def test_image_encoder_refuses_sizes_that_are_not_multiples_of_8() -> None:
    with pytest.raises(ValueError, match="multiples of 8, got 60x64"):
        DemoImageEncoder().encode(torch.zeros(1, 3, 60, 64))
    with pytest.raises(ValueError, match=r"expected \[B, 3, H, W\], got shape \[3, 64, 64\]"):
        DemoImageEncoder().encode(torch.zeros(3, 64, 64))
    with pytest.raises(ValueError, match=r"expected \[B, 8, h, w\], got shape \[1, 4, 8, 8\]"):
        DemoImageEncoder().decode(torch.zeros(1, 4, 8, 8))
    with pytest.raises(ValueError, match="latent_channels: expected 3 to 192"):
        DemoImageEncoder(latent_channels=2)


def test_pil_tensor_conversion_round_trips_exactly() -> None:
    image = DemoSource(1)[0].target
    tensor = pil_to_tensor(image)
    assert tensor.shape == (3, image.height, image.width) and -1.0 <= tensor.min() <= tensor.max() <= 1.0
    assert tensor_to_pil(tensor).tobytes() == image.tobytes()


# --- the text encoder ---


def test_text_encoder_gives_one_unmasked_row_per_word() -> None:
    [(embeddings, mask)] = DemoTextEncoder().encode(["make the red circle blue"])
    assert embeddings.shape == (5, DEMO_TEXT_DIM) and embeddings.dtype == torch.float32
    assert mask.dtype == torch.int64 and mask.tolist() == [1] * 5


def test_text_encoder_is_deterministic_and_ignores_case_and_punctuation() -> None:
    [(first, _)] = DemoTextEncoder().encode(["move the square left"])
    [(again, _), (shouted, _)] = DemoTextEncoder().encode(["move the square left", "Move the SQUARE left."])
    assert torch.equal(first, again) and torch.equal(first, shouted)


def test_word_vectors_are_pinned_so_caches_stay_valid_across_processes() -> None:
    # Python's hash() is salted per process; a stable hash must give these numbers in every run.
    [(embedding, _)] = DemoTextEncoder(dim=4, max_length=1).encode(["red"])
    position = torch.tensor([0.0, 0.1 / 2**0.5, 0.0, 0.1 / 2**0.5])
    assert torch.allclose(embedding[0] - position, torch.tensor([0.630176, -0.145788, 0.424935, 0.633288]), atol=1e-6)


def test_different_prompts_and_word_orders_give_different_embeddings() -> None:
    encoded = DemoTextEncoder().encode(["make the red circle blue", "make the blue circle red", "remove the square"])
    assert not torch.equal(encoded[0][0], encoded[1][0])
    assert encoded[2][0].shape[0] == 3


def test_long_prompts_are_clipped_to_max_length() -> None:
    [(embeddings, mask)] = DemoTextEncoder(max_length=4).encode(["put the shape from the second image into the first"])
    assert embeddings.shape == (4, DEMO_TEXT_DIM) and mask.shape == (4,)


@pytest.mark.parametrize("prompt", ["", "   ", "?!"])
def test_a_prompt_without_words_is_refused(prompt: str) -> None:
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected at least one word"):
        DemoTextEncoder().encode(["make the circle bigger", prompt])
