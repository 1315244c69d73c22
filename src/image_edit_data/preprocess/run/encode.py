"""Prepare (read and resize) and encode a window of samples.

Targets and contexts of every sample in the window go into one pool, grouped by (width, height), so
the image encoder only ever sees same-sized batches. Batches are formed in a fixed order (sizes
sorted, then sample and slot order), so the same window always gives the same batches. A window's
prompts are encoded before its images: their calls need no pixels, so the threads making a window's
pixels get that long a start.

A `PromptEncoder` also gets each sample's condition images, unresized: its `condition` images, or,
when it has none, its context images as read (a diffusers edit pipeline conditions its prompt on
the input images it is given, and resizes them itself). A text-to-image row (no context) with no
condition gets none, and its encoder encodes the prompt as the model's text-to-image pipeline does.
A sample's mask becomes its `edit_mask` (`mask.py`).

An image may be read and sized without being resized yet (`Unresized`): a window's batches need only the
sizes the policy gives, and the resize is then done by whoever makes its pixels. A build that overlaps
reading with encoding does so for its first window, so the encoder starts once that window is decoded.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from ...contract.batch import EDIT_MASK
from ..encoders.base import ImageEncoder, PromptEncoder, PromptEncoding, TextEncoder
from ..sources.base import MISALIGNED_IMAGE, NO_CONTEXT, BadSampleError, EditSource, SourceRecord
from .gil_gate import GilGate
from .mask import latent_mask
from .overlap import Stopwatch
from .resize import ResizePolicy, pixel_batch, pixel_rows, put_pixels, to_pixels
from .writer import EncodedSample


@dataclass(frozen=True)
class Unresized:
    """An image as read, with the size its resize policy gives it: resized when its pixels are made (`ready`)."""

    image: Image.Image
    size: tuple[int, int]  # (width, height) once resized
    policy: ResizePolicy
    factor: int

    def resized(self) -> Image.Image:
        """The image at `size` (the policy's resize, done now)."""
        return self.policy.apply(self.image, self.factor)


EncoderImage = Image.Image | Unresized  # an encoder-ready image, or one that becomes it when its pixels are made


def ready(image: EncoderImage) -> Image.Image:
    """`image` at its encoder-ready size."""
    return image.resized() if isinstance(image, Unresized) else image


@dataclass(frozen=True)
class Prepared:
    """A source record with its images at encoder-ready sizes (or with those sizes known: `Unresized`)."""

    source: SourceRecord
    target: EncoderImage
    contexts: tuple[EncoderImage, ...]
    original_pixel_shapes: Mapping[str, Any]
    conditions: tuple[Image.Image, ...] = ()  # as read, for a prompt encoder
    edit_mask: torch.Tensor | None = None  # float32 [H / f, W / f] over the target's latent cells


def prepare(
    source: EditSource,
    position: int,
    policy: ResizePolicy,
    factor: int,
    allow_no_context: bool = False,
    defer_resize: bool = False,
) -> Prepared | BadSampleError:
    """Read and resize one example, or return why it is bad (without contexts, unless `allow_no_context`).

    With `defer_resize` its images are `Unresized`: their sizes are checked and known, the resizing is left to
    whoever makes their pixels (`PixelFeed`)."""
    try:
        record = source.read(position)
    except BadSampleError as error:
        return error
    sample = record.sample
    if not sample.contexts and not allow_no_context:
        hint = "a text-to-image row: build with allow_no_context (--allow-no-context) to write it"
        return BadSampleError(record.location, NO_CONTEXT, f"{record.missing_context} ({hint})")
    named = [("target image", sample.target), *((f"context image {i}", c) for i, c in enumerate(sample.contexts))]
    images: list[EncoderImage] = []
    for what, image in named:
        try:
            if defer_resize:
                images.append(Unresized(image, policy.output_size(image.size, factor), policy, factor))
            else:
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


def image_chunks(images: Sequence[EncoderImage], batch_size: int) -> list[tuple[tuple[int, int], list[int]]]:
    """Same-sized batches of `images`' indices: sizes sorted, then input order (the window's fixed batches)."""
    slots: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, image in enumerate(images):
        slots[image.size].append(i)
    return [
        (size, members[start : start + batch_size])
        for size, members in sorted(slots.items())
        for start in range(0, len(members), batch_size)
    ]


def window_images(prepared: Sequence[Prepared]) -> list[EncoderImage]:
    """The images a window encodes, in its order: each sample's target, then its contexts."""
    return [image for p in prepared for image in (p.target, *p.contexts)]


class PixelFeed:
    """The pixel tensors of one window's batches, made on the feeder `ahead` batches before the encoder takes them.

    Made for the next window while this one encodes, it has that window's first batches ready when the
    encoder gets there, so the encoder never waits for a window's first pixels. Each image is resized (when
    `Unresized`) and turned into pixels by a task of its own, so one batch's images are made on all the
    feeder's threads at once. At most `ahead` batches are held: at batch size 8 and a megapixel, 4 x 8 x 12 MB
    of float32. With a `gate`, each image's pixels are made when it opens (see `gil_gate.py`).
    """

    def __init__(
        self,
        images: Sequence[EncoderImage],
        batch_size: int,
        feeder: Executor,
        ahead: int = 4,
        gate: GilGate | None = None,
    ) -> None:
        self.chunks = image_chunks(images, batch_size)
        self._gate = gate
        self._images = images
        self._feeder = feeder
        self._ahead = ahead
        self._pending: dict[int, tuple[PixelBatch, list[Future[None]]]] = {}
        self._next = 0  # the first batch not submitted yet
        self._submit_through(ahead - 1)

    def _submit_through(self, last: int) -> None:
        while self._next <= min(last, len(self.chunks) - 1):
            size, chunk = self.chunks[self._next]
            batch = PixelBatch(len(chunk), size, self._gate)
            tasks = [self._feeder.submit(batch.put, k, self._images[i]) for k, i in enumerate(chunk)]
            self._pending[self._next] = batch, tasks
            self._next += 1

    def __iter__(self) -> Iterator[torch.Tensor]:
        for number in range(len(self.chunks)):
            self._submit_through(number + self._ahead)
            batch, tasks = self._pending.pop(number)
            for task in tasks:
                task.result()
            assert batch.tensor is not None  # set by its last image's task
            yield batch.tensor


class PixelBatch:
    """One batch's pixels, an image per feeder task. The encoders' thread neither allocates them nor makes their
    tensor: the first task to run allocates the rows (12 MB a megapixel image, mapped anew each time: the encoders'
    thread waited up to 8 ms for the process's memory map while other threads faulted pages in), the task that puts
    the last image makes the tensor (a torch call lets go of the GIL and waits to take it back)."""

    def __init__(self, count: int, size: tuple[int, int], gate: GilGate | None = None) -> None:
        self._rows: np.ndarray | None = None  # pixel_rows(count, size), once a task has run
        self.tensor: torch.Tensor | None = None
        self._count, self._size = count, size
        self._gate = gate
        self._left = count
        self._lock = threading.Lock()

    def put(self, k: int, image: EncoderImage) -> None:
        """Image `k` of the batch: resized if need be, its pixels in row `k` (PIL's `tobytes` holds the GIL
        about a millisecond for a megapixel: through the gate)."""
        resized = ready(image)
        if self._gate is not None:
            self._gate.wait()
        with self._lock:
            if self._rows is None:
                self._rows = pixel_rows(self._count, self._size)
            rows = self._rows
        put_pixels(resized, rows[k])
        with self._lock:
            self._left -= 1
            if not self._left:
                self.tensor = pixel_batch(rows)


def on_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` detached, in CPU memory. One already there is returned as it is: each torch call on the encoders'
    thread lets go of the GIL and waits to take it back from the build's other threads."""
    if tensor.device.type == "cpu" and not tensor.requires_grad:
        return tensor
    return tensor.detach().cpu()


def timed(stopwatch: Stopwatch | None, kind: Hashable) -> contextlib.AbstractContextManager[object]:
    """`stopwatch` timing one encoder call of `kind`, or nothing."""
    return stopwatch.timing(kind) if stopwatch is not None else contextlib.nullcontext()


def encode_images(
    images: Sequence[EncoderImage],
    encoder: ImageEncoder,
    batch_size: int,
    factor: int,
    feed: PixelFeed | None = None,
    stopwatch: Stopwatch | None = None,
) -> list[torch.Tensor]:
    """Latents `[C, h, w]` for each image (PIL), in input order.

    With a `feed` (made for these images and batch size), pixel tensors come from it, made on its feeder while
    the encoder works; without one they are made here, one batch at a time. `stopwatch` times the encoder calls.
    Each latent is a row of its batch's output, as the encoder returned it (moved to the CPU): nothing is copied on
    the encoder's thread, the writer copies it out (an encoder returns new tensors per call, see `ImageEncoder`).
    """
    chunks = feed.chunks if feed is not None else image_chunks(images, batch_size)
    pixels = iter(feed) if feed is not None else (to_pixels([ready(images[i]) for i in chunk]) for _, chunk in chunks)
    latents: list[torch.Tensor | None] = [None] * len(images)
    for ((width, height), chunk), batch in zip(chunks, pixels):
        with timed(stopwatch, ("image", len(chunk))):
            out = encoder.encode(batch)
        expected = (len(chunk), height // factor, width // factor)
        if out.ndim != 4 or (out.shape[0], *out.shape[2:]) != expected:
            raise ValueError(
                f"image_encoder {_name(encoder)}: encode returned shape {list(out.shape)} for "
                f"{len(chunk)} images of {width}x{height}; expected [{len(chunk)}, C, {height // factor}, "
                f"{width // factor}] (spatial_factor {factor})"
            )
        for k, i in enumerate(chunk):
            latents[i] = on_host(out[k])  # a row of the batch: the writer copies it out (`writer.owned`)
    return [latent for latent in latents if latent is not None]


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
        with timed(stopwatch, ("prompts", len(chunk))):
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
            conditioning = {name: on_host(t) for name, t in item.conditioning.items()}
            encoding = PromptEncoding(on_host(embeddings), on_host(mask), conditioning, item.truncations)
            results.append(encoding)
    return results


def prompts_of(
    prepared: Sequence[Prepared],
    encoder: TextEncoder | PromptEncoder,
    batch_size: int,
    stopwatch: Stopwatch | None = None,
) -> list[PromptEncoding]:
    """The prompt encodings of `prepared`, with their condition images (see `encode_prompts`)."""
    prompts = [p.source.sample.prompt for p in prepared]
    return encode_prompts(prompts, encoder, batch_size, [p.conditions for p in prepared], stopwatch)


def read_encoding_prompts(
    reads: Sequence[Future[Prepared | BadSampleError]],
    encoder: TextEncoder | PromptEncoder,
    batch_size: int,
    stopwatch: Stopwatch | None = None,
) -> tuple[list[Prepared | BadSampleError], list[PromptEncoding]]:
    """A window's reads in order, and the prompt encodings of its good samples' whole batches, each encoded once
    its samples are read: for a window nothing else overlaps (a build's first), the encoder starts before all of
    it is read. The batches are those `encode_prompts` forms; the last, short one is left to `encode_window`."""
    loaded: list[Prepared | BadSampleError] = []
    waiting: list[Prepared] = []
    encoded: list[PromptEncoding] = []
    for read in reads:
        loaded.append(read.result())
        if isinstance(loaded[-1], Prepared):
            waiting.append(loaded[-1])
        if len(waiting) == batch_size:
            encoded += prompts_of(waiting, encoder, batch_size, stopwatch)
            waiting = []
    return loaded, encoded


def encode_window(
    prepared: Sequence[Prepared],
    image_encoder: ImageEncoder,
    text_encoder: TextEncoder | PromptEncoder,
    batch_size: int,
    factor: int,
    feed: PixelFeed | None = None,
    stopwatch: Stopwatch | None = None,
    encoded_prompts: Sequence[PromptEncoding] = (),
) -> list[EncodedSample]:
    """Encode the prompts, then the images of `prepared`, keeping its order (see `encode_images` for the rest).

    `encoded_prompts` are those of the first samples, encoded already in whole batches (`read_encoding_prompts`).
    """
    rest = prepared[len(encoded_prompts) :]
    prompts = [*encoded_prompts, *prompts_of(rest, text_encoder, batch_size, stopwatch)]
    latents = iter(encode_images(window_images(prepared), image_encoder, batch_size, factor, feed, stopwatch))
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
