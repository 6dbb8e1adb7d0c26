"""Parallelism as functions applied to a plain Hugging Face model (torchtitan style).

    mesh = build_mesh(dp=2, tp=2, device_type="cpu")
    apply_tp(model, mesh["tp"])                      # DTensor TP, logits left vocab-sharded
    apply_fsdp(model, fsdp_mesh(mesh), get_precision("bf16-mixed").fsdp_policy())  # per block
    parallelize(model, mesh, strategy="tp")            # the two above (and Ulysses) in order

The order is fixed: tensor parallel first (it rewrites parameters into DTensors on the "tp"
dimension), then FSDP2 (it shards those along the data dimensions). Ulysses sequence
parallel changes only the attention function and the data layout (`otbrl.engine.ulysses`).

Gradient convention: FSDP2 here *sums* gradients over its mesh (divide factor 1). Each rank
therefore backpropagates its own contribution to the global loss (its tokens' terms,
normalised by global counts), which makes the update independent of the world size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from otbrl.engine import ulysses

MESH_DIMS = ("dp", "sp", "tp")


def build_mesh(
    world_size: int, *, dp: int = -1, sp: int = 1, tp: int = 1, device_type: str = "cpu"
) -> DeviceMesh:
    """A 3-D device mesh named ("dp", "sp", "tp"); size-1 dimensions are kept for uniform code.

    `dp=-1` takes whatever `world_size / (sp * tp)` leaves. Ranks are laid out tp-fastest, so
    a TP group sits on consecutive ranks (one node). Ulysses and TP both split attention
    heads, so they are not combined (sp > 1 and tp > 1 is a ValueError).
    """
    for name, value in (("world_size", world_size), ("sp", sp), ("tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if sp > 1 and tp > 1:
        raise ValueError(
            f"sp, tp: Ulysses (sp={sp}) and tensor parallel (tp={tp}) both split heads; use one"
        )
    if dp == -1:
        if world_size % (sp * tp):
            raise ValueError(
                f"world_size: expected a multiple of sp*tp={sp * tp}, got {world_size}"
            )
        dp = world_size // (sp * tp)
    if not isinstance(dp, int) or dp < 1 or dp * sp * tp != world_size:
        raise ValueError(
            f"dp: expected dp*sp*tp == world_size={world_size}, got dp={dp}, sp={sp}, tp={tp}"
        )
    return init_device_mesh(device_type, (dp, sp, tp), mesh_dim_names=MESH_DIMS)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh FSDP2 shards over: every rank that holds different data (dp × sp).

    Ranks of one SP group hold different slices of the same sequences, so their gradients
    are partial sums and are reduced together with the data-parallel ones.
    """
    if mesh["sp"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "sp"]._flatten("dp_sp")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of an HF Llama/Qwen2-style causal LM (`model.model.layers`)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            "model: expected an HF causal LM with model.model.layers (Llama, Qwen2), "
            f"got {type(model).__name__}"
        )
    return layers


