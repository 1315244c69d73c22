"""Prompts per second through a random Qwen-Image-Edit-Plus pipeline on the CPU, one at a time and in batches.

Each prompt comes with one condition image of about a megapixel (resized by the pipeline's rule to 384 x 384,
about 200 vision tokens with the released processor budget). The model is the tests' tiny random Qwen2.5-VL
scaled by `--scale` (widths and depths times the scale); nothing is downloaded.

    python -m benchmarks.build_prompts                  # scale 4: hidden 128, 4 layers
    python -m benchmarks.build_prompts --scale 1 --batch-sizes 1 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from support.pipelines import QWEN_VL_PIXELS, qwen_image_edit_pipeline

from benchmarks.build_data import photo_like
from image_edit_data.preprocess.encoders.pipelines import QwenImageEditEncoder

PROMPTS = ["make the sky red", "add a cat to the tree", "remove the dog", "turn the car blue and the road wet"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scale", type=int, default=4, help="Multiplies the tiny Qwen2.5-VL's widths and depths.")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3, help="The median of this many rounds is printed.")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as directory:
        path = qwen_image_edit_pipeline(Path(directory) / "qwen", vision_pixels=QWEN_VL_PIXELS, text_scale=args.scale)
        encoder = QwenImageEditEncoder(str(path), torch_dtype="float32")
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    conditions = [(photo_like((1216, 912), i),) for i in range(args.prompts)]
    tokens = encoder.encode_prompts(prompts[:1], conditions[:1])[0].embeddings.shape[0]  # vision tokens first
    config = encoder.pipeline.text_encoder.config.text_config
    sys.stdout.write(
        f"random Qwen2.5-VL: hidden {config.hidden_size}, {config.num_hidden_layers} layers; {tokens} tokens per "
        f"prompt; {args.prompts} prompts; torch threads {args.threads}\n"
    )
    rates = {}
    for batch_size in args.batch_sizes:
        encoder.encode_prompts(prompts[:batch_size], conditions[:batch_size])  # first calls pick kernels: not timed
        times = []
        for _ in range(args.rounds):
            started = time.perf_counter()
            for start in range(0, args.prompts, batch_size):
                encoder.encode_prompts(prompts[start : start + batch_size], conditions[start : start + batch_size])
            times.append(time.perf_counter() - started)
        rates[batch_size] = args.prompts / statistics.median(times)
        speedup = rates[batch_size] / rates[args.batch_sizes[0]]
        sys.stdout.write(
            f"batch {batch_size}: {rates[batch_size]:.1f} prompts/s ({speedup:.2f}x batch {args.batch_sizes[0]})\n"
        )


if __name__ == "__main__":
    main()
