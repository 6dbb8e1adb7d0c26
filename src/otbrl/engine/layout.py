"""One model forward → per-response-token outputs ``[B, Lr]``, in every layout.

The alignment — the central data contract — lives here and nowhere else: the output for
response token t comes from the position that predicted it, t − 1 in the full sequence
(``response_rows``), and the outputs of those N positions are scattered back to ``[B, Lr]``
(``scatter_rows``). A ``Layout``, chosen once when the engine is built, decides only

- the model inputs: ``padded`` ``[B, L]`` with the attention mask and position ids of
  left-padded prompts followed by right-padded responses; ``packed`` (remove padding): the valid
  tokens concatenated into ``[1, nnz]`` with position ids that restart at 0 for each sequence and
  ``attention_mask=None`` (transformers 5 detects the restarts and builds a block-diagonal
  causal mask for sdpa/eager; flash-attention reads them as varlen boundaries); ``ulysses``:
  packed and cut into one slice per rank of the sequence-parallel group;
- which statistics op runs on the picked rows: ``token_stats`` on the logits, the fused
  ``fused_linear_token_stats`` on the decoder's hidden states (the ``[N, V]`` logits never
  exist; assumes ``logits = lm_head(hidden)``, no soft-capping), ``vocab_parallel_token_stats``
  on a tensor-parallel lm_head's vocabulary shard, or the value head's scalar.

Statistics are computed on ``logits / temperature``. In the packed layout only the N rows that
predict response tokens reach the vocabulary projection; in the padded one the B·Lr rows that
predict a response column do, and the op runs on all of them when few are padding (else on the
N picked out: ``FULL_WIDTH_SHARE``); under Ulysses each rank computes its slice and the results
are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from otbrl.data.packing import pack, packed_position_ids
from otbrl.engine import ulysses
from otbrl.ops import fused_linear_token_stats, token_stats, vocab_parallel_token_stats
from otbrl.ops.token_stats import HEAD_OUTPUTS, IGNORE_INDEX

HEADS = ("logits", "fused", "vocab_parallel", "value")


def sequence_inputs(
    prompts: Tensor, prompt_mask: Tensor, responses: Tensor, response_attention: Tensor
) -> dict[str, Tensor]:
    """Full-sequence model inputs from a left-padded prompt and a right-padded response.

    prompts/prompt_mask: [B, Lp]; responses/response_attention: [B, Lr], the latter 1 on every
    real response token (model tokens and tool observations alike), 0 on padding.
    Returns ``input_ids``, ``attention_mask`` (long) and ``position_ids``, each [B, Lp+Lr].
    """
    if prompts.shape[0] != responses.shape[0]:
        raise ValueError(
            f"prompts and responses must share the batch dim, got {tuple(prompts.shape)} "
            f"and {tuple(responses.shape)}"
        )
    attention_mask = torch.cat([prompt_mask.long(), (response_attention > 0).long()], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return {
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
    }


def padded_extents(micro: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Per row of a padded batch, the columns it needs: ``(prompt [B], response [B])`` int64,
    counted from the prompt/response boundary outwards to its farthest attended token (its
    left-padded prompt's and right-padded response's lengths). ``input_ids`` and
    ``attention_mask`` [B, Lp + Lr], ``responses`` [B, Lr]."""
    lr = micro["responses"].shape[1]
    lp = micro["input_ids"].shape[1] - lr
    seen = micro["attention_mask"].ne(0)
    device = seen.device
    prompt = (seen[:, :lp] * torch.arange(lp, 0, -1, device=device)).amax(dim=1)
    response = (seen[:, lp:] * torch.arange(1, lr + 1, device=device)).amax(dim=1)
    return prompt, response


