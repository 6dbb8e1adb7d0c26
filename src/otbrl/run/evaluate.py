"""Validation: the mean reward of one response per prompt, greedy by default."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from otbrl.config import Config, ConfigError
from otbrl.data import encode_prompts
from otbrl.rewards import score_responses
from otbrl.rollout import decode_responses, generate


@torch.no_grad()
def evaluate_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: Sequence[dict],
    *,
    max_new_tokens: int,
    greedy: bool = True,
    batch_size: int = 512,
    temperature: float = 1.0,
    seed: int = 0,
    function=None,
    timeout_s: float | None = None,
) -> float:
    """Mean reward of one response per row (greedy by default), batched.

    ``function`` and ``timeout_s`` as in ``score_responses`` (``None``: the built-in for each
    ``data_source``; no time limit); with 0/1 rewards this is the accuracy. Errors in the
    reward function raise.
    """
    if not rows:
        raise ValueError("rows: expected at least one row to evaluate, got none")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected an int ≥ 1, got {batch_size!r}")
    total = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = list(rows[start : start + batch_size])
        enc = encode_prompts(chunk, tokenizer, max_prompt_length=10**9)
        out = generate(
            model,
            tokenizer,
            enc["input_ids"].to(model.device),
            enc["attention_mask"].to(model.device),
            n=1,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            do_sample=not greedy,
            seed=seed + start,
        )
        texts = decode_responses(tokenizer, out["responses"], out["response_mask"])
        scores, _ = score_responses(texts, chunk, function=function, timeout_s=timeout_s)
        total += sum(scores)
    return total / len(rows)


def evaluate_config(cfg: Config) -> tuple[float, int]:
    """(accuracy, number of prompts) of ``model.path`` on the validation rows (``otbrl eval``)."""
    from otbrl.models import load_model_and_tokenizer
    from otbrl.run.build import model_path, validate_config

    plan = validate_config(cfg)
    val_rows = plan.val_rows
    if not val_rows:
        raise ConfigError("'data.val_files' is empty: nothing to evaluate", "data.val_files")
    model, tokenizer = load_model_and_tokenizer(model_path(cfg), dtype=cfg.model.dtype)
    accuracy = evaluate_accuracy(
        model,
        tokenizer,
        val_rows,
        max_new_tokens=cfg.rollout.max_new_tokens,
        greedy=cfg.trainer.val_greedy,
        temperature=cfg.trainer.val_temperature,
        batch_size=cfg.trainer.val_batch_size,
        function=plan.reward_fn,
        timeout_s=cfg.reward.timeout_s,
    )
    return accuracy, len(val_rows)
