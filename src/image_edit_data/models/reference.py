"""The reference image-edit model: a small flow-matching transformer that trains on any cache in our layout.

It is an example and a test harness, not a model zoo. Convention (rectified flow, as in SD3 and Flux):
`x_t = (1 - t) * x0 + t * noise` with `t = 0` the clean target latent and `t = 1` pure noise; the network
predicts the velocity `v = noise - x0`, the loss is its mean squared error, training draws `t` logit-normal,
and `generate` integrates `dx/dt = v` with Euler steps from `t = 1` down to `t = 0`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn

from .reference_blocks import (
    AdaLNBlock,
    FinalLayer,
    patchify,
    sincos_2d,
    timestep_embedding,
    unpatchify,
)


class ImageEditFlowModel(LightningModule):
    """Denoise the target latent, conditioned on the ordered context latents and the masked prompt embeddings.

    One transformer attends jointly over `[text tokens; context 1 tokens; ...; target tokens]`. Latent tokens are
    2-D patches with sin-cos positions on their own grid plus a learned role (target, or context index k); padded
    text tokens are masked out as keys. The flow time and the masked mean of the prompt drive adaLN in every block.

    Args:
        latent_channels: Channels C of target and context latents (8 in the demo cache, 16 for Qwen-Image).
        text_dim: Width D of the prompt embeddings (64 in the demo cache, 3584 for Qwen2.5-VL).
        hidden_dim: Transformer width; a multiple of 4 and of `num_heads`.
        depth: Number of transformer blocks.
        num_heads: Attention heads per block.
        patch_size: Side of the square latent patch that becomes one token; must divide H and W.
        max_contexts: Most context images a batch may carry (size of the role table).
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        warmup_steps: Optimizer steps of linear learning-rate warmup; 0 disables it.
        val_seed: Seed of the noise and times used by `validation_step`, so `val/loss` is comparable across runs.
    """

    def __init__(
        self,
        latent_channels: int = 8,
        text_dim: int = 64,
        hidden_dim: int = 128,
        depth: int = 4,
        num_heads: int = 4,
        patch_size: int = 2,
        max_contexts: int = 4,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 50,
        val_seed: int = 0,
    ) -> None:
        super().__init__()
        if hidden_dim % 4 or hidden_dim % num_heads:
            raise ValueError(f"hidden_dim: expected a multiple of 4 and of num_heads={num_heads}, got {hidden_dim}")
        self.save_hyperparameters()
        # Typed copies of what the model reads back; hparams stays the record for checkpoints and loggers.
        self.latent_channels = latent_channels
        self.hidden_dim = hidden_dim
        self.patch_size = patch_size
        self.max_contexts = max_contexts
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.val_seed = val_seed
        patch_dim = latent_channels * patch_size * patch_size
        self.patch_embed = nn.Linear(patch_dim, hidden_dim)
        # Role 0 is the noisy target, role k + 1 is context k; the shared patch embedding needs this to tell them apart.
        self.role_embed = nn.Embedding(max_contexts + 1, hidden_dim)
        nn.init.normal_(self.role_embed.weight, std=0.02)
        self.text_embed = nn.Linear(text_dim, hidden_dim)
        self.text_pool = nn.Linear(text_dim, hidden_dim)
        self.time_mlp = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.SiLU(), nn.Linear(hidden_dim, hidden_dim))
        self.blocks = nn.ModuleList(AdaLNBlock(hidden_dim, num_heads) for _ in range(depth))
        self.final = FinalLayer(hidden_dim, patch_dim)

    def forward(
        self,
        x_t: torch.Tensor,
        t: torch.Tensor,
        context_latents: list[torch.Tensor],
        text_embeddings: torch.Tensor,
        text_attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Predict the velocity `[B, C, H, W]` at noisy target `x_t` and flow times `t` `[B]`."""
        if len(context_latents) > self.max_contexts:
            raise ValueError(
                f"context_latents: expected at most max_contexts={self.max_contexts}, got {len(context_latents)}"
            )
        _, _, height, width = x_t.shape
        target = self._embed_latent(x_t, role=0, name="image_latents")
        contexts = [self._embed_latent(c, k + 1, f"context_latents[{k}]") for k, c in enumerate(context_latents)]
        keep_text = text_attention_mask.bool()
        # No positions for text: prompt embeddings are a text encoder's hidden states, which already carry order.
        tokens = torch.cat([self.text_embed(text_embeddings), *contexts, target], dim=1)
        keep = torch.cat([keep_text, keep_text.new_ones(tokens.shape[0], tokens.shape[1] - keep_text.shape[1])], dim=1)

        # A masked mean keeps the pooled prompt independent of how much padding the batch carries.
        weights = keep_text.to(text_embeddings.dtype)[..., None]
        pooled = (text_embeddings * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        time = timestep_embedding(t, self.hidden_dim).to(tokens.dtype)
        cond = self.time_mlp(time) + self.text_pool(pooled)

        for block in self.blocks:
            tokens = block(tokens, cond, keep)
        out = self.final(tokens[:, -target.shape[1] :], cond)
        return unpatchify(out, self.patch_size, height, width)

    def _embed_latent(self, latents: torch.Tensor, role: int, name: str) -> torch.Tensor:
        """Patch tokens `[B, N, hidden]` of one latent, with its grid positions and role added."""
        p = self.patch_size
        _, c, h, w = latents.shape
        if c != self.latent_channels or h % p or w % p:
            raise ValueError(
                f"{name}: expected [B, {self.latent_channels}, H, W] with H and W divisible by "
                f"patch_size={p}, got {list(latents.shape)}"
            )
        tokens = self.patch_embed(patchify(latents, p))
        pos = sincos_2d(h // p, w // p, self.hidden_dim, latents.device).to(tokens.dtype)
        return tokens + pos + self.role_embed.weight[role].to(tokens.dtype)

    @property
    def _weight_dtype(self) -> torch.dtype:
        """The dtype inputs are cast to: caches may hold bf16 latents while the weights are float32, or the reverse."""
        return self.patch_embed.weight.dtype

    def _conditioning(self, batch: dict[str, Any]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Contexts, prompt embeddings and mask of a batch, on the model's device and in its dtype."""
        contexts = [c.to(self.device, self._weight_dtype) for c in batch["context_latents"]]
        text = batch["text_embeddings"].to(self.device, self._weight_dtype)
        return contexts, text, batch["text_attention_mask"].to(self.device)

    def flow_loss(self, batch: dict[str, Any], generator: torch.Generator | None = None) -> torch.Tensor:
        """Velocity MSE at logit-normal times; `generator` fixes the noise and times without touching global RNG."""
        x0 = batch["image_latents"].to(self.device, self._weight_dtype)
        b = x0.shape[0]
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
        # Logit-normal t puts most samples at mid noise levels, where the velocity is hardest to predict (SD3).
        t = torch.sigmoid(torch.randn(b, generator=generator, device=x0.device, dtype=torch.float32)).to(x0.dtype)
        t_bchw = t[:, None, None, None]
        x_t = (1 - t_bchw) * x0 + t_bchw * noise
        pred = self(x_t, t, *self._conditioning(batch))
        return F.mse_loss(pred.float(), (noise - x0).float())

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """One flow-matching step on fresh noise; logs `train/loss`."""
        loss = self.flow_loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["image_latents"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        """Flow loss with noise and times seeded by `val_seed` and the batch index; logs `val/loss`."""
        generator = torch.Generator(device=self.device).manual_seed(self.val_seed + batch_idx)
        loss = self.flow_loss(batch, generator)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch["image_latents"].shape[0])
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW, with a linear warmup stepped per optimizer step when `warmup_steps > 0`."""
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)
        if self.warmup_steps <= 0:
            return optimizer
        warmup = torch.optim.lr_scheduler.LinearLR(
            optimizer, start_factor=1.0 / self.warmup_steps, total_iters=self.warmup_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    @torch.no_grad()
    def generate(
        self, batch: dict[str, Any], num_steps: int = 20, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Sample target latents shaped like `batch["image_latents"]` from the batch's contexts and prompts.

        Euler steps on a uniform time grid from noise (`t = 1`) to data (`t = 0`). The starting noise is drawn
        on the generator's device, so a CPU generator gives the same samples whatever device the model is on.
        """
        if num_steps < 1:
            raise ValueError(f"num_steps: expected at least 1, got {num_steps}")
        shape = batch["image_latents"].shape
        noise_device = generator.device if generator is not None else self.device
        x = torch.randn(shape, generator=generator, device=noise_device).to(self.device, self._weight_dtype)
        conditioning = self._conditioning(batch)
        times = torch.linspace(1.0, 0.0, num_steps + 1, device=self.device)
        for t_now, t_next in itertools.pairwise(times):
            v = self(x, t_now.expand(shape[0]).to(x.dtype), *conditioning)
            x = x + (t_next - t_now).to(x.dtype) * v
        return x