def trim_padding(micro: dict[str, Tensor]) -> dict[str, Tensor]:
    """The model inputs of a padded micro-batch cut to its own widths: ``input_ids``,
    ``attention_mask``, ``position_ids`` [B, wp + wr], ``responses`` and ``response_mask``
    [B, wr] (wp / wr: its longest prompt / response, :func:`padded_extents`; wr ≥ 1). The
    columns cut are padding in every row, so each kept token's outputs are unchanged; the
    batch's width is set by its longest row, and a micro-batch of short rows no longer pays
    for it. ``ValueError`` if ``response_mask`` marks a token outside the attended ones."""
    prompt, response = padded_extents(micro)
    lr = micro["responses"].shape[1]
    lp = micro["input_ids"].shape[1] - lr
    wp, wr = max(int(prompt.max()), 1), max(int(response.max()), 1)
    if wr < lr and bool(micro["response_mask"][:, wr:].ne(0).any()):
        raise ValueError(
            f"response_mask: marks tokens past column {wr} of the responses, where "
            "attention_mask is 0 in every row"
        )
    cut = slice(lp - wp, lp + wr)
    out = {key: micro[key][:, cut] for key in ("input_ids", "attention_mask", "position_ids")}
    out["responses"] = micro["responses"][:, :wr]
    out["response_mask"] = micro["response_mask"][:, :wr]
    return out


class ResponseRows(NamedTuple):
    """The N response tokens a forward scores, in row-major order."""

    valid: Tensor  # [B, Lr] bool: response tokens to score (response_mask > 0)
    batch: Tensor  # [N] row of each
    position: Tensor  # [N] full-sequence position that predicts it: Lp − 1 + t
    labels: Tensor  # [N] the token ids


def response_rows(micro: dict[str, Tensor]) -> ResponseRows:
    """Where the outputs of each scored response token come from (the alignment contract).

    micro needs ``input_ids`` [B, L], ``responses`` and ``response_mask`` [B, Lr] (the last Lr
    columns of ``input_ids`` are the response).
    """
    input_ids, responses = micro["input_ids"], micro["responses"]
    prompt_len = input_ids.shape[1] - responses.shape[1]
    if prompt_len < 1:
        raise ValueError(
            f"input_ids: expected at least one prompt token before the {responses.shape[1]} "
            f"response tokens, got shape {tuple(input_ids.shape)}"
        )
    valid = micro["response_mask"] > 0
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    return ResponseRows(valid, b_idx, prompt_len - 1 + t_idx, responses[valid])


def scatter_rows(values: Tensor, valid: Tensor) -> Tensor:
    """[N] outputs in ``response_rows`` order -> [B, Lr] float32, 0 elsewhere (differentiable)."""
    out = torch.zeros(valid.shape, dtype=torch.float32, device=values.device)
    out[valid] = values.float()
    return out


@dataclass(frozen=True)
class Layout:
    """How an engine runs its model; fixed at build time.

    ``packed``: remove padding. ``head``: one of ``HEADS``. ``sp_group``: Ulysses group (packed
    implied). ``tp_group`` / ``vocab_start``: the TP group and first vocabulary id of this rank's
    lm_head shard (``vocab_parallel`` head).
    """

    packed: bool = False
    head: str = "logits"
    sp_group: Any = None
    tp_group: Any = None
    vocab_start: int = 0

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"head: expected one of {HEADS}, got {self.head!r}")
        if self.head == "vocab_parallel" and self.tp_group is None:
            raise ValueError("tp_group: the vocab_parallel head needs the tensor-parallel group")

    @property
    def outputs(self) -> frozenset[str]:
        """The outputs this layout's head can produce."""
        return HEAD_OUTPUTS["value" if self.head == "value" else "policy"]


