"""Loading a ``Config``: defaults, an optional YAML file, then ``key=value`` overrides, each
problem a one-line ``ConfigError`` naming the key (unknown keys get a did-you-mean)."""

from __future__ import annotations

import copy
import difflib
import functools
import re
import warnings
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from otbrl.algos.config import policy_loss_agg
from otbrl.config.checks import check_config
from otbrl.config.keys import LIST_KEYS
from otbrl.config.presets import DEFAULT_TASK, presets_for
from otbrl.config.schema import Config, ConfigError, all_keys
from otbrl.settings import TRISTATE, choice_fields

# keys an earlier version had -> what replaces them (said instead of "unknown key")
REMOVED_KEYS = {
    "model.dtype": (
        "use model.precision (32-true | bf16-mixed | bf16-true; float32 -> 32-true, "
        "bfloat16 -> bf16-true, or bf16-mixed for fp32 master weights)"
    ),
}
# keys an earlier version named otherwise -> their name now: the old name still loads (from the
# command line, a config file or a saved configuration), with a FutureWarning
RENAMED_KEYS = {
    # "engine" is the Engine, the trainer's model wrapper; this key picks its parallel layout
    "actor.engine": "actor.strategy",
    # environments' observations are cut by it too, not only tool results
    "rollout.multi_turn.max_tool_response_tokens": "rollout.multi_turn.max_observation_tokens",
}


class RenamedKeyWarning(FutureWarning):
    """A key given under its old name (``RENAMED_KEYS``): it loads, and the new name is said."""


# what a saved configuration of an earlier version (a checkpoint's config.yaml) meant
_SAVED_DTYPE = {"float32": "32-true", "bfloat16": "bf16-true", "float16": "32-true"}


def upgrade_saved(saved: dict) -> dict:
    """A saved resolved configuration (a checkpoint's or run directory's) of an earlier version
    in today's keys: ``model.dtype`` read as ``model.precision``, ``RENAMED_KEYS`` renamed.
    Returns a new dict; ``saved`` is not changed."""
    out = copy.deepcopy(saved)
    model = out.get("model")
    if isinstance(model, dict) and "dtype" in model:
        dtype = model.pop("dtype")
        model.setdefault("precision", _SAVED_DTYPE.get(dtype, "32-true"))
    _rename_keys(out, "the saved configuration", warn=False)
    return out


def _rename_keys(tree, source: str, *, warn: bool = True) -> None:
    """Move each old key of ``RENAMED_KEYS`` in the nested mapping ``tree`` (a dict or an
    OmegaConf ``DictConfig``) to its new name, in place; both names set is a ``ConfigError``."""
    for old, new in RENAMED_KEYS.items():
        *groups, leaf = old.split(".")
        node = tree
        for group in groups:
            node = node.get(group) if hasattr(node, "get") else None
        if not hasattr(node, "pop") or leaf not in node:
            continue
        new_leaf = new.rpartition(".")[2]
        if new_leaf in node:
            raise ConfigError(f"'{old}' and '{new}' both set in {source}: keep '{new}'", new)
        node[new_leaf] = node.pop(leaf)
        if warn:
            warnings.warn(f"'{old}' in {source} is now '{new}'", RenamedKeyWarning, stacklevel=4)


def _did_you_mean(key: str) -> str:
    candidates = all_keys()
    group, dot, rest = key.partition(".")
    groups = sorted({c.split(".", 1)[0] for c in candidates})
    if dot and group not in groups:
        # a misspelt group ("trainr.total_steps"): fix the group first, then look for the rest
        # inside it — a whole-key match would pick whatever key shares the most letters
        close_groups = difflib.get_close_matches(group, groups, n=1, cutoff=0.6)
        if close_groups:
            fixed = f"{close_groups[0]}.{rest}"
            if fixed in candidates:
                return f" (did you mean '{fixed}'?)"
            candidates = [c for c in candidates if c.startswith(close_groups[0] + ".")]
            key = fixed
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if not close:  # a typo in the leaf with the right group, e.g. "actor.lrr"
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {c.rsplit(".", 1)[-1]: c for c in candidates}
        leaves = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.6)
        close = [by_leaf[leaves[0]]] if leaves else []
    return f" (did you mean '{close[0]}'?)" if close else ""


