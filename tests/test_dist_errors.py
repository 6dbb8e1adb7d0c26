"""Single-process checks of the distributed helpers: bad input, layout arithmetic, errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from dist_utils import tiny_llama


class FakeMesh:
    """Stands in for a 1-D DeviceMesh where only its size and this rank's index matter."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank


def test_build_mesh_rejects_bad_layouts():
    from otbrl.engine.parallel import build_mesh

    with pytest.raises(ValueError, match="world_size"):
        build_mesh(0)
    with pytest.raises(ValueError, match="sp, tp"):
        build_mesh(4, sp=2, tp=2)
    with pytest.raises(ValueError, match="dp"):
        build_mesh(4, dp=3)
    with pytest.raises(ValueError, match="world_size: expected a multiple of sp"):
        build_mesh(3, tp=2)


def test_init_distributed_rejects_bad_arguments(monkeypatch):
    from otbrl.engine.world import init_distributed

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="timeout_s"):
        init_distributed(timeout_s=0)
    with pytest.raises(ValueError, match="backend"):
        init_distributed(backend="mpi")
    with pytest.raises(ValueError, match="rank"):
        init_distributed(rank=2, world_size=2)
    with pytest.raises(ValueError, match="init_method"):
        init_distributed(rank=0, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        init_distributed()


def test_apply_tp_checks_the_model():
    from otbrl.engine.parallel import apply_tp, decoder_layers

    with pytest.raises(ValueError, match=r"num_attention_heads.*TP size 3"):
        apply_tp(tiny_llama(), FakeMesh(3))
    with pytest.raises(TypeError, match="model"):
        decoder_layers(nn.Linear(2, 2))


@pytest.mark.parametrize(("vocab", "tp"), [(64, 2), (63, 2), (64, 4), (65, 4), (19, 2)])
def test_vocab_shards_tile_the_vocabulary_like_torch_chunk(vocab, tp):
    from otbrl.engine.parallel import vocab_shard_range

    model = nn.Module()
    model.lm_head = nn.Linear(4, vocab, bias=False)
    ranges = [vocab_shard_range(model, FakeMesh(tp, r)) for r in range(tp)]
    sizes = [len(c) for c in torch.arange(vocab).chunk(tp)]
    sizes += [0] * (tp - len(sizes))  # torch.chunk may return fewer chunks
    assert [end - start for start, end in ranges] == sizes
    assert ranges[0][0] == 0 and ranges[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_clip_grad_norm_matches_torch_on_plain_tensors():
    from otbrl.engine.parallel import clip_grad_norm

    g = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(reference, params):
        r.grad = p.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(reference, 0.5)
    got = clip_grad_norm(params, 0.5)
    torch.testing.assert_close(got, want)
    for r, p in zip(reference, params):
        torch.testing.assert_close(p.grad, r.grad)
    assert float(got) > 0.5  # clipping happened
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(params, 0.0)


def test_block_causal_mask_matches_a_loop():
    from otbrl.engine.ulysses import block_causal_mask, packed_forward_kwargs, padded_length

    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    mask = block_causal_mask(cu, 8)
    seq = [0, 0, 0, 1, 2, 2, 2, 2]
    for i in range(8):
        for j in range(8):
            assert bool(mask[i, j]) == (seq[i] == seq[j] and j <= i)
    assert [padded_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]
    kwargs = packed_forward_kwargs(torch.tensor([0, 3, 5], dtype=torch.int32), 4)
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 3, 5, 8]  # the pad is one more sequence
    assert kwargs["max_length_q"] == 3
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_forward_kwargs(torch.tensor([3]), 2)


def test_slice_for_rank_checks_shapes():
    from otbrl.engine.ulysses import slice_for_rank

    with pytest.raises(ValueError, match="input_ids"):
        slice_for_rank(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4), None)
    with pytest.raises(ValueError, match="position_ids"):
        slice_for_rank(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 5), None)


def test_split_by_groups_checks_uid():
    from dist_utils import split_by_groups

    with pytest.raises(ValueError, match="uid"):
        split_by_groups(torch.zeros(2, 2), 0, 1)


