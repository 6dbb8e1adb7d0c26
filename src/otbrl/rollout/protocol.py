"""The rollout protocol every backend implements: sampling settings, completions, the backend
interface and the checks of a ``generate`` call.

No model imports here: a backend (``HFRollout``, ``VLLMRollout``, ``ServerRollout``) takes
token-id prompts and ``SamplingParams`` and returns ``Completion`` objects (the vLLM backends
through ``make_completion``, the one check of what an engine answered); ``otbrl.rollout.batch``
turns them into the batch contract (docs/architecture.md, "The batch"). The agent loop
(``otbrl.rollout.agent``) is a ``Sampler`` too: the sampling step asks any sampler for
completions of rows, the same way.

Log-prob definition (both backends): ``Completion.logprobs[t]`` is log π_T(token_t) with
π_T = softmax(logits / temperature) over the full vocabulary, the distribution the trainer's
``old_log_probs`` use. Two documented exceptions: greedy decoding reports T = 1 (the
temperature plays no part in an argmax), and the vLLM backend with top-k / top-p reports the
truncated, renormalised distribution it sampled from (see ``otbrl.rollout.vllm``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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
        check_int("n", self.n, 1)
        check_int("top_k", self.top_k, 0)
        check_int("max_tokens", self.max_tokens, 1)
        if self.seed is not None:
            check_int("seed", self.seed, 0)
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
            check_int("stop_token_ids", i, 0)
        # A list would make the frozen dataclass unhashable; store the tuple.
        object.__setattr__(self, "stop_token_ids", stops)


@dataclass
class Completion:
    """One sampled completion: its tokens, their log-probs (one each) and why it ended.

    ``finish_reason`` is ``"stop"`` (the last token is a stop token) or ``"length"`` (the token
    budget ran out). ``version``: the weight version that sampled it, where the backend counts
    versions (the server backend; None elsewhere) — its first token's, the oldest.
    ``token_versions``: one version per token where the weights may change while a completion
    is generated (partial rollouts: ``rollout.partial_rollout``); None: every token is
    ``version``'s.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version: int | None = None
    token_versions: list[int] | None = None


@runtime_checkable
class Sampler(Protocol):
    """What the sampling step (``otbrl.run.sampling``) samples with: a rollout backend alone, or
    the agent loop over one. ``tools``: the tools rendered into the prompts' chat template (None:
    none). The caller never branches on which it has."""

    tools: Mapping[str, Any] | None

    def prompt_rows(self, rows: Sequence[Mapping]) -> list[Mapping]:
        """The rows as their prompts are rendered: the data rows, or (the agent loop) with what
        each row's environment opens its episode with appended to the prompt."""
        ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_tokens: Sequence[int] | None = None,
        rows: Sequence[Mapping] | None = None,
    ) -> list[list[Completion]]:
        """``result[i][j]`` = sample j of prompt i (token ids, no padding, in and out).

        ``max_tokens``: one budget per prompt, overriding ``params.max_tokens``. ``rows``: the
        data rows the prompts were rendered from (the agent loop reads each row's tools; a
        backend samples from the token ids alone and ignores them).
        """
        ...


@runtime_checkable
class RolloutBackend(Sampler, Protocol):
    """A rollout backend (``name`` is ``"hf"``, ``"vllm"`` or ``"server"``): a ``Sampler`` that
    holds weights, so the trainer can sync them, free its memory between rollouts and release
    it at the end."""

    name: str

    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Load new weights (HF parameter names), consuming the iterable one item at a time."""
        ...

    def sleep(self) -> None:
        """Free memory between rollouts where supported (no-op otherwise)."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep`` (no-op where sleeping is not supported)."""
        ...

    def close(self) -> None:
        """Release what the backend holds (an engine, servers, files); idempotent, and a
        documented no-op where it holds nothing."""
        ...


