"""The preflight's checks of a multi-turn run (``otbrl.run.plan``): the tools and the template
that must carry their turns, the environment factory and the template that must carry its
observations, the rows' tools, and whether an environment's rewards are the rows' only ones."""

from __future__ import annotations

from otbrl.config import Config, ConfigError
from otbrl.envs import resolve_env
from otbrl.envs.builtin import BUILTIN_ENVS
from otbrl.rewards import has_builtin_reward
from otbrl.rollout import make_agent
from otbrl.tools import resolve_tools, tool_schemas, tools_for_row


def _where(cfg: Config) -> tuple[str, str]:
    """The key and the name a template error names: the task's built-in model or the path."""
    if cfg.model.path == "builtin":
        return "data.task", f"built-in model of task {cfg.data.task!r}"
    return "model.path", cfg.model.path


def check_env(cfg: Config, tokenizer):
    """The environment factory of ``rollout.multi_turn.env`` (None without one), after checking
    that it resolves and that the chat template carries user turns after a model turn
    exactly (a template that rewrites earlier turns is refused naming the model)."""
    spec = cfg.rollout.multi_turn.env
    if spec is None:
        return None
    try:
        factory = resolve_env(spec, BUILTIN_ENVS)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"'rollout.multi_turn.env': {err}", "rollout.multi_turn.env") from None
    key, where = _where(cfg)
    try:
        make_agent(
            None,
            tokenizer,
            None,
            cfg.rollout.multi_turn,
            eos_token_ids=[tokenizer.eos_token_id],
            model=where,
            env=factory,
        )
    except ValueError as err:
        raise ConfigError(f"'{key}': {err}", key) from None
    return factory


def env_rewards_alone(cfg: Config, rows: list[dict]) -> bool:
    """With an environment and no ``reward.function``, rows whose data_source has no built-in
    reward are scored by the environment alone (``reward.function=zero``): True when no row has
    one (a mix is refused by ``_check_rewards_resolvable``: set the function)."""
    if cfg.rollout.multi_turn.env is None:
        return False
    return not any(has_builtin_reward(row["data_source"]) for row in rows)


def check_tools(cfg: Config, tokenizer):
    """The resolved tools (None without any), after checking that the run's ``tokenizer``
    (``plan_tokenizer``) and its chat template can carry tool turns in the configured format."""
    multi = cfg.rollout.multi_turn
    if not multi.tools:
        return None
    try:
        tools = resolve_tools(multi.tools)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"'rollout.multi_turn.tools': {err}", "rollout.multi_turn.tools"
        ) from None
    key, where = _where(cfg)
    try:
        make_agent(
            None,
            tokenizer,
            tools,
            multi,
            eos_token_ids=[tokenizer.eos_token_id],
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


def unseen_tools_note(cfg: Config, tokenizer, rows: list[dict], tools) -> list[str]:
    """A note when the chat template renders the first row's prompt the same with its tools
    as without (``tools=`` ignored): the model is then told of no tool, nor how to call one."""
    if cfg.model.path == "builtin" or not rows:  # its task's demonstrations teach the calls
        return []
    messages, names = rows[0]["prompt"], tools_for_row(rows[0], tools)
    if cfg.data.apply_chat_template:
        listed, plain = (
            tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **kw
            )
            for kw in ({"tools": tool_schemas(names, tools)}, {})
        )
        if listed != plain:
            return []
        why = f"the chat template of {cfg.model.path} ignores the tools (tools=)"
    else:
        why = "data.apply_chat_template=false"
    return [
        f"{why}: the prompts do not list {sorted(names)} nor say how to call them; describe them "
        "in the prompts (a system message), or use a chat template that renders tools"
    ]
