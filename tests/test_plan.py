"""Plan, then build: the layout owner, the one table of sources, and the CLI using the plan it
made (the data read once, a built-in task's preset applied by every command)."""

from __future__ import annotations

from pathlib import Path

import pytest

from otbrl import cli
from otbrl.config import ConfigError, load_config
from otbrl.data import get_task, write_parquet_rows
from otbrl.engine.dims import ParallelDims
from otbrl.models import build_tiny_model
from otbrl.ops.token_stats import HEAD_OUTPUTS
from otbrl.run.needs import SOURCES
from otbrl.run.plan import plan_run
from tiny_models import ONE_LAYER


@pytest.mark.parametrize(
    ("kwargs", "strategy", "dp"),
    [
        ({}, "single", 1),
        ({"world_size": 4}, "fsdp", 4),
        ({"world_size": 4, "sp": 2}, "fsdp", 2),
        ({"world_size": 4, "tp": 2}, "tp", 2),
        ({"world_size": 1, "strategy": "fsdp"}, "fsdp", 1),
    ],
)
def test_parallel_dims_resolve_the_strategy_and_the_data_parallel_size(kwargs, strategy, dp):
    dims = ParallelDims(**kwargs)
    assert (dims.strategy, dims.dp) == (strategy, dp)
    assert dims.mesh_shape() == (dp, dims.sp, dims.tp)
    assert dims.distributed == (dims.world_size > 1 or strategy != "single")


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"world_size": 2, "strategy": "single"}, "actor.strategy"),
        ({"strategy": "tp"}, "actor.tensor_parallel_size"),
        ({"world_size": 2, "tp": 2, "strategy": "fsdp"}, "actor.tensor_parallel_size"),
        ({"world_size": 4, "tp": 2, "sp": 2}, "actor.ulysses_sequence_parallel_size"),
        ({"world_size": 3, "sp": 2}, "actor.tensor_parallel_size"),
        ({"world_size": 2, "fused": True}, "actor.use_fused_kernels"),
        ({"strategy": "ddp"}, "actor.strategy"),
        ({"tp": 0}, "actor.tensor_parallel_size"),
    ],
)
def test_parallel_dims_refuse_bad_layouts_naming_the_key(kwargs, key):
    with pytest.raises(ConfigError) as info:
        ParallelDims(**kwargs)
    assert info.value.key == key and key in str(info.value)


def test_parallel_dims_split_batches_over_data_parallel_ranks():
    dims = ParallelDims(world_size=4, tp=2)
    dims.check_divisible("data.train_batch_size", 6)
    with pytest.raises(ConfigError, match="data-parallel size 2") as info:
        dims.check_divisible("data.train_batch_size", 5)
    assert info.value.key == "data.train_batch_size"


def test_the_plan_asks_each_engine_for_what_its_sources_list():
    cfg = load_config(None, ["algorithm.adv_estimator=optimal_token_baseline",
                             "actor.use_kl_loss=true"])  # fmt: skip
    plan = plan_run(cfg)
    assert plan.spec.outputs("policy") == {"log_probs", "entropy", "sum_pi_squared"}
    assert (
        plan.spec.outputs("reference") == {"log_probs"}
        and plan.spec.outputs("critic") == frozenset()
    )
    assert plan.spec.batch_stats("reference", {"log_probs": 1}) == {"ref_log_probs": 1}
    stats = plan.spec.batch_stats("policy", {"log_probs": 1, "entropy": 2, "sum_pi_squared": 3})
    assert stats == {"old_log_probs": 1, "entropy": 2, "sum_pi_squared": 3}
    grpo = plan_run(load_config(None, ["algorithm.adv_estimator=grpo"]))
    assert grpo.spec.outputs("policy") == {"log_probs", "entropy"}
    assert not grpo.spec.uses("reference")
    # critic.enable=true with GRPO: the critic is trained, so its values are a need
    critic = plan_run(load_config(None, ["critic.enable=true"]))
    assert critic.spec.uses("critic") and critic.spec.outputs("critic") == {"values"}
    heads = {"policy": "policy", "reference": "policy", "teacher": "policy", "critic": "value"}
    for src in SOURCES.values():  # every source names an output its engine's head can compute
        if src.engine in heads:
            assert src.output in HEAD_OUTPUTS[heads[src.engine]], src
    assert {s.engine for s in SOURCES.values()} == {"policy", "reference", "teacher", "critic",
                                                    "reward_model"}  # fmt: skip
    assert not critic.spec.uses("reward_model")
    assert critic.spec.outputs("reward_model") == frozenset()


