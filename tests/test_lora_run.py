"""A LoRA run end to end: checkpoints hold the adapter in PEFT's format plus the optimizer state,
SIGKILL + resume gives the uninterrupted run's metrics, `otbrl export` writes a merged plain HF
model (or `--adapter-only` the adapter) that reproduces the trained policy."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from otbrl import cli
from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import load_model_and_tokenizer
from otbrl.models.config import LoraConfig
from otbrl.models.lora import add_lora
from run_utils import (
    kill_at_first_checkpoint,
    length_reward_file,
    stable_metrics,
    tiny_run_factory,
)
from test_engine import make_batch

pytest.importorskip("peft")

LORA = (
    "model.lora.rank=4",
    "model.lora.alpha=8",
    "actor.lr=3e-2",
    "actor.use_kl_loss=true",  # the reference: the same model with its adapters disabled
    "trainer.resume=auto",
    "actor.warmup_steps=0",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread):
    """An uninterrupted LoRA run and one SIGKILLed after its first checkpoint, then resumed
    (only the killed run in a child; the others here, on one thread like the child)."""
    root = tmp_path_factory.mktemp("lora_run")
    overrides = tiny_run_factory(root)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reward = f"reward.function={length_reward_file(root)}:score"

    def args(out):
        return ["train", *overrides(out, *LORA, reward)]

    full, killed = root / "full", root / "killed"
    assert cli.main(args(full)) == 0
    kill_at_first_checkpoint([sys.executable, "-m", "otbrl", *args(killed)], killed, env)
    assert not (killed / "summary.json").exists()
    assert cli.main(args(killed)) == 0
    return root, full, killed


def test_sigkill_and_resume_gives_the_uninterrupted_metrics(runs):
    _, full, killed = runs
    expected, got = stable_metrics(full), stable_metrics(killed)
    assert [r["step"] for r in got] == list(range(5))
    assert got == expected
    steps = [r for r in got if r["step"] > 0]
    assert all(r["policy/grad_norm"] > 0 for r in steps)
    assert all(r["policy/kl_loss"] > 0 for r in steps[1:])  # the adapters moved off the base
    a, b = (run / "checkpoints" / "step_4" / "adapter" for run in (full, killed))
    wa, wb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_the_checkpoint_holds_the_adapter_not_the_base(runs):
    _, full, _ = runs
    step = full / "checkpoints" / "step_4"
    assert not (step / "model.safetensors").exists()
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    names = load_file(step / "adapter" / "adapter_model.safetensors")
    assert names and all(k.startswith("base_model.model.") and ".lora_" in k for k in names)
    optimizer = load_file(next((step / "state" / "policy").glob("*.safetensors")))
    assert optimizer and all(".lora_" in k for k in optimizer)


def _trained_log_probs(root, step_dir):
    """The policy the checkpoint holds, rebuilt independently: base model + peft adapter."""
    from peft import PeftModel

    base, _ = load_model_and_tokenizer(root / "model")
    model = PeftModel.from_pretrained(base, step_dir / "adapter").eval()
    return _log_probs(model.base_model.model)


def _log_probs(model):
    batch = make_batch(seed=3)
    vocab = model.config.vocab_size
    for key in ("input_ids", "prompts", "responses"):
        batch[key] = batch[key] % vocab
    with torch.no_grad():
        out = forward_outputs(model.eval(), batch, Layout(), outputs=frozenset({"log_probs"}))
    return out["log_probs"]


def test_export_merged_and_adapter_only(runs, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, full, _ = runs
    step = full / "checkpoints" / "step_4"
    want = _trained_log_probs(root, step)
    base, _ = load_model_and_tokenizer(root / "model")
    assert (want - _log_probs(base)).abs().max() > 1e-3  # training changed the policy
    assert cli.main(["export", str(full), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(_log_probs(merged), want, atol=1e-5, rtol=0)
    assert cli.main(["export", "--adapter-only", str(full), str(tmp_path / "adapter")]) == 0
    assert (tmp_path / "adapter" / "tokenizer_config.json").is_file()
    again = PeftModel.from_pretrained(
        load_model_and_tokenizer(root / "model")[0], tmp_path / "adapter"
    )
    torch.testing.assert_close(_log_probs(again.base_model.model), want, atol=1e-6, rtol=0)
    # and otbrl starts a new run from it (model.lora.adapter_path)
    saved = LoraConfig(rank=1, adapter_path=str(tmp_path / "adapter"))  # its own rank and alpha
    fresh = add_lora(load_model_and_tokenizer(root / "model")[0], saved)
    torch.testing.assert_close(_log_probs(fresh), want, atol=1e-6, rtol=0)
