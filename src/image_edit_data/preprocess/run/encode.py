"""Prepare (read and resize) and encode a window of samples.

Targets and contexts of every sample in the window go into one pool, grouped by (width, height), so
the image encoder only ever sees same-sized batches. Batches are formed in a fixed order (sizes
sorted, then sample and slot order), so the same window always gives the same batches.

A `PromptEncoder` also gets each sample's condition images, unresized: its `condition` images, or,
when it has none, its context images as read (a diffusers edit pipeline conditions its prompt on
the input images it is given, and resizes them itself). A text-to-image row (no context) with no
condition gets none, and its encoder encodes the prompt as the model's text-to-image pipeline does.
A sample's mask becomes its `edit_mask` (`mask.py`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from ...contract.batch import EDIT_MASK
from ..encoders.base import ImageEncoder, PromptEncoder, PromptEncoding, TextEncoder
from ..sources.base import MISALIGNED_IMAGE, NO_CONTEXT, BadSampleError, EditSource, SourceRecord
from .mask import latent_mask
from .overlap import Stopwatch
from .resize import ResizePolicy, to_pixels
from .writer import EncodedSample


@dataclass(frozen=True)
class Prepared:
    """A source record with its images at encoder-ready sizes."""

    source: SourceRecord
    target: Image.Image
    contexts: tuple[Image.Image, ...]
    original_pixel_shapes: Mapping[str, Any]
    conditions: tuple[Image.Image, ...] = ()  # as read, for a prompt encoder
    edit_mask: torch.Tensor | None = None  # float32 [H / f, W / f] over the target's latent cells


def prepare(
    source: EditSource, position: int, policy: ResizePolicy, factor: int, allow_no_context: bool = False
) -> Prepared | BadSampleError:
    """Read and resize one example, or return why it is bad (without contexts, unless `allow_no_context`)."""
    try:
        record = source.read(position)
    except BadSampleError as error:
        return error
    sample = record.sample
    if not sample.contexts and not allow_no_context:
        hint = "a text-to-image row: build with allow_no_context (--allow-no-context) to write it"
        return BadSampleError(record.location, NO_CONTEXT, f"{record.missing_context} ({hint})")
    named = [("target image", sample.target), *((f"context image {i}", c) for i, c in enumerate(sample.contexts))]
    images = []
    for what, image in named:
        try:
            images.append(policy.apply(image, factor))
        except ValueError as error:
            return BadSampleError(record.location, MISALIGNED_IMAGE, f"{what} {error}")
    edit_mask = None
    if sample.mask is not None:  # after the target's resize, which refuses a size the policy cannot keep
        if sample.mask.size != sample.target.size:
            problem = f"mask image is {sample.mask.size[0]}x{sample.mask.size[1]} pixels, its target " + (
                f"{sample.target.size[0]}x{sample.target.size[1]}; a mask covers its target pixel for pixel"
            )
            return BadSampleError(record.location, MISALIGNED_IMAGE, problem)
        edit_mask = latent_mask(sample.mask, policy, factor)
    shapes: dict[str, Any] = {
        "target": list(sample.target.size[::-1]),
        "contexts": [list(c.size[::-1]) for c in sample.contexts],
    }
    if sample.conditions:
        shapes["conditions"] = [list(c.size[::-1]) for c in sample.conditions]
    return Prepared(record, images[0], tuple(images[1:]), shapes, sample.conditions or sample.contexts, edit_mask)


def _name(encoder: Any) -> str:
    return f"{type(encoder).__module__}.{type(encoder).__qualname__}"


def encode_images(
    images: Sequence[Image.Image],
    encoder: ImageEncoder,
    batch_size: int,
    factor: int,
    feeder: Executor | None = None,
    stopwatch: Stopwatch | None = None,
) -> list[torch.Tensor]:
    """Latents `[C, h, w]` for each image (PIL), in input order.

    With a `feeder`, each batch's pixel tensor is made there while the encoder works on the one before.
    `stopwatch` times the encoder calls.
    """
    slots: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, image in enumerate(images):
        slots[image.size].append(i)
    chunks = [
        (size, members[start : start + batch_size])
        for size, members in sorted(slots.items())
        for start in range(0, len(members), batch_size)
    ]
    pixels = _pixel_batches([[images[i] for i in chunk] for _, chunk in chunks], feeder)
    latents: list[torch.Tensor | None] = [None] * len(images)
    for ((width, height), chunk), batch in zip(chunks, pixels):
        with stopwatch or contextlib.nullcontext():
            out = encoder.encode(batch)
        expected = (len(chunk), height // factor, width // factor)
        if out.ndim != 4 or (out.shape[0], *out.shape[2:]) != expected:
            raise ValueError(
                f"image_encoder {_name(encoder)}: encode returned shape {list(out.shape)} for "
                f"{len(chunk)} images of {width}x{height}; expected [{len(chunk)}, C, {height // factor}, "
                f"{width // factor}] (spatial_factor {factor})"
            )
        for k, i in enumerate(chunk):
            latents[i] = out[k].detach().cpu().clone()  # a copy, so saving it does not save the whole batch
    return [latent for latent in latents if latent is not None]


def _pixel_batches(batches: list[list[Image.Image]], feeder: Executor | None) -> Iterator[torch.Tensor]:
    """`to_pixels` of each batch in turn; with a `feeder`, the next batch is converted while this one is used."""
    if feeder is None:
        yield from (to_pixels(batch) for batch in batches)
        return
    upcoming: Future[torch.Tensor] | None = None
    for number, batch in enumerate(batches):
        current = upcoming or feeder.submit(to_pixels, batch)
        upcoming = feeder.submit(to_pixels, batches[number + 1]) if number + 1 < len(batches) else None
        yield current.result()


def encode_prompts(
    prompts: Sequence[str],
    encoder: TextEncoder | PromptEncoder,
    batch_size: int,
    conditions: Sequence[tuple[Image.Image, ...]] = (),
    stopwatch: Stopwatch | None = None,
) -> list[PromptEncoding]:
    """A `PromptEncoding` per prompt, in input order, `batch_size` prompts per encoder call; `conditions` (one
    tuple per prompt) go to a `PromptEncoder`. `stopwatch` times the encoder calls."""
    results: list[PromptEncoding] = []
    for start in range(0, len(prompts), batch_size):
        chunk = list(prompts[start : start + batch_size])
        with stopwatch or contextlib.nullcontext():
            if isinstance(encoder, PromptEncoder):
                looks = list(conditions[start : start + batch_size]) or [()] * len(chunk)
                out = encoder.encode_prompts(chunk, looks)
            else:
                out = [PromptEncoding(embeddings, mask) for embeddings, mask in encoder.encode(chunk)]
        if len(out) != len(chunk):
            raise ValueError(
                f"text_encoder {_name(encoder)}: encode returned {len(out)} results for {len(chunk)} prompts"
            )
        for item in out:
            embeddings, mask = item.embeddings, item.mask
            if embeddings.ndim != 2 or mask.ndim != 1 or mask.shape[0] != embeddings.shape[0]:
                raise ValueError(
                    f"text_encoder {_name(encoder)}: expected embeddings [S, D] and mask [S], "
                    f"got {list(embeddings.shape)} and {list(mask.shape)}"
                )
            conditioning = {name: t.detach().cpu().clone() for name, t in item.conditioning.items()}
            results.append(
                PromptEncoding(
                    embeddings.detach().cpu().clone(), mask.detach().cpu().clone(), conditioning, item.truncations
                )
            )
    return results


def encode_window(
    prepared: Sequence[Prepared],
    image_encoder: ImageEncoder,
    text_encoder: TextEncoder | PromptEncoder,
    batch_size: int,
    factor: int,
    feeder: Executor | None = None,
    stopwatch: Stopwatch | None = None,
) -> list[EncodedSample]:
    """Encode the images and prompts of `prepared`, keeping its order (see `encode_images` for the rest)."""
    images = [image for p in prepared for image in (p.target, *p.contexts)]
    latents = iter(encode_images(images, image_encoder, batch_size, factor, feeder, stopwatch))
    prompts = encode_prompts(
        [p.source.sample.prompt for p in prepared],
        text_encoder,
        batch_size,
        [p.conditions for p in prepared],
        stopwatch,
    )
    encoded = []
    for p, prompt in zip(prepared, prompts):
        if EDIT_MASK in prompt.conditioning:
            raise ValueError(
                f"text_encoder {_name(text_encoder)}: returned a conditioning tensor named {EDIT_MASK!r}, the name "
                f"the cache keeps for edit-region masks; give it another name"
            )
        target = next(latents)
        contexts = tuple(next(latents) for _ in p.contexts)
        encoded.append(
            EncodedSample(
                p.source,
                target,
                contexts,
                prompt.embeddings,
                prompt.mask,
                p.original_pixel_shapes,
                prompt.conditioning,
                prompt.truncations,
                p.edit_mask,
            )
        )
    return encoded
