"""otbrl.config: schema, YAML + overrides, and the schema-level validation errors."""

import pytest

from otbrl.config import Config, ConfigError, all_keys, load_config, to_dict

ISSUE_KEYS = {
    "data": [
        "train_files",
        "val_files",
        "task",
        "train_batch_size",
        "max_prompt_length",
        "max_response_length",
        "seed",
    ],
    "model": ["path", "precision", "gradient_checkpointing", "use_remove_padding"],
    "rollout": ["name", "n", "temperature", "top_p", "top_k"],
    "actor": [
        "lr",
        "ppo_epochs",
        "ppo_mini_batch_size",
        "micro_batch_size",
        "clip_ratio_low",
        "clip_ratio_high",
        "clip_ratio_c",
        "loss_agg_mode",
        "entropy_coeff",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
        "grad_clip",
        "use_fused_kernels",
        "calculate_sum_pi_squared",
    ],
    "algorithm": [
        "adv_estimator",
        "gamma",
        "lam",
        "norm_adv_by_std_in_grpo",
        "handle_zero_tail",
        "use_kl_in_reward",
        "kl_coef",
    ],
    "reward": ["function", "on_error"],
    "trainer": [
        "total_steps",
        "val_every",
        "save_every",
        "output_dir",
        "logger",
        "seed",
        "resume",
    ],
}


def test_schema_has_every_key_the_issue_names():
    keys = set(all_keys())
    for group, names in ISSUE_KEYS.items():
        for name in names:
            assert f"{group}.{name}" in keys


def test_defaults():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.algorithm.adv_estimator == "optimal_token_baseline"
    assert cfg.actor.calculate_sum_pi_squared == "auto"
    assert cfg.model.path == "builtin"
    assert cfg.rollout.max_new_tokens == cfg.data.max_response_length


def test_yaml_then_overrides_last_wins(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  lr: 0.01\n  ppo_epochs: 2\ndata:\n  max_response_length: 5\n")
    cfg = load_config(path, ["actor.lr=0.02", "actor.calculate_sum_pi_squared=true"])
    assert cfg.actor.lr == 0.02 and cfg.actor.ppo_epochs == 2
    # the interpolation follows the overridden response length
    assert cfg.rollout.max_new_tokens == 5
    # YAML/CLI booleans are normalized to the three documented strings
    assert cfg.actor.calculate_sum_pi_squared == "true"
    assert (
        load_config(None, ["actor.calculate_sum_pi_squared=False"]).actor.calculate_sum_pi_squared
        == "false"
    )


def test_list_shorthand_and_round_trip():
    cfg = load_config(None, ["data.train_files=a.parquet", "trainer.logger=[jsonl]"])
    assert cfg.data.train_files == ["a.parquet"] and cfg.trainer.logger == ["jsonl"]
    plain = to_dict(cfg)
    assert plain["data"]["train_files"] == ["a.parquet"]
    assert plain["rollout"]["max_new_tokens"] == cfg.data.max_response_length


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["actor.lrr=1"], "actor.lrr", "did you mean 'actor.lr'"),
        (["algorithm.adv_estimater=grpo"], "algorithm.adv_estimater", "algorithm.adv_estimator"),
        (["actr.lr=1"], "actr.lr", "did you mean 'actor.lr'"),
        # a misspelt group is matched against the groups first (was: 'trainer.seed')
        (["trainr.total_steps=5"], "trainr.total_steps", "did you mean 'trainer.total_steps'"),
        (["rolout.vllm.kv_cache_gb=2"], "rolout.vllm.kv_cache_gb", "'rollout.vllm.kv_cache_gib'"),
        (["actor.lr=abc"], "actor.lr", "abc"),
        (["actor.ppo_epochs=1.5"], "actor.ppo_epochs", "1.5"),
        (["actor.loss_agg_mode=token_mean"], "actor.loss_agg_mode", "did you mean 'token-mean'"),
        (["actor.calculate_sum_pi_squared=maybe"], "actor.calculate_sum_pi_squared", "maybe"),
        (["algorithm.otb.energy=flat"], "algorithm.otb.energy", "flat"),
        (["reward.on_error=ignore"], "reward.on_error", "ignore"),
        (["trainer.logger=[console,stdout]"], "trainer.logger", "stdout"),
        (["data.train_batch_size=0"], "data.train_batch_size", "> 0"),
        (["trainer.val_every=-1"], "trainer.val_every", ">= 0"),
        (["rollout.top_p=1.5"], "rollout.top_p", "1.5"),
        (
            ["data.train_batch_size=30", "actor.ppo_mini_batch_size=16"],
            "actor.ppo_mini_batch_size",
            "divisor",
        ),
        (["actor.ppo_mini_batch_size=0"], "actor.ppo_mini_batch_size", "divisor"),
        (["critic.enable=maybe"], "critic.enable", "maybe"),
        (["critic.lr=0"], "critic.lr", "> 0"),
        (["actor.strategy=ddp"], "actor.strategy", "ddp"),
        (["trainer.resume=/no/such/ckpt"], "trainer.resume", "/no/such/ckpt"),
        (["reward.function=/no/such.py:fn"], "reward.function", "/no/such.py"),
        (["justakey"], "justakey", "key=value"),
    ],
)
def test_bad_input_is_one_line_naming_the_key(overrides, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    assert key in message and fragment in message
    assert info.value.key == key


def test_bad_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad)
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  total_step: 3\n")
    with pytest.raises(ConfigError, match=r"did you mean 'trainer\.total_steps'"):
        load_config(typo)


