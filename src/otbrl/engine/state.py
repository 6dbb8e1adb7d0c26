"""How an engine's model and optimizer map to checkpoint state, and back, in any layout.

``EngineState`` adapts a trainable engine to what ``otbrl.store.checkpoint`` asks for, over these
functions; the store owns the files (formats, integrity, atomic directories) and never touches a
model or an optimizer itself. The
pairs follow ``torch.distributed.checkpoint``'s Stateful pattern: the engine hands out its
state in its own layout (a sharded tensor as a DTensor that reports its global shape), the
checkpoint reads saved tensors into it (``dcp.load``), and the engine takes it back.

- weights: ``weights`` (name -> tensor, tied aliases left out: ``otbrl.models.tied``) and
  ``load_weights``; a LoRA model's adapter travels in PEFT's names instead (``load_adapter``).
- optimizer: ``optimizer_shard`` (this rank's chunks of the AdamW state with their global
  offsets, from ``DTensor.__create_chunk_list__``: the record DCP itself writes, strided
  FSDP2 + TP shards included), ``optimizer_template`` and ``load_optimizer``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from otbrl.models.lora import adapter_config as peft_config
from otbrl.models.lora import model_names
from otbrl.models.tied import tied_aliases
from otbrl.models.weights import full_tensors, state_tensors

# key -> (this rank's chunk, the chunk's offset in the global tensor, one entry a dim)
Chunks = dict[str, tuple[Tensor, list[int]]]

_ADAMW_SLOTS = ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # AdamW's own order


def weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's state dict in its own layout (DCP's view), tied aliases left out."""
    aliases = tied_aliases(model)
    return {k: v for k, v in get_model_state_dict(model).items() if k not in aliases}


def load_weights(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """``weights``' entries, read into, -> the model (aliases are filled through their kept
    name, so they may be missing)."""
    strict = not tied_aliases(model)
    set_model_state_dict(model, dict(state), options=StateDictOptions(strict=strict))


def adapter_config(model: nn.Module) -> dict:
    """PEFT's ``adapter_config.json`` for a LoRA model, its base the model it was loaded from."""
    base = str(getattr(model.config, "name_or_path", "") or "")
    return peft_config(model, base)


def load_adapter(model: nn.Module, tensors: Mapping[str, Tensor], source: str) -> None:
    """Full adapter tensors in PEFT's names -> the model's LoRA parameters, in its layout
    (sharded or not). Raises ``ValueError`` starting with ``source`` when they do not match."""
    params = {k for k in model.state_dict() if ".lora_" in k}
    named = model_names(dict(tensors))
    missing, unexpected = sorted(params - set(named)), sorted(set(named) - params)
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model's adapters (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, named, options=options)


def optimizer_shard(
    model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool
) -> tuple[Chunks, list]:
    """(the chunks of the optimizer state this rank writes, keyed ``state.<param>.<slot>``,
    references to the optimizer's own tensors; the param groups, plain values). Collective.

    A sharded tensor's local shard is written by one rank per replica group (coordinate 0 on
    every mesh dimension it is replicated over); a plain (replicated) tensor by the main rank.
    """
    osd = get_optimizer_state_dict(model, optimizer)
    chunks: Chunks = {}
    for param, slots in osd["state"].items():
        for slot, value in slots.items():
            key = f"state.{param}.{slot}"
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"optimizer state {key}: expected a tensor, got {type(value).__name__}"
                )
            if isinstance(value, DTensor):
                chunk = _local_chunk(value)
                if chunk is not None:
                    chunks[key] = chunk
            elif is_main:
                chunks[key] = (value, [0] * value.dim())
    return chunks, osd["param_groups"]


def _local_chunk(value: DTensor) -> tuple[Tensor, list[int]] | None:
    coordinate = value.device_mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh
        return None
    # is_replicate, not "not is_shard": FSDP2 over TP shards with _StridedShard, which is no
    # Shard, and every dp rank holds its own rows
    if any(p.is_replicate() and c != 0 for p, c in zip(value.placements, coordinate, strict=True)):
        return None
    local = value.to_local()
    if local.numel() == 0 and value.numel() != 0:
        return None  # an uneven shard left this rank empty
    (chunk,) = value.__create_chunk_list__()  # one chunk a rank: DCP's own record of it
    return local, [int(o) for o in chunk.offsets]


