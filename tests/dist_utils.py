"""Helpers for the multi-process tests (`tests/test_dist_*.py`): launcher, tiny model, stats.

Workers start from a forkserver that has already imported torch and transformers, so each
launch costs ~1-3 s instead of re-importing everything per process (the CPU has 2 cores).
A worker writes its result to `<out>/rank<r>.pt`, or its exception text to `<out>/rank<r>.err`.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from tiny_models import tiny_causal_lm

VOCAB = 64
_PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "transformers",
    "dist_utils",
    "otbrl.engine.parallel",
    "otbrl.engine.ulysses",
    "otbrl.engine.world",
    "otbrl.engine.frozen",
    "otbrl.engine.trainable",
]
_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _entry(fn, rank, world_size, port, out_dir, args):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    out = Path(out_dir)
    try:
        result = fn(rank, world_size, port, *args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException as err:
        (out / f"rank{rank}.err").write_text(
            f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        )
        raise SystemExit(1) from None
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            # A finished rank leaves its peers' sockets alone only if all are done: no barrier
            # here, so a test whose peer died does not hang in teardown.
            dist.destroy_process_group()
    # The result is on disk. torch 2.13's profiler can abort a child at interpreter exit
    # ("terminate called without an active exception"): skip that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(fn, world_size: int, out_dir: Path, *args, timeout_s: float = 120.0) -> dict:
    """Run `fn(rank, world_size, port, *args)` in `world_size` processes; wait at most `timeout_s`.

    Returns {"results": {rank: object}, "errors": {rank: text}, "exitcodes": {rank: code},
    "elapsed": seconds}. A process still alive at the deadline is killed and reported with
    exit code None, so a hang fails the test instead of the suite.
    """
    from otbrl.engine.world import free_port

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = _context()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, str(out_dir), args))
        for r in range(world_size)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    exitcodes = {}
    for r, p in enumerate(procs):
        p.join(max(0.0, timeout_s - (time.monotonic() - start)))
        if p.is_alive():
            p.kill()
            p.join()
            exitcodes[r] = None
        else:
            exitcodes[r] = p.exitcode
    results, errors = {}, {}
    for r in range(world_size):
        if (out_dir / f"rank{r}.pt").exists():
            results[r] = torch.load(out_dir / f"rank{r}.pt", weights_only=False)
        if (out_dir / f"rank{r}.err").exists():
            errors[r] = (out_dir / f"rank{r}.err").read_text()
    return {
        "results": results,
        "errors": errors,
        "exitcodes": exitcodes,
        "elapsed": time.monotonic() - start,
    }


def check_ok(run: dict) -> dict:
    """The per-rank results of a launch that must have succeeded on every rank."""
    assert not run["errors"], "worker errors:\n" + "\n".join(run["errors"].values())
    assert all(code == 0 for code in run["exitcodes"].values()), run["exitcodes"]
    return run["results"]


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """The shared tiny Llama (``tiny_models``) with V = VOCAB and sdpa attention."""
    return tiny_causal_lm(
        "llama", seed, **{"vocab_size": VOCAB, "attn_implementation": "sdpa", **overrides}
    )


def reference_stats(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Log-prob of `labels`, entropy and Σπ² from [..., V] logits, via float64 softmax."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = logp.exp()
    return {
        "log_probs": logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
        "entropy": -(p * logp).sum(-1),
        "sum_pi_squared": (p * p).sum(-1),
    }


def uneven_sequences(lengths=(5, 9, 3), seed: int = 1) -> list[torch.Tensor]:
    """Token-id sequences of the given (uneven) lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def packed_layout(seqs: list[torch.Tensor]):
    """(ids [1, nnz], positions [1, nnz], cu_seqlens [B+1] int32, labels [nnz], label_mask [nnz]).

    labels[i] is the next token of the same sequence; the last token of each sequence has
    none (label 0, mask 0).
    """
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
    labels = torch.cat([torch.cat([s[1:], s.new_zeros(1)]) for s in seqs])
    mask = torch.cat([torch.cat([torch.ones(len(s) - 1), torch.zeros(1)]) for s in seqs])
    return ids, pos, cu, labels, mask


OUTPUTS = frozenset({"log_probs", "entropy", "sum_pi_squared"})


def actor_config(**overrides):
    """The optimizer settings the multi-process tests train with (``OptimConfig``)."""
    from otbrl.engine.optim import OptimConfig

    kwargs = dict(lr=1e-3, warmup_steps=0, grad_clip=0.5, ppo_epochs=1)
    kwargs.update(overrides)
    return OptimConfig(**kwargs)