def test_eval_reads_each_data_file_once(tmp_path, monkeypatch, capsys):
    """``otbrl eval`` evaluates the rows of the plan the CLI made: no second validation, no
    second read of the parquet files."""
    import otbrl.run.plan as plan_mod

    model = build_tiny_model(tmp_path / "model", **ONE_LAYER)
    task = get_task("arithmetic")
    train = write_parquet_rows(task.rows("train", 8, seed=0), tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 4, seed=0), tmp_path / "val.parquet")
    reads = []
    real = plan_mod.read_parquet_rows

    def counting(files):
        reads.append(tuple(str(f) for f in files))
        return real(files)

    monkeypatch.setattr(plan_mod, "read_parquet_rows", counting)
    argv = ["eval", f"model.path={model}", f"data.train_files=[{train}]",
            f"data.val_files=[{val}]", "data.train_batch_size=4",
            "data.max_response_length=4"]  # fmt: skip
    assert cli.main(argv) == 0
    assert sorted(reads) == sorted([(str(train),), (str(val),)])
    assert "on 4 prompts" in capsys.readouterr().out


def test_train_applies_a_built_in_tasks_preset(tmp_path, monkeypatch):
    """``otbrl train data.task=tool_arithmetic`` trains with no extra key (it used to ask for
    data.max_response_length): the task's preset comes first, as in ``otbrl demo``, and the
    user's overrides still win."""
    import otbrl.run.trainer as trainer_mod

    seen = {}

    class Stop(Exception):
        pass

    def stop(self, cfg, plan=None, run_dir=None):
        seen["cfg"], seen["plan"] = cfg, plan
        run_dir.release()
        raise Stop

    monkeypatch.setattr(trainer_mod.Trainer, "__init__", stop)
    out = f"trainer.output_dir={tmp_path / 'run'}"
    with pytest.raises(Stop):
        cli.main(["train", "data.task=tool_arithmetic", out, "trainer.total_steps=7"])
    cfg = seen["cfg"]
    assert cfg.rollout.multi_turn.tools == ["calculator"]
    assert cfg.data.max_response_length == 32 and cfg.trainer.total_steps == 7
    assert set(seen["plan"].tools) == {"calculator"}


def test_resolve_is_pure_and_takes_every_decision(tmp_path, monkeypatch):
    """resolve opens no file and no socket, loads no tokenizer or model: a config naming files
    and a model that do not exist and servers nobody runs still resolves; the decisions the
    trainer follows are in the spec."""
    import builtins
    import socket

    import otbrl.run.spec as spec_module

    missing = tmp_path / "nowhere"
    cfg = load_config(
        None,
        [
            f"model.path={missing}/model",
            f"data.train_files=[{missing}/train.parquet]",
            "rollout.name=vllm", "rollout.mode=server",
            "rollout.server.urls=[http://10.255.255.1:8000]",
            "algorithm.adv_estimator=optimal_token_baseline", "algorithm.off_policy=tis",
            "algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0.05",
            "data.overlong_prompts=truncate_left", "rollout.n=4", "rollout.temperature=0.7",
            "trainer.val_greedy=false", "trainer.val_temperature=0.5",
            "data.train_batch_size=8", "actor.ppo_mini_batch_size=4", "trainer.max_staleness=1",
        ],
    )  # fmt: skip

    def refuse(*args, **kwargs):
        raise AssertionError(f"resolve did I/O: {args[:1]}")

    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    spec = spec_module.resolve(cfg, world_size=2)
    monkeypatch.undo()
    assert {"sum_pi_squared", "ref_log_probs", "old_log_probs"} <= spec.needs
    assert (spec.dims.dp, spec.mini_batch_size) == (2, 4)
    assert spec.correction == "token_tis" and spec.kl_in_reward_coef == 0.05
    assert spec.estimator == "optimal_token_baseline" and spec.overlong == "truncate_left"
    assert spec.estimator_options["energy"] == "logit_gradient"
    assert (spec.sampling.n, spec.sampling.temperature) == (4, 0.7)
    assert (spec.validation.n, spec.validation.greedy, spec.validation.temperature) == (
        1, False, 0.5,
    )  # fmt: skip
    # what build makes: the engines and how each runs, where the weights come from, the sync
    policy = spec.engines["policy"]
    assert set(spec.engines) == {"policy", "reference"}  # the KL reward needs the reference
    assert policy.optim is not None and policy.mini_batch_size == 4 * 4  # prompts x n
    assert policy.spec.temperature == 0.7 and spec.engines["reference"].optim is None
    assert spec.model.path == f"{missing}/model" and spec.model.warm_start is None
    assert spec.sync_at_start and spec.trainer.max_staleness == 1  # a server may hold others
    assert spec.record["rollout"]["n"] == 4  # the config, kept as a record
    # and it refuses what the config alone rules out, naming the key
    with pytest.raises(ConfigError, match=r"critic\.enable") as err:
        spec_module.resolve(
            load_config(None, ["algorithm.adv_estimator=gae", "critic.enable=false"])
        )
    assert err.value.key == "critic.enable"