def optimizer_template(model: nn.Module, keys: Iterable[str], source: str) -> dict[str, Tensor]:
    """Zero tensors for the saved optimizer ``keys`` (``state.<param>.<slot>``) in the model's
    layout, to be read into. Raises ``ValueError`` starting with ``source`` for a key of a
    parameter the model does not have."""
    params = dict(model.named_parameters())
    template = {}
    for key in keys:
        name, _, slot = key[len("state.") :].rpartition(".")
        if name not in params:
            raise ValueError(f"{source}: optimizer state for unknown parameter {name!r}")
        param = params[name].detach()
        # AdamW's moments are shaped (and sharded) like the parameter; its step is a scalar
        template[key] = (
            torch.zeros((), dtype=torch.float32) if slot == "step" else torch.zeros_like(param)
        )
    return template


def load_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: Mapping[str, Tensor],
    param_groups: list,
) -> None:
    """``optimizer_template``'s tensors, read into, and the saved param groups -> the
    optimizer, resharded to the model's layout."""
    nested: dict[str, dict[str, Tensor]] = {}
    for key in sorted(state, key=_slot_order):
        name, _, slot = key[len("state.") :].rpartition(".")
        nested.setdefault(name, {})[slot] = state[key]
    set_optimizer_state_dict(model, optimizer, {"state": nested, "param_groups": param_groups})


def _slot_order(key: str) -> tuple:
    name, _, slot = key[len("state.") :].rpartition(".")
    rank = _ADAMW_SLOTS.index(slot) if slot in _ADAMW_SLOTS else len(_ADAMW_SLOTS)
    return name, rank, slot


class EngineState:
    """A trainable engine as ``otbrl.store.checkpoint`` saves and restores it: an adapter over
    the engine's public parts (``model``, ``optimizer``, ``world``, ``state_dict``), so the
    engine itself holds no checkpoint code and the store never touches a model.

    ``save_checkpoint(..., engines={"policy": EngineState(policy)})``.
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    @property
    def world(self):
        """Where the engine's process sits (the checkpoint's collectives and file names)."""
        return self.engine.world

    @property
    def lora(self) -> dict | None:
        """The model's LoRA settings, or None: a LoRA model is stored as its adapter."""
        return self.engine.lora

    def model_configs(self) -> list:
        """The HF configs saved beside the weights (each has ``save_pretrained(directory)``):
        the model's, and its generation config when the model generates."""
        model = self.engine.model
        generation = getattr(model, "generation_config", None)
        generates = generation is not None and model.can_generate()
        return [model.config] + ([generation] if generates else [])

    def weights(self) -> dict[str, Tensor]:
        """``weights`` of the model: its state in its own layout, tied aliases left out."""
        return weights(self.engine.model)

    def load_weights(self, state: Mapping[str, Tensor]) -> None:
        """Take back ``weights()``' tensors once read into."""
        load_weights(self.engine.model, state)

    def tied_aliases(self) -> dict[str, str]:
        """``{alias: kept name}`` of the model's tied weights (``otbrl.models.tied``)."""
        return tied_aliases(self.engine.model)

    def state_tensors(self, names: Iterable[str] | None = None):
        """``otbrl.models.weights.state_tensors`` of the model (collective)."""
        return state_tensors(self.engine.model, names)

    def adapter_tensors(self) -> dict[str, Tensor]:
        """A LoRA model's adapter tensors in PEFT's names (collective)."""
        return dict(full_tensors(self.engine.model, adapter_only=True))

    def adapter_config(self) -> dict:
        """PEFT's ``adapter_config.json`` of a LoRA model."""
        return adapter_config(self.engine.model)

    def load_adapter(self, tensors: Mapping[str, Tensor], *, source: str = "the adapter") -> None:
        """Full adapter tensors in PEFT's names -> the LoRA parameters, in the model's layout."""
        load_adapter(self.engine.model, tensors, source)

    def optimizer_shard(self) -> tuple[Chunks, list]:
        """``optimizer_shard`` of the engine's AdamW (collective)."""
        engine = self.engine
        return optimizer_shard(engine.model, engine.optimizer, engine.world.is_main)

    def optimizer_template(self, keys: Iterable[str], *, source: str = "keys") -> dict:
        """Zero tensors in the model's layout for saved optimizer ``keys``, to read into."""
        return optimizer_template(self.engine.model, keys, source)

    def load_optimizer(self, state: Mapping[str, Tensor], param_groups: list) -> None:
        """Take back ``optimizer_template``'s tensors once read into, with the param groups."""
        load_optimizer(self.engine.model, self.engine.optimizer, state, param_groups)

    def state_dict(self) -> dict:
        """The engine's own small state (scheduler, shuffling generator)."""
        return self.engine.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.engine.load_state_dict(state)