def _is_tied(model: nn.Module) -> bool:
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return head is not None and emb is not None and head.weight is emb.weight


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Tensor-parallelise `model` in place over the 1-D `tp_mesh` and return it.

    Per block: q/k/v and gate/up column-wise (each rank keeps heads/tp heads and
    intermediate/tp channels), o/down row-wise (output all-reduced). The embedding is split
    over the vocabulary (row-wise, output replicated). The lm_head is column-wise with its
    output *left sharded*: `model(...).logits` is a plain local tensor [..., V/tp] holding
    vocabulary ids `vocab_shard_range(model, tp_mesh)`, ready for `vocab_parallel_token_stats`
    (the vocabulary need not divide by the TP size: shards are then uneven).
    Tied embeddings stay tied (both shard the same [V, H] weight on dim 0). A value model
    (``*ForTokenClassification``: a ``score`` head of a few outputs instead of an lm_head)
    keeps its head replicated: its input, the final hidden state, is replicated already.
    """
    tp = tp_mesh.size()
    config = model.config
    head = getattr(model, "lm_head", None)
    if head is None and not isinstance(getattr(model, "score", None), nn.Linear):
        raise TypeError(
            f"model: expected an lm_head or a score head, got {type(model).__name__} with neither"
        )
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", config.num_attention_heads),
        "intermediate_size": config.intermediate_size,
    }
    for name, size in sizes.items():
        if size % tp:
            raise ValueError(
                f"model.config.{name}: expected a multiple of the TP size {tp}, got {size}"
            )
    tied = _is_tied(model)
    for layer in decoder_layers(model):
        plan = {
            # The block input enters attention and the MLP once as a replicated DTensor, so
            # the backward sums the q/k/v (gate/up) input gradients locally and all-reduces
            # once per sub-block: 2 all-reduces per block instead of 5.
            "self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Replicate()},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            "mlp": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        parallelize_module(layer, tp_mesh, plan)
    plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    }
    if head is not None:
        plan["lm_head"] = ColwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=True
        )
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def vocab_shard_range(model: nn.Module, tp_mesh: DeviceMesh) -> tuple[int, int]:
    """[start, end) of the vocabulary ids whose logits this rank holds after `apply_tp`.

    DTensor shards like `torch.chunk`: ceil(V / tp) rows per rank, the last ranks get fewer
    when V does not divide (V = 63, tp = 2 -> [0, 32) and [32, 63)).
    """
    vocab = model.lm_head.weight.shape[0]  # a DTensor reports the global shape
    per_rank = -(-vocab // tp_mesh.size())
    start = min(vocab, tp_mesh.get_local_rank() * per_rank)
    return start, min(vocab, start + per_rank)


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    *,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """FSDP2-shard `model` in place: `fully_shard` each decoder block, then the root.

    Per-block units let the all-gather of block i+1 overlap compute of block i and bound
    unsharded memory to one block; the root unit takes embeddings, final norm and lm_head.
    Gradients are summed over `dp_mesh` (see the module docstring for the loss convention).
    """
    if dp_mesh.ndim != 1:
        raise ValueError(f"dp_mesh: expected a 1-D mesh, got {dp_mesh.ndim} dimensions")
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last block is resharded by the root's backward anyway; keeping it avoids a re-gather.
        keep = reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=keep)
    fully_shard(
        model, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward
    )
    for module in (*layers, model):
        module.set_gradient_divide_factor(1.0)
        # Factor 1 is a plain sum; without this FSDP2 asks for PREMUL_SUM, which gloo lacks.
        module.set_force_sum_reduction_for_comms(True)
    return model


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients in place to a global L2 norm of `max_norm`; return the norm before clipping.

    Works for any mix of plain tensors and DTensors (FSDP2 shards, TP shards, replicated
    norms): the squared norms are summed per sharding layout and reduced once per layout, so
    every rank sees the same global norm. Returns a 0-d float32 tensor.
    """
    if not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"max_norm: expected a positive number, got {max_norm!r}")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key = (g.device_mesh, tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    total_sq = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for key, group in groups.items():
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        if key is not None:
            norm = norm.full_tensor()
        total_sq = total_sq + norm.float().to(total_sq.device) ** 2
    total = total_sq.sqrt()
    coef = max_norm / (total.item() + 1e-6)
    if math.isfinite(coef) and coef < 1.0:
        # A Python float scales each DTensor shard in place. torch's clip_grads_with_norm_
        # (a foreach multiply by a plain tensor) left FSDP2 gradients unscaled here (torch 2.13).
        for g in grads:
            g.mul_(coef)
    return total


SHARDED = ("fsdp", "tp")


def uses_fsdp(mesh: DeviceMesh, strategy: str) -> bool:
    """Whether ``parallelize(model, mesh, strategy=strategy)`` wraps the model in FSDP2."""
    return strategy == "fsdp" or mesh["dp"].size() > 1


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    strategy: str,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> nn.Module:
    """Apply the parallel layout of `strategy` to `model` in place (TP, then Ulysses, then FSDP2).

    strategy "tp" needs mesh["tp"] > 1 and wraps FSDP2 around it only when dp > 1; strategy
    "fsdp" always shards parameters over dp × sp. ``mp_policy``: FSDP2's mixed precision
    (``Precision.fsdp_policy()``; None: compute in the parameters' dtype).
    """
    if strategy not in SHARDED:
        raise ValueError(f"strategy: expected one of {SHARDED}, got {strategy!r}")
    if mesh["tp"].size() > 1:
        apply_tp(model, mesh["tp"])
    if mesh["sp"].size() > 1:
        ulysses.apply_ulysses(model, mesh["sp"].get_group())
    if uses_fsdp(mesh, strategy):
        apply_fsdp(model, fsdp_mesh(mesh), mp_policy)
    return model
