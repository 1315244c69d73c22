"""LoRA on a diffusers edit transformer with peft: its settings, adding it, and its weights under diffusers' names.

The adapter is added with diffusers' own `add_adapter` (peft underneath), so its weights carry the module names
diffusers' `load_lora_weights` expects; the base transformer is frozen and only the adapter trains, in float32
whatever the base precision (as diffusers' LoRA training scripts upcast it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

ADAPTER = "default"  # peft's adapter name; it appears in parameter names as `.lora_A.default.weight`
WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # the file `load_lora_weights(directory)` looks for


@dataclass(frozen=True)
class LoraDefaults:
    """An architecture's LoRA defaults: the rank and the modules common practice adapts."""

    rank: int
    target_modules: tuple[str, ...]
    source: str  # where the defaults come from, for the docs


@dataclass(frozen=True)
class LoraSettings:
    """A resolved adapter: rank, scale, where it goes, dropout."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float
    exclude_modules: tuple[str, ...] = ()  # full module names left without an adapter (outputs the loss never sees)

    def peft_config(self) -> Any:
        """The `peft.LoraConfig` of this adapter."""
        try:
            from peft import LoraConfig
        except ImportError as error:
            raise ImportError("lora: true needs peft: pip install 'image-edit-data[lora]'") from error

        return LoraConfig(**self.metadata())

    def metadata(self) -> dict[str, Any]:
        """The `LoraConfig` arguments as plain JSON values: saved with the weights, and how diffusers rebuilds it."""
        config: dict[str, Any] = {
            "r": self.rank,
            "lora_alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "lora_dropout": self.dropout,
        }
        if self.exclude_modules:
            config["exclude_modules"] = list(self.exclude_modules)
        return config


def resolve_lora(
    defaults: LoraDefaults,
    rank: int | None,
    alpha: float | None,
    target_modules: Sequence[str] | None,
    dropout: float,
) -> LoraSettings:
    """The settings from the module's arguments, None taking the architecture's default; bad values are refused."""
    resolved_rank = defaults.rank if rank is None else rank
    if resolved_rank < 1:
        raise ValueError(f"lora_rank: expected a positive rank, got {resolved_rank}")
    targets = tuple(defaults.target_modules if target_modules is None else target_modules)
    if not targets or not all(isinstance(name, str) and name for name in targets):
        raise ValueError(f"lora_target_modules: expected module name suffixes like 'attn.to_q', got {list(targets)}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_dropout: expected a probability in [0, 1), got {dropout}")
    resolved_alpha = float(resolved_rank if alpha is None else alpha)
    if resolved_alpha <= 0:
        raise ValueError(f"lora_alpha: expected a positive scale, got {resolved_alpha}")
    return LoraSettings(resolved_rank, resolved_alpha, targets, dropout)


def add_lora(
    transformer: torch.nn.Module, settings: LoraSettings, unreachable: Iterable[torch.nn.Parameter]
) -> LoraSettings:
    """Freeze `transformer` and add the adapter; returns the settings with the linear layers it leaves out.

    A linear layer whose parameters are all `unreachable` (its output never reaches the loss) gets no adapter:
    its adapter could never receive a gradient, which would stall DDP and leave FSDP2 checkpoints incomplete.
    """
    unreachable_ids = {id(p) for p in unreachable}
    excluded = tuple(
        name
        for name, module in transformer.named_modules()
        if isinstance(module, torch.nn.Linear)
        and all(id(p) in unreachable_ids for p in module.parameters())
        and any(name == target or name.endswith(f".{target}") for target in settings.target_modules)
    )
    resolved = LoraSettings(settings.rank, settings.alpha, settings.target_modules, settings.dropout, excluded)
    transformer.requires_grad_(False)
    transformer.add_adapter(resolved.peft_config())  # type: ignore[operator]
    for name, parameter in transformer.named_parameters():
        if is_adapter_name(name):
            parameter.data = parameter.data.float()
            parameter.requires_grad_(True)
    return resolved


def is_adapter_name(name: str) -> bool:
    """Whether a parameter or state-dict key belongs to the adapter."""
    return ".lora_A." in name or ".lora_B." in name


def diffusers_lora_names(state: Mapping[str, torch.Tensor], prefix: str = "transformer.") -> dict[str, torch.Tensor]:
    """Adapter weights from a module or checkpoint state dict, renamed as `load_lora_weights` reads them.

    `transformer.blocks.0.attn.to_q.lora_A.default.weight` becomes `blocks.0.attn.to_q.lora_A.weight` (the
    pipeline's `save_lora_weights` adds the `transformer.` prefix back); anything that is not adapter is dropped.
    """
    renamed = {}
    for key, tensor in state.items():
        if not key.startswith(prefix) or not is_adapter_name(key):
            continue
        name = key[len(prefix) :].replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")
        renamed[name] = tensor
    return renamed
