"""The trainer with tools: multi-turn steps end to end on the HF backend (metrics, holes, the
old statistics computed with the observations in context), config errors before any model
loads, and the single-turn path unchanged when no tool is configured."""

import math

import pytest
import torch

import otbrl.run.trainer as trainer_mod
from otbrl import cli
from otbrl.config import load_config
from otbrl.data import encode_prompts, get_task, write_parquet_rows
from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import build_tiny_model
from otbrl.rewards import score_responses
from otbrl.rewards.placement import place_scores
from otbrl.rollout import HFRollout, SamplingParams, completions_to_batch, unpad_prompts
from otbrl.run.evaluate import evaluate_accuracy
from otbrl.run.sampling import Sample, Scoring
from otbrl.run.seeds import step_seed
from otbrl.run.sources import SyncSource
from run_utils import data_files, read_metrics, stable_metrics, train_overrides
from tiny_models import ONE_LAYER, steer_to_calls

TOOL_METRICS = (
    "tool/calls_per_sample",
    "tool/errors",
    "tool/rows_with_holes_frac",
    "rollout/observation_tokens_frac",
)


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tool"), task="tool_arithmetic", **ONE_LAYER)


@pytest.fixture(scope="module")
def tool_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    task = get_task("tool_arithmetic")
    train = task.rows("train", 16, seed=0)
    for row in train[::2]:  # half the rows name their tools (verl's schema)
        row["extra_info"]["tools_kwargs"] = {"calculator": {"create_kwargs": {"unused": 1}}}
    return (
        write_parquet_rows(train, root / "train.parquet"),
        write_parquet_rows(task.rows("val", 8, seed=0), root / "val.parquet"),
    )


def overrides(model_dir, files, out, *extra):
    """2 steps with validation at the end, on ``files`` (train, val), 24-token responses."""
    run = ["trainer.total_steps=2", "trainer.val_every=2", "actor.micro_batch_size=8"]
    files = data_files(*files)
    return train_overrides(model_dir, out, *files, *run, "data.max_response_length=24", *extra)


