"""The HF backend of the rollout protocol: a Hugging Face causal LM sampling in this process.

All prompts × ``n`` samples are decoded in one batch with the KV cache on; each prompt is
prefilled once and its cache shared by its ``n`` samples (``shared_prefix_sample``). Rows of the
same prompt are adjacent, as the group-wise estimators expect. The sampled tokens' log-probs are
read from the logits the sampler already has.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from otbrl.rollout.batch import left_pad
from otbrl.rollout.protocol import Backend, Completion, SamplingParams


class HFRollout(Backend):
    """Generate with a Hugging Face causal LM in this process.

    Args:
        model: the causal LM to sample from (its train/eval mode is restored after each call).
        tokenizer: gives the pad id used to left-pad prompts (its pad, else its EOS token).
            A prompt plus its budget longer than the model's ``max_position_embeddings`` is a
            ``ValueError``, as in the vLLM backend.
        owns_copy: ``False`` (default) when ``model`` is the training model itself:
            ``sync_weights`` is then a no-op and does not consume its argument. ``True`` when
            ``model`` is a separate inference copy (e.g. the unsharded copy of a distributed
            run): ``sync_weights`` copies the named tensors into it.
        autocast: the compute dtype of a mixed-precision model (``torch.bfloat16`` under
            ``bf16-mixed``): sampling runs under ``torch.autocast`` as the trainer's forwards do;
            None: in the weights' dtype.
    """

    name = "hf"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        owns_copy: bool = False,
        autocast: torch.dtype | None = None,
    ) -> None:
        if not isinstance(owns_copy, bool):
            raise TypeError(f"owns_copy: expected a bool, got {type(owns_copy).__name__}")
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else None
        pad = pad if pad is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("tokenizer: needs a pad or EOS token to left-pad prompts")
        self.model = model
        self.tokenizer = tokenizer
        self.owns_copy = owns_copy
        self.autocast = autocast
        self.pad_id = int(pad)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        # like vLLM's max_model_len: past its positions a model samples garbage, silently
        positions = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = int(positions) if isinstance(positions, int) else None

    @torch.no_grad()
    def _sample(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, budgets: list[int]
    ) -> list[list[Completion]]:
        """Sample the checked call (``Backend.generate``). With ``params.seed`` the draw is
        reproducible and the caller's global RNG is left as it was; without a seed the global
        torch RNG is used (and advanced)."""
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)
        ids, mask = ids.to(device), mask.to(device)
        n = params.n
        rows = torch.tensor(budgets, device=device).repeat_interleave(n)
        sampling = {
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k),
        }
        stops = list(params.stop_token_ids)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else [], enabled=params.seed is not None
            ):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                compute = torch.autocast(
                    device.type, dtype=self.autocast, enabled=self.autocast is not None
                )
                with compute:
                    tokens, logprobs = shared_prefix_sample(
                        self.model, ids, mask, n, max(budgets), stops, self.pad_id,
                        not params.greedy, sampling,
                        budgets=rows, with_logprobs=True,
                    )  # fmt: skip
        finally:
            self.model.train(was_training)
        return _completions(tokens.cpu(), logprobs.cpu(), rows.cpu(), stops, n)

    @torch.no_grad()
    def sync_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy HF-named tensors into the inference copy, one at a time (no-op when shared).

        Every parameter of the copy must come exactly once, with its shape; an unknown name,
        a wrong shape or a missing parameter is a ``ValueError`` (the copy is then partly
        updated: sync again before generating).
        """
        if not self.owns_copy:
            return
        params = dict(self.model.named_parameters())
        seen = set()
        for name, tensor in named_tensors:
            if name not in params:
                raise ValueError(f"named_tensors: {name!r} is not a parameter of the rollout model")
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"named_tensors: {name!r} has shape {tuple(tensor.shape)}, the rollout "
                    f"model's parameter has {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor.detach())
            seen.add(name)
        missing = sorted(set(params) - seen)
        if missing:
            raise ValueError(
                f"named_tensors: {len(missing)} parameters of the rollout model were not "
                f"given, e.g. {missing[:3]}"
            )

    def sleep(self) -> None:
        """No-op: the HF backend keeps its model in place."""

    def wake_up(self) -> None:
        """No-op: the HF backend keeps its model in place."""

    def close(self) -> None:
        """No-op: the model (the trainer's own, or a copy) goes with this object; nothing else
        is held."""


def _completions(
    tokens: Tensor, logprobs: Tensor, budgets: Tensor, stops: list[int], n: int
) -> list[list[Completion]]:
    """Cut each sampled row at its first stop token (kept) or at its budget."""
    steps = tokens.shape[1]
    if stops:
        is_stop = torch.isin(tokens, torch.tensor(stops, dtype=torch.long))
        # The first stop position, or `steps` when the row has none.
        first = torch.where(
            is_stop.any(1), is_stop.long().argmax(1), torch.full_like(budgets, steps)
        )
    else:
        first = torch.full_like(budgets, steps)
    stopped = first < budgets
    lengths = torch.where(stopped, first + 1, budgets.clamp(max=steps)).tolist()
    token_rows, lp_rows = tokens.tolist(), logprobs.tolist()
    flat = [
        Completion(token_rows[r][:k], lp_rows[r][:k], "stop" if s else "length")
        for r, (k, s) in enumerate(zip(lengths, stopped.tolist()))
    ]
    return [flat[i : i + n] for i in range(0, len(flat), n)]


