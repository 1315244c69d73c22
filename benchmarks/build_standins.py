"""Stand-in encoders for the build benches: each call takes a set time, as a GPU encoder's would, and returns tensors
of the real models' shapes (Qwen-Image's 16-channel latents at 1/8 scale, Qwen2.5-VL-7B's 3584-wide embeddings).

A call lasts `call_ms + item_ms * items`: a fixed part (kernel launches, synchronisation) and a part that grows
with the batch (the work itself; a VAE at a megapixel is compute-bound, so it grows about linearly). Making its
output tensors counts in that time, as a GPU encoder's copy of its results to the host does. While it waits,
the calling thread sleeps (a GPU encoder leaves the CPU to the build's other threads) or, with `busy`,
keeps one core busy in torch matmuls (a CPU encoder, which also releases the GIL).
The values used and where they come from: docs/building-caches.md, "Build speed".
"""

from __future__ import annotations

import time

import torch
from PIL import Image

from image_edit_data.preprocess.encoders.base import PromptEncoding

QWEN_IMAGE_LATENT_CHANNELS = 16
QWEN_IMAGE_SPATIAL_FACTOR = 8
QWEN_VL_HIDDEN = 3584
# Seconds all stand-ins of this process were asked to take (the time a GPU would spend, however late the calling
# thread wakes on a busy machine), and when the first call began (time.perf_counter).
CALLS: dict[str, float | None] = {"asked": 0.0, "first": None}


def hold(seconds: float, busy: bool, started: float) -> None:
    """Last `seconds` from `started` (time.perf_counter, when the call began, so making its outputs counts in it):
    asleep, or running torch matmuls on this thread (which release the GIL as real kernels do)."""
    CALLS["asked"] = (CALLS["asked"] or 0.0) + seconds
    CALLS["first"] = CALLS["first"] or started
    deadline = started + seconds
    if not busy:
        time.sleep(max(0.0, deadline - time.perf_counter()))
        return
    a = torch.ones(128, 128)
    while time.perf_counter() < deadline:
        a = torch.mm(a, a).clamp_(max=1.0)


class StandInImageEncoder:
    """A VAE stand-in: `call_ms + image_ms * B` per call, zeros `[B, 16, H / 8, W / 8]` out."""

    spatial_factor = QWEN_IMAGE_SPATIAL_FACTOR

    def __init__(self, call_ms: float = 0.0, image_ms: float = 0.0, busy: bool = False) -> None:
        """
        Args:
            call_ms: Milliseconds every call takes.
            image_ms: Milliseconds more per image in the call.
            busy: Keep a core busy for that time instead of sleeping.
        """
        self.call_ms, self.image_ms, self.busy = call_ms, image_ms, busy

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        batch, _, height, width = images.shape
        f = self.spatial_factor
        latents = torch.zeros(batch, QWEN_IMAGE_LATENT_CHANNELS, height // f, width // f)
        hold((self.call_ms + self.image_ms * batch) / 1000.0, self.busy, started)
        return latents


class StandInPromptEncoder:
    """A Qwen2.5-VL stand-in: `call_ms + prompt_ms * B` per call, zero embeddings `[tokens, 3584]` per prompt."""

    def __init__(self, call_ms: float = 0.0, prompt_ms: float = 0.0, tokens: int = 250, busy: bool = False) -> None:
        """
        Args:
            call_ms: Milliseconds every call takes.
            prompt_ms: Milliseconds more per prompt in the call.
            tokens: Tokens per prompt (vision tokens of one 384 x 384 condition and an instruction: about 250).
            busy: Keep a core busy for that time instead of sleeping.
        """
        self.call_ms, self.prompt_ms, self.tokens, self.busy = call_ms, prompt_ms, tokens, busy

    def encode_prompts(self, prompts: list[str], conditions: list[tuple[Image.Image, ...]]) -> list[PromptEncoding]:
        started = time.perf_counter()
        encodings = [
            PromptEncoding(torch.zeros(self.tokens, QWEN_VL_HIDDEN), torch.ones(self.tokens, dtype=torch.int64))
            for _ in prompts
        ]
        hold((self.call_ms + self.prompt_ms * len(prompts)) / 1000.0, self.busy, started)
        return encodings