class Backend:
    """What the rollout backends (``HFRollout``, ``VLLMRollout``, ``ServerRollout``) share:
    ``generate`` checks a call once against the model's vocabulary and context
    (``check_generate_args``) and hands the per-prompt budgets to the backend's own
    ``_sample(prompts, params, budgets) -> list[list[Completion]]``. A subclass sets
    ``vocab_size`` and ``max_model_len`` (None: no context limit)."""

    tools = None  # a backend renders no tools (the agent loop over it does)
    vocab_size: int
    max_model_len: int | None = None

    def prompt_rows(self, rows: Sequence[Mapping]) -> list[Mapping]:
        """The data rows as they are: a backend has no environment to open an episode."""
        return list(rows)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_tokens: Sequence[int] | None = None,
        rows: Sequence[Mapping] | None = None,
    ) -> list[list[Completion]]:
        """``result[i][j]`` = sample j of prompt i; see ``Sampler.generate`` (``rows`` unused: a
        backend samples from the token ids alone). A prompt plus its budget longer than
        ``max_model_len``, or a token id outside the model's vocabulary, is a ``ValueError``
        before anything reaches the engine."""
        budgets = check_generate_args(
            prompts, params, max_tokens, vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
        )  # fmt: skip
        return self._sample(prompts, params, budgets)

    def _sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, budgets: list[int]
    ) -> list[list[Completion]]:
        """The backend's sampling of a checked call: ``budgets`` [P] tokens at most each."""
        raise NotImplementedError


def make_completion(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    finish_reason,
    *,
    source: str,
    error: type[Exception] = RuntimeError,
    version: int | None = None,
    token_versions: Sequence[int] | None = None,
) -> Completion:
    """The ``Completion`` of what an engine answered (each backend extracts the tokens, their
    log-probs and the finish reason from its own format): ``finish_reason`` one of
    ``FINISH_REASONS``, one log-prob (and with ``token_versions`` one version) per token; else
    ``error``, naming ``source`` and what came. With ``token_versions``, ``version`` is their
    oldest (the first token's)."""
    tokens = [int(t) for t in token_ids]
    logprobs = [float(x) for x in logprobs]
    versions = None if token_versions is None else [int(v) for v in token_versions]
    if (
        finish_reason not in FINISH_REASONS
        or len(logprobs) != len(tokens)
        or (versions is not None and len(versions) != len(tokens))
    ):
        counts = "" if versions is None else f" and {len(versions)} token versions"
        raise error(
            f"{source} answered finish_reason={finish_reason!r} (expected one of "
            f"{FINISH_REASONS}) with {len(tokens)} tokens, {len(logprobs)} log-probs{counts}"
        )
    if versions:
        version = min(versions)
    return Completion(tokens, logprobs, finish_reason, version=version, token_versions=versions)


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
            f"{describe(prompts)}"
        )
    if max_tokens is None:
        budgets = [params.max_tokens] * len(prompts)
    else:
        if isinstance(max_tokens, Tensor):
            max_tokens = max_tokens.tolist()
        if not isinstance(max_tokens, Sequence) or len(max_tokens) != len(prompts):
            raise ValueError(
                f"max_tokens: expected one budget per prompt ({len(prompts)}), got "
                f"{describe(max_tokens)}"
            )
        for b in max_tokens:
            check_int("max_tokens", b, 1)
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
                f"prompts[{i}]: expected a non-empty list of token ids, got {describe(prompt)}"
            )
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"prompts[{i}]: expected int token ids, got {describe(prompt)}")
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


def check_int(name: str, value, minimum: int) -> None:
    """``value`` is an int (not a bool) ≥ ``minimum``; else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int ≥ {minimum}, got {value}")


def describe(x) -> str:
    """A short description of a bad argument for an error message."""
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, Sequence) and not isinstance(x, str):
        return f"a {type(x).__name__} of length {len(x)}"
    return f"{type(x).__name__} {x!r}"[:80]
