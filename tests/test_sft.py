import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import otbrl.run.sft as sft
from hf_sample import generate
from otbrl.config import ConfigError, SFTConfig
from otbrl.data import encode_prompts, get_task
from otbrl.models import build_tiny_model, eos_token_ids, load_model_and_tokenizer
from otbrl.rollout import HFRollout, SamplingParams, decode_responses
from otbrl.run.evaluate import evaluate_accuracy
from tiny_models import TWO_LAYERS

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tiny(tmp_path):
    path = build_tiny_model(tmp_path / "m", seed=1, **TWO_LAYERS)
    return load_model_and_tokenizer(path)


def _data(n=64, seed=0):
    task = get_task("arithmetic")
    rows = task.rows("train", n, seed=seed)
    return rows, [task.demonstration(r) for r in rows]


def test_a_demonstration_is_a_response_trained_to_its_eos(tiny):
    _, tok = tiny
    rows, demos = _data(5)
    data = sft.demonstration_batch(rows, demos, tok)
    prompts = encode_prompts(rows, tok, max_prompt_length=32)
    for i in range(5):
        prompt = prompts["input_ids"][i][prompts["attention_mask"][i].bool()].tolist()
        answer = tok(demos[i], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        real = data["attention_mask"][i].bool()
        assert data["input_ids"][i][real].tolist() == prompt + answer
        # left-padded prompt, right-padded response: the response starts at the same column
        width = data["prompts"].shape[1]
        assert data["input_ids"][i, width : width + len(answer)].tolist() == answer
        trained = data["responses"][i][data["response_mask"][i].bool()].tolist()
        assert trained == answer


def test_the_sft_loss_is_response_token_cross_entropy(tiny):
    from otbrl.algos.loss_math import loss_normalizers
    from otbrl.algos.loss_terms import build_sft_loss
    from otbrl.engine.frozen import FrozenEngine
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig

    model, tok = tiny
    rows, demos = _data(8)
    data = sft.demonstration_batch(rows, demos, tok)
    engine = FrozenEngine(model, EngineSpec(micro=MicroBatchConfig(3)))
    loss_fn = build_sft_loss()
    # one process: the batch's own counts (what TrainableEngine.normalizers sums over ranks)
    norms = loss_normalizers(data["response_mask"])
    with torch.no_grad():
        loss, metrics = loss_fn(engine.forward(data, loss_fn.needs), data, norms)
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    # Reference: float64 log-softmax, logits at t-1 score token t, trained tokens only.
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    target = data["input_ids"][:, 1:]
    width = data["prompts"].shape[1]
    keep = torch.zeros_like(target, dtype=torch.bool)
    keep[:, width - 1 :] = data["response_mask"].bool()
    nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(loss.double(), nll[keep].mean(), atol=1e-5)
    assert metrics["sft/loss"] == loss
    # sure rows: every trained token above probability 1/2 (a plain loop)
    sure = sum(bool((nll[i][keep[i]] < torch.log(torch.tensor(2.0))).all()) for i in range(8))
    assert metrics["sft/sure_frac"].item() == pytest.approx(sure / 8)


def test_sft_reduces_the_loss(tiny):
    model, tok = tiny
    rows, demos = _data(256)
    settings = SFTConfig(lr=1e-2, batch_size=16, max_steps=25)
    result = sft.run_sft(model, tok, rows, demos, settings, seed=0)
    losses = result["losses"]
    assert result["steps"] == 25 and len(losses) == 25 and result["accuracy"] is None
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5


def test_warmup_and_clip_reach_the_engine(tiny, monkeypatch):
    """``sft.warmup_steps`` scales the first step (AdamW's first update is lr · sign(g), so the
    largest parameter change is the step's learning rate); ``sft.grad_clip`` is the engine's."""
    import copy

    model, tok = tiny
    rows, demos = _data(16)
    optims = []
    engine = sft.TrainableEngine
    monkeypatch.setattr(
        sft,
        "TrainableEngine",
        lambda m, optim, *a, **kw: optims.append(optim) or engine(m, optim, *a, **kw),
    )

    def largest_change(**settings):
        trained = copy.deepcopy(model)
        sft.run_sft(
            trained, tok, rows, demos, SFTConfig(lr=1e-2, batch_size=4, max_steps=1, **settings)
        )
        pairs = zip(trained.parameters(), model.parameters())
        return max(float((a - b).detach().abs().max()) for a, b in pairs)

    cold = largest_change()
    assert cold == pytest.approx(1e-2, rel=1e-3)
    assert largest_change(warmup_steps=9, grad_clip=0.5) == pytest.approx(cold / 10, rel=1e-3)
    assert [(o.warmup_steps, o.grad_clip) for o in optims] == [(0, 0.0), (9, 0.5)]


def _sft_to_zero_target(tiny, eval_every, **kw):
    """SFT with a target reached at once (0.0): the step of the first evaluation tells when one
    ran."""
    model, tok = tiny
    rows, demos = _data(32)
    settings = SFTConfig(batch_size=8, max_steps=50, target_accuracy=0.0, eval_every=eval_every)
    return sft.run_sft(
        model, tok, rows, demos, settings, eval_rows=rows[:8], max_new_tokens=4, **kw
    )


def test_sft_stops_at_the_accuracy_target(tiny):
    result = _sft_to_zero_target(tiny, 3)
    assert result["reached_target"] and result["steps"] == 3
    assert result["evaluations"] == [[3, result["accuracy"]]]


def test_trigger_evaluates_between_periodic_evaluations(tiny):
    result = _sft_to_zero_target(tiny, 100, trigger_window=2)
    assert result["reached_target"] and result["steps"] == 2
    assert len(result["train_accuracies"]) == 2


def test_sure_rows_are_greedy_exact_matches(tiny):
    from otbrl.algos.loss_math import loss_normalizers
    from otbrl.algos.loss_terms import build_sft_loss
    from otbrl.engine.frozen import FrozenEngine
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig

    model, tok = tiny
    train_rows, train_demos = _data(128, seed=1)
    # A few steps teach the answer format (digits, then EOS), so greedy answers do end.
    settings = SFTConfig(lr=1e-2, batch_size=16, max_steps=25)
    sft.run_sft(model, tok, train_rows, train_demos, settings)
    rows, _ = _data(12)
    enc = encode_prompts(rows, tok, max_prompt_length=32)
    out = generate(
        model, tok, enc["input_ids"], enc["attention_mask"], max_new_tokens=8, do_sample=False
    )
    greedy = decode_responses(tok, out["responses"], out["response_mask"])
    ended = (out["responses"] == tok.eos_token_id).any(dim=1).tolist()
    # Even rows: the demonstration is what greedy decoding says; odd rows: something else.
    demos = [g if i % 2 == 0 else g + "1" for i, g in enumerate(greedy)]
    exact = [ended[i] and i % 2 == 0 for i in range(12)]
    assert any(exact)  # the comparison below is not vacuous
    loss_fn = build_sft_loss()

    def sure_rows(temperature):
        spec = EngineSpec(temperature=temperature, micro=MicroBatchConfig(12))
        engine = FrozenEngine(model, spec)
        sure = []
        for i in range(12):  # row by row
            data = sft.demonstration_batch(rows[i : i + 1], demos[i : i + 1], tok)
            with torch.no_grad():
                out = engine.forward(data, loss_fn.needs)
            _, metrics = loss_fn(out, data, loss_normalizers(data["response_mask"]))
            sure.append(metrics["sft/sure_frac"].item() == 1.0)
        return sure

    # a sure row is a greedy exact match; at a sharp temperature (the argmax's probability near
    # 1) the two coincide, so the check above is not vacuous
    sure = sure_rows(1.0)
    assert [i for i in range(12) if sure[i] and not exact[i]] == []
    assert sure_rows(1e-3) == exact


def test_evaluate_accuracy_counts_exact_greedy_answers(tiny):
    model, tok = tiny
    rows, _ = _data(10)
    enc = encode_prompts(rows, tok, max_prompt_length=32)
    out = generate(
        model, tok, enc["input_ids"], enc["attention_mask"], max_new_tokens=4, do_sample=False
    )
    greedy = decode_responses(tok, out["responses"], out["response_mask"])
    # Make rows 0, 2, 4, ... correct by construction and the others wrong.
    for i, row in enumerate(rows):
        truth = greedy[i] if i % 2 == 0 else greedy[i] + "0"
        row["reward_model"] = {"ground_truth": truth}
    for batch_size in (3, 512):
        acc = evaluate_accuracy(
            HFRollout(model, tok),
            tok,
            rows,
            SamplingParams(
                max_tokens=4, stop_token_ids=tuple(eos_token_ids(model, tok)), greedy=True
            ),
            batch_size=batch_size,
        )
        assert acc == 0.5


def test_warm_start_is_cached_and_keyed_by_settings(tmp_path, monkeypatch):
    short = SFTConfig(max_steps=2, eval_every=2, target_accuracy=1.0)
    kwargs = {"size": TWO_LAYERS, "n_eval": 8, "n_train": 64}
    first = sft.ensure_warm_start(tmp_path, short, seed=0, **kwargs)
    meta = json.loads((first / sft.WARM_START_FILE).read_text())
    assert meta["result"]["steps"] == 2 and not meta["result"]["reached_target"]
    model, tok = load_model_and_tokenizer(first)
    assert model.config.hidden_size == 32 and tok.padding_side == "left"
    # no temp directory left (the lock file stays: deleting it would race with a waiter)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [first.name]

    def must_not_train(*args, **kw):
        raise AssertionError("the cached warm start should have been reused")

    monkeypatch.setattr(sft, "run_sft", must_not_train)
    assert sft.ensure_warm_start(tmp_path, short, seed=0, **kwargs) == first
    # where the cache lives is no setting of the model
    assert sft.ensure_warm_start(tmp_path, replace(short, cache_dir="elsewhere"), **kwargs) == first
    with pytest.raises(AssertionError, match="reused"):
        sft.ensure_warm_start(tmp_path, replace(short, lr=2e-3), seed=0, **kwargs)


def test_concurrent_builders_wait_for_one_warm_start(tmp_path, monkeypatch):
    """A second process asking for the same warm start blocks on the lock, then reuses it."""
    import threading

    settings = {"size": TWO_LAYERS, "n_eval": 8, "n_train": 64}
    builds = []
    monkeypatch.setattr(sft, "_build_warm_start", lambda *a: builds.append(a))
    final = sft.ensure_warm_start(tmp_path, **settings)  # where the model would go
    assert len(builds) == 1 and not final.exists()
    builds.clear()
    result = {}
    with sft._exclusive(tmp_path / f".{final.name}.lock"):  # "another process" is building
        waiter = threading.Thread(
            target=lambda: result.setdefault("path", sft.ensure_warm_start(tmp_path, **settings))
        )
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # blocked on the lock
        final.mkdir()
        (final / sft.WARM_START_FILE).write_text("{}")
    waiter.join(10)
    assert result["path"] == final and builds == []


def test_stale_temp_directories_of_dead_builds_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".tmp-arithmetic-abc-{dead.pid}"
    live = tmp_path / f".tmp-arithmetic-abc-{os.getpid()}"
    other = tmp_path / f".tmp-arithmetic-xyz-{dead.pid}"
    for path in (stale, live, other):
        path.mkdir()
    sft._remove_stale_temps(tmp_path, "arithmetic-abc")
    assert not stale.exists() and live.exists() and other.exists()


def test_bad_arguments(tiny):
    model, tok = tiny
    rows, demos = _data(4)
    with pytest.raises(ValueError, match="demonstrations"):
        sft.run_sft(model, tok, rows, demos[:3], SFTConfig(max_steps=1))
    with pytest.raises(ConfigError, match=r"'sft\.max_steps'.*> 0"):
        sft.run_sft(model, tok, rows, demos, SFTConfig(max_steps=0))
    with pytest.raises(ConfigError, match=r"'sft\.eval_every'.*> 0"):
        sft.run_sft(model, tok, rows, demos, SFTConfig(eval_every=0), eval_rows=rows)
    with pytest.raises(ConfigError, match=r"'sft\.grad_clip'.*>= 0"):
        sft.run_sft(model, tok, rows, demos, SFTConfig(grad_clip=-1.0))
    with pytest.raises(ValueError, match="rows"):
        evaluate_accuracy(HFRollout(model, tok), tok, [], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="n=1"):  # one response per row is what it averages
        evaluate_accuracy(HFRollout(model, tok), tok, rows, SamplingParams(n=2, max_tokens=2))
