"""An engine's training settings: the AdamW optimizer, its warmup and the update's loops.

Pure Python (no torch): the CLI's schema names the same keys in its ``actor`` and ``critic``
groups, and the run layer hands the engine one of these (``OptimConfig.from_group``), never the
config group itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class OptimConfig:
    """What ``Engine.update`` needs besides the batch and the loss.

    Fields: ``lr`` (AdamW learning rate, > 0), ``weight_decay`` (≥ 0), ``warmup_steps`` (linear
    LR warmup over this many optimizer steps, ≥ 0), ``ppo_epochs`` (passes over each batch,
    ≥ 1), ``micro_batch_size`` (sequences per forward/backward, ≥ 1), ``grad_clip`` (global
    gradient-norm clip; 0: none). Bad values are a ``ValueError`` naming the field.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 20
    ppo_epochs: int = 1
    micro_batch_size: int = 8
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0 and math.isfinite(self.lr),
            "weight_decay": self.weight_decay >= 0 and math.isfinite(self.weight_decay),
            "warmup_steps": _is_int(self.warmup_steps) and self.warmup_steps >= 0,
            "ppo_epochs": _is_int(self.ppo_epochs) and self.ppo_epochs >= 1,
            "micro_batch_size": _is_int(self.micro_batch_size) and self.micro_batch_size >= 1,
            "grad_clip": self.grad_clip >= 0 and math.isfinite(self.grad_clip),
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name}: expected {_EXPECTED[name]}, got {getattr(self, name)!r}")

    @classmethod
    def from_group(cls, group: Any) -> OptimConfig:
        """The settings of a config group that names these keys (``cfg.actor``,
        ``cfg.critic``); its other keys are not read."""
        return cls(**{f.name: getattr(group, f.name) for f in fields(cls)})


_EXPECTED = {
    "lr": "a finite number > 0",
    "weight_decay": "a finite number >= 0",
    "warmup_steps": "an int >= 0",
    "ppo_epochs": "an int >= 1",
    "micro_batch_size": "an int >= 1",
    "grad_clip": "a finite number >= 0 (0: no clipping)",
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def warmup_schedule(warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear from 1/(warmup+1) to 1 over ``warmup_steps`` steps, then constant."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / (warmup_steps + 1))

    return factor
