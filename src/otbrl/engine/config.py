"""The trained models' settings: the model (``model.*``), the policy engine (``actor.*``: its
optimizer, loss and parallel layout) and the critic engine (``critic.*``). Both engines'
groups are an ``OptimConfig`` and a ``MicroBatchConfig`` with their own keys added, so the
optimizer and micro-batch keys are declared once.
No torch: the CLI's schema composes these and starts without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from otbrl.algos.config import KL_KINDS, LOSS_AGG_MODES, POLICY_LOSS_AGG, POLICY_LOSSES
from otbrl.engine.dims import STRATEGIES
from otbrl.engine.optim import OptimConfig
from otbrl.engine.spec import MicroBatchConfig
from otbrl.errors import ConfigError
from otbrl.models.config import LoraConfig
from otbrl.settings import PRECISIONS, TRISTATE, refuse_unset, setting


@dataclass
class ModelConfig:
    # a local HF model directory, a hub id in the local HF cache, or "builtin" (the tiny
    # model, warm-started by SFT on its task)
    path: str = setting("builtin", resume="fixed")
    # 32-true (fp32 weights, state and compute) | bf16-mixed (fp32 master weights and AdamW
    # state, bf16 forward/backward, fp32 gradient reduction) | bf16-true (bf16 weights and
    # state); 32-true by default: measured faster on CPUs without bf16 instructions (docs/memory.md)
    precision: str = setting("32-true", choices=PRECISIONS, resume="fixed")
    # recompute each decoder block's activations in the backward instead of keeping them
    # (less memory, one more forward); off by default: it did not pay at the demo's size
    gradient_checkpointing: bool = setting(False, resume="may_differ")
    # packed [1, nnz] forward instead of padded [B, L]
    use_remove_padding: bool = setting(False, resume="may_differ")
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ActorConfig(MicroBatchConfig, OptimConfig):
    # prompts per optimizer step (x rollout.n sequences); None = the whole step batch
    ppo_mini_batch_size: int | None = setting(None, resume="fixed")
    # ppo (clipped token ratio) | gspo (clipped sequence ratio, its token form; its paper clips
    # at 1 - 3e-4 / 1 + 4e-4) | cispo (a clipped, stop-gradient weight on every token's
    # log-likelihood; its paper sets no lower bound: clip_ratio_low near 1)
    policy_loss: str = setting("ppo", choices=POLICY_LOSSES, resume="fixed")
    # the clip: the ratio's lower bound is 1 - this
    clip_ratio_low: float = setting(0.2, ge=0, lt=1, resume="fixed")
    # the clip: the ratio's upper bound is 1 + this (DAPO's clip-higher: > low)
    clip_ratio_high: float = setting(0.2, ge=0, resume="fixed")
    # PPO's dual-clip bound for negative advantages
    clip_ratio_c: float = setting(3.0, gt=1, resume="fixed")
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm; unset: the
    # policy loss's own (ppo: token-mean; gspo: seq-mean-token-mean, cispo: token-mean, the
    # averages their papers define, the only ones they take)
    loss_agg_mode: str | None = setting(
        None, choices=LOSS_AGG_MODES, null="the policy loss's own", resume="fixed"
    )
    # entropy bonus weight in the policy loss; 0 = off
    entropy_coeff: float = setting(0.0, ge=0, resume="fixed")
    # add a KL-to-reference term to the loss (builds a frozen reference)
    use_kl_loss: bool = setting(False, resume="fixed")
    # weight of the KL loss term
    kl_loss_coef: float = setting(0.001, ge=0, resume="fixed")
    # KL estimator: k1 | k2 | k3 (= low_var_kl) | abs, '+' for straight-through
    kl_loss_type: str = setting("low_var_kl", choices=sorted(KL_KINDS), resume="fixed")
    # fuse the lm_head with the token statistics (no [T, V] logits kept)
    use_fused_kernels: bool = setting(False, resume="may_differ")
    # take the policy's statistics (old log-probs, entropy, Σπ²) from the update's own forward
    # where that is exact — a step trained in one optimizer step of one epoch — instead of a
    # separate pass over the same tokens (the metric policy/one_forward says which ran); false:
    # always the separate pass
    one_forward: bool = setting(True, resume="may_differ")
    # "auto" | "true" | "false" (YAML booleans accepted)
    calculate_sum_pi_squared: str = setting("auto", choices=TRISTATE, resume="may_differ")
    # how the engine is laid out over processes (formerly actor.engine): "auto": one process,
    # or FSDP2 when torchrun starts several; "single" | "fsdp" | "tp"
    strategy: str = setting("auto", choices=STRATEGIES, resume="may_differ")
    # strategy=tp: ranks sharing one model's heads and vocabulary
    tensor_parallel_size: int = setting(1, gt=0, resume="may_differ")
    # ranks splitting each packed sequence
    ulysses_sequence_parallel_size: int = setting(1, gt=0, resume="may_differ")

    def check(self, at: str) -> None:
        """GSPO and CISPO take the aggregation their papers define and no dual clip; the KL
        loss's keys only with the KL loss."""
        defined = POLICY_LOSS_AGG.get(self.policy_loss)
        if defined is not None and self.loss_agg_mode not in (None, defined):
            raise ConfigError(
                f"'{at}loss_agg_mode' is {self.loss_agg_mode} but {at}policy_loss="
                f"{self.policy_loss} is defined with {defined}: set {at}loss_agg_mode={defined}",
                f"{at}loss_agg_mode",
            )
        if self.policy_loss != "ppo":
            because = f"'{at}policy_loss' is {self.policy_loss} (the dual clip is PPO's)"
            refuse_unset(self, at, because, f"use {at}policy_loss=ppo", ["clip_ratio_c"])
        if not self.use_kl_loss:
            because = f"'{at}use_kl_loss' is false (no KL loss)"
            refuse_unset(self, at, because, "set it true", ["kl_loss_coef", "kl_loss_type"])


@dataclass
class CriticConfig(MicroBatchConfig, OptimConfig):
    """The value model of PPO with GAE: ``AutoModelForTokenClassification(num_labels=1)``
    initialised from ``model_path`` (the policy's weights by default), trained with the clipped
    value loss on the actor's mini-batches, under the actor's engine."""

    # the critic's learning rate (verl's default; the built-in model's: 1e-3)
    lr: float = setting(1e-5, gt=0, resume="fixed")
    # linear warmup of the critic's optimizer steps
    warmup_steps: int = setting(0, ge=0, resume="fixed")
    # "auto" (on when the estimator needs values) | "true" | "false"
    enable: str = setting("auto", choices=TRISTATE, resume="fixed")
    model_path: str | None = setting(None, resume="fixed")  # None: the policy's model
    # None: no value clipping
    cliprange_value: float | None = setting(0.5, gt=0, null="no clipping", resume="fixed")
