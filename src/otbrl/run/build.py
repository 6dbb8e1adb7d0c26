"""From a ``Config`` to a run: validated once, before any model loads, then built.

``validate_config`` decides everything that can be known from the configuration and the file
system: the estimator and its needs, which engine provides each need (so a need no layer
provides is a one-line ``ConfigError`` naming the key to set, not a crash deep in a run), the
engine for this world size, the batch sizes, the user's reward function (imported once), and
the data: every file read and every row checked (schema, ground truth, a reward for its
``data_source``) now, not when the row is first sampled hours into a run. It returns a
``Plan`` that the ``Trainer`` builds from.
"""

from __future__ import annotations

import difflib
import functools
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from otbrl.algos import losses
from otbrl.algos.advantages import ESTIMATORS, get_estimator
from otbrl.config import Config, ConfigError
from otbrl.data import get_task, read_parquet_rows
from otbrl.rewards import BUILTIN_REWARDS, DATA_SOURCE_REWARDS, resolve_reward_function
from otbrl.run.outputs import check_backends
from otbrl.run.rollout_setup import check_row_tools, check_tools

# estimator option -> the config key that sets it
ESTIMATOR_OPTION_KEYS = {
    "gamma": "algorithm.gamma",
    "lam": "algorithm.lam",
    "norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "handle_zero_tail": "algorithm.handle_zero_tail",
    "leave_one_out": "algorithm.otb.leave_one_out",
    "energy": "algorithm.otb.energy",
}
# who supplies each batch statistic, and the key that switches the provider on
PROVIDERS = {
    "old_log_probs": ("policy", None),
    "entropy": ("policy", None),
    "sum_pi_squared": ("policy", "actor.calculate_sum_pi_squared"),
    "ref_log_probs": ("reference", "actor.use_kl_loss"),
    "values": ("critic", "critic.enable"),
}
# the policy engine's output name for each batch statistic it supplies
POLICY_STATS = {
    "old_log_probs": "log_probs",
    "entropy": "entropy",
    "sum_pi_squared": "sum_pi_squared",
}


@dataclass(frozen=True)
class Plan:
    """What ``validate_config`` decided; the ``Trainer`` builds exactly this.

    ``needs``: batch statistics the estimator and the enabled metrics need. ``engine``: the
    resolved ``actor.engine`` for ``world_size`` processes. ``mini_batch_size``: prompts per
    optimizer step. ``reward_fn``: the resolved ``reward.function`` (None: by data_source).
    ``train_rows`` / ``val_rows``: the checked data rows (``load_rows``).
    ``tools``: the resolved ``rollout.multi_turn.tools`` (None when empty: single-turn).
    """

    needs: frozenset[str]
    engine: str
    world_size: int
    mini_batch_size: int
    use_reference: bool
    use_critic: bool
    reward_fn: Any = None
    train_rows: list = field(default_factory=list, repr=False)
    val_rows: list = field(default_factory=list, repr=False)
    tools: Any = None  # {name: otbrl.tools.Tool} of rollout.multi_turn.tools; None: single-turn

    @property
    def distributed(self) -> bool:
        """A process group is needed: several processes, or a sharded engine asked for."""
        return self.world_size > 1 or self.engine != "single"

    @property
    def policy_outputs(self) -> frozenset[str]:
        """The policy engine's outputs for the old-statistics forward."""
        return frozenset(POLICY_STATS[k] for k in self.needs if k in POLICY_STATS)


def estimator_options(cfg: Config) -> dict:
    """Options that change what the configured estimator computes (and may change its needs)."""
    return {
        option: functools.reduce(getattr, key.split("."), cfg)
        for option, key in ESTIMATOR_OPTION_KEYS.items()
    }


