"""Plan a run: every check that can be made before a model loads, once, and what it decided.

``validate_config`` decides everything that can be known from the configuration and the file
system: the estimator and its needs, which engine provides each need (so a need no layer
provides is a one-line ``ConfigError`` naming the key to set, not a crash deep in a run), the
parallel layout for this world size (``ParallelDims``), the batch sizes, the user's reward
function (imported once), the tools and the chat template that must carry them, and the data:
every file read and every row checked (schema, ground truth, a reward for its ``data_source``)
now, not when the row is first sampled hours into a run. It returns a ``Plan``;
``otbrl.run.build`` builds the run from it.
"""

from __future__ import annotations

import difflib
import functools
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otbrl.algos.advantages import ESTIMATORS, get_estimator
from otbrl.algos.loss_math import KL_KINDS
from otbrl.config import Config, ConfigError
from otbrl.data import get_task, read_parquet_rows
from otbrl.engine.dims import ParallelDims
from otbrl.models import build_tokenizer
from otbrl.report.metrics_log import check_backends
from otbrl.rewards import (
    BUILTIN_REWARDS,
    CODE_SOURCES,
    DATA_SOURCE_PREFIXES,
    DATA_SOURCE_REWARDS,
    has_builtin_reward,
    resolve_reward_function,
    sandbox_problem,
)
from otbrl.rewards.reward_model import check_reward_model_dir
from otbrl.rollout import check_vllm_installed, make_agent
from otbrl.tools import resolve_tools, tools_for_row

# estimator option -> the config key that sets it
ESTIMATOR_OPTION_KEYS = {
    "gamma": "algorithm.gamma",
    "lam": "algorithm.lam",
    "norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "handle_zero_tail": "algorithm.handle_zero_tail",
    "leave_one_out": "algorithm.otb.leave_one_out",
    "energy": "algorithm.otb.energy",
}


@dataclass(frozen=True)
class Source:
    """Where a batch statistic comes from: the ``engine`` that computes it (``policy``,
    ``reference`` or ``critic``), the name of that engine's forward ``output``, and the config
    key that switches the provider on (None: always on)."""

    engine: str
    output: str
    switch: str | None = None


# batch key -> its source: the one table of who provides what (the plan reads it, the trainer
# asks each engine for exactly the outputs the plan lists)
SOURCES = {
    "old_log_probs": Source("policy", "log_probs"),
    "entropy": Source("policy", "entropy"),
    "sum_pi_squared": Source("policy", "sum_pi_squared", "actor.calculate_sum_pi_squared"),
    "ref_log_probs": Source("reference", "log_probs", "actor.use_kl_loss"),
    "values": Source("critic", "values", "critic.enable"),
    # the learned reward model scores the decoded conversations in the sampling step (its own
    # tokenizer and template), before the policy's forward; it adds to token_level_scores
    "rm_scores": Source("reward_model", "scores", "reward.model.path"),
}


@dataclass(frozen=True)
class Plan:
    """What ``validate_config`` decided; ``otbrl.run.build`` builds exactly this.

    ``needs``: batch statistics the estimator, the losses and the enabled metrics need (each
    has a ``SOURCES`` entry). ``dims``: the parallel layout. ``mini_batch_size``: prompts per
    optimizer step. ``reward_fn``: the resolved ``reward.function`` (None: by data_source).
    ``train_rows`` / ``val_rows``: the checked data rows (``load_rows``). ``tools``: the
    resolved ``rollout.multi_turn.tools`` (None when empty: single-turn).
    """

    needs: frozenset[str]
    dims: ParallelDims
    mini_batch_size: int
    reward_fn: Any = None
    train_rows: list = field(default_factory=list, repr=False)
    val_rows: list = field(default_factory=list, repr=False)
    tools: Any = None  # {name: otbrl.tools.Tool} of rollout.multi_turn.tools; None: single-turn

    @property
    def use_reference(self) -> bool:
        """A frozen reference policy is built (a KL loss or KL reward needs its log-probs)."""
        return "ref_log_probs" in self.needs

    @property
    def use_reward_model(self) -> bool:
        """A learned reward model is loaded (``reward.model.path``)."""
        return "rm_scores" in self.needs

    @property
    def use_critic(self) -> bool:
        """A critic is built and trained (its values are needed)."""
        return "values" in self.needs

    def outputs(self, engine: str) -> frozenset[str]:
        """The forward outputs ``engine`` computes for the step's batch (may be empty)."""
        return frozenset(SOURCES[k].output for k in self.needs if SOURCES[k].engine == engine)

    def batch_stats(self, engine: str, outputs: dict) -> dict:
        """``engine``'s forward ``outputs`` renamed to the batch keys the plan needs."""
        return {
            key: outputs[src.output]
            for key, src in SOURCES.items()
            if src.engine == engine and key in self.needs
        }


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
    if cfg.reward.model.path is not None:
        needs.add("rm_scores")
    return frozenset(needs)


