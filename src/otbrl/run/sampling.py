"""The one sampling step: data rows in, a scored batch out.

    rows ──encode (chat template, the sampler's tools)──▶ prompt ids ──sampler.generate──▶
    completions ──completions_to_batch──▶ batch ──decode──▶ texts ──score──▶ rewards placed on
    the last trained token

The trainer, validation (``otbrl.run.evaluate``) and the research tools (``otbrl variance``)
all sample through ``sample_batch``, so what they measure is the batch the trainer trains on.
The sampler is a rollout backend or the agent loop over one (``otbrl.rollout.Sampler``): the
agent loop reads each row's tools itself, so nothing here branches on which it is. The step
holds no state: everything it uses comes in as arguments, so a background worker can run it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from otbrl.algos.metrics import sample_metrics
from otbrl.data import encode_prompts, pad_token_id
from otbrl.rewards import score_responses
from otbrl.rewards.config import OverlongBufferConfig, RewardConfig
from otbrl.rewards.placement import place_scores
from otbrl.rewards.shaping import overlong_penalty
from otbrl.rollout import (
    Sampler,
    SamplingParams,
    completions_to_batch,
    decode_responses,
    decode_transcripts,
    left_pad,
    tool_metrics,
    transcript_rows,
    unpad_prompts,
)


@dataclass(frozen=True)
class Scoring:
    """How responses are scored: the reward's ``settings`` (``reward.*``, a
    ``otbrl.rewards.RewardConfig``: ``score_responses``'s options, DAPO's overlong shaping of
    the trained reward, the learned reward model's weight) with what the run resolved or loaded
    for them — ``function`` (the reward function itself, resolved once: None uses
    ``settings.function``'s spec, or the built-in reward of each row's ``data_source``), the
    ``reward_model`` (``otbrl.rewards.RewardModel``: its score, times
    ``settings.model.weight``, is added to the trained reward) and a ``pool``
    (``otbrl.rewards.RewardPool``, built from the same settings: score in its workers)."""

    function: Callable | None = None
    settings: RewardConfig = field(default_factory=RewardConfig)
    pool: Any = None
    reward_model: Any = None

    def for_validation(self) -> Scoring:
        """The same scoring without what only shapes the trained reward (overlong penalty,
        reward model): validation counts the rule reward alone."""
        unshaped = dataclasses.replace(self.settings, overlong_buffer=OverlongBufferConfig())
        return dataclasses.replace(self, settings=unshaped, reward_model=None)

    def options(self) -> dict[str, Any]:
        """``score_responses``'s keywords: the settings' own, the resolved function first."""
        options = self.settings.scoring_options()
        if self.function is not None:
            options["function"] = self.function
        return options


class Sample(NamedTuple):
    """One sampled, scored batch.

    ``batch``: the batch contract (``prompts``, ``responses``, ``response_mask``,
    ``rollout_log_probs``, ``input_ids``, ``attention_mask``, ``position_ids``, ``uid``,
    ``truncated``, multi-turn ``num_turns`` / ``tool_calls`` / ``tool_errors``) plus
    ``token_level_scores`` [B, Lr] (the scalar reward on the last trained token). ``rows``: [B]
    the data row of each sample as the reward saw it (multi-turn: with its transcript in
    ``extra_info``). ``scores``: [B] the rewards as the reward function returned them (Python
    floats: an accuracy sums them unrounded). ``metrics``: ``train/reward_*``, response length
    and clip ratio, ``reward/errors`` / ``reward/timeouts``, ``timing/rollout`` (encoding and
    generation) and ``timing/reward`` (scoring; with a pool from submission to the last
    result, and ``timing/reward_wait``: how long the step waited for it), with overlong shaping
    ``reward/overlong_penalty_mean``, with a reward model ``reward/model_mean`` and
    ``timing/reward_model``, and, multi-turn, the ``tool/*`` set. ``token_level_scores`` carry
    the trained reward (rule + shaping + weighted reward model), ``scores`` the rule reward
    alone (what validation accuracy counts). ``responses``: [B] each response as text
    (multi-turn: the whole transcript, observations included), for logs. ``prompt_ids`` [P]
    (each prompt's token ids, unpadded) and ``completions`` [P] (each prompt's ``n``): what the
    batch was built from, so that a subset of its groups can be rebuilt (``merge_groups``).
    """

    batch: dict[str, Tensor]
    rows: list[dict]
    scores: list[float]
    metrics: dict[str, float]
    responses: list[str]
    finish: Callable | None = None  # set while the scores are still on their way
    prompt_ids: list[list[int]] | None = None
    completions: list | None = None

    def resolve(self) -> Sample:
        """The scored sample: waits for scores computed elsewhere (``sample_batch(...,
        defer=True)`` with a pool); the sample itself when it is scored already."""
        return self if self.finish is None else self.finish(self)


def sample_batch(
    sampler: Sampler,
    tokenizer,
    rows: Sequence[dict],
    params: SamplingParams,
    *,
    scoring: Scoring | None = None,
    max_prompt_length: int = 10**9,
    overlong: str = "error",
    uid_offset: int = 0,
    defer: bool = False,
) -> Sample:
    """Sample ``params.n`` responses for each of ``rows`` [P] and score them; B = P · n rows,
    those of a prompt adjacent with one ``uid`` (the prompt's index + ``uid_offset``: the
    global index when ``rows`` is one data-parallel rank's share).

    A prompt longer than ``max_prompt_length`` tokens is a ``ValueError`` naming its row, or
    keeps its last ``max_prompt_length`` tokens with ``overlong="truncate_left"``. A
    multi-turn response is scored on its final turn (the model tokens after the last
    observation), its whole transcript in ``extra_info``. ``scoring`` None: ``Scoring()``.
    ``defer``: return before the scores are in (``token_level_scores``, ``scores`` and the
    reward metrics missing): the caller computes what does not need them, then calls
    ``sample.resolve()``; with a pool (``scoring.pool``) the scoring runs meanwhile.
    """
    scoring = scoring or Scoring()
    start = time.perf_counter()
    rows = sampler.prompt_rows(rows)  # an environment's opening observation in the prompt
    enc = encode_prompts(rows, tokenizer, max_prompt_length, sampler.tools, overlong=overlong)
    prompts = unpad_prompts(enc["input_ids"], enc["attention_mask"])
    completions = sampler.generate(prompts, params, rows=rows)
    batch = completions_to_batch(
        enc["input_ids"], enc["attention_mask"], completions, pad_id=pad_token_id(tokenizer)
    )
    batch["uid"] = batch["uid"] + uid_offset
    sampled = time.perf_counter()
    mask = batch["response_mask"]
    repeated = [row for row in rows for _ in range(params.n)]
    texts = decode_responses(tokenizer, batch["responses"], mask)
    multi_turn = "num_turns" in batch
    responses = texts
    if multi_turn:
        attention = batch["attention_mask"][:, enc["input_ids"].shape[1] :]
        responses = transcripts = decode_transcripts(tokenizer, batch["responses"], attention)
        errors = [getattr(c, "env_error", None) for group in completions for c in group]
        repeated = transcript_rows(repeated, transcripts, batch, errors)
    if scoring.pool is not None:  # scored in worker processes while the caller goes on
        pending = scoring.pool.submit(texts, repeated)
    else:
        pending = _Scored(
            score_responses(
                texts,
                repeated,
                **scoring.options(),
            ),
            time.perf_counter() - sampled,
        )
    metrics = {"timing/rollout": sampled - start}
    if multi_turn:
        metrics.update(tool_metrics(batch))
    width = enc["input_ids"].shape[1]
    finish = _Finish(pending, texts, params, scoring, width)
    sample = Sample(batch, repeated, [], metrics, list(responses), finish, prompts, completions)
    return sample if defer else sample.resolve()


class _Scored:
    """Scores computed in this process, in the shape of ``otbrl.rewards.pool.Pending``."""

    def __init__(self, result: tuple[list[float], dict[str, float]], seconds: float):
        self._result = (result[0], {**result[1], "timing/reward": seconds})

    def result(self) -> tuple[list[float], dict[str, float]]:
        return self._result


@dataclass(frozen=True)
class _Finish:
    """What turns a sample's scores into its trained reward, once the scores are in."""

    pending: Any
    texts: list[str]
    params: SamplingParams
    scoring: Scoring
    prompt_width: int

    def __call__(self, sample: Sample) -> Sample:
        scores, info = self.pending.result()
        batch, mask = sample.batch, sample.batch["response_mask"]
        score = torch.tensor(scores, dtype=torch.float32)
        env_rewards = batch.get("env_rewards")
        if env_rewards is not None:
            # a sample whose environment failed is scored 0 (its reward says nothing of the
            # policy); every other one gets its environment's rewards on top
            score = score.masked_fill(batch["env_errors"].bool(), 0.0)
            scores = (score + env_rewards.sum(dim=1)).tolist()
        shaping = {}
        shape = self.scoring.settings
        if shape.overlong_buffer.len > 0:
            # the response's length in tokens against its budget (observation tokens count,
            # as they do against max_tokens)
            lengths = batch["attention_mask"][:, self.prompt_width :].sum(dim=1)
            penalty = overlong_penalty(
                lengths,
                max_length=self.params.max_tokens,
                buffer_len=shape.overlong_buffer.len,
                penalty=shape.overlong_buffer.penalty,
            )
            score = score + penalty
            shaping["reward/overlong_penalty_mean"] = float(penalty.mean())
        if self.scoring.reward_model is not None:
            # the final turn is the answer the reward model judges (multi-turn: after tools)
            start_rm = time.perf_counter()
            learned = self.scoring.reward_model.score(sample.rows, self.texts)
            score = score + shape.model.weight * learned
            shaping["reward/model_mean"] = float(learned.mean())
            shaping["timing/reward_model"] = time.perf_counter() - start_rm
        batch["token_level_scores"] = place_scores(score, mask)
        if env_rewards is not None:
            batch["token_level_scores"] += env_rewards
            score = score + env_rewards.sum(dim=1)
        metrics = sample_metrics(score, mask, batch["truncated"])
        metrics.update({k: float(v) for k, v in info.items()})
        metrics.update(shaping)
        metrics.update(sample.metrics)
        return sample._replace(scores=list(scores), metrics=metrics, finish=None)


def signal_groups(sample: Sample, n: int) -> list[int]:
    """The groups of a scored ``sample`` (``n`` adjacent rows each) whose trained rewards are
    not all equal: the ones a group-relative estimator gets a signal from. Shapes:
    ``token_level_scores`` [B, Lr], B = P · n -> indices in [0, P)."""
    rewards = sample.batch["token_level_scores"].sum(dim=1).view(-1, n)
    spread = rewards.max(dim=1).values - rewards.min(dim=1).values
    return spread.nonzero().flatten().tolist()


# sampling metrics that count (summed over rounds) or take the largest; the rest are means
_SUMMED = ("timing/", "reward/errors", "reward/timeouts", "tool/errors")


def untrain_groups(batch: dict[str, Tensor], groups: Sequence[int], n: int) -> None:
    """Keep ``groups`` (indices of ``n`` consecutive rows each) in ``batch`` but train none of
    their tokens: their ``response_mask`` rows are set to 0, in place. The rows still take their
    place in the batch (its size, every rank's share) and in its statistics forward; the
    estimators, losses and metrics see them as empty responses (``response_mask`` [B, Lr])."""
    mask = batch["response_mask"]
    for g in groups:
        if not 0 <= g < mask.shape[0] // n:
            raise ValueError(f"groups: {g} is not a group of a batch of {mask.shape[0]} rows")
        mask[g * n : (g + 1) * n] = 0


def merge_groups(
    picks: Sequence[tuple[Sample, Sequence[int]]], n: int, *, pad_id: int, uid_offset: int = 0
) -> Sample:
    """One scored sample made of chosen groups of several (``picks``: each scored sample with
    the indices of its groups to keep, in order), rebuilt from their prompts and completions by
    ``completions_to_batch`` — the one constructor of the batch contract — with each row's
    trained reward placed again and ``uid`` = ``uid_offset`` + the group's position.

    Its metrics describe every sample of ``picks``, kept or not (each round has as many
    samples: ``train/*`` means are their mean): timings and counts summed, maxima the largest.
    """
    prompt_ids, completions, rows, scores, responses, rewards = [], [], [], [], [], []
    for sample, groups in picks:
        trained = sample.batch["token_level_scores"].sum(dim=1)
        for g in groups:
            prompt_ids.append(sample.prompt_ids[g])
            completions.append(sample.completions[g])
            span = slice(g * n, (g + 1) * n)
            rows += sample.rows[span]
            scores += sample.scores[span]
            responses += sample.responses[span]
            rewards.append(trained[span])
    ids, mask = left_pad(prompt_ids, pad_id)
    batch = completions_to_batch(ids, mask, completions, pad_id=pad_id)
    batch["uid"] = batch["uid"] + uid_offset
    batch["token_level_scores"] = place_scores(torch.cat(rewards), batch["response_mask"])
    metrics: dict[str, float] = {}
    rounds = [sample.metrics for sample, _ in picks]
    for key in {k for m in rounds for k in m}:
        values = [m[key] for m in rounds if key in m]
        if key.startswith(_SUMMED):
            metrics[key] = float(sum(values))
        elif key.endswith("_max"):
            metrics[key] = float(max(values))
        else:
            metrics[key] = float(sum(values) / len(values))
    return Sample(batch, rows, scores, metrics, responses, None, prompt_ids, completions)