def stat_needs(cfg: Config) -> frozenset[str]:
    """The statistics the estimator (with its options), the losses and the enabled metrics
    need: ``entropy`` feeds ``policy/entropy_mean`` (always on); Σπ² is needed by OTB and, with
    ``actor.calculate_sum_pi_squared=true``, by the variance-proxy metrics of any estimator."""
    estimator = get_estimator(cfg.algorithm.adv_estimator)
    needs = set(estimator.needs_for(**estimator_options(cfg))) | {"old_log_probs", "entropy"}
    if cfg.actor.calculate_sum_pi_squared == "true":
        needs.add("sum_pi_squared")
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        needs.add("ref_log_probs")
    return frozenset(needs)


def _check_providers(cfg: Config, needs: frozenset[str], use_critic: bool) -> None:
    """Every need has a provider that is switched on; else a ConfigError naming the key."""
    name = cfg.algorithm.adv_estimator
    for need in sorted(needs):
        if need not in PROVIDERS:
            raise ConfigError(
                f"'algorithm.adv_estimator' '{name}' needs '{need}', which no engine provides "
                f"(providers: {sorted(PROVIDERS)})",
                "algorithm.adv_estimator",
            )
    if "sum_pi_squared" in needs and cfg.actor.calculate_sum_pi_squared == "false":
        raise ConfigError(
            f"'actor.calculate_sum_pi_squared' is false but 'algorithm.adv_estimator' "
            f"'{name}' needs Σπ²; use 'auto' or 'true'",
            "actor.calculate_sum_pi_squared",
        )
    if "values" in needs and not use_critic:
        raise ConfigError(
            f"'critic.enable' is false but 'algorithm.adv_estimator' '{name}' needs values "
            "from a critic; use 'auto' or 'true'",
            "critic.enable",
        )


def _resolve_engine(cfg: Config, world_size: int) -> str:
    a = cfg.actor
    tp, sp = a.tensor_parallel_size, a.ulysses_sequence_parallel_size
    engine = a.engine
    if engine == "auto":
        engine = "tp" if tp > 1 else ("fsdp" if world_size > 1 or sp > 1 else "single")
    if engine == "single" and world_size > 1:
        raise ConfigError(
            f"'actor.engine' is 'single' but torchrun started {world_size} processes; use "
            "actor.engine=auto (FSDP2), fsdp or tp",
            "actor.engine",
        )
    if engine == "tp" and tp < 2:
        raise ConfigError(
            "'actor.tensor_parallel_size' must be > 1 with actor.engine=tp",
            "actor.tensor_parallel_size",
        )
    if engine != "tp" and tp > 1:
        raise ConfigError(
            "'actor.tensor_parallel_size' > 1 needs actor.engine=tp (or auto)",
            "actor.tensor_parallel_size",
        )
    if engine == "single" and sp > 1:
        raise ConfigError(
            "'actor.ulysses_sequence_parallel_size' > 1 needs a sharded engine (auto or fsdp)",
            "actor.ulysses_sequence_parallel_size",
        )
    if tp > 1 and sp > 1:
        raise ConfigError(
            "'actor.ulysses_sequence_parallel_size' > 1 cannot be combined with tensor parallel",
            "actor.ulysses_sequence_parallel_size",
        )
    if world_size % (tp * sp):
        raise ConfigError(
            f"'actor.tensor_parallel_size' x 'actor.ulysses_sequence_parallel_size' ({tp * sp}) "
            f"must divide the number of processes ({world_size})",
            "actor.tensor_parallel_size",
        )
    if engine != "single" and a.use_fused_kernels:
        raise ConfigError(
            "'actor.use_fused_kernels' is supported by the single-process engine only",
            "actor.use_fused_kernels",
        )
    return engine


def _check_batch_sizes(cfg: Config, engine: str, world_size: int) -> int:
    """Prompts per optimizer step, after the checks that need the data-parallel size."""
    a = cfg.actor
    mini = a.ppo_mini_batch_size or cfg.data.train_batch_size
    dp = world_size // (a.tensor_parallel_size * a.ulysses_sequence_parallel_size)
    for key, value in (
        ("data.train_batch_size", cfg.data.train_batch_size),
        ("actor.ppo_mini_batch_size", mini),
    ):
        if value % dp:
            raise ConfigError(
                f"'{key}' ({value} prompts) must be divisible by the data-parallel size {dp}", key
            )
    return mini