def test_multi_turn_training_steps(tool_dir, tool_files, tmp_path, monkeypatch):
    cfg = load_config(
        None,
        overrides(
            tool_dir, tool_files, tmp_path / "run",
            "rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=3",
            "rollout.multi_turn.max_observation_tokens=4",
            "algorithm.adv_estimator=tir_optimal_token_baseline",
        ),
    )  # fmt: skip
    trainer = trainer_mod.Trainer(cfg)
    model = trainer.policy.model
    steer_to_calls(model, trainer.tokenizer)
    seen = []
    forward = trainer.policy.forward

    def spy(micro, outputs):
        out = forward(micro, outputs)
        # the old statistics come from forwards over the whole stream, observations in context
        # (the update's own, when the step trains in one optimizer step): a plain forward
        # attending to every real token gives them; one that hides the observations does not
        prompt_len = micro["prompts"].shape[1]
        hidden = dict(micro)
        hidden["attention_mask"] = micro["attention_mask"].clone()
        hidden["attention_mask"][:, prompt_len:] = (micro["response_mask"] > 0).long()
        hidden["position_ids"] = (hidden["attention_mask"].cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            full = forward_outputs(model, micro, Layout(), outputs=frozenset({"log_probs"}))
            blind = forward_outputs(model, hidden, Layout(), outputs=frozenset({"log_probs"}))
        # the micro-batch dict itself: the update fills its advantages after this forward
        seen.append((micro, out["log_probs"].detach(), full["log_probs"], blind["log_probs"]))
        return out

    monkeypatch.setattr(trainer.policy, "forward", spy)
    summary = trainer.fit()
    records = read_metrics(tmp_path / "run")
    steps = [r for r in records if r["step"] > 0]
    for record in steps:
        for key in TOOL_METRICS:
            assert key in record and math.isfinite(record[key]), key
        assert record["tool/calls_per_sample"] > 0 and record["tool/rows_with_holes_frac"] > 0
        assert record["tool/errors"] > 0  # random call bodies: error observations, no crash
    assert "val/tool_call_rate" in records[0] and "val/tool_call_rate" in steps[-1]
    assert summary["initial_val_tool_call_rate"] == records[0]["val/tool_call_rate"]
    assert summary["final_val_tool_call_rate"] == steps[-1]["val/tool_call_rate"]
    # the final policy without its tools: the plain engine, prompts rendered without tools
    alone = evaluate_accuracy(
        HFRollout(model, trainer.tokenizer), trainer.tokenizer, trainer.plan.val_rows,
        SamplingParams(max_tokens=24, stop_token_ids=tuple(trainer.eos_ids), greedy=True),
    )  # fmt: skip
    assert summary["final_val_accuracy_without_tools"] == alone
    assert len(seen) >= 2  # the last step's micro-batches: 16 rows, 8 a micro-batch
    holes_seen = after_seen = False
    for batch, old, full, blind in seen[-2:]:
        mask, prompt_len = batch["response_mask"], batch["prompts"].shape[1]
        attention = batch["attention_mask"][:, prompt_len:]
        holes = (attention > 0) & (mask == 0)
        holes_seen |= bool(holes.any() and (batch["num_turns"] > 1).any())
        m = mask > 0
        assert (old - full)[m].abs().max() <= 1e-6 and (old[~m] == 0).all()
        after = m & (holes.long().cumsum(1) > 0)  # model tokens that follow an observation
        after_seen |= bool(after.any() and (full - blind)[after].abs().max() > 1e-3)
        # the reward sits on the last model token, after the holes; advantages 0 off the mask
        scores = batch["token_level_scores"]
        last = torch.where(m, torch.arange(1, m.shape[1] + 1), 0).amax(1) - 1
        assert torch.equal(scores[torch.arange(m.shape[0]), last], scores.sum(1))
        assert (batch["advantages"][~m] == 0).all()
    assert holes_seen and after_seen


def test_config_errors_name_the_key(tool_dir, tool_files, tmp_path, capsys):
    base = overrides(tool_dir, tool_files, tmp_path / "e")
    cases = [
        (["rollout.multi_turn.tools=[calculater]"], "'rollout.multi_turn.tools'"),
        (["rollout.multi_turn.max_turns=2"], "'rollout.multi_turn.max_turns' is set but"),
        (["rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.max_turns=0"],
         "'rollout.multi_turn.max_turns' must be > 0"),
        (["rollout.multi_turn.tools=[calculator]", "rollout.multi_turn.format=xml"],
         "'rollout.multi_turn.format' must be one of"),
        (["rollout.multi_turn.tools=[calculator]", "data.task=arithmetic", "model.path=builtin",
          "data.train_files=[]", "data.val_files=[]", "rollout.multi_turn.format=compact"],
         "'rollout.multi_turn.format'"),
    ]  # fmt: skip
    for extra, message in cases:
        assert cli.main(["train", *base, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert message in err, (extra, err)
    rows = get_task("tool_arithmetic").rows("train", 8, seed=0)
    rows[3]["extra_info"]["tools"] = ["search"]
    bad = write_parquet_rows(rows, tmp_path / "bad.parquet")
    assert cli.main(["train", *base, f"data.train_files=[{bad}]",
                     "rollout.multi_turn.tools=[calculator]"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "data row 3" in err and "['search']" in err


def _single_turn_sample(self, step):
    """The trainer's sampling before multi-turn rollouts (commit 6411f9e), as a batch source's
    ``next``: generate, decode the prefix of ones, score, place."""
    r = self.rounds
    rows = r.world.shard(r.dataset.next_batch())
    enc = encode_prompts(rows, r.tokenizer, r.max_prompt_length)
    p = r.params
    params = SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
        stop_token_ids=r.stop_token_ids, seed=step_seed(r.seed, step, r.world.dp_rank),
    )  # fmt: skip
    completions = r.rollout.generate(unpad_prompts(enc["input_ids"], enc["attention_mask"]), params)
    batch = completions_to_batch(
        enc["input_ids"], enc["attention_mask"], completions, pad_id=r.tokenizer.pad_token_id
    )
    batch["uid"] = batch["uid"] + r.world.dp_rank * len(rows)
    rows = [row for row in rows for _ in range(p.n)]
    mask = batch["response_mask"]
    lengths = mask.sum(dim=1).long().tolist()
    texts = r.tokenizer.batch_decode(
        [ids[:k] for ids, k in zip(batch["responses"].tolist(), lengths)], skip_special_tokens=True
    )
    settings = r.scoring.settings
    scores, info = score_responses(
        texts, rows, function=r.scoring.function, on_error=settings.on_error,
        timeout_s=settings.timeout_s,
    )  # fmt: skip
    score = torch.tensor(scores, dtype=torch.float32)
    batch["token_level_scores"] = place_scores(score, mask)
    metrics = {
        "train/reward_mean": float(score.mean()),
        "train/reward_max": float(score.max()),
        "train/response_length_mean": float(mask.sum(dim=1).mean()),
        "train/response_clip_ratio": float(batch["truncated"].float().mean()),
        **{k: float(v) for k, v in info.items()},
    }
    return Sample(batch, rows, scores, metrics, texts)


def _single_turn_validate(self, logger=None):
    spec, t = self.spec, self.spec.trainer
    accuracy = evaluate_accuracy(
        self.parts.backend, self.tokenizer, self.plan.val_rows,
        SamplingParams(
            max_tokens=spec.sampling.max_tokens, stop_token_ids=tuple(self.eos_ids),
            greedy=t.val_greedy, temperature=t.val_temperature,
            seed=step_seed(spec.seed, self.step),
        ),
        batch_size=t.val_batch_size,
        scoring=Scoring(self.plan.reward_fn, spec.reward),
    )  # fmt: skip
    return {"val/accuracy": accuracy}


def test_without_tools_the_metrics_equal_the_single_turn_trainer(tmp_path, monkeypatch):
    """No tool configured: every metric of a 3-step run equals the one of the trainer whose
    rollout, reward and validation are the single-turn code from before this feature."""
    path = build_tiny_model(tmp_path / "tiny", task="arithmetic", **ONE_LAYER)
    task = get_task("arithmetic")
    train = write_parquet_rows(task.rows("train", 32, seed=0), tmp_path / "train.parquet")
    val = write_parquet_rows(task.rows("val", 16, seed=0), tmp_path / "val.parquet")

    def run(name):
        cfg = load_config(
            None, overrides(path, (train, val), tmp_path / name, "trainer.total_steps=3",
                            "data.max_response_length=4")
        )  # fmt: skip
        trainer_mod.Trainer(cfg).fit()
        return stable_metrics(tmp_path / name)

    today = run("today")
    monkeypatch.setattr(SyncSource, "next", _single_turn_sample)
    monkeypatch.setattr(trainer_mod.Trainer, "validate", _single_turn_validate)
    before = run("before")
    assert today == before
    assert not any(k.startswith("tool/") for r in today for k in r)
