"""Tied weights: one rule for every stream of a model's weights.

A model with tied embeddings (Qwen2.5-0.5B…3B, Llama-3.2-1B/3B, Qwen3-0.6B, Gemma) holds one
[V, H] parameter under two names, ``model.embed_tokens.weight`` and ``lm_head.weight``;
``state_dict()`` lists both. Every consumer of otbrl's weight streams breaks on the duplicate
in its own way: safetensors refuses tensors that share memory (the server sync, checkpoints),
a rollout model's ``named_parameters()`` lists the parameter once (the HF-rollout sync), and
two copies of one tensor double what a sync moves.

**The rule**: a weight stream carries each parameter once, under the first name PyTorch gives
it (``named_parameters()``' order: the module registered first). For every HF causal LM that
is the input embedding, which is the name ``save_pretrained`` keeps and the one HF, vLLM and
PEFT re-tie from on load (they skip the ``lm_head`` entry of a tied model). The names dropped
are *aliases*; a loader fills them by loading the kept name. The rule reads the module tree,
not the config, so it holds for any tied pair and for sharded (FSDP2/TP) parameters alike.
"""

from __future__ import annotations

from torch import nn

__all__ = ["tied_aliases", "untied_names"]


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{alias: kept name}`` for every parameter reachable under more than one name.

    ``kept name`` is the parameter's first name in ``named_parameters()`` order; an untied
    model returns ``{}``. Works on plain, PEFT-wrapped and FSDP2/TP-sharded models (a tied
    parameter stays one object there).
    """
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        kept = first.setdefault(id(param), name)
        if kept != name:
            aliases[name] = kept
    return aliases


def untied_names(model: nn.Module) -> list[str]:
    """The ``state_dict()`` keys of ``model`` in order, tied aliases left out: the names of a
    weight stream, a checkpoint and an export."""
    aliases = tied_aliases(model)
    return [name for name in model.state_dict() if name not in aliases]
