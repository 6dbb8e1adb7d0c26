"""`otbrl train rollout.name=vllm` end to end against the real vLLM CPU engine: weights synced
after every update and after a resume, mismatch metrics, importance-sampling correction, two
ranks under torchrun, and the errors a user meets first."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
import torch

from otbrl import cli
from otbrl.config import ConfigError, load_config
from otbrl.models import build_tiny_model
from run_utils import (
    kill_at_first_checkpoint,
    length_reward_files,
    read_metrics,
    refused,
    retry_env_file,
    stable_metrics,
    vllm_run_overrides,
)
from tiny_models import VLLM_SIZE

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, **VLLM_SIZE)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return length_reward_files(tmp_path_factory.mktemp("data"), n_val=16)


def overrides(model_dir, data, out, *extra):
    return vllm_run_overrides(model_dir, data, out, "trainer.val_every=3", *extra)


def check_synced(lines):
    steps = [r for r in lines if r["step"] > 0]
    assert steps
    for r in steps:
        for key in ("rollout/logprob_abs_diff_mean", "rollout/logprob_abs_diff_max"):
            assert math.isfinite(r[key]) and r[key] <= 1e-5, (key, r)
        assert abs(r["rollout/ppl_ratio"] - 1) <= 1e-5, r
        assert r["policy/skipped_steps"] == 0 and r["policy/grad_norm"] > 0
    return steps


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["algorithm.rollout_correction=token_tis"],
        ["algorithm.rollout_correction=seq_mis"],
        ["model.lora.rank=4", "model.lora.alpha=8", "actor.lr=5e-2"],
        ["model.lora.rank=4", "model.lora.alpha=8", "actor.lr=5e-2", "model.lora.sync=adapter"],
    ],
    ids=["plain", "token_tis", "seq_mis", "lora-merged", "lora-adapter"],
)
def test_three_steps_with_otb_and_corrections(model_dir, data, tmp_path, extra, monkeypatch):
    """OTB (Σπ² from the trainer's forward) on vLLM samples; each step's samples come from the
    weights of the step before (mismatch at fp32 rounding after lr 1e-2 updates). With LoRA
    the adapters reach vLLM merged into the base weights, or as the adapter vLLM serves (its
    files in a temporary dir that the closed engine removes)."""
    out = tmp_path / "run"
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert cli.main(["train", *overrides(model_dir, data, out, *extra)]) == 0
    assert not list(scratch.glob("otbrl-adapter-*"))
    steps = check_synced(read_metrics(out))
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["policy/sum_pi_squared_mean"] > 0 for r in steps)
    if extra and "correction" in extra[0]:
        assert all(r["rollout/is_weight_mean"] == pytest.approx(1.0, abs=1e-5) for r in steps)
    assert "val/accuracy" in steps[-1]


def test_bf16_mismatch_is_measured_and_corrected(model_dir, data, tmp_path):
    """bf16 on both sides (vLLM's engine, the trainer's bf16-mixed compute): the mismatch is
    bf16 rounding, orders above fp32's 1e-7, and token_tis weights act on it (≠ 1) while the
    training stays finite."""
    out = tmp_path / "run"
    extra = (
        "rollout.vllm.dtype=bfloat16",
        "model.precision=bf16-mixed",
        "algorithm.rollout_correction=token_tis",
    )
    assert cli.main(["train", *overrides(model_dir, data, out, *extra)]) == 0
    steps = [r for r in read_metrics(out) if r["step"] > 0]
    for r in steps:
        assert 1e-4 < r["rollout/logprob_abs_diff_mean"] < 0.1, r
        assert r["rollout/is_weight_mean"] != 1.0
        assert r["policy/skipped_steps"] == 0 and math.isfinite(r["policy/grad_norm"])


def test_a_skipped_sync_shows_in_the_mismatch(model_dir, data, tmp_path, monkeypatch):
    """Negative control: without the sync after the first update the trainer's and vLLM's
    log-probs disagree by orders of magnitude more than the 1e-5 of a synced step."""
    from otbrl.run.trainer import Trainer

    trainer = Trainer(load_config(None, overrides(model_dir, data, tmp_path / "run")))
    monkeypatch.setattr(trainer.source, "sync_weights", lambda model: None)
    trainer.fit()
    steps = [r for r in read_metrics(tmp_path / "run") if r["step"] > 0]
    assert steps[0]["rollout/logprob_abs_diff_max"] <= 1e-5  # the engine started in sync
    assert steps[1]["rollout/logprob_abs_diff_max"] >= 100 * 1e-5


def command(model_dir, data, out):
    cmd = [sys.executable, "-m", "otbrl", "train"]
    return cmd + overrides(model_dir, data, out, "trainer.total_steps=4", "trainer.save_every=2")


@pytest.mark.slow
def test_sigkill_and_resume_syncs_the_engine(model_dir, data, tmp_path, one_thread):
    """Killed after its first checkpoint and resumed: the engine gets the resumed weights
    (first resumed step in sync) and, vLLM being seeded per request, the metrics equal the
    uninterrupted run's exactly. Only the killed run needs a process of its own; the others run
    in this one (one torch thread, as the child's ``OMP_NUM_THREADS=1`` gives it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full, killed = tmp_path / "full", tmp_path / "killed"
    assert cli.main(command(model_dir, data, full)[3:]) == 0
    kill_at_first_checkpoint(command(model_dir, data, killed), killed, env)
    assert not (killed / "summary.json").exists()
    assert cli.main(command(model_dir, data, killed)[3:]) == 0
    check_synced(read_metrics(killed))
    assert stable_metrics(killed) == stable_metrics(full)


def test_two_ranks_fsdp_with_vllm(model_dir, data, tmp_path):
    """`otbrl train --nproc-per-node=2 rollout.name=vllm` (torch.distributed.run under otbrl's
    launcher): FSDP2, one engine per rank, synced from the sharded model; the mismatch metric is
    the maximum over both ranks. And no start-up noise (issue 53): every vLLM run printed vLLM's
    "Triton is installed, but doesn't include CPU backend" (the config check imported vLLM
    before its logging was turned down) and torch's C++ "NUMA binding" note from vLLM's CPU
    worker — once per process, so processes of their own show it. Each rank's engine runs an
    environment's episodes (a user's file): the sync check holds over the whole stream."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    env["OMP_NUM_THREADS"] = "1"
    # each rank's engine runs an environment's episodes too: a second try after "=" (a
    # character of the arithmetic task's tokenizer)
    retry = retry_env_file(tmp_path, "=")
    cmd = [sys.executable, "-m", "otbrl", "train", "--nproc-per-node=2"]
    cmd += overrides(model_dir, data, out, "trainer.total_steps=2",
                     f"rollout.multi_turn.env={retry}:make",
                     "rollout.multi_turn.max_turns=2", "data.max_response_length=12")  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = check_synced(read_metrics(out))
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["env/errors"] == 0 and math.isfinite(r["env/reward_mean"]) for r in steps)
    assert "otbrl: new run in" in done.stderr  # the trainer's own lines stay
    for noise in ("Triton is installed", "NUMA binding"):
        assert noise not in done.stderr, done.stderr[-3000:]


def test_bad_input_names_the_key(model_dir, data, tmp_path, capsys):
    # rollout.vllm.* with the HF backend
    base = [f"model.path={model_dir}", f"trainer.output_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.kv_cache_gib") as info:
        load_config(None, [*base, "rollout.vllm.kv_cache_gib=2"])
    assert info.value.key == "rollout.vllm.kv_cache_gib"
    # a prompt plus the response budget longer than the model's context
    long = overrides(model_dir, data, tmp_path / "a", "data.max_response_length=70")
    refused(["train", *long], capsys, "data.max_response_length")
    # a tokenizer that does not belong to the model
    other = build_tiny_model(tmp_path / "small", task="digit_sum", seed=0, **VLLM_SIZE)
    config = json.loads((model_dir / "config.json").read_text())
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for f in model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            (mixed / f.name).write_bytes(f.read_bytes())
        else:
            (mixed / f.name).write_bytes((other / f.name).read_bytes())
    assert json.loads((mixed / "config.json").read_text())["vocab_size"] < config["vocab_size"]
    bad = overrides(mixed, data, tmp_path / "b")
    assert cli.main(["train", *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert "model.path" in err and "tokenizer" in err
    torch.manual_seed(0)
