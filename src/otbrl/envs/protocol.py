"""The environment protocol: Gymnasium's ``reset`` / ``step`` over text, checked at every call.

An environment is made per sample by a factory ``make(row) -> env`` (the data row: prompt,
ground truth, ``extra_info``), named as ``path/to/file.py:NAME``, ``module:NAME`` or a built-in
name (``BUILTIN_ENVS``). Its methods may be plain or ``async``::

    env.reset(seed=int, options=dict | None) -> (observation, info)
    env.step(action: str) -> (observation, reward, terminated, truncated, info)
    env.close()                                    # optional, called once at the episode's end

``action`` is the model's turn as text (its final EOS left out, special tokens kept). An
observation is a text (appended as a ``user`` turn through the model's chat template), a list
of chat messages (``{"role": "user" | "tool", "content": str}``, ``name`` allowed), or None /
``""`` (nothing to add: at ``reset`` the prompt is the row's alone). The trajectory's reward is
the sum of its steps' rewards; each step's reward is kept (on the token that ended its turn).

Anything else an environment does — a raise, a call past the step timeout, a result of the
wrong shape or type, a reward that is not a finite number — is an ``EnvError`` whose message
says which call and why: the agent loop ends that sample there, never the run.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from otbrl.user_code import load_user_function

OBSERVATION_ROLES = ("user", "tool")  # the roles an observation message may take


class EnvError(Exception):
    """An environment failed one sample: it raised, hung past its timeout or returned something
    the protocol does not allow. The message names the call (``make``, ``reset``, ``step``)."""


@dataclass(frozen=True)
class EnvStep:
    """One checked ``step`` result: the observation as chat ``messages`` ([] = none), the
    step's ``reward`` (a finite float), ``terminated`` / ``truncated`` and the ``info`` dict."""

    messages: list[dict]
    reward: float
    terminated: bool
    truncated: bool
    info: dict = field(default_factory=dict)


def resolve_env(spec: str, builtins: Mapping[str, Callable] | None = None) -> Callable:
    """The factory ``make(row) -> env`` that ``spec`` names: a name of ``builtins``,
    ``path/to/file.py:NAME`` (the file executed once per process) or ``package.module:NAME``
    (imported). A missing file, module or name is a ``ValueError`` naming the spec; a name that
    is not callable a ``TypeError``."""
    if not isinstance(spec, str) or not spec:
        raise TypeError(f"env: expected 'path/file.py:NAME' or 'module:NAME', got {spec!r}")
    if builtins and spec in builtins:
        return builtins[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        known = f"a built-in ({sorted(builtins)}), " if builtins else ""
        raise ValueError(f"env: {spec!r} is not {known}'path/file.py:NAME' or 'module:NAME'")
    if where.endswith(".py"):
        return load_user_function(spec, "env")
    try:
        module = importlib.import_module(where)
    except ImportError as err:
        raise ValueError(f"env: cannot import module {where!r} (from {spec!r}): {err}") from None
    factory = getattr(module, name, None)
    if factory is None:
        raise ValueError(f"env: module {where!r} has no {name!r}")
    if not callable(factory):
        raise TypeError(f"env: {name!r} in {where!r} is a {type(factory).__name__}, not callable")
    return factory


def reset_seed(row: Mapping) -> int:
    """The seed a row's environments reset with: ``extra_info.seed``, else ``extra_info.index``,
    else a hash of the row's prompt — the same for every sample of a group and every epoch, so
    a group's samples face one task and a resumed run the same one."""
    extra = row.get("extra_info") or {}
    for key in ("seed", "index"):
        value = extra.get(key)
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value)
    text = json.dumps(row.get("prompt"), sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def observation_messages(observation, *, what: str) -> list[dict]:
    """An observation as chat messages (module docstring); ``EnvError`` naming ``what`` for
    anything else."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}] if observation else []
    if isinstance(observation, Mapping):
        observation = [observation]
    if not isinstance(observation, list | tuple):
        raise EnvError(
            f"{what}: the observation must be a str, a list of chat messages or None, got "
            f"{type(observation).__name__}"
        )
    messages = []
    for i, message in enumerate(observation):
        if not isinstance(message, Mapping):
            raise EnvError(f"{what}: observation message {i} is a {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in OBSERVATION_ROLES or not isinstance(content, str):
            raise EnvError(
                f"{what}: observation message {i} must have a role in {list(OBSERVATION_ROLES)} "
                f"and a str content, got role {role!r} and a {type(content).__name__} content"
            )
        out = {"role": role, "content": content}
        if isinstance(message.get("name"), str):
            out["name"] = message["name"]
        messages.append(out)
    return messages


def check_reset(result) -> tuple[list[dict], dict]:
    """``reset``'s ``(observation, info)`` checked: (messages, info)."""
    if not isinstance(result, tuple | list) or len(result) != 2:
        raise EnvError(f"reset must return (observation, info), got {_describe(result)}")
    observation, info = result
    return observation_messages(observation, what="reset"), _info(info, "reset")


def check_step(result) -> EnvStep:
    """``step``'s ``(observation, reward, terminated, truncated, info)`` checked."""
    if not isinstance(result, tuple | list) or len(result) != 5:
        raise EnvError(
            "step must return (observation, reward, terminated, truncated, info), got "
            f"{_describe(result)}"
        )
    observation, reward, terminated, truncated, info = result
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise EnvError(f"step: the reward must be a number, got {_describe(reward)}")
    if not math.isfinite(float(reward)):
        raise EnvError(f"step: the reward must be finite, got {float(reward)}")
    for key, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, bool) and not _numpy_bool(flag):
            raise EnvError(f"step: {key} must be a bool, got {_describe(flag)}")
    return EnvStep(
        observation_messages(observation, what="step"),
        float(reward),
        bool(terminated),
        bool(truncated),
        _info(info, "step"),
    )


def _numpy_bool(value) -> bool:
    """NumPy's bool scalar (``np.bool_``), which Gymnasium environments often return."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def _info(info, what: str) -> dict:
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise EnvError(f"{what}: info must be a dict, got {_describe(info)}")
    return dict(info)


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
