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
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from otbrl.algos.metrics import sample_metrics
from otbrl.data import encode_prompts, pad_token_id
from otbrl.rewards import SandboxConfig, score_responses
from otbrl.rewards.placement import place_scores
from otbrl.rewards.shaping import overlong_penalty
from otbrl.rollout import (
    Sampler,
    SamplingParams,
    completions_to_batch,
    decode_responses,
    decode_transcripts,
    tool_metrics,
    transcript_rows,
    unpad_prompts,
)


@dataclass(frozen=True)
class Scoring:
    """How responses are scored (``otbrl.rewards.score_responses``): ``function`` (None: the
    built-in reward of each row's ``data_source``), ``on_error`` (``"raise"`` | ``"zero"``),
    ``timeout_s`` per call (None: no limit), for the built-in rewards ``math_backend`` and
    the code ``sandbox``, and DAPO's overlong shaping of the trained reward: the last
    ``overlong_buffer_len`` tokens of the response budget (0: off) cost up to
    ``overlong_penalty``, and a learned ``reward_model`` (``otbrl.rewards.RewardModel``) whose
    score, times ``reward_model_weight``, is added to it."""

    function: Callable | None = None
    on_error: str = "raise"
    timeout_s: float | None = None
    math_backend: str = "verl"
    sandbox: SandboxConfig | None = None
    overlong_buffer_len: int = 0
    overlong_penalty: float = 1.0
    reward_model: Any = None
    reward_model_weight: float = 1.0

    def for_validation(self) -> Scoring:
        """The same scoring without what only shapes the trained reward (overlong penalty,
        reward model): validation counts the rule reward alone."""
        return dataclasses.replace(self, overlong_buffer_len=0, reward_model=None)


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
    generation) and ``timing/reward`` (decoding and scoring), with overlong shaping
    ``reward/overlong_penalty_mean``, with a reward model ``reward/model_mean`` and
    ``timing/reward_model``, and, multi-turn, the ``tool/*`` set. ``token_level_scores`` carry
    the trained reward (rule + shaping + weighted reward model), ``scores`` the rule reward
    alone (what validation accuracy counts).
    """

    batch: dict[str, Tensor]
    rows: list[dict]
    scores: list[float]
    metrics: dict[str, float]


def sample_batch(
    sampler: Sampler,
    tokenizer,
    rows: Sequence[dict],
    params: SamplingParams,
    *,
    scoring: Scoring | None = None,
    max_prompt_length: int = 10**9,
    uid_offset: int = 0,
) -> Sample:
    """Sample ``params.n`` responses for each of ``rows`` [P] and score them; B = P · n rows,
    those of a prompt adjacent with one ``uid`` (the prompt's index + ``uid_offset``: the
    global index when ``rows`` is one data-parallel rank's share).

    A prompt longer than ``max_prompt_length`` tokens is a ``ValueError`` naming its row. A
    multi-turn response is scored on its final turn (the model tokens after the last
    observation), its whole transcript in ``extra_info``. ``scoring`` None: ``Scoring()``.
    """
    rows = list(rows)
    scoring = scoring or Scoring()
    start = time.perf_counter()
    enc = encode_prompts(rows, tokenizer, max_prompt_length, sampler.tools)
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
    if multi_turn:
        attention = batch["attention_mask"][:, enc["input_ids"].shape[1] :]
        transcripts = decode_transcripts(tokenizer, batch["responses"], attention)
        repeated = transcript_rows(repeated, transcripts, batch)
    scores, info = score_responses(
        texts,
        repeated,
        function=scoring.function,
        on_error=scoring.on_error,
        timeout_s=scoring.timeout_s,
        math_backend=scoring.math_backend,
        sandbox=scoring.sandbox,
    )
    score = torch.tensor(scores, dtype=torch.float32)
    shaping = {}
    if scoring.overlong_buffer_len > 0:
        # the response's length in tokens against its budget (observation tokens count, as
        # they do against max_tokens)
        lengths = batch["attention_mask"][:, enc["input_ids"].shape[1] :].sum(dim=1)
        penalty = overlong_penalty(
            lengths,
            max_length=params.max_tokens,
            buffer_len=scoring.overlong_buffer_len,
            penalty=scoring.overlong_penalty,
        )
        score = score + penalty
        shaping["reward/overlong_penalty_mean"] = float(penalty.mean())
    if scoring.reward_model is not None:
        # the final turn is the answer the reward model judges (multi-turn: after the tools)
        start_rm = time.perf_counter()
        learned = scoring.reward_model.score(repeated, texts)
        score = score + scoring.reward_model_weight * learned
        shaping["reward/model_mean"] = float(learned.mean())
        shaping["timing/reward_model"] = time.perf_counter() - start_rm
    batch["token_level_scores"] = place_scores(score, mask)
    metrics = sample_metrics(score, mask, batch["truncated"])
    metrics.update({k: float(v) for k, v in info.items()})
    metrics.update(shaping)
    metrics["timing/rollout"] = sampled - start
    metrics["timing/reward"] = time.perf_counter() - sampled
    if multi_turn:
        metrics.update(tool_metrics(batch))
    return Sample(batch, repeated, list(scores), metrics)
