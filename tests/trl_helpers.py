"""Shared by the TRL plug-in tests and their 2-process worker: a tiny HF model directory, a
deterministic reward, and a trainer that records an independent reference at each generation.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from datasets import Dataset

from otbrl.algos import compute_advantage
from otbrl.integrations.trl import OTBGRPOConfig, OTBGRPOTrainer
from otbrl.models import build_tiny_model
from otbrl.ops import token_stats
from tiny_models import TWO_LAYERS

TEMPERATURE = 0.9
# Several "end of completion" ids, so completion lengths vary a lot on a random model.
STOP_CHARS = "0123"


def make_model_dir(path: Path) -> Path:
    """A tiny Llama (hidden 32, 2 layers) with a character tokenizer; generation stops at EOS
    or at any of ``STOP_CHARS`` (TRL reads the same ids from generation_config)."""
    out = build_tiny_model(path, **TWO_LAYERS)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    stops = [tok.eos_token_id] + [tok.convert_tokens_to_ids(c) for c in STOP_CHARS]
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
    gen["eos_token_id"] = stops
    gen_path.write_text(json.dumps(gen))
    return out


def reward_digits(completions, completion_ids, **_):
    """A reward that depends on the ids only: the sum of the ids, scaled (recomputable)."""
    return [float(sum(ids)) / 50.0 for ids in completion_ids]


def dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({"prompt": [f"{a}+{a + 1}=" for a in range(10, 10 + n)]})


def config(out_dir: Path, **overrides) -> OTBGRPOConfig:
    kw = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        temperature=TEMPERATURE,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        beta=0.0,
    )
    kw.update(overrides)
    return OTBGRPOConfig(**kw)


def reference(trainer: OTBGRPOTrainer, out: dict) -> dict:
    """What this rank's rows should be fed to the estimator, computed without the plug-in:
    the plain HF forward's logits through ``otbrl.ops.token_stats``, the reward function on
    the completion ids. Shapes ``[b, T]``."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    P, T = out["prompt_ids"].shape[1], out["completion_ids"].shape[1]
    with torch.no_grad():
        logits = trainer.model(input_ids=ids, attention_mask=attn).logits
    stats = token_stats(
        logits[:, P - 1 : P + T - 1], out["completion_ids"], temperature=TEMPERATURE
    )
    mask = out["completion_mask"].float()
    comp = [c[m.bool()].tolist() for c, m in zip(out["completion_ids"], out["completion_mask"])]
    return {
        "mask": mask,
        "rewards": torch.tensor(reward_digits(None, comp)),
        "old_log_probs": stats.log_probs,
        "sum_pi_squared": stats.sum_pi_squared,
        "advantages": out["advantages"].clone(),
        "has_trl_old": "old_per_token_logps" in out,
    }


class RecordingTrainer(OTBGRPOTrainer):
    """Records, after each generation batch, :func:`reference` and the plug-in's batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.records: list[dict] = []

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        rec = reference(self, out)
        rec["plugin"] = dict(self.last_otb_batch)
        self.records.append(rec)
        return out


def trainer(model_dir: Path, out_dir: Path, **overrides) -> RecordingTrainer:
    return RecordingTrainer(
        model=str(model_dir),
        reward_funcs=reward_digits,
        args=config(out_dir, **overrides),
        train_dataset=dataset(),
    )


def single_batch_advantages(masks, rewards, olps, spps, num_generations, **options):
    """The estimator on one batch built from per-rank pieces: rows concatenated in rank order,
    right-padded to the longest T. Returns ``[N, T_max]``."""
    T = max(m.shape[1] for m in masks)

    def cat(xs):
        return torch.cat([torch.nn.functional.pad(x, (0, T - x.shape[1])) for x in xs])

    mask, olp, spp = cat(masks), cat(olps), cat(spps)
    rewards = torch.cat(rewards)
    N = mask.shape[0]
    r = torch.zeros(N, T)
    lengths = mask.sum(-1).long()
    rows = (lengths > 0).nonzero()[:, 0]
    r[rows, lengths[rows] - 1] = rewards[rows]  # completion masks are prefixes
    adv, _ = compute_advantage(
        "optimal_token_baseline",
        token_level_rewards=r,
        response_mask=mask,
        index=torch.arange(N) // num_generations,
        old_log_probs=olp,
        sum_pi_squared=spp,
        **options,
    )
    return adv, mask
