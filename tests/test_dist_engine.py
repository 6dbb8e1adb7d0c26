"""ShardedActor (FSDP2, Ulysses) vs the single-process Actor on the same global PPO batch."""

from __future__ import annotations

import pytest
import torch

from dist_utils import NEEDS, actor_config, check_ok, launch, ppo_batch, tiny_llama

pytestmark = pytest.mark.distributed


def full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def single_process_reference(batch, model_kwargs=None):
    """Stats and mini-batch gradients of the plain Actor on the whole batch."""
    from otbrl.engine.actor import Actor

    model = tiny_llama(**(model_kwargs or {}))
    actor = Actor(model, actor_config(), ppo_mini_batch_size=batch["uid"].numel())
    stats = actor.compute_stats(batch, NEEDS, 1.0)
    mini = {**batch, "old_log_probs": stats["old_log_probs"]}
    tally = actor.accumulate_gradients(mini)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return stats, tally, grads, float(actor.clip_grad_norm(0.5))


def _gloo_ops(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("gloo:")]


def _engine_worker(
    rank, world_size, port, engine, sp, tp, packed, extra_steps=0, model_kwargs=None
):
    from otbrl.engine.dist import init_distributed
    from otbrl.engine.distributed import ShardedActor, split_by_groups
    from otbrl.engine.parallel import build_mesh

    init_distributed(rank=rank, world_size=world_size, timeout_s=60.0)
    mesh = build_mesh(world_size, sp=sp, tp=tp, device_type="cpu")
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    batch = ppo_batch()
    local = {k: v[split_by_groups(batch["uid"], dp_rank, dp)] for k, v in batch.items()}
    actor = ShardedActor(
        tiny_llama(**(model_kwargs or {})),
        actor_config(),
        mesh=mesh,
        engine=engine,
        ppo_mini_batch_size=batch["uid"].numel(),
        use_remove_padding=packed,
    )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stats = actor.compute_stats(local, NEEDS, 1.0)
    collectives = _gloo_ops(prof)
    logits_shape = actor.last_logits_shape
    mini = {**local, "old_log_probs": stats["old_log_probs"]}
    tally = actor.accumulate_gradients(mini)
    grads = full_grads(actor.model)
    norm = float(actor.clip_grad_norm(0.5))
    metrics = actor.update(mini)  # a real PPO step: AdamW, then the rollout copy is refreshed
    for _ in range(extra_steps):
        later = actor.update(mini)
        assert all(torch.isfinite(torch.tensor(v)) for v in later.values()), later
    inference = {k: v.clone() for k, v in actor.inference_model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True))
    synced = all(torch.equal(inference[k], full[k]) for k in full)
    return {
        "rows": split_by_groups(batch["uid"], dp_rank, dp),
        "stats": stats,
        "loss": tally["policy/loss"],
        "grads": grads if rank == 0 else None,
        "norm": norm,
        "metrics": metrics,
        "synced": synced,
        "logits_shape": logits_shape,
        "collectives": collectives,
    }


def check_against_reference(results, world_size, model_kwargs=None):
    batch = ppo_batch()
    ref_stats, ref_tally, ref_grads, ref_norm = single_process_reference(batch, model_kwargs)
    mask = batch["response_mask"].bool()
    for rank in range(world_size):
        got = results[rank]
        rows = got["rows"]
        assert torch.equal(batch["uid"][rows].unique(), batch["uid"][rows].unique_consecutive())
        for key in sorted(NEEDS):
            torch.testing.assert_close(
                got["stats"][key][mask[rows]], ref_stats[key][rows][mask[rows]], atol=2e-6, rtol=0
            )
        assert got["norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert got["synced"]
        assert all(torch.isfinite(torch.tensor(v)) for v in got["metrics"].values())
    # each DP rank's loss is its share of the global mini-batch loss
    dp_ranks = {tuple(results[r]["rows"].tolist()): r for r in range(world_size)}
    total = sum(results[r]["loss"] for r in dp_ranks.values())
    assert total == pytest.approx(ref_tally["policy/loss"], abs=1e-6)
    for name, g in ref_grads.items():
        torch.testing.assert_close(results[0]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    for rank in range(world_size):
        assert results[rank]["metrics"]["policy/loss"] == pytest.approx(
            ref_tally["policy/loss"], abs=1e-6
        )


def test_split_by_groups_keeps_groups_whole():
    from otbrl.engine.distributed import split_by_groups

    uid = torch.tensor([7, 7, 3, 3, 9, 9, 1, 1])
    parts = [split_by_groups(uid, r, 2) for r in range(2)]
    assert parts[0].tolist() == [0, 1, 2, 3] and parts[1].tolist() == [4, 5, 6, 7]
    shuffled = torch.tensor([5, 2, 5, 2, 8, 8])
    got = [split_by_groups(shuffled, r, 3).tolist() for r in range(3)]
    assert got == [[0, 2], [1, 3], [4, 5]]
    with pytest.raises(ValueError, match="divisible"):
        split_by_groups(uid, 0, 3)
    with pytest.raises(ValueError, match="equal size"):
        split_by_groups(torch.tensor([1, 1, 2]), 0, 1)


def test_fsdp_engine_matches_actor(tmp_path):
    results = check_ok(launch(_engine_worker, 2, tmp_path, "fsdp", 1, 1, False))
    check_against_reference(results, 2)


def test_ulysses_engine_matches_actor(tmp_path):
    results = check_ok(launch(_engine_worker, 2, tmp_path, "fsdp", 2, 1, True))
    check_against_reference(results, 2)
    # each SP rank ran the model on half of the packed tokens of the last micro-batch of
    # compute_stats (rows 4..7), rounded up: one pad token when nnz is odd
    nnz = int(ppo_batch()["attention_mask"][4:].sum())
    assert results[0]["logits_shape"][0] == -(-nnz // 2)
