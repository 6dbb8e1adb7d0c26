"""What a key is, declared on its field (``otbrl.settings.setting``): whether it may change when
a run is resumed, the estimator option it sets, whether a bare command-line value is a list —
and the tables the run reads (``otbrl.config.keys``) derived from those declarations."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import pytest

from otbrl.algos.advantages import ESTIMATOR_ALIASES, ESTIMATORS
from otbrl.config import Config, load_config, to_dict
from otbrl.config.keys import (
    ESTIMATOR_OPTION_KEYS,
    LIST_KEYS,
    RESUME_MAY_DIFFER,
    SCHEMA_FIELDS,
    undeclared_resume,
)
from otbrl.config.schema import all_keys
from otbrl.settings import RESUME_CLASSES, is_list, leaf_fields, setting, type_name


def _value(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_every_key_declares_whether_it_may_change_on_resume():
    # the walker sees every key OmegaConf's schema has, and each declares its class
    assert list(SCHEMA_FIELDS) == all_keys()
    undeclared = undeclared_resume()
    assert not undeclared, (
        f"these keys declare no resume safety: {undeclared}; give each field "
        'setting(..., resume="may_differ" | "fixed")'
    )
    assert {f.metadata["resume"] for f in SCHEMA_FIELDS.values()} <= set(RESUME_CLASSES)


def test_a_field_declares_what_it_is():
    @dataclass
    class Group:
        size: int = setting(8, gt=0, resume="may_differ")
        rate: float = setting(0.5, resume="fixed", estimator_option="rate")
        names: list[str] = setting(default_factory=list, resume="fixed")
        plain: int = 0

    found = leaf_fields(Group, "g.")
    assert list(found) == ["g.size", "g.rate", "g.names", "g.plain"]
    assert found["g.size"].metadata["resume"] == "may_differ"
    assert found["g.rate"].metadata["estimator_option"] == "rate"
    assert [k for k, f in found.items() if is_list(f)] == ["g.names"]
    assert "resume" not in found["g.plain"].metadata  # a plain default declares nothing
    with pytest.raises(ValueError, match="resume: expected one of"):
        setting(1, resume="maybe")


def test_the_run_reads_the_derived_tables():
    from otbrl.run import claim, needs

    assert claim.RESUME_MAY_DIFFER is RESUME_MAY_DIFFER
    assert needs.ESTIMATOR_OPTION_KEYS is ESTIMATOR_OPTION_KEYS


def test_resume_classes_follow_what_a_key_changes():
    # micro-batching changes no result (gradients accumulate exactly; a frozen engine's
    # forward is per row): every such key of every engine may differ
    micro = [
        k for k in all_keys() if k.endswith(("micro_batch_size", "max_tokens_per_micro_batch"))
    ]
    assert len(micro) >= 6, micro
    assert set(micro) <= RESUME_MAY_DIFFER, sorted(set(micro) - RESUME_MAY_DIFFER)
    # what the estimator computes, which samples are drawn and how they are scored would mix
    # two runs' steps
    fixed = {
        *ESTIMATOR_OPTION_KEYS.values(),
        "algorithm.adv_estimator",
        "actor.lr",
        "critic.lr",
        "trainer.seed",
        "data.seed",
        "data.train_files",
        "data.train_batch_size",
        "model.path",
        "rollout.n",
        "rollout.temperature",
        "rollout.max_new_tokens",
        "reward.function",
        "reward.timeout_s",
        "trainer.max_staleness",
    }
    assert not fixed & RESUME_MAY_DIFFER, sorted(fixed & RESUME_MAY_DIFFER)


def test_resuming_with_another_micro_batching_is_one_run():
    from otbrl.config.resume import config_differences

    saved = to_dict(load_config(None, []))
    changed = [
        "actor.max_tokens_per_micro_batch=4096",
        "critic.max_tokens_per_micro_batch=4096",
        "algorithm.distill.teacher_path=teacher",
        "algorithm.distill.micro_batch_size=2",
    ]
    saved["algorithm"]["distill"]["teacher_path"] = "teacher"
    diff = config_differences(saved, to_dict(load_config(None, changed)))
    assert set(diff) == {
        "actor.max_tokens_per_micro_batch",
        "critic.max_tokens_per_micro_batch",
        "algorithm.distill.micro_batch_size",
    }
    assert set(diff) <= RESUME_MAY_DIFFER


def test_estimator_options_are_schema_keys_and_cover_every_estimator():
    keys = set(all_keys())
    assert set(ESTIMATOR_OPTION_KEYS.values()) <= keys
    defaults = Config()
    for name, estimator in ESTIMATORS.items():
        # an estimator's options: its keywords with a default that is not a missing tensor
        options = {
            p.name: p.default
            for p in inspect.signature(estimator.fn).parameters.values()
            if p.default is not inspect.Parameter.empty and p.default is not None
        }
        if estimator.options_needs is not None:
            params = inspect.signature(estimator.options_needs).parameters.values()
            named = {p.name for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD}
            assert named <= set(options), (name, named - set(options))
        missing = set(options) - set(ESTIMATOR_OPTION_KEYS)
        assert not missing, f"{name}: options no key sets: {sorted(missing)}"
        for option, default in options.items():  # without a config, the same defaults
            assert _value(defaults, ESTIMATOR_OPTION_KEYS[option]) == default, (name, option)
    for alias, (_, options) in ESTIMATOR_ALIASES.items():  # otbrl compare sets them by key
        assert set(options) <= set(ESTIMATOR_OPTION_KEYS), alias


def test_estimator_options_reach_the_spec():
    from otbrl.run.needs import estimator_options

    cfg = load_config(None, ["algorithm.gamma=0.5", "algorithm.otb.energy=uniform"])
    options = estimator_options(cfg)
    assert set(options) == set(ESTIMATOR_OPTION_KEYS)
    assert options["gamma"] == 0.5 and options["energy"] == "uniform"


# the other keys a list key needs set to load
NEEDS = {"rollout.server.urls": ["rollout.name=vllm", "rollout.mode=server"]}
BARE = {
    "rollout.server.urls": "http://127.0.0.1:8000",
    "rollout.multi_turn.tools": "calculator",
    "trainer.logger": "jsonl",
}


def test_list_keys_are_the_list_typed_fields_and_take_a_bare_value():
    assert {"data.train_files", "data.val_files", "trainer.logger"} <= LIST_KEYS
    assert {"rollout.multi_turn.tools", "rollout.server.urls"} <= LIST_KEYS
    assert "model.lora.target_modules" not in LIST_KEYS  # "all-linear" or a list
    defaults = Config()
    for key in LIST_KEYS:
        assert type_name(SCHEMA_FIELDS[key]).startswith("list["), key
        assert isinstance(_value(defaults, key), list), key
        bare = BARE.get(key, "a.parquet")
        cfg = load_config(None, [*NEEDS.get(key, []), f"{key}={bare}"])
        assert _value(cfg, key) == [bare], key