def test_batch_sizes_that_work_are_accepted():
    """The mini-batch defaults to the whole step batch and the micro-batch size is a cap, so
    sizes that used to need hand-made divisibility load as they are."""
    cfg = load_config(None, ["data.train_batch_size=30", "rollout.n=3"])
    assert cfg.actor.ppo_mini_batch_size is None
    load_config(None, ["rollout.n=3", "actor.ppo_mini_batch_size=32", "actor.micro_batch_size=64"])
    assert load_config(None, ["critic.enable=true"]).critic.enable == "true"


def test_a_renamed_key_still_loads_under_its_old_name(tmp_path):
    """``actor.engine`` became ``actor.strategy`` ("engine" names the Engine): the old name
    loads from the command line, a config file, a saved configuration and a resumed run's
    manifest, with a FutureWarning naming the new one; both names at once are refused."""
    from otbrl.config import upgrade_saved
    from otbrl.config.resume import config_differences

    with pytest.warns(FutureWarning, match=r"'actor\.engine' is now 'actor\.strategy'"):
        assert load_config(None, ["actor.engine=fsdp"]).actor.strategy == "fsdp"
    path = tmp_path / "old.yaml"
    path.write_text("actor:\n  engine: tp\n  tensor_parallel_size: 2\n")
    with pytest.warns(FutureWarning, match=r"'actor\.engine' in '.*old\.yaml' is now"):
        assert load_config(path).actor.strategy == "tp"
    path.write_text("actor:\n  engine: tp\n  strategy: fsdp\n")
    with pytest.raises(ConfigError, match=r"'actor\.engine' and 'actor\.strategy' both set"):
        load_config(path)
    saved = {"actor": {"engine": "fsdp", "lr": 1e-5}, "model": {"path": "builtin"}}
    assert load_config(None, base=saved).actor.strategy == "fsdp"
    assert upgrade_saved(saved)["actor"] == {"strategy": "fsdp", "lr": 1e-5}
    assert saved["actor"] == {"engine": "fsdp", "lr": 1e-5}  # the caller's dict is kept
    current = to_dict(load_config(None, ["actor.strategy=fsdp"]))
    actor = {("engine" if k == "strategy" else k): v for k, v in current["actor"].items()}
    assert config_differences({**current, "actor": actor}, current) == {}
