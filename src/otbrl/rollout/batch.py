"""The one place completions become a batch, and a batch's responses become text.

``completions_to_batch`` turns ``Completion`` objects (``otbrl.rollout.protocol``) into the
batch contract (docs/architecture.md, "The batch"); ``decode_responses`` /
``decode_transcripts`` give a reward the final answer and the whole multi-turn stream of each
row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from otbrl.rollout.protocol import FINISH_REASONS, Completion, check_int, describe


def _check_prompts(prompt_ids, prompt_mask) -> None:
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids: expected a [P, Lp] tensor, got {describe(prompt_ids)}")
    if not isinstance(prompt_mask, Tensor) or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_mask: expected shape {tuple(prompt_ids.shape)} like prompt_ids, "
            f"got {describe(prompt_mask)}"
        )


def unpad_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> list[list[int]]:
    """Left-padded ``[P, Lp]`` ids + mask -> one token-id list per prompt (padding dropped)."""
    _check_prompts(prompt_ids, prompt_mask)
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
    """The batch (docs/architecture.md, "The batch") from the completions of ``P`` prompts.

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
    token, and ``num_turns`` / ``tool_calls`` / ``tool_errors`` [B] int64 are added, with
    ``env_rewards`` [B, Lr] float32 (each environment step's reward on its turn's last token),
    ``env_errors`` [B] int64 (1: the sample's environment failed) and ``retokenized`` [B] int64
    (1: re-rendering the conversation gives other ids than the stream).
    Completions that carry a weight ``version`` (the server backend) add ``policy_version`` [B]
    int64 (a multi-turn row: its oldest turn's); when every completion also carries
    ``token_versions`` (partial rollouts: the weights changed while it was generated)
    ``policy_version`` is [B, Lr] instead, one version per token, padding holding the row's
    newest (so a row's minimum is its oldest token's).
    """
    _check_prompts(prompt_ids, prompt_mask)
    if not isinstance(completions, Sequence) or len(completions) != prompt_ids.shape[0]:
        raise ValueError(
            f"completions: expected one list per prompt ({prompt_ids.shape[0]}), got "
            f"{describe(completions)}"
        )
    check_int("pad_id", pad_id, 0)
    flat, counts = _flat_completions(completions)
    device = prompt_ids.device
    responses, logprobs, lengths = _right_padded(flat, pad_id)
    multi_turn = any(getattr(c, "mask", None) is not None for c in flat)
    response_mask, attention = _response_masks(flat, lengths, multi_turn)
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
    versions = _policy_versions(flat, lengths, device)
    if versions is not None:
        batch["policy_version"] = versions
    if multi_turn:
        for key, default in (("num_turns", 1), ("tool_calls", 0), ("tool_errors", 0)):
            values = [int(getattr(c, key, default)) for c in flat]
            batch[key] = torch.tensor(values, dtype=torch.int64, device=device)
        failed = [getattr(c, "env_error", None) is not None for c in flat]
        batch["env_errors"] = torch.tensor(failed, dtype=torch.int64, device=device)
        retokenized = [bool(getattr(c, "retokenized", False)) for c in flat]
        batch["retokenized"] = torch.tensor(retokenized, dtype=torch.int64, device=device)
        batch["env_rewards"] = _env_rewards(flat, responses.shape[1]).to(device)
    return batch


def _env_rewards(flat: list[Completion], width: int) -> Tensor:
    """[B, Lr] float32: each environment step's reward on the last token of the turn it scored
    (0 elsewhere, and on every token of a sample whose environment failed)."""
    out = torch.zeros(len(flat), width, dtype=torch.float32)
    for b, c in enumerate(flat):
        if getattr(c, "env_error", None) is not None:
            continue
        for reward, at in zip(getattr(c, "rewards", ()), getattr(c, "reward_positions", ())):
            out[b, at] += reward
    return out


def _flat_completions(
    completions: Sequence[Sequence[Completion]],
) -> tuple[list[Completion], list[int]]:
    """Every prompt's completions checked and laid end to end (B of them), with each prompt's
    count (its group size)."""
    flat: list[Completion] = []
    counts = []
    for i, group in enumerate(completions):
        if not isinstance(group, Sequence) or not group:
            raise ValueError(f"completions[{i}]: expected a non-empty list of Completion")
        for j, c in enumerate(group):
            _check_completion(c, f"completions[{i}][{j}]")
        flat.extend(group)
        counts.append(len(group))
    return flat, counts


def _right_padded(flat: list[Completion], pad_id: int) -> tuple[Tensor, Tensor, list[int]]:
    """``(responses [B, Lr] long, logprobs [B, Lr] float32, lengths)`` on the host: each
    completion's tokens and log-probs from column 0, then ``pad_id`` / 0; Lr = the longest."""
    lengths = [len(c.token_ids) for c in flat]
    width = max(lengths)
    # Built on the host in one go (a per-row device copy costs a launch each on a GPU).
    responses = torch.full((len(flat), width), pad_id, dtype=torch.long)
    logprobs = torch.zeros((len(flat), width), dtype=torch.float32)
    for r, c in enumerate(flat):
        responses[r, : lengths[r]] = torch.tensor(c.token_ids, dtype=torch.long)
        logprobs[r, : lengths[r]] = torch.tensor(c.logprobs, dtype=torch.float32)
    return responses, logprobs, lengths


def _response_masks(
    flat: list[Completion], lengths: list[int], multi_turn: bool
) -> tuple[Tensor, Tensor]:
    """``(response_mask, attention)``, both [B, Lr] float32 on the host: 1 on every completion
    token, 0 on padding. A multi-turn row's response mask is its own ``mask`` (0 on observation
    tokens) while its attention stays 1 there; otherwise both are the same tensor."""
    width = max(lengths)
    response_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    attention = response_mask
    if multi_turn:
        attention = response_mask.clone()
        for r, c in enumerate(flat):
            if getattr(c, "mask", None) is not None:
                response_mask[r, : lengths[r]] = torch.tensor(c.mask, dtype=torch.float32)
    return response_mask, attention


def _policy_versions(flat: list[Completion], lengths: list[int], device) -> Tensor | None:
    """The weights version that sampled each row, int64 on ``device``: [B, Lr] when every
    completion carries ``token_versions`` (padding holds the row's newest), [B] when every one
    carries a ``version``, else None."""
    if flat and all(c.token_versions is not None for c in flat):
        versions = torch.zeros((len(flat), max(lengths)), dtype=torch.int64)
        for r, c in enumerate(flat):
            versions[r, : lengths[r]] = torch.tensor(c.token_versions, dtype=torch.int64)
            versions[r, lengths[r] :] = max(c.token_versions)
        return versions.to(device)
    if flat and all(c.version is not None for c in flat):
        versions = [int(c.version) for c in flat]
        return torch.tensor(versions, dtype=torch.int64, device=device)
    return None


def _check_completion(c: Completion, where: str) -> None:
    if not isinstance(c, Completion):
        raise TypeError(f"{where}: expected a Completion, got {type(c).__name__}")
    if not c.token_ids:
        raise ValueError(f"{where}: expected at least one token, got none")
    if len(c.logprobs) != len(c.token_ids):
        raise ValueError(
            f"{where}: expected one log-prob per token ({len(c.token_ids)}), got {len(c.logprobs)}"
        )
    if c.token_versions is not None and len(c.token_versions) != len(c.token_ids):
        raise ValueError(
            f"{where}: expected one version per token ({len(c.token_ids)}), got "
            f"{len(c.token_versions)}"
        )
    mask = getattr(c, "mask", None)
    if mask is not None and (len(mask) != len(c.token_ids) or not set(mask) <= {0, 1}):
        raise ValueError(
            f"{where}: expected a 0/1 mask with one entry per token ({len(c.token_ids)}), got "
            f"{describe(mask)}"
        )
    if c.finish_reason not in FINISH_REASONS:
        raise ValueError(
            f"{where}: finish_reason must be one of {FINISH_REASONS}, got {c.finish_reason!r}"
        )


def decode_responses(
    tokenizer: PreTrainedTokenizerBase, responses: Tensor, response_mask: Tensor
) -> list[str]:
    """The answer text of each response: its model tokens after the last observation, special
    tokens (EOS) dropped.

    Args:
        responses: [B, Lr] long. response_mask: [B, Lr] 0/1 — 1 on model tokens; 0 on padding
            and on tool observations (holes). A row without holes decodes all its masked tokens;
            a multi-turn row decodes its last run of 1s (the final turn), so a reward sees the
            final answer, not the tool calls before it (``decode_transcripts`` has the rest).
    """
    if responses.shape != response_mask.shape:
        raise ValueError(
            f"response_mask: expected shape {tuple(responses.shape)} like responses, "
            f"got {tuple(response_mask.shape)}"
        )
    start, end = final_turn_span(response_mask)
    rows = [ids[s:e] for ids, s, e in zip(responses.tolist(), start.tolist(), end.tolist())]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def final_turn_span(response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(start, end)`` [B] int64: the last run of 1s of each row is ``[start, end)``; a row
    with no 1 gets ``(0, 0)``. For a mask without holes that is ``(0, Σ mask)``."""
    trained = response_mask > 0
    width = response_mask.shape[1]
    positions = torch.arange(1, width + 1, device=response_mask.device)
    end = torch.where(trained, positions, 0).amax(dim=1)  # one past the last 1
    # the last 0 before the end (a hole), + 1; 0 when the row has none
    hole = (~trained) & (positions[None, :] <= end[:, None])
    start = torch.where(hole, positions, 0).amax(dim=1)
    return start.long(), end.long()


def decode_transcripts(
    tokenizer: PreTrainedTokenizerBase, responses: Tensor, attention: Tensor
) -> list[str]:
    """The whole response of each row — model turns and observations — with special tokens
    kept (``<tool_call>``, ``<tool_response>``...). ``attention``: [B, Lr], 1 on real tokens."""
    lengths = (attention > 0).sum(dim=1).tolist()
    rows = [ids[:k] for ids, k in zip(responses.tolist(), lengths)]
    return tokenizer.batch_decode(rows, skip_special_tokens=False)
