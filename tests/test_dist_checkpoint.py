"""Sharded (DCP) checkpoints: written by 2 ranks, resumed by 1 and by 2 with the same next step."""

from __future__ import annotations

import pytest
import torch

from dist_utils import NEEDS, actor_config, check_ok, launch, ppo_batch, tiny_llama

pytestmark = pytest.mark.distributed


def _ppo_step(actor, batch, dp_rank, dp):
    from otbrl.engine.distributed import split_by_groups

    local = {k: v[split_by_groups(batch["uid"], dp_rank, dp)] for k, v in batch.items()}
    stats = actor.compute_stats(local, NEEDS, 1.0)
    metrics = actor.update({**local, "old_log_probs": stats["old_log_probs"]})
    return stats, metrics


def _worker(rank, world_size, port, ckpt_dir, save):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from otbrl.engine.dist import init_distributed
    from otbrl.engine.distributed import ShardedActor, load_sharded_state, save_sharded_state
    from otbrl.engine.parallel import build_mesh

    init_distributed(rank=rank, world_size=world_size, timeout_s=60.0)
    mesh = build_mesh(world_size, device_type="cpu")
    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    # a resumed run starts from other weights: everything must come from the checkpoint
    model = tiny_llama(seed=0 if save else 123)
    actor = ShardedActor(model, actor_config(), mesh=mesh, engine="fsdp", ppo_mini_batch_size=8)
    if save:
        _ppo_step(actor, ppo_batch(seed=7), dp_rank, dp)
        save_sharded_state(actor, ckpt_dir)
    else:
        load_sharded_state(actor, ckpt_dir)
    stats, metrics = _ppo_step(actor, ppo_batch(seed=8), dp_rank, dp)
    full = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True))
    return {"stats": stats, "metrics": metrics, "state": full if rank == 0 else None}


def test_checkpoint_from_two_ranks_resumes_on_one_and_two(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = check_ok(launch(_worker, 2, tmp_path / "save", str(ckpt), True))
    assert (ckpt / ".metadata").is_file()
    for world_size in (1, 2):
        resumed = check_ok(
            launch(_worker, world_size, tmp_path / f"resume{world_size}", str(ckpt), False)
        )
        for key in ("policy/loss", "policy/grad_norm", "policy/clip_frac", "policy/approx_kl"):
            assert resumed[0]["metrics"][key] == pytest.approx(
                first[0]["metrics"][key], rel=1e-5, abs=1e-7
            ), key
        # old log-probs of the next step come from the restored weights
        got = torch.cat([resumed[r]["stats"]["old_log_probs"] for r in range(world_size)])
        want = torch.cat([first[r]["stats"]["old_log_probs"] for r in range(2)])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        # the step after the resume used the restored AdamW moments: same weights afterwards
        for name, value in first[0]["state"].items():
            torch.testing.assert_close(
                resumed[0]["state"][name], value, atol=1e-5, rtol=0, msg=name
            )
    assert not torch.equal(
        first[0]["state"]["lm_head.weight"], tiny_llama().state_dict()["lm_head.weight"]
    )
