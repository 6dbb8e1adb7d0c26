"""The sharded policy engine: the single-process ``Actor`` loop on an FSDP2 / TP / Ulysses model.

``ShardedActor`` keeps the ``Engine`` interface and the PPO loop of ``Actor``; it changes only
the layout hooks:

- ``forward_stats``: tensor parallel feeds the vocabulary-sharded lm_head output to
  ``vocab_parallel_token_stats`` (the [N, V] logits are never gathered); Ulysses runs the
  packed batch split over the SP group and gathers + unpads the per-token stats; otherwise
  the single-process forward (padded or packed) runs on the FSDP2-wrapped model.
- ``loss_normalizers``: token and sequence counts are summed over the data-parallel group, so
  each rank backpropagates its share of the *global* mini-batch loss; FSDP2 sums gradients
  (``apply_fsdp``), which makes the update equal to the single-process one.
- ``clip_grad_norm``: the global norm over DTensor shards.

Each data-parallel rank receives its own shard of the batch, with every ``uid`` group whole
(see ``split_by_groups``), and the rollout reads ``inference_model``: an unsharded copy that
``refresh_inference_model`` overwrites from the gathered full state dict after every update.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh

from otbrl.config import ActorConfig
from otbrl.data.packing import pack, packed_position_ids
from otbrl.engine import parallel, ulysses
from otbrl.engine.actor import Actor
from otbrl.ops import token_stats

ENGINES = ("fsdp", "tp")


def shard_model(
    model: nn.Module, mesh: DeviceMesh, *, engine: str, device: torch.device | str = "cpu"
) -> nn.Module:
    """Apply the parallel layout of `engine` to `model` in place (TP, then Ulysses, then FSDP2).

    engine "tp" needs mesh["tp"] > 1 and wraps FSDP2 around it only when dp > 1; engine
    "fsdp" always shards parameters over dp × sp.
    """
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    if mesh["tp"].size() > 1:
        parallel.apply_tp(model, mesh["tp"])
    if mesh["sp"].size() > 1:
        ulysses.apply_ulysses(model, mesh["sp"].get_group())
    if engine == "fsdp" or mesh["dp"].size() > 1:
        policy = parallel.mixed_precision_policy(device)
        parallel.apply_fsdp(model, parallel.fsdp_mesh(mesh), policy)
    return model


class ShardedActor(Actor):
    """``Actor`` on a sharded model. Every rank calls every method (they are collective).

    Args:
        model: the unsharded HF causal LM (sharded in place; an unsharded copy is kept for
            rollout as ``inference_model``).
        config: the ``actor`` group. ``ppo_mini_batch_size``: *global* sequences per optimizer
            step (divided by the data-parallel size for this rank's share).
        mesh: from ``parallel.build_mesh``; engine: "fsdp" or "tp".
        Others as for ``Actor``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ActorConfig,
        *,
        mesh: DeviceMesh,
        engine: str,
        ppo_mini_batch_size: int,
        temperature: float = 1.0,
        use_remove_padding: bool = False,
        ref_model: nn.Module | None = None,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ):
        dp = mesh["dp"].size()
        if ppo_mini_batch_size % dp:
            raise ValueError(
                f"ppo_mini_batch_size: expected a multiple of the data-parallel size {dp}, "
                f"got {ppo_mini_batch_size}"
            )
        if config.use_fused_kernels:
            # FSDP2 unshards the root parameters in the root's forward, which the fused path
            # bypasses (it calls the decoder, then the head weight directly).
            raise ValueError("actor.use_fused_kernels: not supported by the sharded engines yet")
        self.mesh = mesh
        self.engine = engine
        self.device = torch.device(device)
        self.dp_group = mesh["dp"].get_group()
        self.tp = mesh["tp"].size()
        self.sp = mesh["sp"].size()
        self.inference_model = copy.deepcopy(model).eval()
        self.inference_model.requires_grad_(False)
        shard_model(model, mesh, engine=engine, device=device)
        if ref_model is not None:
            shard_model(ref_model, mesh, engine=engine, device=device)
        # The vocabulary shard held by this rank's lm_head output (all of it without TP).
        start, end = parallel.vocab_shard_range(model, mesh["tp"])
        self.vocab_start, self.vocab_local = start, end - start
        self.last_logits_shape: tuple[int, ...] | None = None  # for tests: the V dim seen
        super().__init__(
            model,
            config,
            ppo_mini_batch_size=ppo_mini_batch_size // dp,
            temperature=temperature,
            use_remove_padding=use_remove_padding or self.sp > 1,
            ref_model=ref_model,
            seed=seed,
        )

    # -- layout hooks ---------------------------------------------------------------------------
    def forward_stats(self, model: nn.Module, micro: dict[str, Tensor], **kwargs) -> dict:
        """Per-response-token stats [B, Lr] float32 of this rank's micro-batch (see ``Actor``).

        The batch may live on the CPU (the trainer's batches do): inputs go to this rank's
        device and the stats come back to the batch's device (differentiably).
        """
        home = micro["input_ids"].device
        micro = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in micro.items()}
        if self.sp > 1:
            out = self._ulysses_stats(model, micro, **kwargs)
        elif self.tp > 1:
            out = self._tp_stats(model, micro, **kwargs)
        else:
            out = super().forward_stats(model, micro, **kwargs)
        return {k: v.to(home) for k, v in out.items()}

    def loss_normalizers(self, mask: Tensor) -> dict:
        """Token / sequence counts of the global mini-batch (summed over the DP group)."""
        local = super().loss_normalizers(mask)
        # NCCL reduces device tensors only; the counts return to the mask's device
        counts = torch.stack([local["num_tokens"].float(), local["num_seqs"].float()])
        counts = counts.to(self.device)
        dist.all_reduce(counts, group=self.dp_group)
        horizon = torch.tensor([float(local["horizon"])], device=self.device)
        dist.all_reduce(horizon, op=dist.ReduceOp.MAX, group=self.dp_group)
        counts = counts.to(mask.device)
        return {"num_tokens": counts[0], "num_seqs": counts[1], "horizon": int(horizon.item())}

    def clip_grad_norm(self, max_norm: float) -> Tensor:
        """Global gradient norm over all shards; clips in place."""
        return parallel.clip_grad_norm(self.model.parameters(), max_norm)

    # -- update + weight sync ---------------------------------------------------------------
    def update(self, batch: dict[str, Tensor]) -> dict[str, float]:
        """PPO update on this rank's shard; metrics averaged over the DP group; refreshes
        ``inference_model``. ``policy/loss`` is the sum of the ranks' shares (the global loss)."""
        metrics = super().update(batch)
        keys = sorted(metrics)
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(values, group=self.dp_group)
        dp = dist.get_world_size(self.dp_group)
        out = {k: float(v) / (1 if k == "policy/loss" else dp) for k, v in zip(keys, values)}
        self.refresh_inference_model()
        return out

    @torch.no_grad()
    def refresh_inference_model(self) -> None:
        """Copy the current sharded weights into the unsharded rollout model (collective)."""
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True))
        self.inference_model.load_state_dict(full)

    # -- forwards ----------------------------------------------------------------------------
    def _tp_stats(self, model, micro, *, temperature, entropy=False, sum_pi_squared=False):
        from otbrl.ops import vocab_parallel_token_stats

        rows = _response_rows(micro)
        if self.packed:
            p = pack(micro["input_ids"], micro["attention_mask"])
            index = _packed_rows(p, rows, micro["input_ids"].shape)
            logits = model(
                input_ids=p.values[None],
                position_ids=packed_position_ids(p.cu_seqlens)[None],
                attention_mask=None,
                use_cache=False,
                logits_to_keep=index,
            ).logits[0]
        else:
            resp_len = micro["responses"].shape[1]
            out = model(
                input_ids=micro["input_ids"],
                attention_mask=micro["attention_mask"],
                position_ids=micro["position_ids"],
                use_cache=False,
                logits_to_keep=resp_len + 1,
            ).logits
            logits = out[rows.batch, rows.offset]
        self.last_logits_shape = tuple(logits.shape)
        if logits.shape[-1] != self.vocab_local:
            raise RuntimeError(
                f"lm_head output: expected a vocabulary shard of {self.vocab_local}, got "
                f"{logits.shape[-1]} (was the lm_head gathered?)"
            )
        stats = vocab_parallel_token_stats(
            logits,
            rows.labels,
            vocab_start=self.vocab_start,
            group=self.mesh["tp"].get_group(),
            temperature=temperature,
            entropy=entropy,
            sum_pi_squared=sum_pi_squared,
        )
        return _scatter_stats(stats, rows.valid, entropy, sum_pi_squared)

    def _ulysses_stats(self, model, micro, *, temperature, entropy=False, sum_pi_squared=False):
        rows = _response_rows(micro)
        group = self.mesh["sp"].get_group()
        p = pack(micro["input_ids"], micro["attention_mask"])
        index = _packed_rows(p, rows, micro["input_ids"].shape)
        ids = p.values[None]
        local_ids, local_pos, pad = ulysses.slice_for_rank(
            ids, packed_position_ids(p.cu_seqlens)[None], group
        )
        n = local_ids.shape[1]
        rank = dist.get_rank(group)
        # label of packed position i is token i+1; wrong across sequence ends, never selected
        next_ids = torch.nn.functional.pad(ids[0, 1:], (0, 1 + pad))[rank * n : (rank + 1) * n]
        logits = model(
            input_ids=local_ids,
            position_ids=local_pos,
            use_cache=False,
            **ulysses.packed_forward_kwargs(p.cu_seqlens, self.sp),
        ).logits[0]
        self.last_logits_shape = tuple(logits.shape)
        local = token_stats(
            logits,
            next_ids,
            temperature=temperature,
            entropy=entropy,
            sum_pi_squared=sum_pi_squared,
        )
        full = [None if t is None else ulysses.gather_and_unpad(t, group, pad) for t in local]
        picked = type(local)(*[None if t is None else t[index] for t in full])
        return _scatter_stats(picked, rows.valid, entropy, sum_pi_squared)