def forward_outputs(
    model: nn.Module,
    micro: dict[str, Tensor],
    layout: Layout,
    *,
    outputs: frozenset[str],
    temperature: float = 1.0,
) -> dict[str, Tensor]:
    """Per-response-token outputs of one forward, each [B, Lr] float32, 0 where not scored.

    micro needs ``input_ids``, ``attention_mask``, ``position_ids`` [B, L], ``responses`` and
    ``response_mask`` [B, Lr]. ``outputs``: a subset of ``layout.outputs`` (``log_probs``,
    ``entropy``, ``sum_pi_squared`` for a policy; ``values`` for a value model). Log-probs,
    entropy and values carry gradients when grad mode is on; Σπ² never does.
    """
    unknown = sorted(set(outputs) - layout.outputs)
    if unknown:
        raise ValueError(f"outputs: {unknown} are not produced by a {layout.head!r} head")
    if not temperature > 0:
        raise ValueError(f"temperature: expected > 0, got {temperature}")
    rows, features, labels, pick = row_features(model, micro, layout)
    stats = _head_stats(model, features, labels, layout, outputs, temperature)
    return {name: scatter_rows(pick(values), rows.valid) for name, values in stats.items()}


def row_features(model: nn.Module, micro: dict[str, Tensor], layout: Layout):
    """The model forward of ``layout`` and the rows its head consumes.

    Returns ``(rows, features [M, F], labels [M], pick)``: ``features`` are logits (hidden
    states for the fused head, value logits for a value head) of M positions, ``labels`` the
    token each predicts (at a position nobody scores: any id, or ``IGNORE_INDEX``), and
    ``pick`` maps per-position values [M] to the N scored tokens in ``rows`` order (M = N
    except under Ulysses, where it gathers the group's slices, and for the padded logits head
    run on every response column, M = B·Lr, where it drops the unscored ones).
    """
    rows = response_rows(micro)
    if layout.sp_group is not None:
        return rows, *_ulysses_features(model, micro, rows, layout)
    return rows, *_features(model, micro, rows, layout)


def _call(model: nn.Module, kwargs: dict, layout: Layout, keep) -> Tensor:
    """The head's input for the kept positions: logits, hidden states or value logits."""
    if layout.head == "fused":
        return model.get_decoder()(**kwargs, use_cache=False).last_hidden_state
    if layout.head == "value":
        # without use_cache=False the model builds a KV cache, and transformers then skips
        # the packed-sequence detection (every sequence would see its predecessors)
        return model(**kwargs, use_cache=False).logits
    return model(**kwargs, use_cache=False, logits_to_keep=keep).logits


def _pack(micro, rows: ResponseRows):
    """The packed batch and the packed-stream index [N] of each scored token's predictor."""
    input_ids = micro["input_ids"]
    bsz, seq_len = input_ids.shape
    p = pack(input_ids, micro["attention_mask"])
    flat_to_packed = torch.full((bsz * seq_len,), -1, dtype=torch.long, device=input_ids.device)
    flat_to_packed[p.indices] = torch.arange(p.indices.numel(), device=input_ids.device)
    index = flat_to_packed[rows.batch * seq_len + rows.position]
    if (index < 0).any():
        raise ValueError("attention_mask: a scored response token's predecessor is masked")
    return p, index


def _features(model, micro, rows: ResponseRows, layout: Layout):
    """(features [M, F], labels [M], pick [M] -> [N]) of the padded or packed layout: M = N
    but for the padded logits head run on every response column (M = B·Lr)."""
    seq_len = micro["input_ids"].shape[1]
    # logits_to_keep spares the vocabulary projection of the positions nobody scores
    trims = layout.head in ("logits", "vocab_parallel")
    if layout.packed:
        p, index = _pack(micro, rows)
        kwargs = {
            "input_ids": p.values[None],
            "position_ids": packed_position_ids(p.cu_seqlens)[None],
            "attention_mask": None,
        }
        out = _call(model, kwargs, layout, index)[0]
        features = out if trims else out[index]
    else:
        kwargs = {k: micro[k] for k in ("input_ids", "attention_mask", "position_ids")}
        lr = micro["responses"].shape[1]
        first = seq_len - lr - 1  # the Lr positions from here on predict the response columns
        keep = torch.arange(first, seq_len - 1, device=micro["input_ids"].device)
        out = _call(model, kwargs, layout, keep)  # [B, Lr, F]; fused, value: [B, L, F]
        if trims and rows.labels.numel() * FULL_WIDTH_SHARE >= rows.valid.numel():
            # the op runs on every column, the unscored ones labelled IGNORE_INDEX and dropped
            labels = torch.where(rows.valid, micro["responses"], IGNORE_INDEX).reshape(-1)
            flat = rows.valid.reshape(-1)
            return out.reshape(-1, out.shape[-1]), labels, lambda values: values[flat]
        features = out[rows.batch, rows.position - (first if trims else 0)]
    return features, rows.labels, _identity


