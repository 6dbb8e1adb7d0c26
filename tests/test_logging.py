"""MetricsLogger: metrics.jsonl contract, resume equality (with a real SIGKILL), non-finite
values, summary, optional backends, bad input."""

import importlib.machinery
import importlib.util
import io
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from otbrl.report.metrics_log import MetricsLogger, check_backends, read_metrics


def strict_lines(path):
    """Parse metrics.jsonl refusing the NaN / Infinity extensions of Python's json."""

    def refuse(token):
        raise AssertionError(f"non-JSON constant {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def step_metrics(step):
    return {"train/reward_mean": step / 10, "policy/entropy_mean": 1.0 / step}


def run_steps(logger, steps, val_every=2):
    for step in steps:
        logger.log(step, step_metrics(step))
        if step % val_every == 0:  # validation arrives after the training metrics of the step
            logger.log(step, {"val/accuracy": step / 100})


def test_one_object_per_step_flushed_at_once(tmp_path):
    logger = MetricsLogger(tmp_path, backends=("jsonl",), total_steps=4)
    logger.log(0, {"val/accuracy": 0.1})
    for step in (1, 2):
        logger.log(step, {"a": np.float32(0.5), "b": torch.tensor(2.0), "n": 3, "flag": True})
    # Readable before close: each step is flushed when logged.
    records = strict_lines(tmp_path / "metrics.jsonl")
    assert records == [
        {"step": 0, "val/accuracy": 0.1},
        {"step": 1, "a": 0.5, "b": 2.0, "n": 3, "flag": 1},
        {"step": 2, "a": 0.5, "b": 2.0, "n": 3, "flag": 1},
    ]
    logger.log(2, {"val/accuracy": 0.7, "a": 0.25})  # same step: merged, not a second line
    logger.log(3, {"a": 1.0})
    logger.close()
    logger.close()  # idempotent
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[2] == {"step": 2, "a": 0.25, "b": 2.0, "n": 3, "flag": 1, "val/accuracy": 0.7}


def test_resume_truncates_to_an_uninterrupted_file(tmp_path):
    full = tmp_path / "full"
    with MetricsLogger(full, backends=("jsonl",), total_steps=8) as logger:
        run_steps(logger, range(1, 9))

    cut = tmp_path / "cut"
    logger = MetricsLogger(cut, backends=("jsonl",), total_steps=8)
    run_steps(logger, range(1, 7))  # checkpoint at step 4, then steps 5-6 before the "kill"
    logger._file.write(b'{"step": 7, "train/rew')  # a write torn by the kill
    logger._file.flush()
    with pytest.warns(RuntimeWarning, match="unreadable"):
        resumed = MetricsLogger(cut, backends=("jsonl",), total_steps=8, initial_step=4)
    assert [r["step"] for r in read_metrics(cut)] == [1, 2, 3, 4]
    run_steps(resumed, range(5, 9))
    resumed.close()
    assert (cut / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()

    # A fresh run (initial_step=0) in an old directory starts the file over.
    with MetricsLogger(cut, backends=("jsonl",), total_steps=8) as fresh:
        fresh.log(1, {"x": 1.0})
    assert read_metrics(cut) == [{"step": 1, "x": 1.0}]


CHILD = """
import os, signal, sys
from otbrl.report.metrics_log import MetricsLogger
out, stop, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
logger = MetricsLogger(out, backends=("jsonl",), total_steps=8, initial_step=start)
for step in range(start + 1, 9):
    logger.log(step, {"train/reward_mean": step / 10, "policy/entropy_mean": 1.0 / step})
    if step % 2 == 0:
        logger.log(step, {"val/accuracy": step / 100})
    if step == stop:
        os.kill(os.getpid(), signal.SIGKILL)
logger.close()
"""


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    def child(out, stop, start):
        cmd = [sys.executable, "-c", CHILD, str(out), str(stop), str(start)]
        return subprocess.run(cmd, capture_output=True, timeout=120).returncode

    assert child(tmp_path / "full", 0, 0) == 0
    assert child(tmp_path / "cut", 6, 0) == -9  # killed after step 6, no close()
    assert [r["step"] for r in read_metrics(tmp_path / "cut")] == list(range(1, 7))
    assert child(tmp_path / "cut", 0, 4) == 0  # resumed from the step-4 checkpoint
    full = (tmp_path / "full" / "metrics.jsonl").read_bytes()
    assert (tmp_path / "cut" / "metrics.jsonl").read_bytes() == full


def test_nonfinite_values_are_null_counted_and_warned_once(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, backends=("jsonl", "console"), total_steps=3, stream=out)
    with pytest.warns(RuntimeWarning) as caught:
        logger.log(1, {"loss": float("nan"), "policy/grad_norm": float("inf"), "ok": 1.0})
        logger.log(2, {"loss": torch.tensor(float("-inf")), "ok": 2.0})
    assert len(caught) == 2  # once per key, not once per value
    assert logger.nonfinite_counts == {"loss": 2, "policy/grad_norm": 1}
    records = strict_lines(tmp_path / "metrics.jsonl")
    assert records[0] == {"step": 1, "loss": None, "policy/grad_norm": None, "ok": 1.0}
    assert records[1] == {"step": 2, "loss": None, "ok": 2.0}
    summary = logger.summary(
        {
            "final_val_accuracy": float("nan"),
            "adv_estimator": "grpo",
            "extra": {
                "loss": torch.tensor(float("inf")),
                "acc": np.float32(0.5),
                "xs": [1.0, math.nan],
            },
        }
    )
    logger.close()
    saved = json.loads((tmp_path / "summary.json").read_text(), parse_constant=float)
    assert saved == summary
    assert saved["final_val_accuracy"] is None
    assert saved["extra"] == {"loss": None, "acc": 0.5, "xs": [1.0, None]}
    assert "n/a -> n/a" in out.getvalue() and "non-finite values  3" in out.getvalue()
    assert saved["nonfinite_metric_counts"] == {"loss": 2, "policy/grad_norm": 1}
    assert "policy/grad_norm" not in saved["last_metrics"]  # never had a finite value


def test_progress_bar_and_summary(tmp_path, capsys):
    out = io.StringIO()
    config = OmegaConf.create(
        {"algorithm": {"adv_estimator": "optimal_token_baseline"}, "data": {"files": ["a", "b"]}}
    )
    logger = MetricsLogger(
        tmp_path, backends=("console", "jsonl"), total_steps=4, config=config, stream=out
    )
    for step in range(1, 5):
        logger.log(
            step,
            {
                "train/reward_mean": 0.25 * step,
                "policy/entropy_mean": 0.5,
                "policy/sum_pi_squared_mean": 0.875,
                "policy/grad_norm": 1.5,
            },
        )
    logger.log(4, {"val/accuracy": 0.625})
    final = {
        "initial_val_accuracy": 0.125,
        "final_val_accuracy": 0.625,
        "wall_seconds": 125.0,
        "adv_estimator": "optimal_token_baseline",
    }
    summary = logger.summary(final)
    logger.close()
    bar = capsys.readouterr().err
    assert "4/4" in bar and "reward 1" in bar and "val acc 0.625" in bar and "Σπ² 0.875" in bar
    table = out.getvalue()
    assert len(table.splitlines()) <= 24  # one screen
    for text in ("optimal_token_baseline", "0.125 -> 0.625  (+0.500)", "2m 05s", "1.5", "0.875"):
        assert text in table, text
    assert summary["steps"] == 4  # defaulted from the last logged step
    assert summary["last_metrics"] == {
        "train/reward_mean": 1.0,
        "policy/entropy_mean": 0.5,
        "policy/sum_pi_squared_mean": 0.875,
        "policy/grad_norm": 1.5,
    }
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == OmegaConf.to_container(config)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
    ]  # no temp files left behind


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match=r"backends.*'csv'"):
        MetricsLogger(tmp_path, backends=("jsonl", "csv"), total_steps=1)
    with pytest.raises(TypeError, match="backends"):
        check_backends("console")
    with pytest.raises(ValueError, match="total_steps"):
        MetricsLogger(tmp_path, backends=(), total_steps=-1)
    with pytest.raises(ValueError, match="initial_step"):
        MetricsLogger(tmp_path, backends=(), total_steps=1, initial_step=1.5)
    logger = MetricsLogger(tmp_path, backends=("jsonl",), total_steps=5)
    with pytest.raises(TypeError, match=r"metrics\['name'\].*str"):
        logger.log(1, {"name": "grpo"})
    with pytest.raises(TypeError, match=r"metrics\['v'\].*shape \(2,\)"):
        logger.log(1, {"v": torch.zeros(2)})
    with pytest.raises(ValueError, match="'step'"):
        logger.log(1, {"step": 1.0})
    logger.log(3, {"x": 1.0})
    with pytest.raises(ValueError, match="step: expected >= last logged step 3, got 2"):
        logger.log(2, {"x": 1.0})
    logger.close()
    with pytest.raises(ValueError, match="closed"):
        logger.log(4, {"x": 1.0})
    with pytest.raises(ValueError, match="run_dir"):
        read_metrics(tmp_path / "nowhere")


