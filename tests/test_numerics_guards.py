"""Numbers that cannot work are refused before a model loads; weights that go non-finite, or a
run that only skips its steps, stop the run before anything broken is saved."""

import dataclasses
import math
import re

import pytest
import torch

from dist_utils import actor_config, actor_spec, ppo_batch, ppo_step, tiny_llama
from otbrl import cli
from otbrl.config import Config, ConfigError, load_config
from otbrl.engine.trainable import NumericsError, TrainableEngine
from otbrl.store.checkpoint import list_checkpoints
from run_utils import read_metrics, refused

pytestmark = pytest.mark.usefixtures("one_thread")


def float_values(node, prefix=""):
    """(dotted key, value) of every float in the config tree (the finite check covers them)."""
    out = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(float_values(value, f"{prefix}{f.name}."))
        elif isinstance(value, float):
            out.append((f"{prefix}{f.name}", value))
    return out


FLOAT_KEYS = [key for key, _ in float_values(Config())]


def test_the_schema_has_the_float_keys_the_issue_names():
    for key in ("actor.entropy_coeff", "algorithm.gamma", "actor.grad_clip", "actor.lr"):
        assert key in FLOAT_KEYS
    assert "rollout.temperature" in FLOAT_KEYS and len(FLOAT_KEYS) > 20


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_must_be_finite(key, value):
    with pytest.raises(ConfigError, match="must be a finite number") as info:
        load_config(None, [f"{key}={value}"])
    assert info.value.key == key


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("algorithm.gamma=1.5", "in [0, 1]"),
        ("algorithm.lam=-0.1", "in [0, 1]"),
        ("actor.clip_ratio_low=1.0", "in [0, 1)"),
        ("actor.entropy_coeff=-0.01", ">= 0"),
        ("reward.timeout_s=-1", ">= 0"),
        ("trainer.dist_timeout_s=0", "> 0"),
        ("trainer.max_skipped_steps=-1", ">= 0"),
    ],
)
def test_values_out_of_range_are_refused(override, fragment):
    with pytest.raises(ConfigError, match=re.escape(fragment)) as info:
        load_config(None, [override])
    assert info.value.key == override.split("=")[0]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("actor.entropy_coeff=nan", "actor.entropy_coeff"),
        ("algorithm.gamma=nan", "algorithm.gamma"),
        ("actor.grad_clip=nan", "actor.grad_clip"),
        ("actor.lr=inf", "actor.lr"),
        ("rollout.temperature=inf", "rollout.temperature"),
        ("model.dtype=float16", "model.dtype"),
        ("model.precision=16-mixed", "model.precision"),
    ],
)
def test_the_issue_numbers_exit_2_before_loading(override, key, capsys, no_model_loading):
    err = refused(["train", override], capsys, f"'{key}'")
    if key == "model.dtype":  # the key was replaced: the message names its successor
        assert "removed" in err and "model.precision" in err and "bf16-mixed" in err


def _update(engine):
    return ppo_step(engine, ppo_batch())[1]


def _engine(model, mini_batch_size=8):
    """The tests' trainable engine (``dist_utils``' settings) on ``model``."""
    return TrainableEngine(model, actor_config(), actor_spec(), mini_batch_size=mini_batch_size)


def test_pure_fp16_step_is_caught_not_trained_on():
    """fp16 AdamW: eps underflows, the update is NaN although the gradient is finite (so the
    skip guard does not fire); the parameter check stops it. bf16 and fp32 train."""
    engine = _engine(tiny_llama(seed=0).half())
    with pytest.raises(NumericsError, match=r"non-finite values in the parameters \(model\."):
        _update(engine)
    for dtype in (torch.bfloat16, torch.float32):
        engine = _engine(tiny_llama(seed=0).to(dtype))
        metrics = _update(engine)
        assert metrics["policy/skipped_steps"] == 0 and math.isfinite(metrics["policy/grad_norm"])
        assert all(bool(torch.isfinite(p).all()) for p in engine.model.parameters())


def test_the_check_names_the_parameter_that_went_bad(monkeypatch):
    engine = _engine(tiny_llama(seed=0))
    real_step = engine.optimizer.step

    def step_then_poison(*args, **kwargs):
        out = real_step(*args, **kwargs)
        with torch.no_grad():
            engine.model.model.norm.weight[3] = float("inf")
        return out

    monkeypatch.setattr(engine.optimizer, "step", step_then_poison)
    with pytest.raises(NumericsError, match=r"\(model\.norm\.weight\)"):
        _update(engine)


def test_trainer_stops_before_saving_non_finite_weights(tiny_run, tmp_path, capsys, monkeypatch):
    """Weights poisoned by the 3rd optimizer step (RL step 2): exit 1 with one line, step 1's
    checkpoint kept, nothing of step 2 logged or saved."""
    calls = []
    real_step = torch.optim.AdamW.step

    def poisoning_step(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        calls.append(1)
        if len(calls) == 3:
            with torch.no_grad():
                self.param_groups[0]["params"][0].fill_(float("nan"))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", poisoning_step)
    run = tmp_path / "run"
    assert cli.main(["train", *tiny_run(run, "trainer.save_every=1")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("otbrl: error: policy: an optimizer step left non-finite")
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_1"]
    assert [r["step"] for r in read_metrics(run)] == [0, 1]


def test_a_run_that_only_skips_stops(tiny_run, tmp_path, capsys, monkeypatch):
    import otbrl.engine.trainable as engine_mod

    monkeypatch.setattr(engine_mod.parallel, "clip_grad_norm", lambda *a: torch.tensor(math.nan))
    run = tmp_path / "run"
    argv = ["train", *tiny_run(run, "trainer.save_every=1", "trainer.max_skipped_steps=2")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the last 4 optimizer steps were all skipped" in err
    assert "trainer.max_skipped_steps=2" in err and "step 2" in err
    records = read_metrics(run)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["policy/skipped_steps"] == 2 and records[2]["policy/skipped_steps"] == 2
    # step 1 (2 skips in a row, not more than 2) was saved; step 2 was not
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step_1"]


def test_skips_counted_in_a_row_reset_on_a_taken_step(monkeypatch):
    import otbrl.engine.trainable as engine_mod

    real = engine_mod.parallel.clip_grad_norm
    norms = iter([math.nan, math.nan, None, math.nan])

    def scripted(params, clip):
        value = next(norms)
        return real(params, clip) if value is None else torch.tensor(value)

    monkeypatch.setattr(engine_mod.parallel, "clip_grad_norm", scripted)
    engine = _engine(tiny_llama(seed=0), mini_batch_size=4)  # 2 steps / update
    seen = []
    for _ in range(2):
        _update(engine)
        seen.append(engine.skipped_in_a_row)
    assert seen == [2, 1]


def test_the_check_is_exact_when_a_sum_overflows():
    """The fast path sums each parameter; finite values whose sum overflows are not an error,
    one NaN next to them is."""
    engine = _engine(tiny_llama(seed=0))
    weight = engine.model.model.layers[0].mlp.up_proj.weight
    with torch.no_grad():
        weight[0, :2] = 3e38  # finite in fp32; their sum is not
    engine._check_parameters()
    with torch.no_grad():
        weight[1, 0] = float("nan")
    with pytest.raises(NumericsError, match=r"\(model\.layers\.0\.mlp\.up_proj\.weight\)"):
        engine._check_parameters()
