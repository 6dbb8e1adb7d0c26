"""The HF backend of the rollout protocol: the shared-prefix sampler of ``otbrl.rollout.hf``.

``HFRollout.generate`` + ``completions_to_batch`` give the batch ``generate()`` gives for the
same seed, bit for bit (tested), and add the sampled tokens' log-probs, read from the logits
the sampler already has.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from otbrl.rollout.base import Completion, SamplingParams, check_generate_args, left_pad
from otbrl.rollout.hf import shared_prefix_sample


class HFRollout:
    """Generate with a Hugging Face causal LM in this process.

    Args:
        model: the causal LM to sample from (its train/eval mode is restored after each call).
        tokenizer: gives the pad id used to left-pad prompts (its pad, else its EOS token).
        owns_copy: ``False`` (default) when ``model`` is the training model itself:
            ``sync_weights`` is then a no-op and does not consume its argument. ``True`` when
            ``model`` is a separate inference copy (e.g. the unsharded copy of a distributed
            run): ``sync_weights`` copies the named tensors into it.
    """

    name = "hf"

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        owns_copy: bool = False,
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
        self.pad_id = int(pad)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_tokens: Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``result[i][j]`` = sample j of prompt i; see ``RolloutEngine.generate``.

        With ``params.seed`` the draw is reproducible and the caller's global RNG is left as it
        was; without a seed the global torch RNG is used (and advanced).
        """
        budgets = check_generate_args(prompts, params, max_tokens, vocab_size=self.vocab_size)
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
                tokens, logprobs = shared_prefix_sample(
                    self.model, ids, mask, n, max(budgets), stops, self.pad_id,
                    not params.greedy, sampling, budgets=rows if max_tokens is not None else None,
                    with_logprobs=True,
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
