"""Every closed set of config values is declared once, by the component that owns it: the
config checks read it from there, and a new choice key cannot slip past the table."""

from __future__ import annotations

import importlib
import re

import pytest

from otbrl.config import ConfigError, load_config
from otbrl.config.checks import TRISTATE, choices
from otbrl.config.describe import key_comments
from otbrl.config.schema import all_keys

# key -> (owner module, attribute): where the allowed values live; the checks must use them
OWNERS = {
    "model.precision": ("otbrl.engine.precision", "PRECISIONS"),
    "model.lora.sync": ("otbrl.models.lora", "LORA_SYNCS"),
    "rollout.name": ("otbrl.rollout.protocol", "ROLLOUT_NAMES"),
    "rollout.mode": ("otbrl.rollout.protocol", "ROLLOUT_MODES"),
    "rollout.stale_samples": ("otbrl.rollout.protocol", "STALE_SAMPLES"),
    "rollout.vllm.dtype": ("otbrl.models.hf", "DTYPES"),
    "rollout.multi_turn.format": ("otbrl.tools.formats", "FORMATS"),
    "algorithm.rollout_correction": ("otbrl.algos.rollout_correction", "CORRECTIONS"),
    "algorithm.off_policy": ("otbrl.algos.rollout_correction", "OFF_POLICY_MODES"),
    "actor.loss_agg_mode": ("otbrl.algos.loss_math", "LOSS_AGG_MODES"),
    "actor.calculate_sum_pi_squared": ("otbrl.config.checks", "TRISTATE"),
    "actor.engine": ("otbrl.engine.dims", "ENGINES"),
    "critic.enable": ("otbrl.config.checks", "TRISTATE"),
    "algorithm.otb.energy": ("otbrl.algos.otb", "ENERGIES"),
    "reward.on_error": ("otbrl.rewards.scoring", "ON_ERROR"),
    "data.overlong_prompts": ("otbrl.data.datasets", "OVERLONG_PROMPTS"),
    "reward.math_backend": ("otbrl.rewards.builtin", "MATH_BACKENDS"),
    "trainer.logger": ("otbrl.report.metrics_log", "BACKENDS"),
}


def test_every_choice_comes_from_its_owner():
    table = choices()
    assert set(table) == set(OWNERS)
    for key, (module, name) in OWNERS.items():
        owned = getattr(importlib.import_module(module), name)
        assert tuple(table[key]) == tuple(owned), key


def test_every_key_that_lists_its_values_is_in_the_table():
    # a schema comment that lists quoted alternatives ("a" | "b") documents a closed set: it
    # must be checked against its owner's values, and those are the values it documents
    alternatives = re.compile(r'"([^"\s]+)"\s*(?:\([^)]*\)\s*)?\|')
    table = choices()
    listed = set()
    for key, comment in key_comments().items():
        if alternatives.search(comment) and key in all_keys():
            listed.add(key)
    unchecked = listed - set(table)
    # keys whose alternatives are open-ended (a built-in name or a path, a model id...)
    open_ended = {"data.task", "model.path", "model.lora.target_modules", "trainer.resume"}
    assert unchecked <= open_ended, sorted(unchecked - open_ended)
    for key in listed & set(table):
        documented = set(re.findall(r'"([^"\s]+)"', key_comments()[key]))
        assert set(table[key]) <= documented | set(TRISTATE), (key, documented)


def test_defaults_are_allowed_and_other_values_refused():
    cfg = load_config(overrides=[])
    table = choices()
    for key, allowed in table.items():
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        for item in value if isinstance(value, list) else [value]:
            assert item in allowed, key
    for key in ("model.precision", "rollout.stale_samples", "algorithm.off_policy"):
        with pytest.raises(ConfigError, match=re.escape(key)) as err:
            load_config(overrides=[f"{key}=nonsense"])
        assert err.value.key == key
    with pytest.raises(ConfigError, match=r"trainer\.logger.*jsonlines"):
        load_config(overrides=["trainer.logger=[console,jsonlines]"])
