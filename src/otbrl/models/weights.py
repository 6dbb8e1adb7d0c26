"""A model's weights streamed out in full, one tensor at a time, in any layout: what a rollout
backend loads after an update and what a checkpoint writes.

Functions of the model alone (an engine's ``model``, sharded or not): a consumer that drops
each tensor before the next never holds a second copy of the model. On several processes each
sharded tensor is gathered with ``full_tensor()``: the streams are collective, every rank must
consume them to the end, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from otbrl.models.lora import adapter_tensors, lora_settings, merged_tensors
from otbrl.models.tied import untied_names


def state_tensors(
    model: nn.Module, names: Iterable[str] | None = None
) -> Iterator[tuple[str, Tensor]]:
    """(name, full tensor) of every entry of ``model``'s own state dict, tied aliases left out
    (``otbrl.models.tied``: each parameter once, under its first name), or of ``names``, in
    that order, one at a time: only the tensor being yielded is gathered."""
    state = model.state_dict()
    for name in untied_names(model) if names is None else names:
        value = state[name]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        yield name, full.detach()


def full_tensors(model: nn.Module, *, adapter_only: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) of the plain model ``model`` computes, each tied parameter once,
    under its first name (what a rollout backend loads). A LoRA model's adapters come merged
    into their base weights (``otbrl.models.lora.merged_tensors``: one module held at a time);
    ``adapter_only=True``: its adapter tensors alone, in PEFT's names (a backend that serves the
    adapter). ``ValueError`` for ``adapter_only`` on a model without adapters."""
    lora = lora_settings(model)
    if adapter_only:
        if lora is None:
            raise ValueError("adapter_only: the model has no LoRA adapters")
        names = [k for k in model.state_dict() if ".lora_" in k]
        yield from adapter_tensors(state_tensors(model, names)).items()
    elif lora is not None:
        yield from merged_tensors(state_tensors(model), scaling=lora["alpha"] / lora["rank"])
    else:
        yield from state_tensors(model)