def actor_spec(micro_batch_size: int = 4, max_tokens_per_micro_batch=None, **overrides):
    """The engine spec the multi-process tests run with: micro-batches of 4 rows (or a token
    budget), and ``overrides`` of its other fields (strategy, packed, precision...)."""
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig

    micro = MicroBatchConfig(micro_batch_size, max_tokens_per_micro_batch)
    return EngineSpec(micro=micro, **overrides)


def ppo_batch(groups: int = 4, n: int = 2, seed: int = 7) -> dict[str, torch.Tensor]:
    """`groups` prompts × `n` responses: left-padded prompts, right-padded responses, uids."""
    from otbrl.engine.layout import sequence_inputs

    g = torch.Generator().manual_seed(seed)
    b, lp, lr = groups * n, 4, 5
    prompts = torch.randint(1, VOCAB, (groups, lp), generator=g).repeat_interleave(n, 0)
    prompt_lens = torch.tensor([4, 2, 3, 4]).repeat_interleave(n)[:b]
    prompt_mask = (torch.arange(lp)[None] >= lp - prompt_lens[:, None]).long()
    responses = torch.randint(1, VOCAB, (b, lr), generator=g)
    resp_lens = torch.tensor([5, 1, 3, 4, 2, 5, 4, 3])[:b]
    response_mask = (torch.arange(lr)[None] < resp_lens[:, None]).float()
    responses = responses * response_mask.long()
    batch = sequence_inputs(prompts * prompt_mask, prompt_mask, responses, response_mask)
    batch.update(
        responses=responses,
        response_mask=response_mask,
        uid=torch.arange(groups).repeat_interleave(n),
        advantages=torch.randn(b, lr, generator=g) * response_mask,
    )
    return batch


def split_by_groups(uid: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Row indices [B / dp] of a pre-built batch that one DP rank trains on, every `uid` group
    whole (groups dealt in order of first appearance, contiguous blocks of equal counts) —
    what the trainer's prompt sharding gives each rank."""
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
    first = torch.full((groups.numel(),), uid.numel(), dtype=torch.long)
    first.scatter_reduce_(0, inverse, torch.arange(uid.numel()), reduce="amin")
    order = torch.argsort(first)
    per_rank = groups.numel() // dp_size
    mine = torch.zeros(groups.numel(), dtype=torch.bool)
    mine[order[dp_rank * per_rank : (dp_rank + 1) * per_rank]] = True
    return mine[inverse].nonzero(as_tuple=True)[0]


def local_batch(batch: dict[str, torch.Tensor], world) -> dict[str, torch.Tensor]:
    """The rows of the global ``batch`` that ``world``'s data-parallel rank trains on
    (``split_by_groups``; the whole batch, in order, at world size 1)."""
    rows = split_by_groups(batch["uid"], world.dp_rank, world.dp_size)
    return {k: v[rows] for k, v in batch.items()}


def ppo_step(engine, batch: dict[str, torch.Tensor]):
    """One PPO step of ``engine`` on its rank's rows of the global ``batch``: the old log-probs
    from its own forward, then ``engine.update`` with ``policy_loss()``; returns the forward's
    stats and the update's metrics."""
    local = local_batch(batch, engine.world)
    stats = engine.compute(local, OUTPUTS)
    return stats, engine.update({**local, "old_log_probs": stats["log_probs"]}, policy_loss())


def start_test_world(rank: int, world_size: int, *, sp: int = 1, tp: int = 1):
    """A ``World`` over gloo for a test worker (the trainer uses ``start_world`` under torchrun)."""
    from otbrl.engine.parallel import build_mesh
    from otbrl.engine.world import World, init_distributed

    info = init_distributed(rank=rank, world_size=world_size, timeout_s=60.0)
    mesh = build_mesh(world_size, sp=sp, tp=tp, device_type="cpu")
    return World(rank=info.rank, size=info.world_size, device=info.device, mesh=mesh)


def policy_loss(name: str = "ppo"):
    """The policy loss the multi-process tests train with (``actor.policy_loss``; GSPO and
    CISPO with the aggregation they define)."""
    from otbrl.algos.config import POLICY_LOSS_AGG
    from otbrl.algos.loss_terms import build_loss

    return build_loss(policy_loss=name, loss_agg_mode=POLICY_LOSS_AGG.get(name, "token-mean"))
