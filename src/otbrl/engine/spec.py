"""How an engine holds and runs its model: ``EngineSpec`` (placement, precision, head,
statistics temperature) and its ``MicroBatchConfig`` (how many rows one forward takes).

Pure Python (no torch): ``otbrl.run.spec.resolve`` builds one ``EngineSpec`` per engine of a
run (policy, critic, reference, teacher) before any model loads, and the CLI's ``actor`` and
``critic`` groups compose ``MicroBatchConfig`` (``otbrl.engine.config``), so its keys are
declared once. Frozen and trainable engines take their micro-batch settings the same way: in
their spec.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from otbrl.engine.dims import STRATEGIES
from otbrl.settings import PRECISIONS, check_settings, setting


@dataclass
class MicroBatchConfig:
    """How many rows one forward (and backward) of an engine takes; the engine checks each
    field (``otbrl.settings.check_settings``: ``ConfigError`` naming it)."""

    # at most this many sequences per forward/backward (the last micro-batch may be smaller;
    # gradients are accumulated exactly, as if the mini-batch ran at once)
    micro_batch_size: int = setting(8, gt=0, resume="may_differ")
    # at most this many tokens per forward/backward instead (rows packed by length, the same
    # number of micro-batches on every rank; with model.use_remove_padding=true real tokens
    # count, else rows x the micro-batch's own width); None: micro_batch_size rows
    max_tokens_per_micro_batch: int | None = setting(
        None, gt=0, null="micro_batch_size rows", resume="may_differ"
    )

    @classmethod
    def from_group(cls, group: Any) -> MicroBatchConfig:
        """The micro-batch settings of a config group that names these keys (``cfg.actor``,
        ``cfg.critic``); its other keys are not read."""
        return cls(**{f.name: getattr(group, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class EngineSpec:
    """Everything about how an engine runs its model but the model and the optimizer.

    ``strategy``: ``"fsdp"`` or ``"tp"`` on a multi-process world (``actor.strategy`` resolved;
    ignored without a mesh). ``precision``: ``"32-true"`` | ``"bf16-mixed"`` | ``"bf16-true"``
    (``otbrl.engine.precision``; the model comes loaded in its storage dtype). ``packed``:
    remove padding ([1, nnz] forwards; implied by Ulysses). ``fused``: fused lm_head
    statistics, the [N, V] logits never exist (one process only). ``value``: the model has a
    value head (outputs ``values``) instead of an lm_head. ``temperature``: the rollout's; the
    statistics use ``logits / temperature``. ``gradient_checkpointing``: recompute each
    decoder block's activations in the backward (non-reentrant). ``micro``: rows per forward.
    """

    strategy: str = "fsdp"
    precision: str = "32-true"
    packed: bool = False
    fused: bool = False
    value: bool = False
    temperature: float = 1.0
    gradient_checkpointing: bool = False
    micro: MicroBatchConfig = field(default_factory=MicroBatchConfig)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {STRATEGIES}, got {self.strategy!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {PRECISIONS}, got {self.precision!r}")
        if isinstance(self.temperature, bool) or not self.temperature > 0:
            raise ValueError(f"temperature: expected a number > 0, got {self.temperature!r}")
        if not isinstance(self.micro, MicroBatchConfig):
            raise TypeError(
                "micro: expected an otbrl.engine.spec.MicroBatchConfig, got "
                f"{type(self.micro).__name__}"
            )
        check_settings(self.micro)
