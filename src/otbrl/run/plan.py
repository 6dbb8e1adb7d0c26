"""Plan a run: ``resolve`` the config (``otbrl.run.spec``: pure), then ``preflight`` it — every
check that needs the file system, imports or the network, once, before a model loads.

The preflight imports the user's reward function once, loads the tokenizer (no model), resolves
the tools and checks the chat template that must carry them, asks vLLM servers who they serve,
and reads the data: every file read and every row checked (schema, ground truth, a reward for
its ``data_source``) now, not when the row is first sampled hours into a run. It returns a
``Plan``; ``otbrl.run.build`` builds the run from it.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from otbrl.config import Config, ConfigError
from otbrl.data import get_task, read_parquet_rows, tokenize_prompts
from otbrl.data.reasoning_gym import DEFAULT_TRAIN_SIZE as RG_TRAIN_SIZE
from otbrl.data.reasoning_gym import TASK_PREFIX as RG_PREFIX
from otbrl.data.reasoning_gym import ReasoningGymTask
from otbrl.models import (
    build_tokenizer,
    load_tokenizer,
    resolve_model_dir,
    set_prompt_template,
)
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
from otbrl.rewards.sandbox import describe as sandbox_describe
from otbrl.rollout import check_vllm_installed
from otbrl.rollout.server import (
    ServerError,
    check_cpu_head_dim,
    check_server_url,
    user_server_token,
)
from otbrl.run.model_checks import (
    check_context,
    check_model_settings,
    check_teacher,
    check_token_budgets,
)
from otbrl.run.multi_turn_checks import (
    check_env,
    check_row_tools,
    check_tools,
    env_rewards_alone,
    unseen_tools_note,
)
from otbrl.run.spec import RunSpec, resolve

TASK_VAL_SIZE = 500  # validation prompts of a built-in task when data.val_size is unset


@dataclass(frozen=True)
class Plan:
    """The run's ``RunSpec`` and what the preflight found; ``otbrl.run.build`` builds from it.

    ``spec``: every decision the config fixes (``otbrl.run.spec.resolve``). ``reward_fn``: the
    resolved ``reward.function`` (None: by data_source). ``train_rows`` / ``val_rows``: the
    checked data rows (``load_rows``). ``tools``: the resolved ``rollout.multi_turn.tools``
    (None when empty: single-turn). ``tokenizer``: the run's (``plan_tokenizer``).
    ``longest_prompt``: the longest prompt in tokens after ``data.overlong_prompts``; ``notes``:
    one line per change that policy made (rows dropped or cut), printed when the run starts.
    """

    spec: RunSpec
    reward_fn: Any = None
    train_rows: list = field(default_factory=list, repr=False)
    val_rows: list = field(default_factory=list, repr=False)
    tools: Any = None  # {name: otbrl.tools.Tool} of rollout.multi_turn.tools; None: single-turn
    env: Any = None  # the factory make(row) of rollout.multi_turn.env; None: no environment
    tokenizer: Any = field(default=None, repr=False)  # plan_tokenizer's: the run's one tokenizer
    longest_prompt: int = 0  # tokens, over all kept rows (a rollout engine's context: + budget)
    notes: tuple[str, ...] = ()  # what the plan changed in the data, for the run's start-up lines


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
        if path not in (None, "builtin"):
            try:
                resolve_model_dir(path)
            except ValueError as err:
                raise ConfigError(f"'{key}': {str(err).removeprefix('path: ')}", key) from None


def task_for(cfg: Config):
    """The task ``data.task`` names: a built-in (``otbrl.data.get_task``) or a reasoning-gym
    dataset with ``data.task_options`` and the data's sizes (``ReasoningGymTask``); a name
    neither knows is a ``ConfigError`` naming ``data.task``, a missing reasoning-gym an
    install hint."""
    name = cfg.data.task
    try:
        if name.startswith(RG_PREFIX):
            return ReasoningGymTask(
                name[len(RG_PREFIX) :],
                cfg.data.task_options,
                train_size=cfg.data.train_size or RG_TRAIN_SIZE,
                val_size=cfg.data.val_size or TASK_VAL_SIZE,
            )
        return get_task(name)
    except (ValueError, ImportError) as err:
        key = "data.task_options" if "task_options" in str(err) else "data.task"
        raise ConfigError(f"'{key}': {err}", key) from None


def _check_task(cfg: Config) -> None:
    task = task_for(cfg)
    if isinstance(task, ReasoningGymTask):
        return  # a user's model: no answer length is known
    longest = task.max_response_chars + 1  # + EOS: a shorter cap truncates right answers
    if cfg.data.max_response_length < longest:
        raise ConfigError(
            f"'data.max_response_length' ({cfg.data.max_response_length}) is shorter than "
            f"the {task.name} task's longest answer ({task.max_response_chars} characters "
            f"+ EOS): set data.max_response_length={longest}",
            "data.max_response_length",
        )


def plan_run(
    cfg: Config, world_size: int | None = None, *, train: bool = True, estimators=()
) -> Plan:
    """``resolve`` the config, then ``preflight`` it: the ``Plan`` of the run, made once before
    any model loads; raises ``ConfigError`` naming the key. ``world_size`` defaults to
    torchrun's ``WORLD_SIZE`` (1 without torchrun); ``estimators``: as ``resolve``'s."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return preflight(cfg, resolve(cfg, world_size, estimators=estimators), train=train)