# The padded logits head runs its statistics op on every response column of the micro-batch
# when at least 1 in this many of them is scored: the statistics of the padding then cost less
# than picking the N scored rows out of the [B, Lr, V] logits (a copy of N·V; in the backward,
# zeros of B·Lr·V and a scatter-add of N·V), and the logits are not held twice. Measured on
# CPU (V = 32k): the full width took 0.83-0.91 x the time of picking at 1-2 columns per scored
# token, 1.18 x at 2.9.
FULL_WIDTH_SHARE = 2.0


def _ulysses_features(model, micro, rows: ResponseRows, layout: Layout):
    """This rank's packed slice: (features [n_local, F], next-token labels, pick) where pick
    gathers the slices of the SP group and keeps the N scored positions."""
    group = layout.sp_group
    p, index = _pack(micro, rows)
    ids = p.values[None]
    local_ids, local_pos, pad = ulysses.slice_for_rank(
        ids, packed_position_ids(p.cu_seqlens)[None], group
    )
    n = local_ids.shape[1]
    rank = dist.get_rank(group)
    # label of packed position i is token i + 1: wrong across sequence ends, never picked
    next_ids = F.pad(ids[0, 1:], (0, 1 + pad))[rank * n : (rank + 1) * n]
    sp = dist.get_world_size(group)
    kwargs = {
        "input_ids": local_ids,
        "position_ids": local_pos,
        "use_cache": False,
        **ulysses.packed_forward_kwargs(p.cu_seqlens, sp),
    }
    if layout.head == "fused":
        features = model.get_decoder()(**kwargs).last_hidden_state[0]
    else:
        features = model(**kwargs).logits[0]

    def pick(values: Tensor) -> Tensor:
        return ulysses.gather_and_unpad(values, group, pad)[index]

    return features, next_ids, pick


def _identity(values: Tensor) -> Tensor:
    return values


def _head_stats(model, features, labels, layout: Layout, outputs, temperature) -> dict:
    """The statistics op of ``layout.head`` on the picked rows -> {name: [M]}.

    The ops run outside autocast on the features as they come (bf16 logits under bf16 compute)
    and accumulate in float32 themselves; under a mixed-precision autocast the fused head casts
    the hidden states and the head weight to the compute dtype, as the lm_head matmul would be.
    """
    if layout.head == "value":
        return {"values": features[..., 0]}
    device_type = features.device.type
    compute = None
    if torch.is_autocast_enabled(device_type):
        compute = torch.get_autocast_dtype(device_type)
    with torch.autocast(device_type, enabled=False):
        return _stats_of(model, features, labels, layout, outputs, temperature, compute)


def _stats_of(model, features, labels, layout, outputs, temperature, compute) -> dict:
    kwargs = {
        "temperature": temperature,
        "entropy": "entropy" in outputs,
        "sum_pi_squared": "sum_pi_squared" in outputs,
    }
    if layout.head == "fused":
        head = model.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if compute is not None:
            features, weight = features.to(compute), weight.to(compute)
            bias = None if bias is None else bias.to(compute)
        stats = fused_linear_token_stats(features, weight, labels, bias=bias, **kwargs)
    elif layout.head == "vocab_parallel":
        stats = vocab_parallel_token_stats(
            features, labels, vocab_start=layout.vocab_start, group=layout.tp_group, **kwargs
        )
    else:
        stats = token_stats(features, labels, **kwargs)
    out = {"log_probs": stats.log_probs}
    if kwargs["entropy"]:
        out["entropy"] = stats.entropy
    if kwargs["sum_pi_squared"]:
        out["sum_pi_squared"] = stats.sum_pi_squared.detach()
    return out
