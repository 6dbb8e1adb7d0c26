"""The rollout protocol every backend implements, and the one place completions become a batch.

No model imports here: a backend (``HFRollout``, ``VLLMRollout``) takes token-id prompts and
``SamplingParams`` and returns ``Completion`` objects; ``completions_to_batch`` turns them into
the batch contract of DESIGN.md.

Log-prob definition (both backends): ``Completion.logprobs[t]`` is log π_T(token_t) with
π_T = softmax(logits / temperature) over the full vocabulary, the distribution the trainer's
``old_log_probs`` use. Two documented exceptions: greedy decoding reports T = 1 (the
temperature plays no part in an argmax), and the vLLM backend with top-k / top-p reports the
truncated, renormalised distribution it sampled from (see ``otbrl.rollout.vllm_engine``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

FINISH_REASONS = ("stop", "length")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``n`` rows per prompt are adjacent in results and batches.

    ``stop_token_ids`` end a completion and are INCLUDED as its last token (EOS ids, a
    tool-call end token...); an empty tuple means only the token budget ends it.
    ``top_k=0`` and ``top_p=1`` switch those filters off. ``greedy`` ignores temperature,
    top-k/p and seed. ``seed`` makes a batch reproducible (``None``: a fresh draw per call).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    greedy: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("top_k", self.top_k, 0)
        _check_int("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        if not isinstance(self.greedy, bool):
            raise TypeError(f"greedy: expected a bool, got {type(self.greedy).__name__}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"temperature: expected a finite number > 0, got {t!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top_p: expected a number in (0, 1], got {p!r}")
        if isinstance(self.stop_token_ids, str | bytes) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise TypeError(
                "stop_token_ids: expected a sequence of token ids, got "
                f"{type(self.stop_token_ids).__name__}"
            )
        stops = tuple(self.stop_token_ids)
        for i in stops:
            _check_int("stop_token_ids", i, 0)
        # A list would make the frozen dataclass unhashable; store the tuple.
        object.__setattr__(self, "stop_token_ids", stops)


@dataclass
class Completion:
    """One sampled completion: its tokens, their log-probs (one each) and why it ended.

    ``finish_reason`` is ``"stop"`` (the last token is a stop token) or ``"length"`` (the token
    budget ran out).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer codes against; ``name`` is ``"hf"`` or ``"vllm"``."""

    name: str

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_tokens: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``result[i][j]`` = sample j of prompt i (token ids, no padding, in and out).

        ``max_tokens``: one budget per prompt, overriding ``params.max_tokens``.
        """
        ...

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load new weights (HF parameter names), consuming the iterable one item at a time."""
        ...

    def sleep(self) -> None:
        """Free memory between rollouts where supported (no-op otherwise)."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep`` (no-op where sleeping is not supported)."""
        ...


