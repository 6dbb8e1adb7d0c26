"""FSDP2 data parallel over gloo: one-process update and statistics; dead ranks fail fast."""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import VOCAB, check_ok, launch, reference_stats, tiny_llama

pytestmark = pytest.mark.distributed

# Plain SGD with a large step, so parameter differences are gradient differences: AdamW's first
# step is lr·g/(|g|+eps), which blows float-rounding noise on near-zero gradient entries up to
# O(lr) and would test the optimizer's conditioning rather than the parallel layout.
LR = 1.0


def padded_batch():
    """Four right-padded rows [4, 8] with uneven lengths, token advantages and masks."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    lengths = torch.tensor([8, 6, 7, 5])
    attention_mask = (torch.arange(8)[None] < lengths[:, None]).long()
    advantages = torch.randn(4, 7, generator=g)
    return ids, attention_mask, advantages


def policy_step(model, optimizer, ids, attention_mask, advantages, global_tokens, clip):
    """Forward, loss = this shard's share of the global token-mean, backward, clip, step."""
    logits = model(input_ids=ids, attention_mask=attention_mask).logits[:, :-1]
    stats = reference_stats(logits, ids[:, 1:])
    mask = attention_mask[:, 1:].float()
    loss = -(advantages * stats["log_probs"].float() * mask).sum() / global_tokens
    loss.backward()
    norm = clip(model.parameters(), 0.5)
    optimizer.step()
    return {k: v.detach() for k, v in stats.items()}, float(norm)


def _fsdp_worker(rank, world_size, port, die_mid_step=False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from otbrl.engine.parallel import apply_fsdp, build_mesh, clip_grad_norm, fsdp_mesh
    from otbrl.engine.world import collective_guard, init_distributed

    init_distributed(rank=rank, world_size=world_size, timeout_s=30.0)
    mesh = build_mesh(world_size, device_type="cpu")
    model = apply_fsdp(tiny_llama(), fsdp_mesh(mesh))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, attention_mask, advantages = padded_batch()
    global_tokens = attention_mask[:, 1:].sum()
    rows = slice(rank * 2, rank * 2 + 2)
    # policy_step's arguments after the model and optimizer: this rank's rows of the batch
    shard = (ids[rows], attention_mask[rows], advantages[rows], global_tokens, clip_grad_norm)
    if die_mid_step:
        model(input_ids=ids[rows], attention_mask=attention_mask[rows])
        if rank == 1:
            os._exit(3)  # a crash between forward and backward: rank 0 waits in reduce-scatter
        with collective_guard("the FSDP backward"):
            policy_step(model, optimizer, *shard)
        return None
    stats, norm = policy_step(model, optimizer, *shard)
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {"stats": stats, "norm": norm, "state": full if rank == 0 else None}


def test_fsdp_two_ranks_match_one_process(tmp_path):
    run = launch(_fsdp_worker, 2, tmp_path)
    results = check_ok(run)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ids, attention_mask, advantages = padded_batch()
    global_tokens = attention_mask[:, 1:].sum()
    ref_stats, ref_norm = policy_step(
        model,
        optimizer,
        ids,
        attention_mask,
        advantages,
        global_tokens,
        torch.nn.utils.clip_grad_norm_,
    )
    mask = attention_mask[:, 1:].bool()
    for key in ("log_probs", "sum_pi_squared", "entropy"):
        got = torch.cat([results[0]["stats"][key], results[1]["stats"][key]])
        torch.testing.assert_close(got[mask], ref_stats[key][mask], atol=1e-6, rtol=0)
    # the global gradient norm (before clipping) is the same on both ranks and equals the reference
    assert results[0]["norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert results[1]["norm"] == pytest.approx(ref_norm, rel=1e-5)
    assert ref_norm > 0.5  # so clipping was active and its global norm mattered
    state = results[0]["state"]
    ref_state = model.state_dict()
    assert set(state) == set(ref_state)
    moved = 0.0
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)
        moved = max(moved, float((value - tiny_llama().state_dict()[name]).abs().max()))
    assert moved > 1e-3  # the step really changed the weights


def test_dead_rank_fails_peers_fast(tmp_path):
    run = launch(_fsdp_worker, 2, tmp_path, True, timeout_s=90.0)
    assert run["exitcodes"][1] == 3
    assert run["exitcodes"][0] == 1, run  # failed, not hung (None) nor silently fine (0)
    err = run["errors"][0]
    assert "DistributedError" in err and "another rank probably died" in err, err
    assert "FSDP backward" in err
    assert run["elapsed"] < 60.0
