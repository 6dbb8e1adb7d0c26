"""Per-estimator policy gradients of one model on the same sampled responses.

``GradientProbe`` samples a batch (one rollout, scored), runs one forward that yields the
log-probs with their graph plus Σπ² and entropy, computes every estimator's advantages on that
batch and returns each estimator's parameter gradient of the configured policy loss at
ratio = 1. The loss is linear in the advantages, so estimator e's gradient is the
vector-Jacobian product Jᵀ c_e of the one log-prob graph with the cotangent
c_e = ∂loss(A_e)/∂log π: only the backward is repeated per estimator (``method="loop"``), or
done once for all of them as a batched VJP (``method="batched"``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from otbrl.algos.advantages import ESTIMATOR_ALIASES, compute_advantage, get_estimator
from otbrl.algos.loss_math import loss_normalizers
from otbrl.algos.loss_terms import Loss
from otbrl.algos.metrics import variance_proxy
from otbrl.algos.otb import token_energy, zero_tail_mask
from otbrl.engine.layout import Layout, forward_outputs, row_features, scatter_rows
from otbrl.models import eos_token_ids
from otbrl.ops import token_stats
from otbrl.rollout import HFRollout, SamplingParams
from otbrl.run.sampling import Scoring, sample_batch


@dataclass(frozen=True)
class EstimatorSpec:
    """One estimator to measure: its label, registry name and option overrides."""

    label: str
    name: str
    options: dict = field(default_factory=dict)


def _parse_value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_estimators(text: str) -> list[EstimatorSpec]:
    """``"grpo,otb,optimal_token_baseline:energy=uniform"`` -> specs (``ESTIMATOR_ALIASES`` too).

    Raises ``ValueError`` naming the bad entry (unknown estimator, malformed option, duplicate).
    """
    specs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            raise ValueError(f"estimators: empty entry in {text!r}")
        name, *opts = item.split(":")
        if name in ESTIMATOR_ALIASES:
            name, options = ESTIMATOR_ALIASES[name][0], dict(ESTIMATOR_ALIASES[name][1])
        else:
            options = {}
        get_estimator(name)  # ValueError listing the valid names
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep or not key:
                raise ValueError(f"estimators: option {opt!r} of {item!r} is not key=value")
            options[key] = _parse_value(value)
        specs.append(EstimatorSpec(item, name, options))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"estimators: expected distinct entries, got {labels}")
    return specs


def flat_grad(params: list[nn.Parameter], grads) -> Tensor:
    """Concatenate per-parameter gradients (None -> zeros) into one [P] float32 vector."""
    return torch.cat(
        [
            (torch.zeros_like(p) if g is None else g).reshape(-1).float()
            for p, g in zip(params, grads)
        ]
    )


class GradientProbe:
    """Per-estimator policy gradients of one model on freshly sampled batches.

    ``params``: how the trainer samples (``RunSpec.sampling``: temperature, top-p/k, response
    budget; ``n`` and the seed are set per batch, the stop ids are the model's EOS ids).
    ``options``: the configured estimator options (``RunSpec.estimator_options``), each spec's
    own options override them. ``loss_fn``: the configured policy loss
    (``otbrl.run.build.policy_loss(cfg, regularizers=False)``, the trainer's own construction
    without the entropy and KL terms). ``scoring``: how responses are scored
    (``otbrl.run.build.scoring``: the trainer's; default ``Scoring()``). ``method``:
    ``"loop"`` (one backward per estimator, graph retained) or ``"batched"`` (one batched
    vector-Jacobian product, ``is_grads_batched``).
    ``sampler``: what batches are sampled with (default: ``HFRollout(model, tokenizer)``); the
    agent loop over a backend of ``model`` for multi-turn tool runs, as the trainer samples.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        params: SamplingParams,
        options: dict,
        loss_fn: Loss,
        scoring: Scoring | None = None,
        method: str = "loop",
        sampler=None,
    ):
        if method not in ("loop", "batched"):
            raise ValueError(f"method: expected 'loop' or 'batched', got {method!r}")
        self.model, self.tokenizer = model, tokenizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.num_params = sum(p.numel() for p in self.params)
        # how the trainer samples (its RunSpec.sampling); n and the seed are set per batch
        self.sampling = dataclasses.replace(
            params, stop_token_ids=tuple(eos_token_ids(model, tokenizer))
        )
        self.temperature = params.temperature  # the log-probs' temperature, as the trainer's
        self.options, self.loss_fn = options, loss_fn
        self.scoring, self.method = scoring or Scoring(), method
        self.sampler = sampler if sampler is not None else HFRollout(model, tokenizer)

    def sample(self, rows: list[dict], n: int, seed: int) -> dict:
        """One rollout of ``n`` responses per row through the trainer's sampling step
        (``otbrl.run.sampling.sample_batch``), scored: the batch the trainer would train on,
        ``rollout_log_probs`` included, with ``token_level_rewards`` = the placed scores."""
        params = dataclasses.replace(self.sampling, n=n, seed=seed)
        batch = sample_batch(self.sampler, self.tokenizer, rows, params, scoring=self.scoring).batch
        batch["token_level_rewards"] = batch["token_level_scores"]
        return batch

    def gradients(self, batch: dict, specs: list[EstimatorSpec]) -> tuple[Tensor, dict]:
        """[E, P] gradients of the policy loss at ratio 1, one per spec, on ``batch``.

        Also returns per-spec online variance-proxy power and the zero-tail token counts.
        """
        self.model.eval()  # no dropout: the gradient of the policy that sampled
        if self.method == "batched":
            stats = self._vmappable_stats(batch)
        else:
            stats = forward_outputs(
                self.model,
                batch,
                Layout(),
                outputs=frozenset({"log_probs", "entropy", "sum_pi_squared"}),
                temperature=self.temperature,
            )
        log_probs, mask = stats["log_probs"], batch["response_mask"]
        old = log_probs.detach()
        common = {
            "token_level_rewards": batch["token_level_rewards"],
            "response_mask": mask,
            "index": batch["uid"],
            "old_log_probs": old,
            "sum_pi_squared": stats["sum_pi_squared"],
        }
        w_score = token_energy(mask, old, stats["sum_pi_squared"]).sum(-1)  # W(τ)
        norms = loss_normalizers(mask)
        cotangents, power = [], {}
        for spec in specs:
            adv, _ = compute_advantage(spec.name, **common, **{**self.options, **spec.options})
            # ∂loss/∂log π at ratio 1 from the configured loss itself, on a cheap leaf
            leaf = old.clone().requires_grad_()
            micro = {"response_mask": mask, "old_log_probs": old, "advantages": adv.detach()}
            loss, _ = self.loss_fn({"log_probs": leaf}, micro, norms)
            cotangents.append(torch.autograd.grad(loss, leaf)[0])
            proxy = variance_proxy(adv.detach(), mask, w_score)
            power[spec.label] = float(proxy["variance_proxy/total_power"])
        if self.method == "batched":
            grads = torch.autograd.grad(
                log_probs,
                self.params,
                grad_outputs=torch.stack(cotangents),
                is_grads_batched=True,
                allow_unused=True,
            )
            out = torch.cat(
                [
                    (torch.zeros(len(specs), p.numel()) if g is None else g.reshape(len(specs), -1))
                    for p, g in zip(self.params, grads)
                ],
                dim=1,
            )
        else:
            rows = []
            for i, c in enumerate(cotangents):
                g = torch.autograd.grad(
                    log_probs,
                    self.params,
                    grad_outputs=c,
                    retain_graph=i < len(cotangents) - 1,
                    allow_unused=True,
                )
                rows.append(flat_grad(self.params, g))
            out = torch.stack(rows)
        tail = zero_tail_mask(mask, batch["uid"])
        extras = {
            "power": power,
            "tail_tokens": float(tail.sum()),
            "tokens": float(mask.sum()),
        }
        return out, extras

    def _vmappable_stats(self, batch: dict) -> dict[str, Tensor]:
        """The padded layout's outputs with log-probs from plain ``log_softmax``: the fused
        op's backward writes in place, which ``is_grads_batched`` (vmap over the backward)
        rejects. Σπ² and entropy carry no gradient here."""
        rows, logits, labels, pick = row_features(self.model, batch, Layout())
        logits = logits.float() / self.temperature
        # the rows pick drops may be labelled IGNORE_INDEX: any index serves them
        picked = labels.clamp(min=0)[:, None]
        log_probs = torch.log_softmax(logits, -1).gather(-1, picked)[:, 0]
        extra = token_stats(logits.detach(), labels, temperature=1.0)
        return {
            "log_probs": scatter_rows(pick(log_probs), rows.valid),
            "entropy": scatter_rows(pick(extra.entropy), rows.valid),
            "sum_pi_squared": scatter_rows(pick(extra.sum_pi_squared), rows.valid),
        }

    def reference(self, rows: list[dict], samples: int, chunk: int, seed: int) -> Tensor:
        """[P] RLOO gradient averaged over ``samples`` responses per prompt (in chunks of
        ``chunk`` per prompt): an unbiased, low-noise direction for the signal scale."""
        spec = [EstimatorSpec("rloo", "rloo")]
        total = torch.zeros(self.num_params, dtype=torch.float64)
        num_chunks = max(1, math.ceil(samples / chunk))
        for i in range(num_chunks):
            batch = self.sample(rows, chunk, seed + i)
            total += self.gradients(batch, spec)[0][0].double()
        return total / num_chunks
