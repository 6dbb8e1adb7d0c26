"""The engine: one model, its optimizer and LR schedule, its parallel layout — on 1..N processes.

The policy, the critic and the frozen reference policy are three instances of ``Engine``. The
engine never decides which statistics exist nor which loss is trained: ``compute(batch,
outputs)`` runs the forwards the trainer asks for, and ``update(batch, loss_fn)`` takes PPO
epochs × mini-batches × micro-batches of the loss it is handed (``otbrl.algos.loss_terms``).

On more than one process the model is sharded in place when the engine is built (tensor
parallel, then Ulysses, then FSDP2: ``otbrl.engine.parallel.parallelize``); every method is then
collective and every rank calls it with its own share of the batch (whole ``uid`` groups). Each
rank backpropagates its share of the *global* mini-batch loss (normalisers summed over the
data-parallel group) and FSDP2 sums the gradients, so the update equals the one-process update.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from otbrl.algos.loss_math import Normalizers, loss_normalizers
from otbrl.algos.loss_terms import Loss
from otbrl.engine import parallel
from otbrl.engine import state as checkpoint_state
from otbrl.engine.layout import Layout, forward_outputs, padded_extents, trim_padding
from otbrl.engine.micro import balance_ranks, padded_bins, token_bins
from otbrl.engine.optim import OptimConfig, warmup_schedule
from otbrl.engine.precision import get_precision
from otbrl.engine.world import World
from otbrl.models.lora import adapter_tensors, adapters_disabled, lora_settings, merged_tensors
from otbrl.models.tied import tied_aliases, untied_names
from otbrl.settings import check_settings


class NumericsError(RuntimeError):
    """Training cannot go on: the weights became non-finite, or every step is being skipped."""


class Engine:
    """A model with its optimizer on this process's share of the job.

    Args:
        model: a plain HF model — a causal LM (policy, reference) or a
            ``*ForTokenClassification`` with one label (critic). Sharded in place when
            ``world`` has a mesh.
        optim: the training settings (``otbrl.engine.optim.OptimConfig``), or None for a
            frozen model (``compute`` only; its cap on sequences per forward then comes from
            ``micro_batch_size``).
        world: where this process sits (``World()``: one process).
        name: metric prefix of ``update`` (``policy``, ``critic``).
        strategy: ``"fsdp"`` or ``"tp"`` on a multi-process world (``actor.strategy`` resolved;
            ignored without a mesh).
        packed: remove padding ([1, nnz] forward); implied by Ulysses.
        fused: fused lm_head statistics (the [N, V] logits never exist); one process only.
        value: the model has a value head (outputs ``values``) instead of an lm_head.
        temperature: the rollout temperature; statistics use ``logits / temperature``.
        mini_batch_size: *global* sequences per optimizer step (None: the whole batch).
        micro_batch_size: cap on sequences per forward of a frozen engine.
        seed: seeds the mini-batch shuffling generator (kept in ``state_dict``).
        precision: ``"32-true"`` | ``"bf16-mixed"`` | ``"bf16-true"``
            (``otbrl.engine.precision``); the model comes loaded in its storage dtype
            (``bf16-mixed`` checks that the trained parameters are float32 master weights).
            ``bf16-mixed`` computes under autocast on one process (or TP alone) and through FSDP2's
            ``MixedPrecisionPolicy`` when sharded.
        gradient_checkpointing: recompute each decoder block's activations in the backward
            (non-reentrant; HF's per-layer checkpointing) instead of keeping them.
    """

    def __init__(
        self,
        model: nn.Module,
        optim: OptimConfig | None = None,
        *,
        world: World | None = None,
        name: str = "policy",
        strategy: str = "fsdp",
        packed: bool = False,
        fused: bool = False,
        value: bool = False,
        temperature: float = 1.0,
        mini_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        max_tokens_per_micro_batch: int | None = None,
        seed: int = 0,
        precision: str = "32-true",
        gradient_checkpointing: bool = False,
    ):
        if optim is not None and not isinstance(optim, OptimConfig):
            raise TypeError(
                "optim: expected an otbrl.engine.optim.OptimConfig (from a config group: "
                f"OptimConfig.from_group(cfg.actor)) or None, got {type(optim).__name__}"
            )
        if optim is not None:
            # its own six settings, whichever group (the actor's, the critic's) held them
            optim = OptimConfig.from_group(optim)
            check_settings(optim)
        self.world = world or World()
        self.name = name
        self.optim = optim
        self.temperature = temperature
        micro = optim.micro_batch_size if optim is not None else micro_batch_size
        if not isinstance(micro, int) or micro < 1:
            raise ValueError(f"micro_batch_size: expected an int >= 1, got {micro!r}")
        self.micro_batch_size = micro
        budget = (
            optim.max_tokens_per_micro_batch if optim is not None else max_tokens_per_micro_batch
        )
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
        ):
            raise ValueError(
                f"max_tokens_per_micro_batch: expected None or an int >= 1, got {budget!r}"
            )
        self.max_tokens = budget
        mesh = self.world.mesh
        dp = self.world.dp_size
        if mini_batch_size is not None and (mini_batch_size < 1 or mini_batch_size % dp):
            raise ValueError(
                f"mini_batch_size: expected a positive multiple of the data-parallel size {dp}, "
                f"got {mini_batch_size}"
            )
        self.mini_batch_size = None if mini_batch_size is None else mini_batch_size // dp
        self.precision = get_precision(precision)
        if optim is not None and self.precision.mixed:  # the master weights' promise
            wrong = sorted(
                {str(p.dtype) for p in model.parameters() if p.requires_grad}
                - {str(self.precision.storage)}
            )
            if wrong:
                raise ValueError(
                    f"model: {precision} trains {self.precision.storage} parameters, got "
                    f"{', '.join(wrong)} (load the model in the precision's storage dtype)"
                )
        model.to(self.world.device)
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        # an unsharded mixed model computes under autocast; FSDP2 casts the shards itself
        self._autocast = True
        self._context = contextlib.nullcontext  # the reference view: adapters disabled
        head = "value" if value else ("fused" if fused else "logits")
        sp_group = tp_group = None
        vocab_start = 0
        if mesh is not None:
            if fused:
                # FSDP2 unshards the root parameters in the root's forward, which the fused
                # path bypasses (it calls the decoder, then the head weight directly).
                raise ValueError("fused: the fused lm_head is not supported on several processes")
            parallel.parallelize(
                model, mesh, strategy=strategy, mp_policy=self.precision.fsdp_policy()
            )
            self._autocast = not parallel.uses_fsdp(mesh, strategy)
            if mesh["sp"].size() > 1:
                sp_group, packed = mesh["sp"].get_group(), True
            if mesh["tp"].size() > 1 and not value:
                head, tp_group = "vocab_parallel", mesh["tp"].get_group()
                vocab_start = parallel.vocab_shard_range(model, mesh["tp"])[0]
        self.model = model
        self.layout = Layout(
            packed=packed, head=head, sp_group=sp_group, tp_group=tp_group, vocab_start=vocab_start
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.skipped_in_a_row = 0  # optimizer steps skipped since the last one taken
        self.optimizer = self.scheduler = None
        if optim is None:
            model.requires_grad_(False)
        else:
            self.optimizer = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                betas=(0.9, 0.999),
            )
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self.optimizer, warmup_schedule(optim.warmup_steps)
            )

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
        with self._context(), self.precision.autocast(device, enabled=self._autocast):
            out = forward_outputs(
                self.model, micro, self.layout, outputs=outputs, temperature=self.temperature
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
        if self.max_tokens is None:
            cap = self.micro_batch_size
            return [torch.arange(i, min(i + cap, rows)) for i in range(0, rows, cap)]
        if self.layout.packed:
            binning, sizes = token_bins, [batch["attention_mask"].sum(dim=1).tolist()]
        else:
            binning, sizes = padded_bins, [e.tolist() for e in padded_extents(batch)]
        try:
            need = len(binning(*sizes, self.max_tokens, None))
        except ValueError as err:
            raise ValueError(
                f"max_tokens_per_micro_batch: {str(err).removeprefix('lengths: ')}"
            ) from None
        count = int(self.world.max([need])[0])
        return [torch.tensor(b, dtype=torch.long) for b in binning(*sizes, self.max_tokens, count)]

    # -- training ----------------------------------------------------------------------------
    def update(self, batch: dict[str, Tensor], loss_fn: Loss) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches, exact gradient accumulation over micro-batches.

        ``batch``: this rank's rows with the model inputs and ``loss_fn.batch_keys``. One
        optimizer + scheduler step per mini-batch; a non-finite gradient norm skips the step
        (counted), and so does a mini-batch whose ``response_mask`` is 0 on every rank (not
        counted: nothing to train).
        Returns the loss's metrics (summed over micro-batches and ranks, i.e. mini-batch
        values) averaged over optimizer steps, plus ``<name>/grad_norm``, ``<name>/lr`` and
        ``<name>/skipped_steps``; ``skipped_in_a_row`` counts the skips since the last step
        taken. A step that leaves a parameter non-finite raises ``NumericsError``.
        """
        if self.frozen:
            raise ValueError("update: this engine is frozen (built without optimizer settings)")
        missing = sorted(set(loss_fn.batch_keys) - set(batch))
        if missing:
            raise ValueError(f"batch: the loss needs {missing}, which the batch lacks")
        size = batch["input_ids"].shape[0]
        mini = self.mini_batch_size or size
        if size % mini:
            raise ValueError(
                f"batch: {size} sequences on this rank is not a multiple of the mini-batch "
                f"share {mini}"
            )
        self.model.train()
        sums: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(self.optim.ppo_epochs):
            order = torch.randperm(size, generator=self.generator)
            for start in range(0, size, mini):
                idx = order[start : start + mini]
                rows = {k: v[idx] for k, v in batch.items()}
                if self.max_tokens is not None and self.layout.packed and self.world.dp_size > 1:
                    rows = self.balanced(rows)
                metrics, finite = self._optimizer_step(rows, loss_fn)
                for key, value in metrics.items():
                    sums[key] = sums.get(key, 0.0) + value
                steps += 1
                skipped += not finite
                self.skipped_in_a_row = 0 if finite else self.skipped_in_a_row + 1
        out = {key: value / steps for key, value in sums.items()}
        out[f"{self.name}/lr"] = self.scheduler.get_last_lr()[0]
        out[f"{self.name}/skipped_steps"] = float(skipped)
        return out

    def accumulate_gradients(
        self, mini: dict[str, Tensor], loss_fn: Loss, norms: Normalizers | None = None
    ) -> dict[str, float]:
        """Zero the gradients, then backpropagate the mini-batch loss micro-batch by micro-batch.

        Every micro-batch loss is normalised by the whole (global) mini-batch's counts
        (``norms``; default: ``normalizers(mini["response_mask"])``, collective), so the
        accumulated gradient equals that of the mini-batch loss taken at once, for every
        ``loss_agg_mode`` and any micro-batch cap. Returns the loss's metrics, summed over
        micro-batches and data-parallel ranks (mini-batch values).
        """
        norms = self.normalizers(mini["response_mask"]) if norms is None else norms
        self.optimizer.zero_grad(set_to_none=True)
        tally: dict[str, float] = {}
        for idx in self.micro_batches(mini):
            micro = {k: v[idx] for k, v in mini.items()}
            out = self.forward(micro, frozenset(loss_fn.needs))
            loss, metrics = loss_fn(out, micro, norms)
            loss.backward()
            for key, value in metrics.items():
                tally[key] = tally.get(key, 0.0) + float(value)
        keys = sorted(tally)
        return dict(zip(keys, self.world.sum([tally[k] for k in keys], over="dp")))

    def balanced(self, mini: dict[str, Tensor]) -> dict[str, Tensor]:
        """This rank's rows of the global mini-batch after the data-parallel ranks dealt all of
        them out again by token load (``otbrl.engine.micro.balance_ranks``). Collective over the
        data-parallel group: every rank's rows are gathered (re-padded to the widest prompt and
        response: ``prompts`` [B, Lp], ``input_ids``-like [B, Lp + Lr] keys, response-aligned
        [B, Lr] keys and [B] keys), then each keeps the rows dealt to it."""
        group = self.world.mesh["dp"].get_group()
        dp = self.world.dp_size
        lr = mini["responses"].shape[1]
        lp = mini["input_ids"].shape[1] - lr
        shape = torch.tensor([mini["input_ids"].shape[0], lp, lr], device=self.world.device)
        shapes = [torch.empty_like(shape) for _ in range(dp)]
        dist.all_gather(shapes, shape, group=group)
        counts = [int(s[0]) for s in shapes]
        rows, wp, wr = max(counts), max(int(s[1]) for s in shapes), max(int(s[2]) for s in shapes)
        out = {}
        for key in sorted(mini):
            value = mini[key]
            padded = _repad(value, lp, lr, wp, wr, rows, prompt_key=key == "prompts")
            cast = padded.to(torch.uint8) if padded.dtype == torch.bool else padded
            parts = [torch.empty_like(cast) for _ in range(dp)]
            dist.all_gather(parts, cast.contiguous(), group=group)
            whole = torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])
            out[key] = whole.to(value.dtype)
        lengths = out["attention_mask"].sum(dim=1).tolist()
        mine = torch.tensor(balance_ranks(lengths, dp)[self.world.dp_rank], dtype=torch.long)
        return {key: value[mine] for key, value in out.items()}

    def _optimizer_step(self, mini: dict[str, Tensor], loss_fn: Loss) -> tuple[dict, bool]:
        norms = self.normalizers(mini["response_mask"])
        metrics = self.accumulate_gradients(mini, loss_fn, norms)
        clip = self.optim.grad_clip if self.optim.grad_clip > 0 else float("inf")
        grad_norm = parallel.clip_grad_norm(self.model.parameters(), clip)
        finite = bool(torch.isfinite(grad_norm))
        # a non-finite gradient skips the step (and shows in the metrics) instead of writing
        # NaNs into the weights; a mini-batch with no trained token on any rank (every row
        # dropped by seq_mis, or filled up by dynamic sampling) trains nothing: AdamW would
        # still move the weights by its momentum and weight decay
        if finite and float(norms.num_tokens) > 0:
            self.optimizer.step()
            self._check_parameters()
        with warnings.catch_warnings():
            # a skipped step still takes its slot of the schedule (torch warns about the order)
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)`")
            self.scheduler.step()
        metrics[f"{self.name}/grad_norm"] = float(grad_norm)
        return metrics, finite

    def _check_parameters(self) -> None:
        """A finite gradient can still overflow the weights (fp16 AdamW, a huge lr): stop at
        once instead of training, and saving, NaN weights. Collective; one sync per step."""
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        local = [(p.to_local() if isinstance(p, DTensor) else p).detach() for _, p in params]
        # A sum is finite only if every element is (NaN and inf propagate), and summing is
        # ~14x cheaper than isfinite().all() on CPU; suspects (a sum may also just overflow)
        # get the exact check.
        sums = torch.stack([p.sum(dtype=torch.float32) for p in local])
        suspects = (~torch.isfinite(sums)).tolist()
        names = [
            name
            for (name, _), p, suspect in zip(params, local, suspects)
            if suspect and not bool(torch.isfinite(p).all())
        ]
        if self.world.sum([float(len(names))])[0] == 0:
            return
        names = names[:3]
        raise NumericsError(
            f"{self.name}: an optimizer step left non-finite values in the parameters "
            f"({', '.join(names) or 'on another rank'}) although the gradient was finite: the "
            "update overflowed the weights (learning rate too high, or bf16-true weights: "
            "model.precision=bf16-mixed keeps fp32 master weights); stopping before anything "
            "more is trained or saved"
        )

    def normalizers(self, response_mask: Tensor) -> Normalizers:
        """Token and sequence counts of the global mini-batch (summed over data parallel)."""
        local = loss_normalizers(response_mask)
        tokens, seqs = self.world.sum([float(local.num_tokens), float(local.num_seqs)], over="dp")
        device = response_mask.device
        return Normalizers(
            torch.tensor(tokens, dtype=torch.float32, device=device),
            torch.tensor(seqs, dtype=torch.float32, device=device),
        )

    # -- weights and state ---------------------------------------------------------------------
    def full_tensors(self, *, adapter_only: bool = False) -> Iterator[tuple[str, Tensor]]:
        """(HF name, full tensor) of every entry of the plain model's state dict, one at a time,
        each tied parameter once, under its first name (what a rollout backend loads). A LoRA
        model's adapters come merged into their base weights
        (``otbrl.models.lora.merged_tensors``: one module held at a time);
        ``adapter_only=True``: its adapter tensors alone, in PEFT's names (a backend that
        serves the adapter).

        Collective on several processes: every rank must consume the iterator to the end.
        """
        lora = self.lora
        if adapter_only:
            if lora is None:
                raise ValueError("adapter_only: the model has no LoRA adapters")
            names = [k for k in self.model.state_dict() if ".lora_" in k]
            yield from adapter_tensors(self.state_tensors(names)).items()
        elif lora is not None:
            yield from merged_tensors(self.state_tensors(), scaling=lora["alpha"] / lora["rank"])
        else:
            yield from self.state_tensors()

    def state_tensors(self, names: Iterable[str] | None = None) -> Iterator[tuple[str, Tensor]]:
        """(name, full tensor) of every entry of the model's own state dict, tied aliases left
        out (``otbrl.models.tied``: each parameter once, under its first name), or of
        ``names``, in that order, one at a time: only the tensor being yielded is gathered, so
        a consumer that drops each one before the next never holds a second copy of the model.

        Collective on several processes (each sharded tensor is gathered with
        ``full_tensor()``): every rank must consume the iterator to the end, in the same order.
        """
        state = self.model.state_dict()
        for name in untied_names(self.model) if names is None else names:
            value = state[name]
            full = value.full_tensor() if isinstance(value, DTensor) else value
            yield name, full.detach()

    def without_adapters(self, *, name: str = "reference", micro_batch_size: int) -> Engine:
        """A frozen engine over this LoRA engine's own (sharded) model with its adapters
        disabled: the reference policy, without a second copy of the weights.

        Raises ``ValueError`` when the model has no LoRA adapters.
        """
        if self.lora is None:
            raise ValueError("without_adapters: the model has no LoRA adapters")
        view = copy.copy(self)
        view.name, view.optim, view.optimizer, view.scheduler = name, None, None, None
        view.micro_batch_size = micro_batch_size
        view.generator = torch.Generator().manual_seed(0)
        view._context = lambda: adapters_disabled(self.model)
        return view

    @property
    def frozen(self) -> bool:
        """Built without optimizer settings: ``compute`` only, no optimizer state."""
        return self.optimizer is None

    @property
    def lora(self) -> dict | None:
        """``{"rank", "alpha", "dropout", "targets"}`` of a LoRA model, else None."""
        return lora_settings(self.model)

    def tied_aliases(self) -> dict[str, str]:
        """``{alias: kept name}`` of the model's tied weights (``otbrl.models.tied``)."""
        return tied_aliases(self.model)

    # -- checkpoint state: the engine maps its model and optimizer to tensors in its own layout
    # (``otbrl.engine.state``); ``otbrl.store.checkpoint`` owns the files ----------------------
    def model_configs(self) -> list:
        """The HF configs saved beside the weights (each has ``save_pretrained(directory)``):
        the model's, and its generation config when the model generates."""
        generation = getattr(self.model, "generation_config", None)
        generates = generation is not None and self.model.can_generate()
        return [self.model.config] + ([generation] if generates else [])

    def weights(self) -> dict[str, Tensor]:
        """name -> weight in this engine's layout (sharded: a DTensor reporting its global shape
        and dtype), tied aliases left out: the names and shapes a checkpoint holds
        (``state_tensors`` streams them in full), and the tensors to read a saved model into
        (``dcp.load``) before ``load_weights``."""
        return checkpoint_state.weights(self.model)

    def load_weights(self, weights: Mapping[str, Tensor]) -> None:
        """Take back ``weights()``' tensors once read into."""
        checkpoint_state.load_weights(self.model, weights)

    def adapter_config(self) -> dict:
        """PEFT's ``adapter_config.json`` of a LoRA model (its tensors:
        ``full_tensors(adapter_only=True)``), the base being the model it was loaded from."""
        return checkpoint_state.adapter_config(self.model)

    def load_adapter(self, tensors: Mapping[str, Tensor], *, source: str = "the adapter") -> None:
        """Full adapter tensors in PEFT's names -> the LoRA parameters, in this layout.
        ``ValueError`` starting with ``source`` when they are not the model's adapters."""
        checkpoint_state.load_adapter(self.model, tensors, source)

    def optimizer_shard(self) -> tuple[dict[str, tuple[Tensor, list[int]]], list] | None:
        """({``state.<param>.<slot>``: (this rank's chunk, its global offsets)} for the chunks
        this rank writes, the param groups), or None for a frozen engine. Collective."""
        if self.frozen:
            return None
        return checkpoint_state.optimizer_shard(self.model, self.optimizer, self.world.is_main)

    def optimizer_template(self, keys: Iterable[str], *, source: str = "keys") -> dict:
        """Zero tensors in this layout for saved optimizer ``keys``, to read into."""
        return checkpoint_state.optimizer_template(self.model, keys, source)

    def load_optimizer(self, state: Mapping[str, Tensor], param_groups: list) -> None:
        """Take back ``optimizer_template``'s tensors once read into, with the param groups."""
        checkpoint_state.load_optimizer(self.model, self.optimizer, state, param_groups)

    def state_dict(self) -> dict:
        """Scheduler and shuffling-generator state (weights and optimizer: the methods above)."""
        state: dict[str, Any] = {"generator": self.generator.get_state()}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.generator.set_state(state["generator"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def _repad(x: Tensor, lp: int, lr: int, wp: int, wr: int, rows: int, *, prompt_key: bool) -> Tensor:
    """A batch key ``x`` [B, ...] re-padded to ``rows`` rows and to prompts of ``wp`` / responses
    of ``wr`` tokens (from ``lp`` / ``lr``): prompt-aligned columns padded on the left,
    response-aligned ones on the right, with zeros (their masks are 0 there)."""
    pad_rows = rows - x.shape[0]
    if x.dim() == 1:
        return torch.nn.functional.pad(x, (0, pad_rows))
    width = x.shape[1]
    if prompt_key:
        left, right = wp - lp, 0
    elif width == lp + lr:
        prompt, response = x[:, :lp], x[:, lp:]
        x = torch.cat([torch.nn.functional.pad(prompt, (wp - lp, 0)),
                       torch.nn.functional.pad(response, (0, wr - lr))], dim=1)  # fmt: skip
        left = right = 0
    elif width == lr:
        left, right = 0, wr - lr
    else:
        raise ValueError(f"batch key of shape {tuple(x.shape)}: expected [B], [B, {lp}], [B, {lr}] "
                         f"or [B, {lp + lr}]")  # fmt: skip
    extra = [0, 0] * (x.dim() - 2)
    return torch.nn.functional.pad(x, (*extra, left, right, 0, pad_rows))
