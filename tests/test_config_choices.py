"""Each component owns its settings: every closed set of config values is declared once, with
the field, by the component that acts on it; ranges and types live with the field too; the
CLI's schema only composes the groups (and importing it loads no torch)."""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
from omegaconf import OmegaConf

from otbrl.config import ConfigError, load_config
from otbrl.config.checks import choices
from otbrl.config.describe import key_comments
from otbrl.config.schema import Config, all_keys
from otbrl.settings import (
    TRISTATE,
    check_field,
    check_settings,
    range_text,
    refuse_unset,
    setting,
)

# key -> (the module whose code acts on the values, its name for them): the field's choices
# must be that very tuple (or, for KL_KINDS, its names)
OWNERS = {
    "model.precision": ("otbrl.engine.precision", "PRECISIONS"),
    "algorithm.distill.precision": ("otbrl.engine.precision", "PRECISIONS"),
    "model.lora.sync": ("otbrl.models.config", "LORA_SYNCS"),
    "rollout.name": ("otbrl.rollout.config", "ROLLOUT_NAMES"),
    "rollout.mode": ("otbrl.rollout.config", "ROLLOUT_MODES"),
    "rollout.server.weight_transport": ("otbrl.rollout.config", "WEIGHT_TRANSPORTS"),
    "rollout.stale_samples": ("otbrl.run.producer", "STALE_SAMPLES"),
    "rollout.vllm.dtype": ("otbrl.models.hf", "DTYPES"),
    "rollout.multi_turn.format": ("otbrl.tools.formats", "FORMATS"),
    "algorithm.rollout_correction": ("otbrl.algos.rollout_correction", "CORRECTIONS"),
    "algorithm.off_policy": ("otbrl.algos.rollout_correction", "OFF_POLICY_MODES"),
    "actor.loss_agg_mode": ("otbrl.algos.loss_math", "LOSS_AGG_MODES"),
    "actor.policy_loss": ("otbrl.algos.loss_terms", "POLICY_LOSSES"),
    "actor.kl_loss_type": ("otbrl.algos.loss_math", "KL_KINDS"),
    "actor.calculate_sum_pi_squared": ("otbrl.settings", "TRISTATE"),
    "actor.strategy": ("otbrl.engine.dims", "STRATEGIES"),
    "critic.enable": ("otbrl.settings", "TRISTATE"),
    "algorithm.otb.energy": ("otbrl.algos.otb", "ENERGIES"),
    "reward.on_error": ("otbrl.rewards.scoring", "ON_ERROR"),
    "data.overlong_prompts": ("otbrl.data.datasets", "OVERLONG_PROMPTS"),
    "reward.math_backend": ("otbrl.rewards.builtin", "MATH_BACKENDS"),
    "trainer.logger": ("otbrl.report.metrics_log", "BACKENDS"),
}


def test_every_choice_is_the_tuple_its_owner_acts_on():
    table = choices()
    assert set(table) == set(OWNERS)
    for key, (module, name) in OWNERS.items():
        owned = getattr(importlib.import_module(module), name)
        assert sorted(table[key]) == sorted(owned), key


def test_the_groups_are_declared_by_their_components():
    # the schema composes: every group but the run's own comes from the package that reads it
    owners = {f.name: f.default_factory.__module__ for f in dataclasses.fields(Config)}
    assert owners == {
        "data": "otbrl.data.config",
        "model": "otbrl.engine.config",
        "rollout": "otbrl.rollout.config",
        "actor": "otbrl.engine.config",
        "critic": "otbrl.engine.config",
        "algorithm": "otbrl.algos.config",
        "reward": "otbrl.rewards.config",
        "trainer": "otbrl.config.schema",
        "sft": "otbrl.config.schema",
    }
    # the optimizer keys are declared once, by the engine, for both of its groups
    from otbrl.engine.optim import OptimConfig

    cfg = Config()
    assert isinstance(cfg.actor, OptimConfig) and isinstance(cfg.critic, OptimConfig)
    assert key_comments()["critic.ppo_epochs"] == key_comments()["actor.ppo_epochs"]
    assert key_comments()["critic.lr"] != key_comments()["actor.lr"]  # its own default, said


