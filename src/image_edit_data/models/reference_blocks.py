"""Building blocks of the reference edit model: patches, sin-cos embeddings and an adaLN transformer block."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def patchify(latents: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Cut `[B, C, H, W]` into row-major tokens `[B, (H / p) * (W / p), C * p * p]`."""
    b, c, h, w = latents.shape
    p = patch_size
    x = latents.reshape(b, c, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)


def unpatchify(tokens: torch.Tensor, patch_size: int, height: int, width: int) -> torch.Tensor:
    """Invert `patchify`: tokens `[B, N, C * p * p]` back to `[B, C, height, width]`."""
    b, _, d = tokens.shape
    p = patch_size
    c = d // (p * p)
    x = tokens.reshape(b, height // p, width // p, c, p, p)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(b, c, height, width)


def _sincos_1d(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Sin-cos features `[N, dim]` of float positions `[N]` (the transformer paper's frequencies)."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, device=positions.device) / (dim // 2))
    angles = positions[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


def sincos_2d(height: int, width: int, dim: int, device: torch.device) -> torch.Tensor:
    """Position embeddings `[height * width, dim]` for a row-major grid; half the channels per axis.

    Computed on the fly so any latent size works without a fixed table.
    """
    rows = torch.arange(height, device=device, dtype=torch.float32).repeat_interleave(width)
    cols = torch.arange(width, device=device, dtype=torch.float32).repeat(height)
    return torch.cat([_sincos_1d(rows, dim // 2), _sincos_1d(cols, dim // 2)], dim=1)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sin-cos features `[B, dim]` of flow times `t` in `[0, 1]`, scaled by 1000 to spread the frequencies."""
    return _sincos_1d(t.float() * 1000.0, dim)


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Apply a per-sample affine `[B, D]` to every token of `x` `[B, N, D]`."""
    return x * (1 + scale[:, None, :]) + shift[:, None, :]


class AdaLNBlock(nn.Module):
    """Pre-norm transformer block whose norms are shifted, scaled and gated by a conditioning vector (DiT adaLN-Zero).

    The gates start at zero, so each block starts as the identity and training is stable from step one.
    """

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Update tokens `x` `[B, N, D]` given `cond` `[B, D]`; `keep` `[B, N]` is False for keys to ignore."""
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(cond)).chunk(6, dim=1)
        b, n, d = x.shape
        qkv = self.qkv(_modulate(self.norm1(x), shift1, scale1))
        q, k, v = qkv.reshape(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = x + gate1[:, None, :] * self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + gate2[:, None, :] * self.mlp(_modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    """Modulated norm and a zero-initialised projection from hidden tokens to patch pixels."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ada = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, out_dim)
        # Zero output at start: the first prediction is v = 0, a well-scaled starting loss.
        for layer in (self.ada, self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Map `[B, N, D]` tokens to `[B, N, out_dim]`."""
        shift, scale = self.ada(F.silu(cond)).chunk(2, dim=1)
        return self.out(_modulate(self.norm(x), shift, scale))
