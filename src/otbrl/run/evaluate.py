"""Validation: the mean reward of one response per prompt, greedy by default, sampled through the
one sampling step (``otbrl.run.sampling``) exactly as training samples."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from otbrl.config import Config
from otbrl.engine.world import World
from otbrl.rollout import Sampler, SamplingParams
from otbrl.run.plan import overlong_mode
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
    max_prompt_length: int = 10**9,
    overlong: str = "error",
    progress: str | None = None,
) -> dict[str, float]:
    """``{"accuracy"}`` — the mean reward of one response per row (with 0/1 rewards, the
    accuracy) — plus ``"tool_call_rate"`` (rows with at least one tool call) and
    ``"tool_calls_per_sample"`` when the sampler has tools (the agent loop).

    ``sampler``: any rollout backend, or the agent loop over one (validation samples the way
    training does); rows are sampled in batches of ``batch_size``, batch k with seed
    ``seed + k · batch_size``. ``scoring``, ``max_prompt_length`` and ``overlong`` as in
    ``sample_batch``. ``progress``: a label to show a progress bar over the rows under (on
    stderr, cleared when done); None: silent.
    """
    if not rows:
        raise ValueError("rows: expected at least one row to evaluate, got none")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int ≥ 1, got {batch_size!r}")
    total = calls = called = 0.0
    bar = tqdm(
        total=len(rows), desc=progress, unit="prompt", leave=False, disable=progress is None,
        dynamic_ncols=True,
    )  # fmt: skip
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
            sampler, tokenizer, rows[start : start + batch_size], params, scoring=scoring,
            max_prompt_length=max_prompt_length, overlong=overlong,
        )  # fmt: skip
        total += sum(sample.scores)
        if "tool_calls" in sample.batch:
            calls += float(sample.batch["tool_calls"].sum())
            called += float((sample.batch["tool_calls"] > 0).sum())
        bar.update(len(sample.rows))
    bar.close()
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
    label: str = "validating",
) -> dict[str, float]:
    """The run's validation with the ``trainer.val_*`` settings: ``{"val/accuracy"}`` (and
    ``"val/tool_call_rate"`` when the sampler has tools), averaged over the whole of ``rows``.
    Collective: each rank evaluates its share (rows ``rank::size``); rank 0 shows a progress
    bar under ``label``."""
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
            max_prompt_length=cfg.data.max_prompt_length,
            overlong=overlong_mode(cfg),
            progress=f"{label} ({len(rows)} prompts)" if world.is_main else None,
        )
        accuracy, rate = result["accuracy"], result.get("tool_call_rate", 0.0)
    total, called, count = world.sum([accuracy * len(share), rate * len(share), len(share)])
    out = {"val/accuracy": total / max(count, 1.0)}
    if sampler.tools:
        out["val/tool_call_rate"] = called / max(count, 1.0)
    return out
