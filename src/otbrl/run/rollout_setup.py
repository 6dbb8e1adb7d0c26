"""The rollout side of a run: the backend of ``rollout.name`` (HF or vLLM), the agent loop of
``rollout.multi_turn`` over it, and the tool checks ``validate_config`` runs before any model
loads.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

from otbrl.config import Config, ConfigError
from otbrl.data import get_task

if TYPE_CHECKING:
    from otbrl.run.build import Plan


def check_tools(cfg: Config):
    """The resolved tools (None without any), after checking that the model's tokenizer and
    chat template can carry tool turns in the configured format: the built-in task's tokenizer
    for ``model.path=builtin``, else the one in ``model.path`` (no model is loaded)."""
    multi = cfg.rollout.multi_turn
    if not multi.tools:
        return None
    from otbrl.rollout.agent import make_agent
    from otbrl.tools import resolve_tools

    try:
        tools = resolve_tools(multi.tools)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"'rollout.multi_turn.tools': {err}", "rollout.multi_turn.tools"
        ) from None
    if cfg.model.path == "builtin":
        from otbrl.models import build_tokenizer

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
    from otbrl.tools import tools_for_row

    for i, row in enumerate(rows):
        try:
            tools_for_row(row, tools)
        except ValueError as err:
            raise ConfigError(f"'rollout.multi_turn.tools': data row {i}: {err}",
                              "rollout.multi_turn.tools") from None  # fmt: skip


def build_agent(cfg: Config, plan: Plan, engine, tokenizer, eos_ids, model_name: str):
    """The ``AgentLoop`` of ``rollout.multi_turn`` over ``engine``, or None without tools."""
    if not plan.tools:
        return None
    from otbrl.rollout.agent import make_agent

    multi = cfg.rollout.multi_turn
    return make_agent(
        engine,
        tokenizer,
        plan.tools,
        eos_token_ids=eos_ids,
        fmt=multi.format,
        max_turns=multi.max_turns,
        max_tool_response_tokens=multi.max_tool_response_tokens,
        timeout_s=multi.tool_timeout_s,
        model=model_name,
    )


def build_rollout(cfg: Config, model, tokenizer, world, model_dir: Path, context: int):
    """The rollout engine of ``rollout.name`` for this process.

    ``hf``: one process samples with the training ``model`` itself (no weight sync); several
    keep an unsharded copy made here, before the engine shards the model, synced after every
    update. ``vllm``: one in-process engine per rank, started from ``model_dir`` (the policy's
    initial weights) with a context of ``context`` tokens (the longest prompt + the response
    budget). Every rank calls this at the same point (vLLM's start-up is collective).
    """
    from otbrl.rollout import HFRollout, VLLMRollout
    from otbrl.run.build import step_seed  # build imports this module

    if len(tokenizer) > model.config.vocab_size:
        raise ConfigError(
            f"'model.path': the tokenizer has {len(tokenizer)} tokens, the model's vocabulary "
            f"{model.config.vocab_size}: they do not belong together",
            "model.path",
        )
    if cfg.rollout.name == "hf":
        if world.mesh is None:
            return HFRollout(model, tokenizer)
        copy_ = copy.deepcopy(model).eval().requires_grad_(False).to(world.device)
        return HFRollout(copy_, tokenizer, owns_copy=True)
    v = cfg.rollout.vllm
    positions = getattr(model.config, "max_position_embeddings", None)
    if positions is not None and context > positions:
        raise ConfigError(
            f"'data.max_response_length': the longest prompt plus the response budget is "
            f"{context} tokens, more than the model's {positions} positions",
            "data.max_response_length",
        )
    return VLLMRollout(
        model_dir,
        dtype=v.dtype,
        enforce_eager=v.enforce_eager,
        gpu_memory_utilization=v.gpu_memory_utilization,
        kv_cache_gib=v.kv_cache_gib,
        enable_sleep_mode=v.enable_sleep_mode,
        max_model_len=context,
        seed=step_seed(cfg.trainer.seed, 0, world.dp_rank),
    )
