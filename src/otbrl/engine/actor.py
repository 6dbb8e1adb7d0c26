"""The actor: one model, its optimizer and LR schedule; computes token statistics, takes PPO steps.

``Engine`` is the interface the trainer talks to. ``Actor`` is its single-process
implementation; a sharded one (FSDP2/TP, issue 5) implements the same four methods and the
trainer does not change. The engine never decides *which* statistics exist: the trainer asks
for them (``needs``), after it has unioned the estimator's and the metrics' needs.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor, nn

from otbrl.algos import losses
from otbrl.config import ActorConfig
from otbrl.engine.forward import forward_token_stats

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
STAT_NEEDS = frozenset({"old_log_probs", "entropy", "sum_pi_squared"})


class Engine(Protocol):
    """What the trainer needs from a policy engine, whatever its parallel layout."""

    model: nn.Module

    def compute_stats(
        self, batch: dict[str, Tensor], needs: frozenset[str], temperature: float
    ) -> dict[str, Tensor]: ...

    def update(self, batch: dict[str, Tensor]) -> dict[str, float]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def warmup_schedule(warmup_steps: int):
    """LR multiplier: linear from 1/(warmup+1) to 1 over ``warmup_steps`` steps, then constant."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / (warmup_steps + 1))

    return factor


class Actor:
    """Single-process policy engine (CPU or one GPU).

    Args:
        model: an HF causal LM (``get_decoder``/``get_output_embeddings`` for the fused path).
        config: the ``actor`` config group.
        ppo_mini_batch_size: sequences per optimizer step (prompts x rollout.n).
        temperature: the rollout temperature; training log-probs use the same one.
        use_remove_padding: packed forward instead of padded.
        ref_model: frozen reference policy for the KL loss (required when ``use_kl_loss``).
        seed: seeds the mini-batch shuffling generator (saved in ``state_dict``).
    """

    def __init__(
        self,
        model: nn.Module,
        config: ActorConfig,
        *,
        ppo_mini_batch_size: int,
        temperature: float = 1.0,
        use_remove_padding: bool = False,
        ref_model: nn.Module | None = None,
        seed: int = 0,
    ):
        if ppo_mini_batch_size % config.micro_batch_size != 0:
            raise ValueError(
                f"ppo_mini_batch_size ({ppo_mini_batch_size} sequences) must be divisible by "
                f"micro_batch_size ({config.micro_batch_size})"
            )
        if config.use_kl_loss and ref_model is None:
            raise ValueError("ref_model is required when config.use_kl_loss is true")
        self.model = model
        self.config = config
        self.ppo_mini_batch_size = ppo_mini_batch_size
        self.temperature = temperature
        self.packed = use_remove_padding
        self.ref_model = ref_model
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(0.9, 0.999),
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, warmup_schedule(config.warmup_steps)
        )
        self.generator = torch.Generator().manual_seed(seed)

    # -- statistics -------------------------------------------------------------------------
    @torch.no_grad()
    def compute_stats(
        self, batch: dict[str, Tensor], needs: frozenset[str], temperature: float | None = None
    ) -> dict[str, Tensor]:
        """``old_log_probs`` plus exactly the requested stats, each [B, Lr] float32.

        needs: subset of ``{"old_log_probs", "entropy", "sum_pi_squared"}`` (other names, e.g.
        ``ref_log_probs``, are ignored here: they come from elsewhere).
        """
        temperature = self.temperature if temperature is None else temperature
        self.model.eval()
        out = []
        for micro in _split(batch, self.config.micro_batch_size):
            out.append(
                self.forward_stats(
                    self.model,
                    micro,
                    temperature=temperature,
                    entropy="entropy" in needs,
                    sum_pi_squared="sum_pi_squared" in needs,
                )
            )
        return {key: torch.cat([o[key] for o in out]) for key in out[0]}

    @torch.no_grad()
    def compute_ref_log_probs(self, batch: dict[str, Tensor]) -> Tensor:
        """Reference-policy log-probs [B, Lr] (same layout and temperature as the actor)."""
        if self.ref_model is None:
            raise ValueError("compute_ref_log_probs needs a ref_model")
        self.ref_model.eval()
        parts = [
            self.forward_stats(self.ref_model, micro, temperature=self.temperature)["old_log_probs"]
            for micro in _split(batch, self.config.micro_batch_size)
        ]
        return torch.cat(parts)

    # -- training -------------------------------------------------------------------------------
    def update(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches, gradient accumulation over micro-batches.

        batch needs the model inputs, ``response_mask``, ``old_log_probs``, ``advantages`` [B, Lr]
        (and ``ref_log_probs`` with the KL loss). One optimizer + scheduler step per mini-batch.
        Returns metrics averaged over optimizer steps.
        """
        cfg = self.config
        size = batch["responses"].shape[0]
        if size % self.ppo_mini_batch_size != 0:
            raise ValueError(
                f"batch of {size} sequences is not divisible by ppo_mini_batch_size "
                f"({self.ppo_mini_batch_size})"
            )
        self.model.train()
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(size, generator=self.generator)
            for start in range(0, size, self.ppo_mini_batch_size):
                idx = order[start : start + self.ppo_mini_batch_size]
                mini = {k: v[idx] for k, v in batch.items()}
                metrics = self._optimizer_step(mini)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps += 1
        result = {key: value / steps for key, value in sums.items()}
        result["policy/lr"] = self.scheduler.get_last_lr()[0]
        return result

    def accumulate_gradients(self, mini: dict[str, Tensor]) -> dict[str, float]:
        """Zero the gradients, then backpropagate the mini-batch loss micro-batch by micro-batch.

        The loss of every micro-batch is divided by one normalizer computed on the whole
        mini-batch, so the accumulated gradient equals that of the mini-batch loss taken at
        once, for every ``loss_agg_mode``. Returns token-weighted loss metrics.
        """
        cfg = self.config
        mask = mini["response_mask"]
        # normalizers of the whole mini-batch: micro-batch losses then sum to the mini-batch loss
        norms = self.loss_normalizers(mask)
        agg = {"loss_agg_mode": cfg.loss_agg_mode, **norms}
        self.optimizer.zero_grad(set_to_none=True)
        need_entropy = cfg.entropy_coeff != 0.0
        tally = {"policy/clip_frac": 0.0, "policy/approx_kl": 0.0, "policy/loss": 0.0}
        if cfg.use_kl_loss:
            tally["policy/kl_loss"] = 0.0
        tokens = float(mask.sum().clamp(min=1.0))
        for micro in _split(mini, cfg.micro_batch_size):
            m_mask = micro["response_mask"]
            stats = self.forward_stats(
                self.model, micro, temperature=self.temperature, entropy=need_entropy
            )
            loss, pg = losses.ppo_policy_loss(
                stats["old_log_probs"],
                micro["old_log_probs"],
                micro["advantages"],
                m_mask,
                clip_ratio_low=cfg.clip_ratio_low,
                clip_ratio_high=cfg.clip_ratio_high,
                clip_ratio_c=cfg.clip_ratio_c,
                **agg,
            )
            if need_entropy:
                loss = loss + losses.entropy_bonus(
                    stats["entropy"], m_mask, cfg.entropy_coeff, **agg
                )
            if cfg.use_kl_loss:
                kl = losses.kl_penalty(
                    stats["old_log_probs"], micro["ref_log_probs"], cfg.kl_loss_type
                )
                kl_loss = losses.agg_loss(kl, m_mask, **agg)
                loss = loss + cfg.kl_loss_coef * kl_loss
                tally["policy/kl_loss"] += float(kl_loss.detach())
            loss.backward()
            weight = float(m_mask.sum()) / tokens  # token-weighted means over micro-batches
            tally["policy/clip_frac"] += float(pg["clip_frac"]) * weight
            tally["policy/approx_kl"] += float(pg["approx_kl"]) * weight
            tally["policy/loss"] += float(loss.detach())
        return tally

    def _optimizer_step(self, mini: dict[str, Tensor]) -> dict[str, float]:
        metrics = self.accumulate_gradients(mini)
        clip = self.config.grad_clip if self.config.grad_clip > 0 else math.inf
        grad_norm = self.clip_grad_norm(clip)
        # a non-finite gradient skips the step (and shows in the metric) instead of writing
        # NaNs into the weights
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        metrics["policy/grad_norm"] = float(grad_norm)
        return metrics

    # -- layout hooks: a sharded engine (otbrl.engine.distributed) overrides these three ------
    def forward_stats(self, model: nn.Module, micro: dict[str, Tensor], **kwargs) -> dict:
        """One forward -> per-response-token stats [B, Lr] (``forward_token_stats``'s contract)."""
        return forward_token_stats(
            model, micro, packed=self.packed, fused=self.config.use_fused_kernels, **kwargs
        )

    def loss_normalizers(self, mask: Tensor) -> dict:
        """The mini-batch's loss normalizers (token/sequence counts, horizon) from [B, Lr]."""
        return {**losses.loss_normalizers(mask), "horizon": mask.shape[1]}

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Clip gradients to a global L2 norm; returns the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=max_norm)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Optimizer, scheduler and shuffling-generator state (weights are saved separately)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.generator.set_state(state["generator"])


def _split(batch: dict[str, Tensor], size: int) -> list[dict[str, Tensor]]:
    total = next(iter(batch.values())).shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, total, size)]
