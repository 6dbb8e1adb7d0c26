"""The configuration's checks: each field against what its owner declared for it (its type,
range and closed set of values: ``otbrl.settings``), each group's own rules (its ``check``),
then the rules that span groups, here. Checks that need the registries, the file system's data
or the world size are ``otbrl.run.plan.plan_run``'s, which the CLI calls before any model
loads."""

from __future__ import annotations

from otbrl.config.schema import Config, ConfigError
from otbrl.settings import check_settings, choice_fields, refuse_unset


def choices() -> dict[str, tuple[str, ...]]:
    """Every key with a closed set of values -> those values (declared with the field, by the
    component that owns it)."""
    return choice_fields(Config)


REASONING_GYM = "reasoning_gym:"  # otbrl.data.reasoning_gym.TASK_PREFIX (no import: no torch)


def check_config(cfg: Config) -> None:
    """Every field and group (``check_settings``), then the rules across groups; raises
    ``ConfigError`` naming the key."""
    check_settings(cfg)
    _check_staleness(cfg)
    rollout, lora = cfg.rollout, cfg.model.lora
    in_process_vllm = rollout.name == "vllm" and rollout.mode == "colocated"
    if lora.rank > 0 and lora.sync == "adapter" and not in_process_vllm:
        server = rollout.mode == "server"
        where = "rollout.mode=server" if server else f"rollout.name={rollout.name}"
        raise ConfigError(
            "'model.lora.sync=adapter' is served by the in-process vLLM engine only "
            f"(rollout.name=vllm, rollout.mode=colocated), not with {where}; drop the key "
            "(merged weights are synced)",
            "model.lora.sync",
        )
    task = cfg.data.task or ""
    if cfg.model.path == "builtin" and task.startswith(REASONING_GYM):
        raise ConfigError(
            f"'data.task={task}': reasoning-gym's questions need a model of yours (the built-in "
            "model's vocabulary is a built-in task's few characters); set model.path",
            "data.task",
        )
    batch, mini = cfg.data.train_batch_size, cfg.actor.ppo_mini_batch_size
    if mini is not None and (mini <= 0 or batch % mini != 0):
        raise ConfigError(
            f"'actor.ppo_mini_batch_size' ({mini}) must be a positive divisor of "
            f"'data.train_batch_size' ({batch}), or null for the whole step batch",
            "actor.ppo_mini_batch_size",
        )
    overlong = cfg.reward.overlong_buffer
    if overlong.len >= cfg.rollout.max_new_tokens:
        raise ConfigError(
            f"'reward.overlong_buffer.len' ({overlong.len}) must be smaller than the response "
            f"budget 'rollout.max_new_tokens' ({cfg.rollout.max_new_tokens})",
            "reward.overlong_buffer.len",
        )


def _check_staleness(cfg: Config) -> None:
    """Sampling ahead of the update (``trainer.max_staleness`` > 0) needs the servers, and the
    keys of stale samples need sampling ahead."""
    staleness, mode = cfg.trainer.max_staleness, cfg.rollout.mode
    if staleness > 0 and mode != "server":
        raise ConfigError(
            f"'trainer.max_staleness={staleness}' samples ahead of training, which the "
            "colocated engine cannot (it shares the trainer's process and weights); set "
            "rollout.mode=server (with rollout.name=vllm) or trainer.max_staleness=0",
            "trainer.max_staleness",
        )
    if staleness == 0:
        because = "'trainer.max_staleness' is 0 (nothing samples while the weights change)"
        keys = ["stale_samples", "partial_rollout"]
        refuse_unset(cfg.rollout, "rollout.", because, "set trainer.max_staleness > 0", keys)