def _check_files(cfg: Config) -> None:
    for key in ("train_files", "val_files"):
        for file in getattr(cfg.data, key):
            if not Path(file).is_file():
                raise ConfigError(f"'data.{key}' file not found: '{file}'", f"data.{key}")
    for key, path in (("model.path", cfg.model.path), ("critic.model_path", cfg.critic.model_path)):
        if path not in (None, "builtin") and not (Path(path) / "config.json").is_file():
            raise ConfigError(
                f"'{key}' must be 'builtin' or a local HF model directory with config.json, "
                f"got '{path}'",
                key,
            )


def _check_task(cfg: Config) -> None:
    try:
        task = get_task(cfg.data.task)
    except ValueError as err:
        raise ConfigError(f"'data.task': {err}", "data.task") from None
    longest = task.max_response_chars + 1  # + EOS: a shorter cap truncates right answers
    if cfg.data.max_response_length < longest:
        raise ConfigError(
            f"'data.max_response_length' ({cfg.data.max_response_length}) is shorter than "
            f"the {task.name} task's longest answer ({task.max_response_chars} characters "
            f"+ EOS): set data.max_response_length={longest}",
            "data.max_response_length",
        )


def validate_config(cfg: Config, world_size: int | None = None) -> Plan:
    """Every check that needs the registries, the file system or the world size; returns the
    ``Plan``. Runs once, before any model is loaded; raises ``ConfigError`` naming the key.

    ``world_size`` defaults to torchrun's ``WORLD_SIZE`` (1 without torchrun).
    """
    name = cfg.algorithm.adv_estimator
    if name not in ESTIMATORS:
        close = difflib.get_close_matches(name, list(ESTIMATORS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"'algorithm.adv_estimator' must be one of {sorted(ESTIMATORS)}, got '{name}'{hint}",
            "algorithm.adv_estimator",
        )
    if cfg.actor.kl_loss_type not in losses.KL_KINDS:
        raise ConfigError(
            f"'actor.kl_loss_type' must be one of {sorted(losses.KL_KINDS)}, got "
            f"'{cfg.actor.kl_loss_type}'",
            "actor.kl_loss_type",
        )
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    _check_files(cfg)
    try:  # an optional logger package missing is reported now, not after the model loads
        check_backends(cfg.trainer.logger)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"'trainer.logger': {err}", "trainer.logger") from None
    if not cfg.data.train_files:
        _check_task(cfg)
    reward_fn = None
    if cfg.reward.function is not None:
        try:
            reward_fn = resolve_reward_function(cfg.reward.function)
        except (ValueError, TypeError, ImportError, AttributeError) as err:
            raise ConfigError(f"'reward.function': {err}", "reward.function") from None
    tools = check_tools(cfg)
    if cfg.rollout.name == "vllm":
        from otbrl.rollout import check_vllm_installed

        try:
            check_vllm_installed()
        except ImportError as err:
            raise ConfigError(f"'rollout.name': {err}", "rollout.name") from None
    needs = stat_needs(cfg)
    use_critic = cfg.critic.enable == "true" or (cfg.critic.enable == "auto" and "values" in needs)
    _check_providers(cfg, needs, use_critic)
    engine = _resolve_engine(cfg, world_size)
    mini = _check_batch_sizes(cfg, engine, world_size)
    train_rows, val_rows = load_rows(cfg)
    if reward_fn is None:
        _check_rewards_resolvable(train_rows + val_rows)
    if tools:
        check_row_tools(train_rows + val_rows, tools)
    if len(train_rows) < cfg.data.train_batch_size:
        raise ConfigError(
            f"'data.train_batch_size' ({cfg.data.train_batch_size}) is larger than the training "
            f"data ({len(train_rows)} rows)",
            "data.train_batch_size",
        )
    return Plan(
        needs=needs,
        engine=engine,
        world_size=world_size,
        mini_batch_size=mini,
        use_reference="ref_log_probs" in needs,
        use_critic=use_critic,
        reward_fn=reward_fn,
        train_rows=train_rows,
        val_rows=val_rows,
        tools=tools,
    )


