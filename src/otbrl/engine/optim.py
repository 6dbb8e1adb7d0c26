"""A trainable engine's training settings: the AdamW optimizer, its warmup and the update's
loops (how many rows one forward takes is the engine's ``MicroBatchConfig``, frozen or not).

Pure Python (no torch): the CLI's ``actor`` and ``critic`` groups are ``OptimConfig``s with
their own keys added (``otbrl.engine.config``), so these keys are declared once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from otbrl.settings import setting


@dataclass
class OptimConfig:
    """What ``TrainableEngine.update`` needs besides the batch, the loss and the micro-batches;
    the engine checks each field's type and range (``otbrl.settings.check_settings``:
    ``ConfigError`` naming it)."""

    # AdamW learning rate (1e-6: verl's and TRL's default for full fine-tuning; the built-in
    # model's preset: 3e-4)
    lr: float = setting(1e-6, gt=0, resume="fixed")
    # linear warmup of optimizer steps; a cold AdamW can wreck the policy
    warmup_steps: int = setting(20, ge=0, resume="fixed")
    # AdamW weight decay
    weight_decay: float = setting(0.0, ge=0, resume="fixed")
    # passes over each step's batch
    ppo_epochs: int = setting(1, gt=0, resume="fixed")
    # global gradient-norm clip; 0 = none
    grad_clip: float = setting(1.0, ge=0, resume="fixed")

    @classmethod
    def from_group(cls, group: Any) -> OptimConfig:
        """The settings of a config group that names these keys (``cfg.actor``,
        ``cfg.critic``); its other keys are not read."""
        return cls(**{f.name: getattr(group, f.name) for f in fields(cls)})


def warmup_schedule(warmup_steps: int) -> Callable[[int], float]:
    """LR multiplier: linear from 1/(warmup+1) to 1 over ``warmup_steps`` steps, then constant."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / (warmup_steps + 1))

    return factor