def test_importing_the_schema_loads_no_torch():
    # the CLI answers --help from the schema: composing the components' settings must not
    # import their torch code (the heavy packages export lazily: otbrl.lazy)
    code = (
        "import sys, otbrl.config, otbrl.config.describe as d; d.keys_help(); "
        "print(sorted(m for m in ('torch', 'transformers', 'pandas') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_key_that_lists_its_values_declares_them():
    # a comment that lists quoted alternatives ("a" | "b") documents a closed set: the field
    # must declare it, and the values it documents are the ones it allows
    alternatives = re.compile(r'"([^"\s]+)"\s*(?:\([^)]*\)\s*)?\|')
    table = choices()
    listed = {
        key
        for key, comment in key_comments().items()
        if alternatives.search(comment) and key in all_keys()
    }
    # keys whose alternatives are open-ended (a built-in name or a path, a model id...)
    open_ended = {"data.task", "model.path", "model.lora.target_modules", "trainer.resume"}
    assert listed - set(table) <= open_ended, sorted(listed - set(table) - open_ended)
    for key in listed & set(table):
        documented = set(re.findall(r'"([^"\s]+)"', key_comments()[key]))
        assert set(table[key]) <= documented | set(TRISTATE), (key, documented)


def test_defaults_are_allowed_and_other_values_refused():
    cfg = load_config(overrides=[])
    # the schema's own defaults (no preset) pass their fields' rules
    check_settings(OmegaConf.to_object(OmegaConf.structured(Config)))
    nullable = {"algorithm.distill.precision"}  # None: the policy's (model.precision)
    for key, allowed in choices().items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        for item in value if isinstance(value, list) else [value]:
            assert item in allowed or (item is None and key in nullable), key
    keys = ("model.precision", "rollout.stale_samples", "algorithm.off_policy")
    for key in (*keys, "algorithm.distill.precision"):
        with pytest.raises(ConfigError, match=re.escape(key)) as err:
            load_config(overrides=[f"{key}=nonsense"])
        assert err.value.key == key
    with pytest.raises(ConfigError, match=r"trainer\.logger.*jsonlines"):
        load_config(overrides=["trainer.logger=[console,jsonlines]"])
    with pytest.raises(ConfigError, match=r"'actor\.kl_loss_type' must be one of .*'k3\+'"):
        load_config(overrides=["actor.kl_loss_type=k4"])
    # a YAML boolean is read as the tri-state's string
    assert load_config(overrides=["critic.enable=True"]).critic.enable == "true"


@dataclass
class _Group:
    count: int = setting(2, gt=0)
    share: float = setting(0.5, gt=0, le=1)
    size: int | None = setting(None, ge=1, null="all of them")
    mode: str = setting("a", choices=("a", "b"))
    names: list[str] = setting(default_factory=list, choices=("x", "y"))
    extra: int = 0


def test_a_field_declares_its_rules():
    """The generic checks against a plain loop of what each field allows."""
    fields = {f.name: f for f in dataclasses.fields(_Group)}
    assert range_text(fields["count"].metadata) == "> 0"
    assert range_text(fields["share"].metadata) == "in (0, 1]"
    assert range_text(fields["size"].metadata) == ">= 1 or null (all of them)"
    cases = [
        ("count", 0, "'g.count' must be > 0, got 0"),
        ("count", 1.5, "'g.count' must be an int, got 1.5"),
        ("count", True, "'g.count' must be an int, got True"),
        ("share", 1.5, "'g.share' must be in (0, 1], got 1.5"),
        ("share", float("nan"), "'g.share' must be a finite number, got nan"),
        ("share", "x", "'g.share' must be a number, got 'x'"),
        ("size", 0, "'g.size' must be >= 1 or null (all of them), got 0"),
        ("mode", "bb", "'g.mode' must be one of ['a', 'b'], got 'bb' (did you mean 'b'?)"),
        ("names", ["x", "z"], "'g.names' entries must be in ['x', 'y'], got 'z'"),
    ]
    for name, value, message in cases:
        with pytest.raises(ConfigError) as err:
            check_field(fields[name], value, f"g.{name}")
        assert str(err.value) == message and err.value.key == f"g.{name}"
    for name, value in (("count", 1), ("share", 1.0), ("size", None), ("names", ["y"])):
        check_field(fields[name], value, f"g.{name}")
    group = _Group(extra=3)
    refuse_unset(group, "g.", "off", "switch it on", ["mode"])
    with pytest.raises(ConfigError, match=r"^'g\.extra' is set but off; switch it on or drop"):
        refuse_unset(group, "g.", "off", "switch it on", ["mode", "extra"])
    with pytest.raises(ConfigError, match=r"^'g\.extra' is set"):
        refuse_unset(group, "g.", "off", "switch it on")  # every field