class _ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values sit in buffers reserved for the whole decode: a
    step writes its token's keys and values in place where ``DynamicLayer.update`` concatenates
    (a copy of the layer's whole cache at every step: 31 % of a 64-token rollout's time in a
    profile, 17 % of its wall time). The attention sees the same [B, H, L, D] values."""

    def reserve(self, capacity: int, dtype: torch.dtype) -> None:
        """Move the cached keys and values [B, H, L, D] into buffers of ``capacity`` positions
        of ``dtype``."""
        b, h, length, _ = self.keys.shape
        self._keys = self.keys.new_empty(b, h, capacity, self.keys.shape[-1], dtype=dtype)
        self._values = self.values.new_empty(b, h, capacity, self.values.shape[-1], dtype=dtype)
        self._keys[:, :, :length] = self.keys
        self._values[:, :, :length] = self.values
        self._length = length
        self.keys, self.values = self._keys[:, :, :length], self._values[:, :, :length]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        end = self._length + key_states.shape[-2]
        if end > self._keys.shape[-2]:  # past the reservation: grow as DynamicLayer does
            return super().update(key_states, value_states, *args, **kwargs)
        self._keys[:, :, self._length : end] = key_states
        self._values[:, :, self._length : end] = value_states
        self._length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values


def reserve_cache(cache, capacity: int) -> None:
    """Give each plain (full-attention) layer of a filled HF ``cache`` buffers of ``capacity``
    positions (``_ReservedLayer``); sliding-window and other layers are left as they are.

    Under autocast the buffers hold the autocast dtype: the attention casts its keys and values
    to it at every step anyway (HF's rotary embedding leaves them float32), so storing them cast
    gives the same values without a cast of the whole cache per step (a third of a bf16-mixed
    rollout's time)."""
    for i, layer in enumerate(getattr(cache, "layers", ())):
        if type(layer) is not DynamicLayer or not layer.is_initialized or not layer.keys.numel():
            continue
        device = layer.keys.device.type
        dtype = layer.keys.dtype
        if torch.is_autocast_enabled(device) and dtype == torch.float32:
            dtype = torch.get_autocast_dtype(device)
        reserved = _ReservedLayer()
        reserved.dtype, reserved.device, reserved.is_initialized = dtype, layer.device, True
        reserved.keys, reserved.values = layer.keys, layer.values
        reserved.reserve(capacity, dtype)
        cache.layers[i] = reserved


def _prefill(model, prompt_ids, prompt_mask, positions, n: int, capacity: int):
    """The prompts' forward [P, Lp] -> (the last position's logits [P*n, V] float32, the KV
    cache fanned out to ``n`` samples a prompt with ``capacity`` positions reserved, the
    keyword the model takes it back as)."""
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
        raise ValueError("model: no KV cache with batch_repeat_interleave to share over samples")
    if n > 1:
        cache.batch_repeat_interleave(n)
    reserve_cache(cache, capacity)
    return out.logits[:, -1].float().repeat_interleave(n, dim=0), cache, cache_kw


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
    width = prompt_ids.shape[1]
    logits, cache, cache_kw = _prefill(
        model, prompt_ids, prompt_mask, positions, n, width + max_new_tokens
    )
    # the mask of every step, written once: step s attends to the first width + s + 1 columns
    attention = torch.ones(
        logits.shape[0], width + max_new_tokens, dtype=prompt_mask.dtype, device=prompt_mask.device
    )
    attention[:, :width] = prompt_mask.repeat_interleave(n, dim=0)
    position = positions[:, -1:].repeat_interleave(n, dim=0)
    eos = torch.tensor(eos_ids, dtype=torch.long, device=prompt_ids.device)
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=prompt_ids.device)
    # The log-probs follow the trainer's definition; greedy picks an argmax, so T plays no part.
    lp_temperature = sampling["temperature"] if do_sample else 1.0
    tokens, logprobs = [], []
    for step in range(max_new_tokens):
        if with_logprobs:
            # Only the sampled token's log-prob is kept (no [B, V] log-softmax output per step).
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
        position = position + 1
        out = model(
            input_ids=token[:, None],
            attention_mask=attention[:, : width + step + 1],
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
    # Inverse CDF: one uniform per row, found in the row's cumulative mass (float64, so no
    # token's share is rounded away). The distribution torch.multinomial draws from, at a
    # fraction of its cost: it draws an exponential per vocabulary entry (8 % of a 64-token
    # rollout at an 8 k vocabulary). A token of probability 0 spans no interval: never drawn.
    probs = logits.softmax(dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all()):
        raise ValueError("logits: a row has NaN or infinite logits (no distribution to sample)")
    draw = torch.rand(total.shape, dtype=torch.float64, device=total.device) * total
    # the product can round up to total (about once in 2^53 draws): keep it below, so the
    # first cumulative mass above it is a token of positive probability
    draw = torch.minimum(draw, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, draw, right=True).squeeze(1)
