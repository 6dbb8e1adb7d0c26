"""The batch the trainer's HF road gives (``HFRollout.generate`` + ``completions_to_batch``),
called the way the rollout tests call it: tensors in, a batch dict out."""

from __future__ import annotations

from otbrl.models import eos_token_ids
from otbrl.rollout import HFRollout, SamplingParams, completions_to_batch, unpad_prompts


def generate(
    model, tok, prompt_ids, prompt_mask, *, n=1, max_new_tokens, temperature=1.0, top_p=1.0,
    top_k=0, do_sample=True, seed=None,
):  # fmt: skip
    """``n`` samples per prompt of [P, Lp] left-padded ``prompt_ids``, stopping at the model's
    EOS ids: ``prompts``, ``responses``, ``response_mask`` [B, Lr], full-sequence keys, ``uid``."""
    params = SamplingParams(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_new_tokens,
        stop_token_ids=tuple(eos_token_ids(model, tok)), greedy=not do_sample, seed=seed,
    )  # fmt: skip
    completions = HFRollout(model, tok).generate(unpad_prompts(prompt_ids, prompt_mask), params)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return completions_to_batch(prompt_ids, prompt_mask, completions, pad_id=pad)