def save_sharded_state(actor: ShardedActor, directory) -> None:
    """Write model and optimizer shards with torch.distributed.checkpoint (collective).

    Every rank writes only its shards; the metadata records global shapes and placements, so
    ``load_sharded_state`` can read the directory back with any mesh (other world size, FSDP
    or TP). Scheduler, RNG and data position are small and saved by the trainer.
    """
    model_state, optim_state = get_state_dict(actor.model, actor.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))


def load_sharded_state(actor: ShardedActor, directory) -> None:
    """Read what ``save_sharded_state`` wrote into `actor`'s current layout, then refresh the
    rollout copy (collective)."""
    model_state, optim_state = get_state_dict(actor.model, actor.optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(
        actor.model,
        actor.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
    )
    actor.refresh_inference_model()


class _Rows:
    """Where each valid response token sits: its [B, Lr] mask, batch index, predicting column
    in the last Lr+1 positions, and its label."""

    def __init__(self, valid, batch, offset, labels, prompt_len):
        self.valid, self.batch, self.offset = valid, batch, offset
        self.labels, self.prompt_len = labels, prompt_len


def _response_rows(micro: dict[str, Tensor]) -> _Rows:
    input_ids, responses = micro["input_ids"], micro["responses"]
    prompt_len = input_ids.shape[1] - responses.shape[1]
    valid = micro["attention_mask"][:, prompt_len:].bool()
    b_idx, t_idx = valid.nonzero(as_tuple=True)
    # column t of the response is predicted by full position prompt_len - 1 + t, which is
    # column t of the last Lr + 1 positions
    return _Rows(valid, b_idx, t_idx, responses[valid], prompt_len)


def _packed_rows(p, rows: _Rows, shape) -> Tensor:
    """Packed-stream index of the position predicting each valid response token [N]."""
    bsz, seq_len = shape
    dev = p.indices.device
    flat_to_packed = torch.full((bsz * seq_len,), -1, dtype=torch.long, device=dev)
    flat_to_packed[p.indices] = torch.arange(p.indices.numel(), device=dev)
    index = flat_to_packed[rows.batch * seq_len + rows.prompt_len - 1 + rows.offset]
    if (index < 0).any():
        raise ValueError("attention_mask: a response token's predecessor is masked")
    return index


def _scatter_stats(stats, valid: Tensor, entropy: bool, sum_pi_squared: bool) -> dict:
    def scatter(values: Tensor) -> Tensor:
        out = torch.zeros(valid.shape, dtype=torch.float32, device=values.device)
        out[valid] = values.float()
        return out

    result = {"old_log_probs": scatter(stats.log_probs)}
    if entropy:
        result["entropy"] = scatter(stats.entropy)
    if sum_pi_squared:
        result["sum_pi_squared"] = scatter(stats.sum_pi_squared.detach())
    return result


def split_by_groups(uid: Tensor, dp_rank: int, dp_size: int) -> Tensor:
    """Row indices [B / dp] of the batch this DP rank trains on; every `uid` group whole.

    Groups (rows sharing a uid) are dealt to ranks in order of first appearance, contiguous
    blocks of equal group counts. Keeping a group on one rank lets each rank compute the
    group-relative advantages (GRPO, RLOO, OTB) itself, exactly as on one process, with no
    gather of rewards or Σπ² before the estimator. Needs the number of groups divisible by
    dp_size and groups of equal size (as rollout.n makes them).
    """
    if uid.ndim != 1:
        raise ValueError(f"uid: expected a 1-D [B] tensor, got shape {tuple(uid.shape)}")
    groups, inverse, counts = torch.unique(uid, return_inverse=True, return_counts=True)
    if groups.numel() % dp_size:
        raise ValueError(
            f"uid: expected a number of groups divisible by the data-parallel size {dp_size}, "
            f"got {groups.numel()}"
        )
    if (counts != counts[0]).any():
        raise ValueError(f"uid: expected groups of equal size, got sizes {counts.tolist()}")
    # order groups by first appearance so the split follows the batch order
    first = torch.full((groups.numel(),), uid.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(uid.numel()), reduce="amin")
    order = torch.argsort(first)
    per_rank = groups.numel() // dp_size
    mine = torch.zeros(groups.numel(), dtype=torch.bool)
    mine[order[dp_rank * per_rank : (dp_rank + 1) * per_rank]] = True
    return mine[inverse].nonzero(as_tuple=True)[0]
