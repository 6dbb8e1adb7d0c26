"""Response generation with a Hugging Face causal LM (the CPU / single-device rollout).

All prompts × ``n`` samples are decoded in one batch with the KV cache on; each prompt is
prefilled once and its cache shared by its ``n`` samples (``model.generate`` is an option).
Rows of the same prompt are adjacent, as the group-wise estimators expect.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from otbrl.models import eos_token_ids


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    *,
    n: int = 1,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    do_sample: bool = True,
    seed: int | None = None,
    use_hf_generate: bool = False,
) -> dict[str, Tensor]:
    """Sample ``n`` responses per prompt.

    Args:
        model: a causal LM (its train/eval mode is restored afterwards).
        tokenizer: gives the pad and EOS ids.
        prompt_ids: [P, Lp] long, left-padded.
        prompt_mask: [P, Lp] 0/1, 1 on real prompt tokens.
        n: samples per prompt (rows ``i*n .. i*n+n-1`` come from prompt ``i``).
        max_new_tokens: response length cap.
        temperature, top_p, top_k: sampling parameters (``top_k=0`` and ``top_p=1`` disable
            those filters); ignored when ``do_sample=False`` (greedy decoding).
        seed: makes sampling reproducible without touching the caller's global RNG state.
        use_hf_generate: decode with ``model.generate`` instead of the built-in loop. The
            built-in loop runs the prompt forward once per prompt (not once per sample),
            copies its KV cache to the ``n`` samples and skips prompt logits: 2x faster on
            the demo's 32 prompts x 8 samples. Both stop at EOS; greedy results are identical.

    Returns:
        ``prompts`` [B, Lp] long (B = P*n), ``responses`` [B, Lr] long right-padded with the
        pad id (Lr ≤ ``max_new_tokens`` is the longest response), ``response_mask`` [B, Lr]
        float32 (1 up to and including the first EOS, 0 after), the full sequence
        ``input_ids`` / ``attention_mask`` / ``position_ids`` [B, Lp+Lr] long, and ``uid``
        [B] int64 (the prompt index, shared by the ``n`` rows of a group).
    """
    _check_args(prompt_ids, prompt_mask, n, max_new_tokens, temperature, top_p, top_k)
    prompt_mask = prompt_mask.to(dtype=torch.long, device=prompt_ids.device)
    prompts = prompt_ids.repeat_interleave(n, dim=0)
    masks = prompt_mask.repeat_interleave(n, dim=0)
    eos_ids = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    sampling = {"temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k)}
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=_devices(prompt_ids)):
            if seed is not None:
                torch.manual_seed(seed)
            if use_hf_generate:
                responses = _hf_generate(
                    model, prompts, masks, max_new_tokens, eos_ids, pad_id, do_sample, sampling
                )
            else:
                responses, _ = shared_prefix_sample(
                    model, prompt_ids, prompt_mask, n, max_new_tokens, eos_ids, pad_id, do_sample,
                    sampling,
                )  # fmt: skip
    finally:
        model.train(was_training)
    response_mask = eos_response_mask(responses, eos_ids)
    # generate() already pads finished rows, but with pad == EOS (common for real models) only
    # the mask tells a trained-on EOS from padding; make the ids after the first EOS uniform.
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    attention_mask = torch.cat([masks, response_mask.long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    uid = torch.arange(prompt_ids.shape[0], device=prompts.device).repeat_interleave(n)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "uid": uid,
    }


def shared_prefix_sample(
    model,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    n: int,
    max_new_tokens: int,
    eos_ids: list[int],
    pad_id: int,
    do_sample: bool,
    sampling: dict,
    *,
    budgets: Tensor | None = None,
    with_logprobs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """KV-cached decoding that prefills each prompt once and fans the cache out to n samples.

    Args:
        prompt_ids, prompt_mask: [P, Lp] left-padded. eos_ids: the stop ids (may be empty).
        budgets: [P*n] long per-row token budgets (≤ ``max_new_tokens``); None = all
            ``max_new_tokens``. A row past its budget is finished like one past a stop id.
        with_logprobs: also return log softmax(logits / T) of each sampled token over the full
            vocabulary (T = 1 when greedy), float32.

    Returns:
        ``(tokens, logprobs)``: [P*n, S] long, S = steps run (the longest row), pad id after a
        row finished; logprobs [P*n, S] float32 or None. Uses the global torch RNG.
    """
    positions = (prompt_mask.cumsum(dim=1) - 1).clamp(min=0)
    accepted = inspect.signature(model.forward).parameters
    # Only the last prompt position's logits are needed; not every model takes the argument.
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
    out = model(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        position_ids=positions,
        use_cache=True,
        **last_only,
    )
    # transformers 5 renamed past_key_values -> cache (the old name warns, then goes away).
    cache_kw = "cache" if "cache" in accepted else "past_key_values"
    cache = out.get(cache_kw)
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        raise ValueError("model: no KV cache to share; pass use_hf_generate=True for this model")
    if n > 1:
        cache.batch_repeat_interleave(n)
    logits = out.logits[:, -1].float().repeat_interleave(n, dim=0)
    attention = prompt_mask.repeat_interleave(n, dim=0)
    position = positions[:, -1:].repeat_interleave(n, dim=0)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=prompt_ids.device)
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=prompt_ids.device)
    # The log-probs follow the trainer's definition; greedy picks an argmax, so T plays no part.
    lp_temperature = sampling["temperature"] if do_sample else 1.0
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        if with_logprobs:
            # No RNG is used here, so the samples are exactly the ones generate() draws; only
            # the sampled token's log-prob is kept (no [B, V] log-softmax output per step).
            scaled = logits / lp_temperature
            lse = torch.logsumexp(scaled, dim=-1)
        token = sample_next_token(logits, do_sample=do_sample, **sampling)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        if with_logprobs:
            logprobs.append(scaled.gather(1, token[:, None]).squeeze(1) - lse)
        finished |= torch.isin(token, eos)
        if budgets is not None:
            finished |= budgets <= step + 1
        if step == max_new_tokens - 1 or bool(finished.all()):
            break
        attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
        position = position + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=attention,
            position_ids=position,
            use_cache=True,
            **{cache_kw: cache},
        )
        logits = out.logits[:, -1].float()
    return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1) if with_logprobs else None


def sample_next_token(
    logits: Tensor, *, do_sample: bool, temperature: float, top_p: float, top_k: int
) -> Tensor:
    """One token per row from [B, V] logits: argmax, or a sample from the filtered softmax.

    Filters, in order: ``logits / temperature``; keep the ``top_k`` largest (0 = all); keep the
    smallest set of most likely tokens whose mass reaches ``top_p`` (a token stays when the mass
    of the tokens ranked above it is < ``top_p``). Uses the global torch RNG.
    """
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1).squeeze(1)


def _hf_generate(model, prompts, masks, max_new_tokens, eos_ids, pad_id, do_sample, sampling):
    if do_sample:
        top_k = sampling["top_k"] if sampling["top_k"] > 0 else None
        kwargs = {"do_sample": True, **sampling, "top_k": top_k}
    else:
        kwargs = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    out = model.generate(
        input_ids=prompts,
        attention_mask=masks,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos_ids,
        pad_token_id=pad_id,
        use_cache=True,
        **kwargs,
    )
    return out[:, prompts.shape[1] :]


def eos_response_mask(responses: Tensor, eos_ids: list[int] | int) -> Tensor:
    """[B, Lr] float32 mask: 1 up to and including the first EOS of each row, 0 after.

    A row without EOS (truncated at the length cap) is 1 everywhere.
    """
    eos = torch.as_tensor(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    is_eos = torch.isin(responses, eos.to(responses.device)).long()
    # Number of EOS strictly before each position: 0 means "not past the first EOS yet".
    before = is_eos.cumsum(dim=1) - is_eos
    return (before == 0).to(torch.float32)


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


def _devices(t: Tensor) -> list:
    return [t.device] if t.device.type == "cuda" else []


def _check_args(prompt_ids, prompt_mask, n, max_new_tokens, temperature, top_p, top_k) -> None:
    if not isinstance(prompt_ids, Tensor) or prompt_ids.dim() != 2:
        raise ValueError(f"prompt_ids: expected a [P, Lp] tensor, got {_describe(prompt_ids)}")
    if prompt_ids.dtype not in (torch.long, torch.int32):
        raise TypeError(f"prompt_ids: expected an integer tensor, got dtype {prompt_ids.dtype}")
    if not isinstance(prompt_mask, Tensor) or prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_mask: expected shape {tuple(prompt_ids.shape)} like prompt_ids, "
            f"got {_describe(prompt_mask)}"
        )
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected an int ≥ 1, got {n!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int ≥ 1, got {max_new_tokens!r}")
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a float in (0, 1], got {top_p!r}")
    if not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k: expected an int ≥ 0 (0 = off), got {top_k!r}")


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
