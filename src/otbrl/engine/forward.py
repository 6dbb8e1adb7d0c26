"""One model forward → per-response-token statistics, in three layouts with identical results.

- padded: the model sees ``[B, L]`` with the attention mask and position ids of left-padded
  prompts followed by right-padded responses.
- packed (``model.use_remove_padding``): only the valid tokens, concatenated into ``[1, nnz]``,
  with position ids that restart at 0 for each sequence and ``attention_mask=None``.
  transformers 5 detects the restarts (``masking_utils.find_packed_sequence_indices``) and builds
  a block-diagonal causal mask for sdpa/eager, and flash-attention reads the same position ids as
  varlen boundaries; so no custom mask is needed. Fallback for attention implementations that do
  not read position ids this way: ``block_causal_mask`` builds the 4-D mask explicitly and
  ``packed_mask="explicit"`` passes it in instead.
- fused (``actor.use_fused_kernels``): the decoder body runs without the lm_head and
  ``fused_linear_token_stats`` applies the output projection chunk by chunk, so ``[N, V]``
  logits never exist. Assumes ``logits = lm_head(hidden)`` (no logit soft-capping).

In every layout the statistics of response token t come from the position that predicted it
(t − 1 in the full sequence), on ``logits / temperature``, and only rows of valid response
tokens reach the vocabulary projection.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from otbrl.data.packing import pack, packed_position_ids
from otbrl.ops import fused_linear_token_stats, token_stats

STAT_KEYS = ("old_log_probs", "entropy", "sum_pi_squared")


def sequence_inputs(
    prompts: Tensor, prompt_mask: Tensor, responses: Tensor, response_mask: Tensor
) -> dict[str, Tensor]:
    """Full-sequence model inputs from a left-padded prompt and a right-padded response.

    prompts/prompt_mask: [B, Lp]; responses/response_mask: [B, Lr].
    Returns ``input_ids``, ``attention_mask`` (long) and ``position_ids``, each [B, Lp+Lr].
    """
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(
            f"prompts and responses must share the batch dim, got {tuple(prompts.shape)} "
            f"and {tuple(responses.shape)}"
        )
    attention_mask = torch.cat([prompt_mask.long(), (response_mask > 0).long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


def block_causal_mask(cu_seqlens: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive 4-D mask [1, 1, nnz, nnz]: causal inside each packed sequence, -inf across."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    nnz = seq_id.numel()
    causal = torch.ones(nnz, nnz, dtype=torch.bool).tril()
    allowed = causal & (seq_id[:, None] == seq_id[None, :])
    mask = torch.zeros(nnz, nnz, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def forward_token_stats(
    model: nn.Module,
    batch: dict[str, Tensor],
    *,
    temperature: float = 1.0,
    entropy: bool = False,
    sum_pi_squared: bool = False,
    packed: bool = False,
    fused: bool = False,
    packed_mask: str = "position_ids",
) -> dict[str, Tensor]:
    """Per-response-token statistics from one forward.

    batch needs ``input_ids``, ``attention_mask``, ``position_ids`` [B, L] and ``responses``
    [B, Lr] (the last Lr columns of ``input_ids``). Returns ``old_log_probs`` and, when asked,
    ``entropy`` and ``sum_pi_squared``: each [B, Lr] float32, 0 on padding. Log-probs and
    entropy carry gradients when grad mode is on; Σπ² never does.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if packed_mask not in ("position_ids", "explicit"):
        raise ValueError(f"packed_mask must be 'position_ids' or 'explicit', got {packed_mask!r}")
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    responses = batch["responses"]
    bsz, seq_len = input_ids.shape
    resp_len = responses.shape[1]
    prompt_len = seq_len - resp_len
    if prompt_len < 1:
        raise ValueError(
            f"input_ids must hold at least one prompt token before the {resp_len} response "
            f"tokens, got shape {tuple(input_ids.shape)}"
        )
    valid = attention_mask[:, prompt_len:].bool()  # [B, Lr] response tokens to score
    labels = responses[valid]  # [N]
    # full-sequence position that predicts each valid response token
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    pred_pos = prompt_len - 1 + t_idx

    if packed:
        packed_ids = pack(input_ids, attention_mask)
        flat_to_packed = torch.full((bsz * seq_len,), -1, dtype=torch.long)
        flat_to_packed[packed_ids.indices] = torch.arange(packed_ids.indices.numel())
        rows = flat_to_packed[b_idx * seq_len + pred_pos]  # [N] rows of the packed stream
        if (rows < 0).any():
            raise ValueError("attention_mask marks a response token whose predecessor is masked")
        kwargs = {
            "input_ids": packed_ids.values[None],
            "position_ids": packed_position_ids(packed_ids.cu_seqlens)[None],
            "attention_mask": None,
        }
        if packed_mask == "explicit":
            kwargs["attention_mask"] = block_causal_mask(
                packed_ids.cu_seqlens, dtype=_param_dtype(model)
            )
        select = (torch.zeros_like(rows), rows)
    else:
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": batch["position_ids"],
        }
        select = (b_idx, pred_pos)

    if fused:
        hidden = model.get_decoder()(**kwargs, use_cache=False).last_hidden_state
        head = model.get_output_embeddings()
        stats = fused_linear_token_stats(
            hidden[select],
            head.weight,
            labels,
            bias=head.bias,
            temperature=temperature,
            entropy=entropy,
            sum_pi_squared=sum_pi_squared,
        )
    else:
        if packed:
            keep = rows  # logits only at the rows that predict response tokens
            logits = model(**kwargs, use_cache=False, logits_to_keep=keep).logits[0]
        else:
            # the last Lr + 1 positions cover every predictor of a response token
            out = model(**kwargs, use_cache=False, logits_to_keep=resp_len + 1).logits
            logits = out[b_idx, t_idx]
        stats = token_stats(
            logits,
            labels,
            temperature=temperature,
            entropy=entropy,
            sum_pi_squared=sum_pi_squared,
        )
    result = {"old_log_probs": _scatter(stats.log_probs, valid)}
    if entropy:
        result["entropy"] = _scatter(stats.entropy, valid)
    if sum_pi_squared:
        result["sum_pi_squared"] = _scatter(stats.sum_pi_squared.detach(), valid)
    return result


def _scatter(values: Tensor, valid: Tensor) -> Tensor:
    out = torch.zeros(valid.shape, dtype=torch.float32, device=values.device)
    out[valid] = values.float()  # differentiable index_put: gradients reach the valid rows
    return out


def _param_dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype
