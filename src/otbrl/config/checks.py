"""Schema-level checks: what the configuration alone decides — allowed values (declared by the
components that own them: ``choices``), ranges, finite numbers, files named by the config.
Checks that need the registries, the file system's data or the world size are
``otbrl.run.plan.plan_run``'s, which the CLI calls before any model loads."""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from otbrl.config.schema import (
    Config,
    ConfigError,
    LoraConfig,
    MultiTurnConfig,
    RewardModelConfig,
    RolloutConfig,
    ServerConfig,
    VLLMConfig,
)

TRISTATE = ("auto", "true", "false")  # a switch that "auto" sets from the rest of the config


def choices() -> dict[str, tuple[str, ...]]:
    """Every key with a closed set of values -> those values, each read from the component that
    owns the choice (the one place it is declared; ``tests/test_config_choices.py`` keeps this
    table complete). Imported here, not at the top: the owners import torch and sit above the
    config package."""
    from otbrl.algos import otb, rollout_correction
    from otbrl.algos.loss_math import LOSS_AGG_MODES
    from otbrl.data.datasets import OVERLONG_PROMPTS
    from otbrl.engine.dims import ENGINES
    from otbrl.engine.precision import PRECISIONS
    from otbrl.models.hf import DTYPES
    from otbrl.models.lora import LORA_SYNCS
    from otbrl.report.metrics_log import BACKENDS as LOGGERS
    from otbrl.rewards.builtin import MATH_BACKENDS
    from otbrl.rewards.scoring import ON_ERROR
    from otbrl.rollout.protocol import ROLLOUT_MODES, ROLLOUT_NAMES, STALE_SAMPLES
    from otbrl.tools.formats import FORMATS

    return {
        "model.precision": PRECISIONS,
        "model.lora.sync": LORA_SYNCS,
        "rollout.name": ROLLOUT_NAMES,
        "rollout.mode": ROLLOUT_MODES,
        "rollout.stale_samples": STALE_SAMPLES,
        "rollout.vllm.dtype": tuple(DTYPES),
        "rollout.multi_turn.format": FORMATS,
        "algorithm.rollout_correction": rollout_correction.CORRECTIONS,
        "algorithm.off_policy": rollout_correction.OFF_POLICY,
        "actor.loss_agg_mode": LOSS_AGG_MODES,
        "actor.calculate_sum_pi_squared": TRISTATE,
        "actor.engine": ENGINES,
        "critic.enable": TRISTATE,
        "algorithm.otb.energy": otb.ENERGIES,
        "reward.on_error": ON_ERROR,
        "data.overlong_prompts": OVERLONG_PROMPTS,
        "reward.math_backend": MATH_BACKENDS,
        "trainer.logger": LOGGERS,  # a list: each entry one of these
    }


_POSITIVE = (
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "rollout.n",
    "rollout.max_new_tokens",
    "rollout.multi_turn.max_turns",
    "rollout.multi_turn.max_tool_response_tokens",
    "rollout.multi_turn.tool_timeout_s",
    "actor.ppo_epochs",
    "actor.micro_batch_size",
    "critic.lr",
    "critic.ppo_epochs",
    "critic.micro_batch_size",
    "actor.tensor_parallel_size",
    "actor.ulysses_sequence_parallel_size",
    "trainer.total_steps",
    "trainer.val_batch_size",
    "sft.batch_size",
    "sft.lr",
    "actor.lr",
    "rollout.temperature",
    "trainer.val_temperature",
    "trainer.dist_timeout_s",
    "reward.code.cpu_s",
    "reward.code.wall_s",
    "reward.code.memory_mb",
    "reward.code.max_workers",
    "reward.model.micro_batch_size",
    "rollout.server.num_servers",
    "rollout.max_concurrent_trajectories",
    "rollout.server.startup_timeout_s",
    "rollout.server.request_timeout_s",
    "rollout.server.bucket_mb",
)

_NON_NEGATIVE = (
    "rollout.top_k",
    "actor.warmup_steps",
    "actor.weight_decay",
    "actor.clip_ratio_low",
    "actor.clip_ratio_high",
    "actor.kl_loss_coef",
    "actor.grad_clip",
    "critic.warmup_steps",
    "critic.weight_decay",
    "critic.grad_clip",
    "algorithm.kl_coef",
    "trainer.val_every",
    "trainer.save_every",
    "trainer.keep_last_checkpoints",
    "trainer.max_wall_seconds",
    "trainer.max_skipped_steps",
    "trainer.log_generations",
    "actor.entropy_coeff",
    "reward.timeout_s",
    "reward.workers",
    "reward.overlong_buffer.len",
    "reward.overlong_buffer.penalty",
    "sft.max_steps",
    "sft.eval_every",
    "trainer.max_staleness",
    "rollout.server.max_restarts",
)


def _check_async(cfg: Config) -> None:
    """rollout.mode=server needs vLLM; its keys and a staleness > 0 need the server mode."""
    r = cfg.rollout
    if r.mode == "server" and r.name != "vllm":
        raise ConfigError(
            f"'rollout.mode=server' serves the policy with vLLM servers but 'rollout.name' is "
            f"'{r.name}'; set rollout.name=vllm",
            "rollout.mode",
        )
    if r.mode != "server":
        server, defaults = r.server, ServerConfig()
        for key in vars(defaults):
            if getattr(server, key) != getattr(defaults, key):
                raise ConfigError(
                    f"'rollout.server.{key}' is set but 'rollout.mode' is '{r.mode}'; set "
                    "rollout.mode=server or drop the key",
                    f"rollout.server.{key}",
                )
        if r.max_concurrent_trajectories != RolloutConfig().max_concurrent_trajectories:
            raise ConfigError(
                "'rollout.max_concurrent_trajectories' is set but 'rollout.mode' is "
                f"'{r.mode}' (the colocated engine's agent loop is turn-synchronous); set "
                "rollout.mode=server or drop the key",
                "rollout.max_concurrent_trajectories",
            )
        if cfg.trainer.max_staleness > 0:
            raise ConfigError(
                f"'trainer.max_staleness={cfg.trainer.max_staleness}' samples ahead of training, "
                f"which the colocated engine cannot (it shares the trainer's process and "
                "weights); set rollout.mode=server (with rollout.name=vllm) or "
                "trainer.max_staleness=0",
                "trainer.max_staleness",
            )
    if cfg.trainer.max_staleness == 0:
        for key, default in (("stale_samples", "wait"), ("partial_rollout", False)):
            if getattr(r, key) != default:
                raise ConfigError(
                    f"'rollout.{key}' is set but 'trainer.max_staleness' is 0 (nothing samples "
                    "while the weights change); set trainer.max_staleness > 0 or drop the key",
                    f"rollout.{key}",
                )
    for i, url in enumerate(r.server.urls):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(
                f"'rollout.server.urls[{i}]' must be an http:// url, got {url!r}",
                "rollout.server.urls",
            )


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def float_values(node: Any, prefix: str = "") -> list[tuple[str, float]]:
    """(dotted key, value) of every float in the config tree."""
    out = []
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            out.extend(float_values(value, f"{prefix}{f.name}."))
        elif isinstance(value, float):
            out.append((f"{prefix}{f.name}", value))
    return out


def check_config(cfg: Config) -> None:
    """Schema-level checks (values, ranges, divisibility); raises ``ConfigError``."""
    for key, value in float_values(cfg):
        # NaN passes every comparison check below and inf overflows at step 1
        if not math.isfinite(value):
            raise ConfigError(f"'{key}' must be a finite number, got {value}", key)
    for key, allowed in choices().items():
        value = _get(cfg, key)
        many = isinstance(value, Sequence) and not isinstance(value, str)  # trainer.logger
        for item in value if many else [value]:
            if item not in allowed:
                close = difflib.get_close_matches(str(item), allowed, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                what = "entries must be in" if many else "must be one of"
                raise ConfigError(f"'{key}' {what} {list(allowed)}, got '{item}'{hint}", key)
    for key in _POSITIVE:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"'{key}' must be > 0, got {_get(cfg, key)}", key)
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"'{key}' must be >= 0, got {_get(cfg, key)}", key)
    if cfg.data.val_size is not None and cfg.data.val_size < 1:
        raise ConfigError(
            f"'data.val_size' must be >= 1 or null (all validation rows), got {cfg.data.val_size}",
            "data.val_size",
        )
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError(
            f"'rollout.top_p' must be in (0, 1], got {cfg.rollout.top_p}", "rollout.top_p"
        )
    if not cfg.algorithm.rollout_is_cap >= 1.0:
        raise ConfigError(
            f"'algorithm.rollout_is_cap' must be >= 1, got {cfg.algorithm.rollout_is_cap}",
            "algorithm.rollout_is_cap",
        )
    if cfg.algorithm.off_policy != "none" and cfg.algorithm.rollout_correction != "none":
        raise ConfigError(
            f"'algorithm.off_policy={cfg.algorithm.off_policy}' and "
            f"'algorithm.rollout_correction={cfg.algorithm.rollout_correction}' both weight the "
            "rollout's samples: set one of them (off_policy=tis is rollout_correction=token_tis)",
            "algorithm.off_policy",
        )
    vllm, defaults = cfg.rollout.vllm, VLLMConfig()
    if cfg.rollout.name != "vllm":
        for key in vars(defaults):
            if getattr(vllm, key) != getattr(defaults, key):
                raise ConfigError(
                    f"'rollout.vllm.{key}' is set but 'rollout.name' is "
                    f"'{cfg.rollout.name}'; set rollout.name=vllm or drop the key",
                    f"rollout.vllm.{key}",
                )
    _check_async(cfg)
    multi, multi_defaults = cfg.rollout.multi_turn, MultiTurnConfig()
    if not multi.tools:
        for key in ("format", "max_turns", "max_tool_response_tokens", "tool_timeout_s"):
            if getattr(multi, key) != getattr(multi_defaults, key):
                raise ConfigError(
                    f"'rollout.multi_turn.{key}' is set but 'rollout.multi_turn.tools' is empty; "
                    "list the tools (e.g. rollout.multi_turn.tools=[calculator]) or drop the key",
                    f"rollout.multi_turn.{key}",
                )
    if not 0.0 < vllm.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"'rollout.vllm.gpu_memory_utilization' must be in (0, 1], got "
            f"{vllm.gpu_memory_utilization}",
            "rollout.vllm.gpu_memory_utilization",
        )
    if not vllm.kv_cache_gib > 0:
        raise ConfigError(
            f"'rollout.vllm.kv_cache_gib' must be > 0, got {vllm.kv_cache_gib}",
            "rollout.vllm.kv_cache_gib",
        )
    _check_lora(cfg)
    if cfg.actor.clip_ratio_c <= 1.0:
        raise ConfigError(
            f"'actor.clip_ratio_c' must be > 1.0, got {cfg.actor.clip_ratio_c}",
            "actor.clip_ratio_c",
        )
    for key in ("algorithm.gamma", "algorithm.lam"):
        if not 0.0 <= _get(cfg, key) <= 1.0:
            raise ConfigError(f"'{key}' must be in [0, 1], got {_get(cfg, key)}", key)
    if not cfg.actor.clip_ratio_low < 1.0:
        raise ConfigError(
            f"'actor.clip_ratio_low' must be < 1 (the ratio's lower bound is 1 - it), got "
            f"{cfg.actor.clip_ratio_low}",
            "actor.clip_ratio_low",
        )
    if cfg.trainer.overwrite and cfg.trainer.resume != "never":
        raise ConfigError(
            "'trainer.overwrite' starts a new run (moving the old one aside): it needs "
            f"trainer.resume=never, got trainer.resume={cfg.trainer.resume}",
            "trainer.overwrite",
        )
    if not 0.0 <= cfg.sft.target_accuracy <= 1.0:
        raise ConfigError(
            f"'sft.target_accuracy' must be in [0, 1], got {cfg.sft.target_accuracy}",
            "sft.target_accuracy",
        )
    if cfg.trainer.resume not in ("auto", "never") and not Path(cfg.trainer.resume).exists():
        raise ConfigError(
            f"'trainer.resume' must be 'auto', 'never' or an existing checkpoint path, "
            f"got '{cfg.trainer.resume}'",
            "trainer.resume",
        )
    batch, mini = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if mini is not None and (mini <= 0 or batch % mini != 0):
        raise ConfigError(
            f"'actor.ppo_mini_batch_size' ({mini}) must be a positive divisor of "
            f"'data.train_batch_size' ({batch}), or null for the whole step batch",
            "actor.ppo_mini_batch_size",
        )
    clip = cfg.critic.cliprange_value
    if clip is not None and not clip > 0:
        raise ConfigError(
            f"'critic.cliprange_value' must be > 0 or null (no clipping), got {clip}",
            "critic.cliprange_value",
        )
    if cfg.reward.code.max_workers > 64:  # otbrl.rewards.sandbox.UIDS_PER_PROCESS
        raise ConfigError(
            f"'reward.code.max_workers' must be <= 64 (sandboxed runs at once per process), got "
            f"{cfg.reward.code.max_workers}",
            "reward.code.max_workers",
        )
    if cfg.reward.batched and cfg.reward.function is None:
        raise ConfigError(
            "'reward.batched' is true but 'reward.function' is unset: a batched reward is "
            "your function taking lists (the built-in rewards score one sample at a time)",
            "reward.batched",
        )
    rm, rm_defaults = cfg.reward.model, RewardModelConfig()
    if rm.path is None:
        for key in ("weight", "micro_batch_size"):
            if getattr(rm, key) != getattr(rm_defaults, key):
                raise ConfigError(
                    f"'reward.model.{key}' is set but 'reward.model.path' is not; set the "
                    "reward model's directory or drop the key",
                    f"reward.model.{key}",
                )
    overlong = cfg.reward.overlong_buffer
    if overlong.len == 0 and overlong.penalty != 1.0:
        raise ConfigError(
            "'reward.overlong_buffer.penalty' is set but 'reward.overlong_buffer.len' is 0 "
            "(shaping off); set reward.overlong_buffer.len to the tokens before the budget's end "
            "where the penalty ramps up, or drop the key",
            "reward.overlong_buffer.penalty",
        )
    if overlong.len >= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"'reward.overlong_buffer.len' ({overlong.len}) must be smaller than the response "
            f"budget 'rollout.max_new_tokens' ({cfg.rollout.max_new_tokens})",
            "reward.overlong_buffer.len",
        )
    if cfg.reward.function is not None and ":" in cfg.reward.function:
        file = cfg.reward.function.rsplit(":", 1)[0]
        if not Path(file).is_file():
            raise ConfigError(f"'reward.function' file not found: '{file}'", "reward.function")


def _check_lora(cfg: Config) -> None:
    """``model.lora``: its keys only with rank > 0, and of the right form."""
    lora, defaults = cfg.model.lora, LoraConfig()
    if lora.rank < 0:
        raise ConfigError(
            f"'model.lora.rank' must be >= 0 (0 = off), got {lora.rank}", "model.lora.rank"
        )
    if lora.rank == 0:
        for key in vars(defaults):
            if key != "rank" and getattr(lora, key) != getattr(defaults, key):
                raise ConfigError(
                    f"'model.lora.{key}' is set but 'model.lora.rank' is 0 (LoRA off); set "
                    "model.lora.rank (e.g. 16) or drop the key",
                    f"model.lora.{key}",
                )
        return
    if not lora.alpha > 0:
        raise ConfigError(f"'model.lora.alpha' must be > 0, got {lora.alpha}", "model.lora.alpha")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(
            f"'model.lora.dropout' must be in [0, 1), got {lora.dropout}", "model.lora.dropout"
        )
    target = lora.target_modules
    names = [target] if isinstance(target, str) else list(target or [])
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            "'model.lora.target_modules' must be \"all-linear\" or a list of module names, "
            f"got {target!r}",
            "model.lora.target_modules",
        )
    rollout = cfg.rollout
    if lora.sync == "adapter" and (rollout.name, rollout.mode) != ("vllm", "colocated"):
        where = f"rollout.name={rollout.name}"
        if rollout.mode == "server":
            where = "rollout.mode=server"
        raise ConfigError(
            "'model.lora.sync=adapter' is served by the in-process vLLM engine only "
            f"(rollout.name=vllm, rollout.mode=colocated), not with {where}; drop the key "
            "(merged weights are synced)",
            "model.lora.sync",
        )
    adapter = lora.adapter_path
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise ConfigError(
            f"'model.lora.adapter_path' {lora.adapter_path!r} holds no adapter_config.json "
            "(expected a directory saved by PEFT or `otbrl export --adapter-only`)",
            "model.lora.adapter_path",
        )