def test_collective_guard_names_the_step():
    from otbrl.engine.world import DistributedError, collective_guard

    expected = r"during the update.*Connection closed by peer"
    with pytest.raises(DistributedError, match=expected), collective_guard("the update"):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(RuntimeError, match="shape mismatch") as info, collective_guard("update"):
        raise RuntimeError("shape mismatch")
    assert type(info.value) is RuntimeError  # not a collective failure: left alone


@pytest.mark.parametrize(
    ("overrides", "world_size", "key"),
    [
        (["actor.strategy=tp"], 2, "actor.tensor_parallel_size"),
        (["actor.strategy=fsdp", "actor.tensor_parallel_size=2"], 2, "actor.tensor_parallel_size"),
        (
            [
                "actor.strategy=tp",
                "actor.tensor_parallel_size=2",
                "actor.ulysses_sequence_parallel_size=2",
            ],
            4,
            "actor.ulysses_sequence_parallel_size",
        ),
        (["actor.strategy=tp", "actor.tensor_parallel_size=4"], 6, "actor.tensor_parallel_size"),
        (
            [
                "actor.strategy=fsdp",
                "data.train_batch_size=3",
                "actor.ppo_mini_batch_size=3",
                "actor.micro_batch_size=4",
            ],
            2,
            "data.train_batch_size",
        ),
        (["actor.strategy=single"], 2, "actor.strategy"),
        (
            ["actor.ulysses_sequence_parallel_size=2", "actor.strategy=single"],
            1,
            "actor.ulysses_sequence_parallel_size",
        ),
        (["actor.use_fused_kernels=true"], 2, "actor.use_fused_kernels"),
    ],
)
def test_parallel_config_errors_name_the_key(overrides, world_size, key):
    from otbrl.config import ConfigError, load_config
    from otbrl.run.plan import plan_run

    cfg = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        plan_run(cfg, world_size)
    assert info.value.key == key and key in str(info.value)


def test_parallel_defaults_fit_any_world_size():
    """strategy=auto picks FSDP2 on several processes, one process otherwise; the micro-batch
    size is a cap (8 > each rank's 4 sequences is fine)."""
    from otbrl.config import load_config
    from otbrl.run.plan import plan_run

    small = ["data.train_batch_size=4", "rollout.n=2", "actor.micro_batch_size=8"]
    assert plan_run(load_config(None, small), 2).spec.dims.strategy == "fsdp"
    assert plan_run(load_config(None, small), 1).spec.dims.strategy == "single"
    tp = plan_run(load_config(None, ["actor.tensor_parallel_size=2"]), 4)
    assert tp.spec.dims.strategy == "tp" and tp.spec.dims.dp == 2 and tp.spec.mini_batch_size == 32


def test_warm_start_comes_before_the_process_group_and_its_timeout_is_configured(
    monkeypatch, tmp_path
):
    """The warm start (minutes of one-rank SFT) runs before any process group exists: ranks
    wait on its cache lock, not in a collective with a timeout; trainer.dist_timeout_s reaches
    start_world."""
    import otbrl.run.trainer as trainer_mod
    from otbrl.config import load_config

    events = []

    class Stop(Exception):
        pass

    def fake_model_path(cfg):
        events.append(("warm start", torch.distributed.is_initialized()))
        return tmp_path / "model"

    def fake_start_world(dims, *, timeout_s):
        events.append(("start_world", timeout_s))
        raise Stop

    monkeypatch.setattr(trainer_mod, "model_path", fake_model_path)
    monkeypatch.setattr(trainer_mod, "start_world", fake_start_world)
    overrides = [f"trainer.output_dir={tmp_path / 'run'}", "trainer.dist_timeout_s=77"]
    with pytest.raises(Stop):
        trainer_mod.Trainer(load_config(None, overrides))
    assert events == [("warm start", False), ("start_world", 77.0)]
    assert load_config(None, []).trainer.dist_timeout_s == 1800.0