def _merge(
    base: DictConfig, other: DictConfig | ListConfig, source: str, key_hint: str = ""
) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or key_hint
        if key_hint.startswith(f"{key}."):  # OmegaConf names only the unknown group
            key = key_hint
        if type(err).__name__ in ("ConfigKeyError", "ConfigAttributeError"):
            if key in REMOVED_KEYS:
                msg = f"'{key}' in {source} was removed: {REMOVED_KEYS[key]}"
                raise ConfigError(msg, key) from None
            raise ConfigError(
                f"unknown config key '{key}' in {source}{_did_you_mean(key)}", key
            ) from None
        msg = str(err).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}' in {source}: {msg}", key) from None


def _literal(value):
    """A saved configuration with every string's ``${`` escaped: OmegaConf then reads it as the
    text it is instead of resolving it (``${oc.env:HF_TOKEN}`` in a checkpoint someone sent
    must not read your environment)."""
    if isinstance(value, dict):
        return {k: _literal(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_literal(v) for v in value]
    if isinstance(value, str):  # k backslashes before "${" escape as 2k + 1 (OmegaConf's rule)
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    return value


def load_config(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    *,
    base: dict | None = None,
) -> Config:
    """Build a ``Config``: the schema's defaults, the presets of the built-in model and task the
    run uses (``otbrl.config.presets``; none for a user's model on its own data), an optional
    YAML file, then ``key=value`` overrides — each later layer wins.

    ``base``: a saved, resolved configuration (``to_dict`` of a run's config, e.g. the one a
    checkpoint holds) that takes the presets' place: ``otbrl eval`` of a checkpoint starts from
    the settings it was trained with.

    Raises ``ConfigError`` (one line, naming the key) for unknown keys, bad types or values.
    """
    user = _user_layers(config_file, overrides or [])
    cfg = OmegaConf.structured(Config)
    if base is not None:  # data: a "${...}" in it is text, never resolved (env vars, files)
        saved = OmegaConf.create(_literal(upgrade_saved(base)))
        cfg = _merge(cfg, saved, "the saved configuration")
    else:
        probe = cfg
        for layer, source, key in user:
            probe = _merge(probe, layer, source, key)
        preset = presets_for(probe.model.path, probe.data.task, list(probe.data.train_files or []))
        user = [*_user_layers(None, preset), *user]
    for layer, source, key in user:
        cfg = _merge(cfg, layer, source, key)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or ""
        msg = str(err).splitlines()[0]
        raise ConfigError(f"invalid value for '{key}': {msg}", key) from None
    assert isinstance(obj, Config)
    _normalize(obj)
    check_config(obj)
    return obj


def _user_layers(config_file: str | Path | None, overrides: list[str]) -> list:
    """[(DictConfig, where it came from, its key)]: the config file, then each override."""
    layers = []
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file not found: '{path}'", "--config")
        try:
            loaded = OmegaConf.load(path)
        except Exception as err:  # YAML syntax errors come in several exception types
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ConfigError(f"cannot parse config file '{path}': {first}", "--config") from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(f"config file '{path}' must hold a mapping of groups", "--config")
        _rename_keys(loaded, f"'{path}'")
        layers.append((loaded, f"'{path}'", ""))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override '{item}' is not of the form key=value", item)
        key, value = (part.strip() for part in item.split("=", 1))
        if key in RENAMED_KEYS:
            warnings.warn(
                f"'{key}' is now '{RENAMED_KEYS[key]}' (override '{item}')", RenamedKeyWarning, 3
            )
            key = RENAMED_KEYS[key]
            item = f"{key}={value}"
        if key in LIST_KEYS and not value.startswith("["):
            item = f"{key}=[{value}]"  # CLI shorthand: data.train_files=a.parquet
        try:
            dot = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as err:
            msg = str(err).splitlines()[0]
            raise ConfigError(f"cannot parse override '{item}': {msg}", key) from None
        layers.append((dot, f"override '{item}'", key))
    return layers


def _normalize(cfg: Config) -> None:
    if cfg.model.path == "builtin" and cfg.data.task is None:
        cfg.data.task = DEFAULT_TASK  # the built-in model's vocabulary is its task's alphabet
    if cfg.actor.loss_agg_mode is None:  # the policy loss's own (gspo: seq-mean-token-mean)
        cfg.actor.loss_agg_mode = policy_loss_agg(cfg.actor.policy_loss)
    cfg.model.lora.follow_adapter("model.lora.")  # a saved adapter's rank, alpha... (its file)
    # a tri-state key read a YAML boolean as "True" / "False" (its field is a string)
    for key, allowed in choice_fields(Config).items():
        if allowed == TRISTATE:
            group, _, name = key.rpartition(".")
            node = functools.reduce(getattr, group.split("."), cfg)
            setattr(node, name, str(getattr(node, name)).lower())