def preflight(cfg: Config, spec: RunSpec, *, train: bool = True) -> Plan:
    """The checks that need the file system, imports or the network, each made once: model and
    data files, the logger's package, the user's reward function, the tokenizer (prompts are
    measured now), the tools and their template, vLLM and its servers, every data row, prompt
    lengths and the model's shape (a meta model). ``train=False`` (``otbrl eval``): no training
    rows are needed."""
    _check_files(cfg)
    try:  # an optional logger package missing is reported now, not after the model loads
        check_backends(cfg.trainer.logger)
    except (ImportError, ValueError) as err:
        raise ConfigError(f"'trainer.logger': {err}", "trainer.logger") from None
    if cfg.data.task is not None and not cfg.data.train_files:  # the task supplies the data
        _check_task(cfg)
    reward_fn = None
    if cfg.reward.function is not None:
        try:
            reward_fn = resolve_reward_function(cfg.reward.function)
        except (ValueError, TypeError, ImportError, AttributeError) as err:
            raise ConfigError(f"'reward.function': {err}", "reward.function") from None
    tokenizer = plan_tokenizer(cfg)  # loaded once, no model: the tools and prompts need it
    tools = check_tools(cfg, tokenizer)
    env = check_env(cfg, tokenizer)
    if cfg.rollout.name == "vllm":
        try:
            check_vllm_installed()
        except ImportError as err:
            raise ConfigError(f"'rollout.name': {err}", "rollout.name") from None
        _check_vllm_serves(cfg)
    train_rows, val_rows = load_rows(cfg, train=train)
    if not train and not val_rows:  # otbrl eval: an accuracy of no prompt means nothing
        raise ConfigError(
            "'data.val_files': there is nothing to evaluate (no validation prompts): set "
            "data.val_files=[val.parquet] (verl's row schema), or data.task=<a built-in task> "
            "for its validation rows",
            "data.val_files",
        )
    sandbox_notes: list[str] = []
    if reward_fn is None and env_rewards_alone(cfg, train_rows + val_rows):
        reward_fn = BUILTIN_REWARDS["zero"]
        spec = dataclasses.replace(spec, reward=dataclasses.replace(spec.reward, function="zero"))
    if reward_fn is None:
        _check_rewards_resolvable(train_rows + val_rows)
        sandbox_notes = _check_reward_backends(cfg, train_rows + val_rows)
    if tools:
        check_row_tools(train_rows + val_rows, tools)
        sandbox_notes += unseen_tools_note(cfg, tokenizer, train_rows + val_rows, tools)
    train_rows, longest, notes = check_prompt_lengths(cfg, train_rows, tokenizer, tools, "train")
    val_rows, longest_val, val_notes = check_prompt_lengths(cfg, val_rows, tokenizer, tools, "val")
    check_context(cfg, max(longest, longest_val))
    check_token_budgets(cfg, max(longest, longest_val) + cfg.rollout.max_new_tokens)
    notes = [*notes, *sandbox_notes, *check_model_settings(cfg, spec.dims)]
    if train and spec.uses("teacher"):  # otbrl eval of a distilled run needs no teacher
        context = max(longest, longest_val) + cfg.rollout.max_new_tokens
        notes += check_teacher(cfg, tokenizer, context, spec.dims)
    if train and len(train_rows) < cfg.data.train_batch_size:
        raise ConfigError(
            f"'data.train_batch_size' ({cfg.data.train_batch_size}) is larger than the training "
            f"data ({len(train_rows)} rows)",
            "data.train_batch_size",
        )
    return Plan(
        spec=spec,
        reward_fn=reward_fn,
        train_rows=train_rows,
        val_rows=val_rows,
        tools=tools,
        env=env,
        tokenizer=tokenizer,
        longest_prompt=max(longest, longest_val),
        notes=(*notes, *val_notes),
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


def _check_reward_backends(cfg: Config, rows: list[dict]) -> list[str]:
    """What the rows' built-in rewards need is there: the sandbox for code rows (or
    ``reward.code.allow_unsandboxed``), ``math-verify`` for ``reward.math_backend``. Returns
    the start-up note on how model-written code is isolated (a warning when it is not)."""
    code_rows = sum(row["data_source"] in CODE_SOURCES for row in rows)
    notes = []
    if code_rows:
        problem = sandbox_problem()
        if problem is not None and not cfg.reward.code.allow_unsandboxed:
            raise ConfigError(
                f"'reward.code.allow_unsandboxed': {code_rows} rows are scored by running "
                f"model-written code, and it cannot be sandboxed here: {problem}; set "
                "reward.code.allow_unsandboxed=true to run it without the sandbox",
                "reward.code.allow_unsandboxed",
            )
        if problem is not None:
            notes.append(
                f"WARNING: model-written code of {code_rows} rows runs UNSANDBOXED "
                "(reward.code.allow_unsandboxed=true) as this user, with the host's network "
                f"and files; only time, memory, CPU and file-size limits apply ({problem})"
            )
        else:
            notes.append(f"model-written code of {code_rows} rows: {sandbox_describe()}")
    if cfg.reward.math_backend == "math_verify":
        try:
            import math_verify  # noqa: F401
        except ImportError:
            raise ConfigError(
                "'reward.math_backend' is math_verify but the math-verify package is not "
                "installed: pip install 'otbrl[rewards]'",
                "reward.math_backend",
            ) from None
    return notes


def load_rows(cfg: Config, *, train: bool = True) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows): from parquet files, else from the built-in task
    ``data.task`` (the task's validation rows only when neither file list is set); validation
    rows capped at ``data.val_size`` (a seeded sample, kept in file order). With a user's model
    and no files, ``data.task`` must name the task: no silent fallback. ``train=False``: the
    training rows may be missing (``otbrl eval``). A problem with a file is a one-line
    ``ConfigError`` naming the key and the file."""
    data = cfg.data
    task = task_for(cfg) if data.task is not None else None
    train_rows = _read_rows(cfg, "train_files")
    if not train_rows and task is not None:
        train_rows = _task_rows(task, "train", None, data.seed)
    if not train_rows and train:
        raise ConfigError(
            f"'data.train_files' is empty and model.path is a model of yours "
            f"('{cfg.model.path}'): set data.train_files=[train.parquet] (verl's row schema), "
            "or data.task=arithmetic to train it on a built-in task",
            "data.train_files",
        )
    val = _read_rows(cfg, "val_files")
    if val and data.val_size is not None and len(val) > data.val_size:
        keep = np.random.default_rng(data.seed).choice(len(val), data.val_size, replace=False)
        val = [val[i] for i in sorted(keep)]
    if not val and not data.train_files and task is not None:
        val = _task_rows(task, "val", data.val_size or TASK_VAL_SIZE, data.seed)
    return train_rows, val


def _task_rows(task, split: str, n: int | None, seed: int) -> list[dict]:
    """A task's rows; a reasoning-gym dataset that refuses its options names the key."""
    try:
        return task.rows(split, n, seed=seed)
    except ValueError as err:
        raise ConfigError(f"'data.task_options': {err}", "data.task_options") from None


def plan_tokenizer(cfg: Config):
    """The run's tokenizer, loaded once, without its model (a ``ConfigError`` for a model without
    a usable one): the built-in task's for ``model.path=builtin``, else the one in ``model.path``
    (``load_tokenizer``: padding on the left, a pad token), with prompts rendered as
    ``data.apply_chat_template`` asks (``set_prompt_template``). The run's models load with it
    (``otbrl.run.build.load_policy``)."""
    if cfg.model.path == "builtin":
        task = get_task(cfg.data.task)
        tokenizer = build_tokenizer(task.alphabet, tool_tokens=bool(task.tools))
        where = f"the built-in model of task {cfg.data.task!r}"
    else:
        path = resolve_model_dir(cfg.model.path)
        try:
            tokenizer = load_tokenizer(path)
        except Exception as err:  # transformers raises many types for a broken tokenizer
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise ConfigError(
                f"'model.path': cannot load the tokenizer in '{path}': {first}", "model.path"
            ) from None
        where = f"'{cfg.model.path}'"
    try:
        set_prompt_template(tokenizer, cfg.data.apply_chat_template, where)
    except ValueError as err:
        raise ConfigError(
            f"'data.apply_chat_template': {err}", "data.apply_chat_template"
        ) from None
    return tokenizer


def check_prompt_lengths(
    cfg: Config, rows: list[dict], tokenizer, tools, split: str
) -> tuple[list[dict], int, list[str]]:
    """Apply ``data.overlong_prompts`` to the ``split`` rows: (the rows kept, their longest
    prompt in tokens after truncation, notes on what changed). ``error``: a ``ConfigError``
    naming the first long row and how many there are; ``filter``: those rows dropped;
    ``truncate_left``: kept (the sampling step keeps each prompt's last tokens)."""
    limit, mode = cfg.data.max_prompt_length, cfg.data.overlong_prompts
    lengths: list[int] = []
    for start in range(0, len(rows), 4096):  # bounded memory on big files
        lengths += [len(x) for x in tokenize_prompts(rows[start : start + 4096], tokenizer, tools)]
    over = [i for i, n in enumerate(lengths) if n > limit]
    if not over:
        return rows, max(lengths, default=0), []
    first = over[0]
    what = f"{len(over)} of {len(rows)} {split} prompts are longer than {limit} tokens"
    if mode == "error":
        raise ConfigError(
            f"'data.max_prompt_length': {what} ({split} row {first}, data_source "
            f"{rows[first].get('data_source')!r}: {lengths[first]} tokens); raise "
            "data.max_prompt_length, or set data.overlong_prompts=filter (drop them) or "
            "truncate_left (cut their beginning)",
            "data.max_prompt_length",
        )
    if mode == "filter":
        dropped = set(over)
        kept = [row for i, row in enumerate(rows) if i not in dropped]
        longest = max((n for i, n in enumerate(lengths) if i not in dropped), default=0)
        return kept, longest, [f"{what}: dropped (data.overlong_prompts=filter)"]
    return rows, limit, [f"{what}: their beginning is cut (data.overlong_prompts=truncate_left)"]


def _check_vllm_serves(cfg: Config) -> None:
    """Before any model loads: vLLM's CPU attention supports the model's head size, and every
    ``rollout.server.urls`` entry answers and serves ``rollout.server.served_model_name``."""
    if cfg.model.path != "builtin":  # the built-in model's head size is a supported 32
        try:
            model_dir = resolve_model_dir(cfg.model.path)
        except (ValueError, OSError) as err:
            raise ConfigError(f"'model.path': {err}", "model.path") from None
        try:
            check_cpu_head_dim(model_dir)
        except ValueError as err:
            fix = "rollout.name=hf samples any head size"
            raise ConfigError(f"'model.path': {err}; {fix}", "model.path") from None
        except OSError as err:
            raise ConfigError(f"'model.path': {err}", "model.path") from None
    if cfg.rollout.mode == "server":
        server = cfg.rollout.server
        for i, url in enumerate(server.urls):
            key = f"rollout.server.urls[{i}]"
            try:
                check_server_url(
                    url,
                    server.served_model_name,
                    key=key,
                    timeout_s=10.0,
                    token=user_server_token(),
                )
            except ServerError as err:
                raise ConfigError(str(err), "rollout.server.urls") from None


def _read_rows(cfg: Config, key: str) -> list[dict]:
    files = getattr(cfg.data, key)
    if not files:
        return []
    try:
        return read_parquet_rows(files)
    except ValueError as err:
        raise ConfigError(f"'data.{key}': {err}", f"data.{key}") from None
