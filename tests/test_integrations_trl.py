"""OTBGRPOTrainer against the real TRL (CPU): Σπ² from TRL's fused head, [B, T] advantages
equal to otbrl.algos.compute_advantage on both old-log-prob paths, TIR-OTB on a tool mask,
2 processes with groups straddling ranks, refusals."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from trl import GRPOConfig
from trl.trainer.utils import add_fused_lm_head

import otbrl.integrations.trl as otbrl_trl
import trl_helpers as H
from otbrl.algos import compute_advantage
from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer
from otbrl.ops import sum_pi_squared
from tiny_models import tiny_causal_lm

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.make_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_trl_fused_head_sum_pi_squared_equals_ops(arch):
    model = tiny_causal_lm(arch, seed=1, vocab_size=80)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 80, (3, 11), generator=g)
    attn = torch.ones_like(ids)
    attn[0, :3] = 0  # a left-padded row
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "log_sum_sq_probs"))
    labels = ids.masked_fill(attn == 0, -100)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, labels=labels, fused_lm_head=True)
    valid = labels[:, 1:] != -100
    theirs = out.log_sum_sq_probs.exp()[valid]
    ours = sum_pi_squared(logits, temperature=0.7)[valid]
    assert ours.dtype == torch.float32
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=0)


def _check_records(trainer, *, expect_trl_old: bool):
    assert len(trainer.records) == 2
    for rec in trainer.records:
        assert rec["has_trl_old"] is expect_trl_old
        plugin = rec["plugin"]
        assert plugin["extra_forward"] == (0.0 if expect_trl_old else 1.0)
        m = rec["mask"]
        torch.testing.assert_close(plugin["response_mask"], m)
        torch.testing.assert_close(
            plugin["sum_pi_squared"] * m, rec["sum_pi_squared"] * m, atol=1e-6, rtol=0
        )
        expected, _ = H.single_batch_advantages(
            [m], [rec["rewards"]], [rec["old_log_probs"]], [rec["sum_pi_squared"]], 4
        )
        assert rec["advantages"].shape == m.shape  # [B, T], not one scalar per row
        torch.testing.assert_close(rec["advantages"], expected, atol=1e-5, rtol=1e-5)
        assert (rec["advantages"] * (1 - m)).abs().max() == 0
    lengths = torch.cat([r["mask"].sum(-1) for r in trainer.records])
    assert lengths.unique().numel() > 2  # the stop ids make completion lengths differ


def test_train_trl_old_log_prob_path(model_dir, tmp_path):
    # num_iterations=2: TRL computes old log-probs itself, Σπ² rides on that forward.
    t = H.trainer(model_dir, tmp_path, num_iterations=2, max_steps=3)
    t.train()
    t.records = t.records[:2]
    _check_records(t, expect_trl_old=True)
    logged = {k for entry in t.state.log_history for k in entry}
    assert {"otb/extra_forward", "otb/w_score/mean", "otb/zero_tail_fraction"} <= logged


def test_train_extra_forward_path(model_dir, tmp_path):
    # Aligned accumulation: TRL skips the old-log-prob forward; the plug-in runs one.
    t = H.trainer(model_dir, tmp_path)
    t.train()
    _check_records(t, expect_trl_old=False)


def test_uniform_energy_needs_no_forward(model_dir, tmp_path):
    t = H.trainer(model_dir, tmp_path, otb_energy="uniform", max_steps=1)
    t.train()
    plugin = t.records[0]["plugin"]
    assert plugin["extra_forward"] == 0.0 and plugin["sum_pi_squared"] is None


def test_tool_mask_selects_tir(model_dir, tmp_path):
    t = H.trainer(model_dir, tmp_path, max_steps=1)
    t.train()
    rec = t.records[0]
    m = rec["mask"]
    holes = torch.ones_like(m)
    holes[:, 1:3] = 0  # tool output inside every completion
    out = {"completion_mask": m.long(), "tool_mask": holes.long()}
    adv = t._otb_advantages(out, rec["old_log_probs"], rec["sum_pi_squared"], 0.0)
    assert t.last_otb_batch["estimator"] == "tir_optimal_token_baseline"
    N, T = m.shape
    r = torch.zeros(N, T)
    mm = m * holes
    last = torch.where(mm > 0, torch.arange(T)[None].expand(N, T), -1).amax(-1)
    rows = (last >= 0).nonzero()[:, 0]
    r[rows, last[rows]] = rec["rewards"][rows]
    expected, _ = compute_advantage(
        "tir_optimal_token_baseline",
        token_level_rewards=r,
        response_mask=mm,
        index=torch.arange(N) // 4,
        old_log_probs=rec["old_log_probs"],
        sum_pi_squared=rec["sum_pi_squared"],
    )
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=1e-6)
    assert (adv[:, 1:3] == 0).all()


@pytest.mark.distributed
def test_two_processes_equal_single_batch(model_dir, tmp_path):
    worker = Path(__file__).with_name("trl_dist_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join([str(worker.parent), env.get("PYTHONPATH", "")])
    with socket.socket() as s:  # a free port (torchrun's --master_port=0 hung here)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={port}", str(worker), str(model_dir), str(tmp_path)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    steps = len(ranks[0])
    assert steps == len(ranks[1]) >= 2
    unequal = 0
    for step in range(steps):
        recs = [ranks[r][step] for r in range(2)]
        unequal += recs[0]["mask"].shape[1] != recs[1]["mask"].shape[1]
        expected, _ = H.single_batch_advantages(
            [r["mask"] for r in recs],
            [r["rewards"] for r in recs],
            [r["old_log_probs"] for r in recs],
            [r["sum_pi_squared"] for r in recs],
            4,
        )
        b = recs[0]["mask"].shape[0]
        for rank, rec in enumerate(recs):
            T = rec["mask"].shape[1]
            got = rec["advantages"]
            torch.testing.assert_close(
                got, expected[rank * b : (rank + 1) * b, :T], atol=1e-5, rtol=1e-5
            )
            assert expected[rank * b : (rank + 1) * b, T:].abs().sum() == 0
    assert unequal >= 1, "no step had unequal completion lengths across ranks"


def test_config_refusals(tmp_path):
    base = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    cases = [
        (dict(loss_type="vespo"), "loss_type"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(scale_rewards="group"), "scale_rewards"),
        (dict(multi_objective_aggregation="normalize_then_sum"), "multi_objective_aggregation"),
        (dict(otb_estimator="grpo"), "otb_estimator"),
        (dict(otb_energy="flat"), "otb_energy"),
        (dict(otb_use_vllm_is_weights=True), "otb_use_vllm_is_weights"),
    ]
    for kw, key in cases:
        with pytest.raises(ValueError, match=key):
            OTBGRPOConfig(**base, **kw)
    OTBGRPOConfig(**base, loss_type="grpo")  # per-token meaning unchanged: accepted


def test_trainer_refuses_plain_grpo_config(model_dir, tmp_path):
    with pytest.raises(TypeError, match="OTBGRPOConfig"):
        OTBGRPOTrainer(
            str(model_dir),
            H.reward_digits,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
        )


def test_untested_trl_version_refused(monkeypatch):
    monkeypatch.setattr(otbrl_trl, "version", lambda name: "1.10.0")
    with pytest.raises(ImportError, match=r"trl>=1\.16\.0,<1\.17"):
        otbrl_trl._check_trl()


def test_importing_the_integration_prints_no_vllm_version_warning():
    """Each TRL import printed its vLLM-version warning 5 times (one per TRL module that checks
    it), then once (issue 53: still on every import): otbrl tests this integration against the
    vLLM it installs, so exactly that warning is filtered, at import and on TRL's later checks;
    another warning still shows, and vLLM's own start-up warnings are off (VLLM_LOGGING_LEVEL)."""
    pytest.importorskip("vllm")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    script = (
        "import warnings; import otbrl.integrations.trl; from trl.import_utils import "
        "is_vllm_available; is_vllm_available(); warnings.warn('another UserWarning')"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TRL currently supports vLLM versions" not in done.stderr, done.stderr
    assert "another UserWarning" in done.stderr
    assert "Triton is installed" not in done.stderr
