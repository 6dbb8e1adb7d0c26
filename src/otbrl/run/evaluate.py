"""Validation: the mean reward of one response per prompt, greedy by default, sampled through the
one sampling step (``otbrl.run.sampling``) exactly as training samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from otbrl.engine.world import World
from otbrl.rollout import Sampler, SamplingParams
from otbrl.run.sampling import Scoring, sample_batch
from otbrl.run.seeds import step_seed
from otbrl.run.spec import RunSpec


@torch.no_grad()
def evaluate(
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    params: SamplingParams,
    *,
    batch_size: int = 512,
    scoring: Scoring | None = None,
    max_prompt_length: int = 10**9,
    overlong: str = "error",
    progress: str | None = None,
    generations: int = 0,
) -> dict:
    """``{"accuracy"}`` — the mean reward of one response per row (with 0/1 rewards, the
    accuracy) — plus ``"tool_call_rate"`` (rows with at least one tool call) and
    ``"tool_calls_per_sample"`` when the sampler has tools (the agent loop).

    ``sampler``: any rollout backend, or the agent loop over one (validation samples the way
    training does). ``params``: one response per row (``n=1``; greedy, or sampled with its
    temperature and filters), its stop ids and budget; rows are sampled in batches of
    ``batch_size``, batch k with seed ``params.seed + k · batch_size`` (``None``: 0).
    ``scoring``, ``max_prompt_length`` and ``overlong`` as in ``sample_batch``.
    ``progress``: a label to show a progress bar over the rows under (on stderr, cleared
    when done); None: silent. ``generations`` > 0: also ``"generations"``, the first that
    many rows as ``{"prompt", "response", "reward", "data_source"}`` (the prompt as the
    model saw it, chat template included; the response as text, multi-turn: the transcript).
    """
    if not rows:
        raise ValueError("rows: expected at least one row to evaluate, got none")
    if params.n != 1:
        raise ValueError(f"params: expected n=1 (one response per row), got n={params.n}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int ≥ 1, got {batch_size!r}")
    total = calls = called = 0.0
    kept: list[dict] = []
    bar = tqdm(
        total=len(rows), desc=progress, unit="prompt", leave=False, disable=progress is None,
        dynamic_ncols=True,
    )  # fmt: skip
    seed = params.seed or 0
    for start in range(0, len(rows), batch_size):
        sample = sample_batch(
            sampler, tokenizer, rows[start : start + batch_size],
            dataclasses.replace(params, seed=seed + start), scoring=scoring,
            max_prompt_length=max_prompt_length, overlong=overlong,
        )  # fmt: skip
        total += sum(sample.scores)
        if "tool_calls" in sample.batch:
            calls += float(sample.batch["tool_calls"].sum())
            called += float((sample.batch["tool_calls"] > 0).sum())
        bar.update(len(sample.rows))
        if len(kept) < generations:
            kept += _generations(tokenizer, sample, generations - len(kept))
    bar.close()
    out: dict = {"accuracy": total / len(rows)}
    if generations > 0:
        out["generations"] = kept
    if sampler.tools:
        out["tool_call_rate"] = called / len(rows)
        out["tool_calls_per_sample"] = calls / len(rows)
    return out


def _generations(tokenizer, sample, n: int) -> list[dict]:
    """The first ``n`` samples of ``sample`` as log rows."""
    prompts, mask = sample.batch["prompts"][:n], sample.batch["attention_mask"]
    width = prompts.shape[1]
    return [
        {
            "prompt": tokenizer.decode(ids[mask[i, :width] > 0].tolist()),
            "response": sample.responses[i],
            "reward": sample.scores[i],
            "data_source": sample.rows[i].get("data_source"),
            **_env_error(sample.rows[i]),
        }
        for i, ids in enumerate(prompts)
    ]


def _env_error(row: dict) -> dict:
    """``{"env_error": why}`` for a sample whose environment failed, else nothing."""
    error = (row.get("extra_info") or {}).get("env_error")
    return {} if error is None else {"env_error": error}


def evaluate_accuracy(
    sampler: Sampler, tokenizer, rows: Sequence[dict], params: SamplingParams, **kwargs
) -> float:
    """``evaluate(...)["accuracy"]`` (arguments as there)."""
    return evaluate(sampler, tokenizer, rows, params, **kwargs)["accuracy"]


class Validation(NamedTuple):
    """``metrics``: ``{"val/accuracy"[, "val/tool_call_rate"]}``; ``generations``: the logged
    rows of ``evaluate(..., generations=)`` (rank 0's share; [] when none were asked for)."""

    metrics: dict[str, float]
    generations: list[dict]


def validate(
    sampler: Sampler,
    tokenizer,
    rows: Sequence[dict],
    spec: RunSpec,
    *,
    world: World,
    stop_token_ids: Sequence[int],
    seed: int,
    scoring: Scoring,
    label: str = "validating",
    generations: int = 0,
) -> Validation:
    """The run's validation: the metrics averaged over the whole of ``rows`` and
    ``generations`` sample rows, sampled as ``spec.validation`` says (with ``stop_token_ids``
    and ``seed``), in batches of ``spec.validation_batch_size``, prompts held to the spec's
    limit and overlong mode; ``scoring`` as in ``evaluate``. Collective: each
    data-parallel rank evaluates its contiguous share of the rows (``World.shard``, as training
    shards its prompts; the ranks of one model replica sample the same rows); rank 0 shows a
    progress bar under ``label``."""
    share = world.shard(rows, even=False)
    params = dataclasses.replace(spec.validation, stop_token_ids=tuple(stop_token_ids), seed=seed)
    accuracy = rate = 0.0
    kept: list[dict] = []
    if share:
        result = evaluate(
            sampler,
            tokenizer,
            share,
            params,
            batch_size=spec.validation_batch_size,
            scoring=scoring,
            max_prompt_length=spec.max_prompt_length,
            overlong=spec.overlong,
            progress=f"{label} ({len(rows)} prompts)" if world.is_main else None,
            generations=generations,
        )
        accuracy, rate = result["accuracy"], result.get("tool_call_rate", 0.0)
        kept = result.get("generations", [])
    total, called, count = world.sum(
        [accuracy * len(share), rate * len(share), len(share)], over="dp"
    )
    out = {"val/accuracy": total / max(count, 1.0)}
    if sampler.tools:
        out["val/tool_call_rate"] = called / max(count, 1.0)
    return Validation(out, kept)


@dataclasses.dataclass(frozen=True)
class Validator:
    """The run's validation bound to what it samples with: ``validate`` of ``rows`` through
    ``sampler`` (the agent loop when tools are configured) or, ``with_tools=False``, the
    ``rollout`` backend alone (the same policy answering without its tools), seeded by the
    step, scored by ``scoring`` without what only shapes the trained reward."""

    sampler: Sampler
    rollout: Sampler
    tokenizer: Any
    rows: Sequence[dict]
    spec: RunSpec
    world: World
    stop_token_ids: Sequence[int]
    scoring: Scoring

    def __call__(self, step: int, *, with_tools: bool = True, generations: int = 0) -> Validation:
        """``validate`` at ``step`` (its seed: ``step_seed(spec.seed, step)``), with the first
        ``generations`` samples kept. Collective."""
        return validate(
            self.sampler if with_tools else self.rollout,
            self.tokenizer,
            self.rows,
            self.spec,
            world=self.world,
            stop_token_ids=self.stop_token_ids,
            seed=step_seed(self.spec.seed, step),
            scoring=self.scoring.for_validation(),
            generations=generations,
        )