@pytest.mark.parametrize(("items", "dp"), [(8, 4), (10, 4), (3, 4), (0, 2), (5, 1)])
def test_one_sharding_rule_covers_every_item_once(items, dp):
    """Training (even) and validation (uneven) shard by the same rule: contiguous shares in
    rank order that together are the items, each once, sizes differing by at most one."""
    from otbrl.engine.world import World

    class Rank(World):
        def __init__(self, rank):
            super().__init__()
            self._rank = rank

        dp_rank = property(lambda self: self._rank)
        dp_size = property(lambda self: dp)

    rows = list(range(items))
    shares = [Rank(r).shard(rows, even=False) for r in range(dp)]
    assert [x for share in shares for x in share] == rows
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    if items % dp:
        with pytest.raises(ValueError, match="multiple of the data-parallel size"):
            Rank(0).shard(rows)
    else:
        assert [Rank(r).shard(rows) for r in range(dp)] == shares


@pytest.mark.parametrize("task", ["arithmetic", "tool_arithmetic"])
def test_the_plan_loads_the_one_tokenizer_the_model_was_saved_with(tmp_path, task):
    """The run loads its tokenizer once, in the plan, and its models with it: for the built-in
    model the plan builds the task's tokenizer, which must be the one the (warm-started) model
    directory holds; for a user's model it is that directory's, set up for left padding."""
    from otbrl.models import load_model_and_tokenizer
    from otbrl.run.plan import plan_tokenizer

    path = build_tiny_model(tmp_path / task, task=task, **ONE_LAYER)
    _, saved = load_model_and_tokenizer(path)
    text = [{"role": "user", "content": "12+34="}]
    for cfg in (
        load_config(None, ["model.path=builtin", f"data.task={task}"]),
        load_config(None, [f"model.path={path}", f"data.task={task}"]),
    ):
        planned = plan_tokenizer(cfg)
        assert planned.get_vocab() == saved.get_vocab()
        assert (planned.pad_token_id, planned.eos_token_id, planned.padding_side) == (
            saved.pad_token_id,
            saved.eos_token_id,
            "left",
        )
        assert planned.apply_chat_template(text, tokenize=False) == saved.apply_chat_template(
            text, tokenize=False
        )
        batch = planned(["12+3=", "1="], padding=True)["input_ids"]
        assert batch == saved(["12+3=", "1="], padding=True)["input_ids"]


def test_runs_sharing_a_weights_dir_get_their_own_buckets(tmp_path):
    """A shared ``rollout.server.weights_dir`` (the multi-host recipe of docs/rollout.md) holds one
    directory per run and rank: on main every run's rank r wrote (and deleted) ``rank-r``."""
    from types import SimpleNamespace

    from otbrl.run.build import weights_subdir
    from otbrl.run.spec import resolve

    def subdir(out, rank):
        spec = resolve(load_config(None, [f"trainer.output_dir={out}"]))
        return weights_subdir(spec, "/shared/w", SimpleNamespace(dp_rank=rank))

    a, b = subdir(tmp_path / "a", 0), subdir(tmp_path / "b", 0)
    assert a != b and a.parent.parent == b.parent.parent == Path("/shared/w")
    assert subdir(tmp_path / "a", 1) == a.parent / "rank-1"
    assert subdir(tmp_path / "x" / ".." / "a", 0) == a  # the same run, however it is written


def test_weight_buckets_without_room_say_so_before_writing(tmp_path, monkeypatch):
    """A weights dir without room for a bucket (a container's small /dev/shm) is one error
    naming the directory, the sizes and what to change, raised before a byte is written; the
    server backend turns it into its one-line ServerError."""
    import errno
    import shutil
    from collections import namedtuple

    import torch

    import otbrl.rollout.weight_buckets as buckets

    weights = [("a.weight", torch.zeros(256, 256)), ("b.weight", torch.zeros(256))]
    manifest = buckets.write_buckets(tmp_path, iter(weights), bucket_bytes=1 << 20)
    assert [e["tensors"] for e in manifest] == [2]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1 << 10))
    with pytest.raises(OSError, match=r"has 0\.0 MiB free.*rollout\.server\.weights_dir") as err:
        buckets.write_buckets(tmp_path, iter(weights), bucket_bytes=1 << 20)
    assert err.value.errno == errno.ENOSPC
    assert not list(tmp_path.iterdir())  # the old buckets went, no torn new one came