def _check_providers(cfg: Config, needs: frozenset[str], use_critic: bool) -> None:
    """Every need has a provider that is switched on; else a ConfigError naming the key."""
    name = cfg.algorithm.adv_estimator
    for need in sorted(needs):
        if need not in SOURCES:
            raise ConfigError(
                f"'algorithm.adv_estimator' '{name}' needs '{need}', which no engine provides "
                f"(providers: {sorted(SOURCES)})",
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


def _check_files(cfg: Config) -> None:
    if cfg.reward.model.path is not None:
        try:
            check_reward_model_dir(cfg.reward.model.path)
        except ValueError as err:
            raise ConfigError(f"'reward.model.path': {err}", "reward.model.path") from None
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
    if cfg.actor.kl_loss_type not in KL_KINDS:
        raise ConfigError(
            f"'actor.kl_loss_type' must be one of {sorted(KL_KINDS)}, got "
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
        try:
            check_vllm_installed()
        except ImportError as err:
            raise ConfigError(f"'rollout.name': {err}", "rollout.name") from None
    needs = stat_needs(cfg)
    use_critic = cfg.critic.enable == "true" or (cfg.critic.enable == "auto" and "values" in needs)
    _check_providers(cfg, needs, use_critic)
    if use_critic:  # critic.enable=true with any estimator: the value loss reads the values
        needs = needs | {"values"}
    dims = ParallelDims.from_config(cfg.actor, world_size)
    mini = cfg.actor.ppo_mini_batch_size or cfg.data.train_batch_size
    dims.check_divisible("data.train_batch_size", cfg.data.train_batch_size)
    dims.check_divisible("actor.ppo_mini_batch_size", mini)
    train_rows, val_rows = load_rows(cfg)
    if reward_fn is None:
        _check_rewards_resolvable(train_rows + val_rows)
        _check_reward_backends(cfg, train_rows + val_rows)
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
        dims=dims,
        mini_batch_size=mini,
        reward_fn=reward_fn,
        train_rows=train_rows,
        val_rows=val_rows,
        tools=tools,
    )


def _check_rewards_resolvable(rows: list[dict]) -> None:
    """Without ``reward.function`` each row is scored by its data_source's built-in reward:
    every data_source must have one."""
    unknown = Counter(
        row["data_source"] for row in rows if not has_builtin_reward(row["data_source"])
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
        f"{sorted(DATA_SOURCE_REWARDS)} and names starting with {sorted(DATA_SOURCE_PREFIXES)}"
        "); set reward.function to a built-in "
        f"({sorted(BUILTIN_REWARDS)}) or to path/to/file.py:function",
        "reward.function",
    )


def _check_reward_backends(cfg: Config, rows: list[dict]) -> None:
    """What the rows' built-in rewards need is there: the sandbox for code rows (or
    ``reward.code.allow_unsandboxed``), ``math-verify`` for ``reward.math_backend``."""
    code_rows = sum(row["data_source"] in CODE_SOURCES for row in rows)
    if code_rows and not cfg.reward.code.allow_unsandboxed:
        problem = sandbox_problem()
        if problem is not None:
            raise ConfigError(
                f"'reward.code.allow_unsandboxed': {code_rows} rows are scored by running "
                f"model-written code, and it cannot be sandboxed here: {problem}; set "
                "reward.code.allow_unsandboxed=true to run it without the sandbox",
                "reward.code.allow_unsandboxed",
            )
    if cfg.reward.math_backend == "math_verify":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise ConfigError(
                "'reward.math_backend' is math_verify but the math-verify package is not "
                "installed: pip install 'otbrl[rewards]'",
                "reward.math_backend",
            ) from None


def check_tools(cfg: Config):
    """The resolved tools (None without any), after checking that the model's tokenizer and
    chat template can carry tool turns in the configured format: the built-in task's tokenizer
    for ``model.path=builtin``, else the one in ``model.path`` (no model is loaded)."""
    multi = cfg.rollout.multi_turn
    if not multi.tools:
        return None
    try:
        tools = resolve_tools(multi.tools)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"'rollout.multi_turn.tools': {err}", "rollout.multi_turn.tools"
        ) from None
    if cfg.model.path == "builtin":
        task = get_task(cfg.data.task)
        tokenizer = build_tokenizer(task.alphabet, tool_tokens=bool(task.tools))
        key, where = "data.task", f"built-in model of task {cfg.data.task!r}"
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        key, where = "model.path", cfg.model.path
    try:
        make_agent(
            None,
            tokenizer,
            tools,
            eos_token_ids=[tokenizer.eos_token_id],
            fmt=multi.format,
            model=where,
        )
    except ValueError as err:
        key = "rollout.multi_turn.format" if str(err).startswith("format:") else key
        raise ConfigError(f"'{key}': {err}", key) from None
    return tools


def check_row_tools(rows: list[dict], tools) -> None:
    """Rows that name their tools (``extra_info.tools`` / ``tools_kwargs``) name configured
    ones."""
    for i, row in enumerate(rows):
        try:
            tools_for_row(row, tools)
        except ValueError as err:
            raise ConfigError(f"'rollout.multi_turn.tools': data row {i}: {err}",
                              "rollout.multi_turn.tools") from None  # fmt: skip


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
