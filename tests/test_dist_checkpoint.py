"""One checkpoint format for every world size: written by 2 FSDP ranks, resumed by one process
(no process group) and by 2 ranks; written by one process, resumed by 2; written by FSDP2 over
TP (dp 2 × tp 2), resumed by one process — same next step."""

from __future__ import annotations

import pytest
import torch

from ckpt_utils import plant_pickle, reseal
from dist_utils import (
    actor_config,
    actor_spec,
    check_ok,
    launch,
    ppo_batch,
    ppo_step,
    start_test_world,
    tiny_llama,
)

pytestmark = pytest.mark.distributed


def _worker(rank, world_size, port, ckpt_root, save, tp=1):
    from otbrl.engine.state import EngineState
    from otbrl.engine.trainable import TrainableEngine
    from otbrl.engine.world import World
    from otbrl.models.weights import full_tensors
    from otbrl.store.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    world = start_test_world(rank, world_size, tp=tp) if world_size > 1 else World()
    # a resumed run starts from other weights: everything must come from the checkpoint
    model = tiny_llama(seed=0 if save else 123)
    engine = TrainableEngine(
        model,
        actor_config(),
        actor_spec(strategy="tp" if tp > 1 else "fsdp"),
        world=world,
        mini_batch_size=8,
        seed=0 if save else 5,
    )
    engines = {"policy": EngineState(engine)}
    if save:
        ppo_step(engine, ppo_batch(seed=7))
        save_checkpoint(ckpt_root, 1, engines=engines, trainer_state={"step": 1})
    else:
        state = load_checkpoint(latest_checkpoint(ckpt_root), engines=engines)
        assert state == {"step": 1}
    stats, metrics = ppo_step(engine, ppo_batch(seed=8))
    full = dict(full_tensors(engine.model))
    return {"stats": stats, "metrics": metrics, "state": full if rank == 0 else None}


def _compare(first, resumed, world_first, world_resumed, tp_first=1):
    for key in ("policy/loss", "policy/grad_norm", "policy/clip_frac", "policy/approx_kl"):
        assert resumed[0]["metrics"][key] == pytest.approx(
            first[0]["metrics"][key], rel=1e-5, abs=1e-7
        ), key
    # old log-probs of the next step come from the restored weights
    got = torch.cat([resumed[r]["stats"]["log_probs"] for r in range(world_resumed)])
    # one rank per data-parallel group (the tp ranks of a group score the same rows)
    want = torch.cat([first[r]["stats"]["log_probs"] for r in range(0, world_first, tp_first)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    # the step after the resume used the restored AdamW moments: same weights afterwards
    for name, value in first[0]["state"].items():
        torch.testing.assert_close(resumed[0]["state"][name], value, atol=1e-5, rtol=0, msg=name)


def test_checkpoint_from_two_ranks_resumes_on_one_and_two(tmp_path):
    """...and the sharded optimizer state is read from safetensors headers only: a crafted
    DCP ``.metadata`` pickle next to the shards (the manifest resealed, as an attacker with
    write access would) is never unpickled by the one- or the two-rank resume."""
    ckpt = tmp_path / "ckpt"
    first = check_ok(launch(_worker, 2, tmp_path / "save", ckpt, True))
    step = ckpt / "step_1"
    assert (step / "model.safetensors").is_file() and (step / "checkpoint.json").is_file()
    assert not list(step.rglob("*.metadata")) and not list(step.rglob("*.pt"))  # no pickles
    assert len(list((step / "state" / "policy").glob("shard-*.safetensors"))) == 2
    marker = tmp_path / "pwned"
    for folder in (step / "state" / "policy", step):
        plant_pickle(folder / ".metadata", marker)
    reseal(step)
    for world_size in (1, 2):
        resumed = check_ok(
            launch(_worker, world_size, tmp_path / f"resume{world_size}", ckpt, False)
        )
        _compare(first, resumed, 2, world_size)
    assert not marker.exists()
    assert not torch.equal(
        first[0]["state"]["lm_head.weight"], tiny_llama().state_dict()["lm_head.weight"]
    )


def test_checkpoint_from_one_process_resumes_on_two_ranks(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = check_ok(launch(_worker, 1, tmp_path / "save", ckpt, True))
    resumed = check_ok(launch(_worker, 2, tmp_path / "resume", ckpt, False))
    _compare(first, resumed, 1, 2)


def test_checkpoint_from_fsdp_over_tp_resumes_on_one_process(tmp_path):
    """FSDP2 over TP shards each TP shard again over dp (``_StridedShard``, which is not a
    ``Shard``): every dp rank writes its own rows of the optimizer state, so the shards cover
    the whole tensors and one process resumes to the same next step."""
    ckpt = tmp_path / "ckpt"
    first = check_ok(launch(_worker, 4, tmp_path / "save", ckpt, True, 2))
    assert len(list((ckpt / "step_1" / "state" / "policy").glob("shard-*.safetensors"))) == 4
    resumed = check_ok(launch(_worker, 1, tmp_path / "resume", ckpt, False))
    _compare(first, resumed, 4, 1, tp_first=2)