def check_generate_args(
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    max_tokens: Sequence[int] | None,
    *,
    vocab_size: int,
    max_model_len: int | None = None,
) -> list[int]:
    """Validate a ``generate`` call; returns the per-prompt budgets ``[P]``.

    Token ids (prompts and stop ids) must lie in ``[0, vocab_size)``, which catches a
    tokenizer that does not belong to the model; with ``max_model_len`` every prompt plus its
    budget must fit in the engine's context.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected a SamplingParams, got {type(params).__name__}")
    if isinstance(prompts, Tensor | str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(
            "prompts: expected a non-empty list of token-id lists (no padding), got "
            f"{_describe(prompts)}"
        )
    if max_tokens is None:
        budgets = [params.max_tokens] * len(prompts)
    else:
        if isinstance(max_tokens, Tensor):
            max_tokens = max_tokens.tolist()
        if not isinstance(max_tokens, Sequence) or len(max_tokens) != len(prompts):
            raise ValueError(
                f"max_tokens: expected one budget per prompt ({len(prompts)}), got "
                f"{_describe(max_tokens)}"
            )
        for b in max_tokens:
            _check_int("max_tokens", b, 1)
        budgets = [int(b) for b in max_tokens]
    for s in params.stop_token_ids:
        if s >= vocab_size:
            raise ValueError(
                f"params.stop_token_ids: id {s} is outside the model's vocabulary [0, {vocab_size})"
            )
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, str) or not isinstance(prompt, Sequence) or not prompt:
            raise ValueError(
                f"prompts[{i}]: expected a non-empty list of token ids, got {_describe(prompt)}"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"prompts[{i}]: expected int token ids, got {_describe(prompt)}")
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(
                f"prompts[{i}]: token id {bad} is outside the model's vocabulary "
                f"[0, {vocab_size}) (is the tokenizer the model's own?)"
            )
        if max_model_len is not None and len(prompt) + budgets[i] > max_model_len:
            raise ValueError(
                f"prompts[{i}]: {len(prompt)} prompt tokens + max_tokens {budgets[i]} exceed "
                f"the engine's context of {max_model_len} tokens (max_model_len)"
            )
    return budgets


def unpad_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> list[list[int]]:
    """Left-padded ``[P, Lp]`` ids + mask -> one token-id list per prompt (padding dropped)."""
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids: expected a [P, Lp] tensor, got {_describe(prompt_ids)}")
    if not isinstance(prompt_mask, Tensor) or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_mask: expected shape {tuple(prompt_ids.shape)} like prompt_ids, "
            f"got {_describe(prompt_mask)}"
        )
    keep = prompt_mask.bool().cpu()
    return [row[m].tolist() for row, m in zip(prompt_ids.cpu(), keep)]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token-id lists -> ``(ids, mask)`` both ``[P, Lp]`` long, left-padded, Lp = longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


def completions_to_batch(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completions: Sequence[Sequence[Completion]],
    *,
    pad_id: int,
) -> dict[str, Tensor]:
    """The batch of DESIGN.md's data contract from the completions of ``P`` prompts.

    Args:
        prompt_ids, prompt_mask: ``[P, Lp]`` left-padded, as given to the rollout (kept as is).
        completions: ``completions[i]`` = the samples of prompt i (usually ``n`` each).
        pad_id: fills responses after a completion's last token.

    Returns (B = total number of completions, Lr = longest completion), on
    ``prompt_ids.device``: ``prompts`` [B, Lp]; ``responses`` [B, Lr] long right-padded;
    ``response_mask`` [B, Lr] float32 (1 on every completion token, the stop token included);
    ``rollout_log_probs`` [B, Lr] float32 (0 on padding); ``input_ids`` / ``attention_mask`` /
    ``position_ids`` [B, Lp+Lr] long; ``uid`` [B] int64 (the prompt index); ``truncated`` [B]
    bool (finish reason ``"length"``).

    Multi-turn completions (``otbrl.rollout.agent.Trajectory``, with a ``mask``): the response
    mask is that mask (0 on observation tokens: holes), the attention mask stays 1 on every real
    token, and ``num_turns`` / ``tool_calls`` / ``tool_errors`` [B] int64 are added.
    """
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids: expected a [P, Lp] tensor, got {_describe(prompt_ids)}")
    if not isinstance(prompt_mask, Tensor) or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_mask: expected shape {tuple(prompt_ids.shape)} like prompt_ids, "
            f"got {_describe(prompt_mask)}"
        )
    if not isinstance(completions, Sequence) or len(completions) != prompt_ids.shape[0]:
        raise ValueError(
            f"completions: expected one list per prompt ({prompt_ids.shape[0]}), got "
            f"{_describe(completions)}"
        )
    _check_int("pad_id", pad_id, 0)
    flat: list[Completion] = []
    counts = []
    for i, group in enumerate(completions):
        if not isinstance(group, Sequence) or not group:
            raise ValueError(f"completions[{i}]: expected a non-empty list of Completion")
        for j, c in enumerate(group):
            _check_completion(c, f"completions[{i}][{j}]")
        flat.extend(group)
        counts.append(len(group))
    device = prompt_ids.device
    lengths = [len(c.token_ids) for c in flat]
    width = max(lengths)
    # Built on the host in one go (a per-row device copy costs a launch each on a GPU).
    responses = torch.full((len(flat), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros((len(flat), width), dtype=torch.float32)
    for r, c in enumerate(flat):
        responses[r, : lengths[r]] = torch.tensor(c.token_ids, dtype=torch.long)
        logprobs[r, : lengths[r]] = torch.tensor(c.logprobs, dtype=torch.float32)
    response_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    attention = response_mask
    multi_turn = any(getattr(c, "mask", None) is not None for c in flat)
    if multi_turn:
        attention = response_mask.clone()
        for r, c in enumerate(flat):
            if getattr(c, "mask", None) is not None:
                response_mask[r, : lengths[r]] = torch.tensor(c.mask, dtype=torch.float32)
    truncated = torch.tensor([c.finish_reason == "length" for c in flat], dtype=torch.bool)
    repeats = torch.tensor(counts, device=device)
    prompts = prompt_ids.repeat_interleave(repeats, dim=0)
    masks = prompt_mask.to(dtype=torch.long).repeat_interleave(repeats, dim=0)
    responses, response_mask = responses.to(device), response_mask.to(device)
    attention_mask = torch.cat([masks, attention.long().to(device)], dim=1)
    batch = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": logprobs.to(device),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "uid": torch.arange(len(counts), device=device).repeat_interleave(repeats),
        "truncated": truncated.to(device),
    }
    if multi_turn:
        for key, default in (("num_turns", 1), ("tool_calls", 0), ("tool_errors", 0)):
            values = [int(getattr(c, key, default)) for c in flat]
            batch[key] = torch.tensor(values, dtype=torch.int64, device=device)
    return batch


def _check_completion(c: Completion, where: str) -> None:
    if not isinstance(c, Completion):
        raise TypeError(f"{where}: expected a Completion, got {type(c).__name__}")
    if not c.token_ids:
        raise ValueError(f"{where}: expected at least one token, got none")
    if len(c.logprobs) != len(c.token_ids):
        raise ValueError(
            f"{where}: expected one log-prob per token ({len(c.token_ids)}), got {len(c.logprobs)}"
        )
    mask = getattr(c, "mask", None)
    if mask is not None and (len(mask) != len(c.token_ids) or not set(mask) <= {0, 1}):
        raise ValueError(
            f"{where}: expected a 0/1 mask with one entry per token ({len(c.token_ids)}), got "
            f"{_describe(mask)}"
        )
    if c.finish_reason not in FINISH_REASONS:
        raise ValueError(
            f"{where}: finish_reason must be one of {FINISH_REASONS}, got {c.finish_reason!r}"
        )


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int ≥ {minimum}, got {value}")


def _describe(x) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, Sequence) and not isinstance(x, str):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"{type(x).__name__} {x!r}"[:80]
