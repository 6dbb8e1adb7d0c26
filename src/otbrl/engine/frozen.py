"""The frozen engine: one model on this process's share of the job, computing per-token
statistics of a batch, micro-batch by micro-batch — the reference policy, the distillation
teacher, evaluation and the policy's statistics pass. ``TrainableEngine``
(``otbrl.engine.trainable``) builds the update on top of it.

The engine never decides which statistics exist: ``compute(batch, outputs)`` runs the forwards
the trainer asks for. On more than one process the model is sharded in place when the engine
is built (tensor parallel, then Ulysses, then FSDP2: ``otbrl.engine.parallel.parallelize``);
every method is then collective and every rank calls it with its own share of the batch.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import Tensor, nn

from otbrl.engine import parallel
from otbrl.engine.layout import Layout, forward_outputs, padded_extents, trim_padding
from otbrl.engine.micro import padded_bins, token_bins
from otbrl.engine.precision import get_precision
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.engine.world import World
from otbrl.models.lora import adapters_disabled, lora_settings


class Placement(NamedTuple):
    """Where a placed model runs: its forward ``layout`` and whether an unsharded mixed-precision
    forward runs under autocast (FSDP2 casts the shards itself)."""

    layout: Layout
    autocast: bool


def place_model(model: nn.Module, spec: EngineSpec, world: World) -> Placement:
    """Move ``model`` to this rank's device and lay it out as ``spec`` says, in place: gradient
    checkpointing, then the parallel layout of ``world``'s mesh (TP, Ulysses, FSDP2) with the
    precision's FSDP2 policy. Returns the ``Placement`` its forwards use."""
    model.to(world.device)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    head = "value" if spec.value else ("fused" if spec.fused else "logits")
    packed, autocast = spec.packed, True
    sp_group = tp_group = None
    vocab_start = 0
    mesh = world.mesh
    if mesh is not None:
        if spec.fused:
            # FSDP2 unshards the root parameters in the root's forward, which the fused path
            # bypasses (it calls the decoder, then the head weight directly).
            raise ValueError("fused: the fused lm_head is not supported on several processes")
        precision = get_precision(spec.precision)
        parallel.parallelize(model, mesh, strategy=spec.strategy, mp_policy=precision.fsdp_policy())
        autocast = not parallel.uses_fsdp(mesh, spec.strategy)
        if mesh["sp"].size() > 1:
            sp_group, packed = mesh["sp"].get_group(), True
        if mesh["tp"].size() > 1 and not spec.value:
            head, tp_group = "vocab_parallel", mesh["tp"].get_group()
            vocab_start = parallel.vocab_shard_range(model, mesh["tp"])[0]
    layout = Layout(
        packed=packed, head=head, sp_group=sp_group, tp_group=tp_group, vocab_start=vocab_start
    )
    return Placement(layout, autocast)


