"""The reward model sharded over two data-parallel ranks scores each rank's rows as the
unsharded model does."""

from __future__ import annotations

import pytest
import torch

from dist_utils import check_ok, launch, start_test_world

pytestmark = pytest.mark.distributed


def _worker(rank, world_size, port, rm_dir):
    from otbrl.config import load_config
    from otbrl.data import get_task
    from otbrl.rewards.reward_model import RewardModel
    from otbrl.run.build import build_reward_model
    from otbrl.run.spec import resolve

    world = start_test_world(rank, world_size)
    rows = get_task("arithmetic").rows("train", 4, seed=0)
    answers = ["1", "22", "333", "4444"]
    mine = slice(2 * rank, 2 * rank + 2)  # each rank scores its own rows
    full = RewardModel(rm_dir).score(rows[mine], answers[mine])
    cfg = load_config(None, [f"reward.model.path={rm_dir}", "reward.model.micro_batch_size=1"])
    sharded = build_reward_model(resolve(cfg), world)
    from torch.distributed.tensor import DTensor

    assert any(isinstance(p, DTensor) for p in sharded.model.parameters())
    return {"full": full, "sharded": sharded.score(rows[mine], answers[mine])}


def test_sharded_reward_model_scores_as_the_full_one(tmp_path):
    from test_reward_model import make_reward_model_dir

    rm_dir = make_reward_model_dir(tmp_path)
    results = check_ok(launch(_worker, 2, tmp_path / "out", str(rm_dir)))
    for rank in (0, 1):
        torch.testing.assert_close(results[rank]["sharded"], results[rank]["full"])
    assert not torch.equal(results[0]["full"], results[1]["full"])