def _check_rewards_resolvable(rows: list[dict]) -> None:
    """Without ``reward.function`` each row is scored by its data_source's built-in reward:
    every data_source must have one."""
    unknown = Counter(
        row["data_source"] for row in rows if row["data_source"] not in DATA_SOURCE_REWARDS
    )
    if not unknown:
        return
    listed = ", ".join(
        f"{source!r} ({n} row{'s' * (n > 1)})" for source, n in unknown.most_common(5)
    )
    more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
    raise ConfigError(
        f"'reward.function' is unset and {sum(unknown.values())} rows of the data have a "
        f"data_source with no built-in reward: {listed}{more} (built-in data sources: "
        f"{sorted(DATA_SOURCE_REWARDS)}); set reward.function to a built-in "
        f"({sorted(BUILTIN_REWARDS)}) or to path/to/file.py:function",
        "reward.function",
    )


def policy_loss(cfg: Config, *, regularizers: bool = True) -> losses.Loss:
    """The actor's loss from the ``actor`` group. ``regularizers=False`` leaves out the entropy
    and KL terms: the policy-gradient part alone, which ``otbrl variance`` measures — built here
    too, so the two cannot disagree (aggregation, clipping, horizon)."""
    a = cfg.actor
    return losses.build_loss(
        loss_agg_mode=a.loss_agg_mode,
        horizon=cfg.rollout.max_new_tokens,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coeff=a.entropy_coeff if regularizers else 0.0,
        kl_loss_coef=a.kl_loss_coef if a.use_kl_loss and regularizers else 0.0,
        kl_loss_type=a.kl_loss_type,
    )


def critic_loss(cfg: Config) -> losses.Loss:
    """The critic's clipped value loss."""
    return losses.build_value_loss(
        cliprange_value=cfg.critic.cliprange_value,
        loss_agg_mode=cfg.actor.loss_agg_mode,
        horizon=cfg.rollout.max_new_tokens,
    )


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, rank: int = 0) -> int:
    """The sampling seed of one step (or repeat) on one data-parallel rank: every sample is a
    function of (seed, step, rank), which makes runs resume exactly."""
    return seed * 1_000_003 + step + rank * 1_000_000_007


def warm_start(cfg: Config) -> Path:
    """The built-in model after its cached supervised warm start (``otbrl sft``)."""
    from otbrl.run.sft import ensure_warm_start

    return ensure_warm_start(
        cfg.sft.cache_dir,
        task=cfg.data.task,
        seed=cfg.trainer.seed,
        lr=cfg.sft.lr,
        batch_size=cfg.sft.batch_size,
        max_steps=cfg.sft.max_steps,
        target_accuracy=cfg.sft.target_accuracy,
        eval_every=cfg.sft.eval_every,
    )


def model_path(cfg: Config) -> Path:
    """``model.path``, or the warm-started built-in model when it is ``builtin``."""
    return warm_start(cfg) if cfg.model.path == "builtin" else Path(cfg.model.path)


def load_rows(cfg: Config) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows): from parquet files, else from the built-in task (the
    task's validation rows only when neither file list is set). A problem with a file is a
    one-line ``ConfigError`` naming the key and the file."""
    data = cfg.data
    task = None if data.train_files and data.val_files else get_task(data.task)
    train = _read_rows(cfg, "train_files") or task.rows("train", seed=data.seed)
    val = _read_rows(cfg, "val_files")
    if not val and not data.train_files:
        val = task.rows("val", data.val_size, seed=data.seed)
    return train, val


def _read_rows(cfg: Config, key: str) -> list[dict]:
    files = getattr(cfg.data, key)
    if not files:
        return []
    try:
        return read_parquet_rows(files)
    except ValueError as err:
        raise ConfigError(f"'data.{key}': {err}", f"data.{key}") from None