class FrozenEngine:
    """A model that computes per-response-token statistics, on 1..N processes.

    Args:
        model: a plain HF model — a causal LM (policy, reference, teacher) or a
            ``*ForTokenClassification`` with one label (``spec.value``). Placed (moved, sharded)
            and frozen in place.
        spec: how it runs (``otbrl.engine.spec.EngineSpec``: strategy, precision, layout,
            temperature, micro-batches).
        world: where this process sits (``World()``: one process).
        name: what it is (``reference``, ``teacher``...), for messages and metrics.
        view_of: another engine whose placed model this one runs as it is (``world`` is that
            engine's; nothing is placed or frozen again): ``without_adapters``.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: EngineSpec | None = None,
        *,
        world: World | None = None,
        name: str = "reference",
        view_of: FrozenEngine | None = None,
    ):
        spec = EngineSpec() if spec is None else spec
        if not isinstance(spec, EngineSpec):
            raise TypeError(f"spec: expected an otbrl.engine.spec.EngineSpec, got {spec!r}")
        self.name, self.spec = name, spec
        self.precision = get_precision(spec.precision)
        self.model = model
        self._context: Callable = contextlib.nullcontext
        if view_of is not None:  # its model, placed (and perhaps trained) by that engine
            self.world, self.placement = view_of.world, view_of.placement
            return
        self.world = world or World()
        self.placement = place_model(model, spec, self.world)
        self._freeze()

    def _freeze(self) -> None:
        """A frozen engine's parameters take no gradient (``TrainableEngine`` keeps them)."""
        self.model.requires_grad_(False)

    @property
    def layout(self) -> Layout:
        """How this engine's forwards run (``otbrl.engine.layout.Layout``)."""
        return self.placement.layout

    # -- forwards ----------------------------------------------------------------------------
    def forward(self, micro: dict[str, Tensor], outputs: frozenset[str]) -> dict[str, Tensor]:
        """One forward of a micro-batch -> {output: [B, Lr] float32} on the batch's device.

        The batch may live on the CPU (the trainer's batches do): inputs go to this rank's
        device and the outputs come back (differentiably). In the padded layout the
        micro-batch runs cut to its own widths (``trim_padding``): the outputs are padded back.
        """
        home = micro["input_ids"].device
        device = self.world.device
        width = micro["responses"].shape[1]
        if not self.layout.packed:
            micro = trim_padding(micro)
        cut = width - micro["responses"].shape[1]
        micro = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in micro.items()}
        autocast = self.placement.autocast
        with self._context(), self.precision.autocast(device, enabled=autocast):
            out = forward_outputs(
                self.model, micro, self.layout, outputs=outputs, temperature=self.spec.temperature
            )
        out = {k: v.to(home) for k, v in out.items()}
        if cut:  # the response columns trim_padding dropped
            out = {k: torch.nn.functional.pad(v, (0, cut)) for k, v in out.items()}
        return out

    @torch.no_grad()
    def compute(self, batch: dict[str, Tensor], outputs: frozenset[str]) -> dict[str, Tensor]:
        """``outputs`` (e.g. ``{"log_probs", "sum_pi_squared"}`` or ``{"values"}``) of the whole
        batch, micro-batch by micro-batch, each [B, Lr] float32 (0 where not scored)."""
        self.model.eval()
        bins = self.micro_batches(batch)
        parts = [self.forward({k: v[idx] for k, v in batch.items()}, outputs) for idx in bins]
        back = torch.cat(bins).argsort()  # the rows in the batch's order again
        return {key: torch.cat([p[key] for p in parts])[back] for key in parts[0]}

    def micro_batches(self, batch: dict[str, Tensor]) -> list[Tensor]:
        """The rows of each micro-batch of ``batch`` (int64 index tensors, together a
        permutation of its B rows): consecutive runs of ``micro_batch_size`` rows, or, with a
        token budget, rows packed by length (``otbrl.engine.micro``) into as many micro-batches
        as the rank that needs the most (a forward is collective: every rank runs as many).
        Tokens: a row's real tokens in the packed layout; in the padded one a micro-batch's
        rows × its own width (its longest prompt + response: ``micro.padded_bins``)."""
        rows = batch["input_ids"].shape[0]
        budget = self.spec.micro.max_tokens_per_micro_batch
        if budget is None:
            cap = self.spec.micro.micro_batch_size
            return [torch.arange(i, min(i + cap, rows)) for i in range(0, rows, cap)]
        binning, sizes = self._budget_binning(batch, [[i] for i in range(rows)])
        try:
            need = len(binning(*sizes, budget, None))
        except ValueError as err:
            raise ValueError(
                f"max_tokens_per_micro_batch: {str(err).removeprefix('lengths: ')}"
            ) from None
        count = int(self.world.max([need])[0])
        return [torch.tensor(b, dtype=torch.long) for b in binning(*sizes, budget, count)]

    def group_micro_batches(self, batch: dict[str, Tensor], groups: Tensor) -> list[Tensor] | None:
        """Micro-batches of whole groups (the rows sharing a value of ``groups`` [B]) under this
        engine's cap — ``micro_batch_size`` rows, or the token budget counted as
        ``micro_batches`` counts it — as many on every rank; int64 index tensors, together a
        permutation of the B rows. Collective. None on every rank when a rank's groups cannot
        be so split (a group over the cap, or fewer groups than the micro-batches the ranks
        agree on): the caller then takes the rows as ``micro_batches`` cuts them."""
        members: dict[int, list[int]] = {}
        for row, group in enumerate(groups.tolist()):
            members.setdefault(group, []).append(row)
        parts = list(members.values())
        budget = self.spec.micro.max_tokens_per_micro_batch
        if budget is None:  # the row cap, a group's rows its size
            sizes, budget = [[len(p) for p in parts]], self.spec.micro.micro_batch_size
            binning = token_bins
        else:
            binning, sizes = self._budget_binning(batch, parts)
        try:
            need = len(binning(*sizes, budget, None))
        except ValueError:  # a group over the cap
            need = len(parts) + 1
        count = int(self.world.max([need])[0])
        if self.world.max([float(count > len(parts))])[0] > 0:
            return None
        bins = binning(*sizes, budget, count)
        rows = [sorted(r for i in b for r in parts[i]) for b in bins]
        return [torch.tensor(r, dtype=torch.long) for r in rows]

    def _budget_binning(self, batch: dict[str, Tensor], parts: list[list[int]]):
        """``(binning, sizes)``: ``binning(*sizes, budget, count)`` cuts the items of ``parts``
        (each a list of the batch's rows that run together) into micro-batches under the token
        budget, an item costing what its rows cost — their real tokens in the packed layout
        (``micro.token_bins``), its rows × the widest prompt + response in the padded one
        (``micro.padded_bins``)."""
        if self.layout.packed:
            tokens = batch["attention_mask"].sum(dim=1).tolist()
            return token_bins, [[sum(tokens[i] for i in p) for p in parts]]
        prompt, response = (e.tolist() for e in padded_extents(batch))
        widest = [[max(prompt[i] for i in p) for p in parts],
                  [max(response[i] for i in p) for p in parts]]  # fmt: skip
        return functools.partial(padded_bins, rows=[len(p) for p in parts]), widest

    # -- views --------------------------------------------------------------------------------
    def without_adapters(
        self, *, name: str = "reference", micro: MicroBatchConfig | None = None
    ) -> FrozenEngine:
        """A frozen view of this LoRA engine's own (placed, sharded) model with its adapters
        disabled — the reference policy without a second copy of the weights. It shares the
        model, its placement, its world and how it runs (precision, temperature); only its
        ``micro``-batches may be its own (default: this engine's). Nothing is copied, and the
        model's parameters keep training in this engine.

        Raises ``ValueError`` when the model has no LoRA adapters.
        """
        if self.lora is None:
            raise ValueError("without_adapters: the model has no LoRA adapters")
        spec = self.spec if micro is None else replace(self.spec, micro=micro)
        view = FrozenEngine(self.model, spec, name=name, view_of=self)
        view._context = lambda: adapters_disabled(self.model)
        return view

    @property
    def lora(self) -> dict | None:
        """``{"rank", "alpha", "dropout", "targets"}`` of a LoRA model, else None."""
        return lora_settings(self.model)
