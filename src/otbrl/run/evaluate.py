"""Validation: the mean reward of one response per prompt, greedy by default, sampled through the
one sampling step (``otbrl.run.sampling``) exactly as training samples."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from otbrl.config import Config, ConfigError
from otbrl.engine.world import World
from otbrl.models import eos_token_ids, load_model_and_tokenizer
from otbrl.rollout import HFRollout, Sampler, SamplingParams
from otbrl.run.sampling import Scoring, sample_batch


@torch.no_grad()
def evaluate(
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    *,
    stop_token_ids: Sequence[int],
    max_new_tokens: int,
    greedy: bool = True,
    batch_size: int = 512,
    temperature: float = 1.0,
    seed: int = 0,
    scoring: Scoring | None = None,
) -> dict[str, float]:
    """``{"accuracy"}`` — the mean reward of one response per row (with 0/1 rewards, the
    accuracy) — plus ``"tool_call_rate"`` (rows with at least one tool call) and
    ``"tool_calls_per_sample"`` when the sampler has tools (the agent loop).

    ``sampler``: any rollout backend, or the agent loop over one (validation samples the way
    training does); rows are sampled in batches of ``batch_size``, batch k with seed
    ``seed + k · batch_size``. ``scoring`` as in ``sample_batch``.
    """
    if not rows:
        raise ValueError("rows: expected at least one row to evaluate, got none")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int ≥ 1, got {batch_size!r}")
    total = calls = called = 0.0
    for start in range(0, len(rows), batch_size):
        params = SamplingParams(
            n=1,
            temperature=temperature,
            max_tokens=max_new_tokens,
            stop_token_ids=tuple(stop_token_ids),
            greedy=greedy,
            seed=seed + start,
        )
        sample = sample_batch(
            sampler, tokenizer, rows[start : start + batch_size], params, scoring=scoring
        )
        total += sum(sample.scores)
        if "tool_calls" in sample.batch:
            calls += float(sample.batch["tool_calls"].sum())
            called += float((sample.batch["tool_calls"] > 0).sum())
    out = {"accuracy": total / len(rows)}
    if sampler.tools:
        out["tool_call_rate"] = called / len(rows)
        out["tool_calls_per_sample"] = calls / len(rows)
    return out


def evaluate_accuracy(sampler: Sampler, tokenizer, rows: Sequence[dict], **kwargs) -> float:
    """``evaluate(...)["accuracy"]`` (keywords as there)."""
    return evaluate(sampler, tokenizer, rows, **kwargs)["accuracy"]


def validate(
    sampler: Sampler,
    tokenizer,
    rows: Sequence[dict],
    cfg: Config,
    *,
    world: World,
    stop_token_ids: Sequence[int],
    seed: int,
    scoring: Scoring,
) -> dict[str, float]:
    """The run's validation with the ``trainer.val_*`` settings: ``{"val/accuracy"}`` (and
    ``"val/tool_call_rate"`` when the sampler has tools), averaged over the whole of ``rows``.
    Collective: each rank evaluates its share (rows ``rank::size``)."""
    t = cfg.trainer
    share = list(rows[world.rank :: world.size])
    accuracy = rate = 0.0
    if share:
        result = evaluate(
            sampler,
            tokenizer,
            share,
            stop_token_ids=stop_token_ids,
            max_new_tokens=cfg.rollout.max_new_tokens,
            greedy=t.val_greedy,
            temperature=t.val_temperature,
            batch_size=t.val_batch_size,
            seed=seed,
            scoring=scoring,
        )
        accuracy, rate = result["accuracy"], result.get("tool_call_rate", 0.0)
    total, called, count = world.sum([accuracy * len(share), rate * len(share), len(share)])
    out = {"val/accuracy": total / max(count, 1.0)}
    if sampler.tools:
        out["val/tool_call_rate"] = called / max(count, 1.0)
    return out


def evaluate_model(cfg: Config, val_rows: Sequence[dict], path: Path, scoring: Scoring):
    """(accuracy, number of prompts) of the model at ``path`` on ``val_rows`` (``otbrl eval``;
    the rows and the reward come from the plan the CLI already made)."""
    if not val_rows:
        raise ConfigError("'data.val_files' is empty: nothing to evaluate", "data.val_files")
    model, tokenizer = load_model_and_tokenizer(path, dtype=cfg.model.dtype)
    accuracy = evaluate_accuracy(
        HFRollout(model, tokenizer),
        tokenizer,
        val_rows,
        stop_token_ids=eos_token_ids(model, tokenizer),
        max_new_tokens=cfg.rollout.max_new_tokens,
        greedy=cfg.trainer.val_greedy,
        temperature=cfg.trainer.val_temperature,
        batch_size=cfg.trainer.val_batch_size,
        scoring=scoring,
    )
    return accuracy, len(val_rows)