@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_missing_optional_backend_names_the_package(tmp_path, monkeypatch, backend):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == backend else real_find_spec(name, *a),
    )
    with pytest.raises(ImportError, match=rf"'{backend}' package.*otbrl\[{backend}\]"):
        MetricsLogger(tmp_path, backends=("jsonl", backend), total_steps=1)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing started before the error


def fake_module(name, **attrs):
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(attrs)
    return module


def test_tensorboard_and_wandb_receive_finite_scalars(tmp_path, monkeypatch):
    calls = {"tb": [], "wandb": [], "closed": []}

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            calls["tb_init"] = (Path(log_dir), purge_step)

        def add_scalar(self, key, value, global_step):
            calls["tb"].append((key, value, global_step))

        def add_text(self, key, text):
            calls["tb_text"] = key

        def flush(self):
            pass

        def close(self):
            calls["closed"].append("tb")

    class Run:
        def log(self, metrics, step):
            calls["wandb"].append((metrics, step))

        def finish(self):
            calls["closed"].append("wandb")

    def init(**kwargs):
        calls["wandb_init"] = kwargs
        return Run()

    monkeypatch.setitem(sys.modules, "tensorboard", fake_module("tensorboard"))
    tb_module = fake_module("torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb_module)
    monkeypatch.setitem(sys.modules, "wandb", fake_module("wandb", init=init))

    with pytest.warns(RuntimeWarning):
        logger = MetricsLogger(
            tmp_path,
            backends=("tensorboard", "wandb"),
            total_steps=10,
            config={"seed": 1},
            initial_step=5,
        )
        logger.log(6, {"a": 1.0, "b": math.nan})
    logger.close()
    assert calls["tb_init"] == (tmp_path / "tensorboard", 6)  # events past the resume purged
    assert calls["tb"] == [("a", 1.0, 6)]
    assert calls["wandb"] == [({"a": 1.0}, 6)]
    assert calls["wandb_init"]["config"] == {"seed": 1}
    assert calls["closed"] == ["tb", "wandb"]
    assert not (tmp_path / "metrics.jsonl").exists()  # jsonl not requested


def test_generations_go_to_jsonl_tensorboard_and_wandb_tables(tmp_path, monkeypatch):
    """No generations were logged: whether tools or rewards fire was invisible."""
    texts, tables = [], []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            pass

        def add_text(self, key, text, global_step=None):
            texts.append((key, text, global_step))

        def add_scalar(self, *args, **kwargs):
            pass

        def flush(self):
            pass

        def close(self):
            pass

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, metrics, step):
            tables.append((metrics, step))

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "tensorboard", fake_module("tensorboard"))
    tb_module = fake_module("torch.utils.tensorboard", SummaryWriter=SummaryWriter)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", tb_module)
    monkeypatch.setitem(
        sys.modules, "wandb", fake_module("wandb", init=lambda **_: Run(), Table=Table)
    )
    rows = [{"prompt": "1+1=", "response": "2 | two\nok", "reward": 1.0}]
    logger = MetricsLogger(tmp_path, backends=("jsonl", "tensorboard", "wandb"), total_steps=4)
    logger.log_generations(2, rows)
    logger.log_generations(4, [{**rows[0], "reward": 0.0}])
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert lines == [{"step": 2, **rows[0]}, {"step": 4, **rows[0], "reward": 0.0}]
    key, text, step = texts[0]
    assert (key, step) == ("generations", 2) and "2 \\| two<br>ok" in text  # one table row
    assert tables[0][1] == 2 and tables[0][0]["generations"].columns == [
        "step",
        "prompt",
        "response",
        "reward",
    ]
    # resuming at step 2 keeps step 2's rows and drops step 4's
    MetricsLogger(tmp_path, backends=("jsonl",), total_steps=4, initial_step=2).close()
    kept = [json.loads(x) for x in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [2]


def test_the_bar_shows_the_tool_call_rate(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, backends=("console",), total_steps=2)
    logger.log(1, {"train/reward_mean": 0.5, "tool/call_rate": 0.75})
    logger.close()
    assert "tool rate 0.75" in capsys.readouterr().err
