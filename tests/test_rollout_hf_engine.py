"""HFRollout: the shared-prefix sampler behind the rollout protocol.

Per-row budgets equal to the shared one give the same batch (the agent loop's path); its
log-probs equal the trainer's forward; budgets, stop ids and weight sync do what they say.
"""

import copy

import pytest
import torch

from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import eos_token_ids
from otbrl.rollout import (
    HFRollout,
    RolloutBackend,
    SamplingParams,
    completions_to_batch,
    unpad_prompts,
)
from tiny_models import sharpened_policy

pytestmark = pytest.mark.usefixtures("one_thread")

LOG_PROBS = frozenset({"log_probs"})  # the trainer forward's sampled-token log-probs


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def policy(request, tmp_path_factory):
    # EOS shows up and samples differ
    root = tmp_path_factory.mktemp("tiny")
    return sharpened_policy(root, request.param, scale=20.0, eos_boost=0.4, prompts=10)


def _batch(engine, tok, ids, mask, params, max_tokens=None):
    comps = engine.generate(unpad_prompts(ids, mask), params, max_tokens=max_tokens)
    return comps, completions_to_batch(ids, mask, comps, pad_id=tok.pad_token_id)


SETTINGS = [
    dict(n=3, temperature=1.0, seed=0),
    dict(n=2, temperature=0.7, top_p=0.9, top_k=6, seed=11),
    dict(n=4, temperature=1.3, top_k=3, seed=12),
    dict(n=2, greedy=True),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_equal_per_row_budgets_give_the_same_batch(policy, setting):
    model, tok, ids, mask = policy
    stops = tuple(eos_token_ids(model, tok))
    params = SamplingParams(max_tokens=7, stop_token_ids=stops, **setting)
    comps, ref = _batch(HFRollout(model, tok), tok, ids, mask, params)
    # Same batch again with per-row budgets all equal to max_tokens (the agent-loop path).
    _, again = _batch(HFRollout(model, tok), tok, ids, mask, params, [7] * ids.shape[0])
    assert all(torch.equal(again[k], v) for k, v in ref.items())
    reasons = {c.finish_reason for group in comps for c in group}
    if not params.greedy:
        assert reasons == {"stop", "length"}  # both endings are covered


@pytest.mark.parametrize("setting", SETTINGS[:3], ids=["t1", "t0.7-topk-topp", "t1.3-topk"])
def test_log_probs_equal_the_trainer_forward(policy, setting):
    model, tok, ids, mask = policy
    params = SamplingParams(max_tokens=7, stop_token_ids=(tok.eos_token_id,), **setting)
    _, batch = _batch(HFRollout(model, tok), tok, ids, mask, params)
    with torch.no_grad():
        stats = forward_outputs(
            model, batch, Layout(), outputs=LOG_PROBS, temperature=params.temperature
        )
    m = batch["response_mask"].bool()
    # Full-vocabulary tempered log-probs, whatever top-k / top-p did to the sampling.
    assert (stats["log_probs"] - batch["rollout_log_probs"])[m].abs().max() <= 1e-5
    assert (batch["rollout_log_probs"][~m] == 0).all()


def test_greedy_log_probs_are_untempered(policy):
    model, tok, ids, mask = policy
    params = SamplingParams(max_tokens=5, temperature=0.5, greedy=True)
    _, batch = _batch(HFRollout(model, tok), tok, ids, mask, params)
    with torch.no_grad():
        stats = forward_outputs(model, batch, Layout(), outputs=LOG_PROBS, temperature=1.0)
    m = batch["response_mask"].bool()
    assert (stats["log_probs"] - batch["rollout_log_probs"])[m].abs().max() <= 1e-5


def test_per_row_budgets_and_custom_stop_ids(policy):
    model, tok, ids, mask = policy
    engine = HFRollout(model, tok)
    prompts = unpad_prompts(ids, mask)
    budgets = [1 + i % 6 for i in range(len(prompts))]
    free = SamplingParams(n=3, max_tokens=6, seed=5)  # no stop id: only budgets end rows
    full = engine.generate(prompts, free)
    cut = engine.generate(prompts, free, max_tokens=budgets)
    for i, b in enumerate(budgets):
        for whole, part in zip(full[i], cut[i]):
            assert len(whole.token_ids) == 6 and whole.finish_reason == "length"
            # A smaller budget draws the same samples, cut short.
            assert part.token_ids == whole.token_ids[:b] and part.logprobs == whole.logprobs[:b]
            assert part.finish_reason == "length"
    # A non-EOS stop id (e.g. a tool-call end token) ends completions and is kept.
    counts = torch.bincount(torch.tensor([t for g in full for c in g for t in c.token_ids]))
    stop = int(counts.argmax())
    params = SamplingParams(n=3, max_tokens=6, seed=5, stop_token_ids=(stop,))
    stopped = 0
    for i, group in enumerate(engine.generate(prompts, params, max_tokens=budgets)):
        assert len(group) == 3
        for c in group:
            assert 1 <= len(c.token_ids) <= budgets[i]
            assert stop not in c.token_ids[:-1]
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == stop
                stopped += 1
            else:
                assert len(c.token_ids) == budgets[i] and c.token_ids[-1] != stop
    assert stopped > 0


def test_seeds_and_the_callers_rng(policy):
    model, tok, ids, mask = policy
    engine = HFRollout(model, tok)
    prompts = unpad_prompts(ids, mask)
    seeded = SamplingParams(n=2, max_tokens=5, seed=3)
    torch.manual_seed(123)
    a = engine.generate(prompts, seeded)
    after = torch.rand(1)
    torch.manual_seed(123)
    assert engine.generate(prompts, seeded) == a  # reproducible
    assert torch.equal(torch.rand(1), after)  # a seeded call leaves the global RNG alone
    unseeded = SamplingParams(n=2, max_tokens=5)
    assert engine.generate(prompts, unseeded) != engine.generate(prompts, unseeded)


def test_sync_weights_into_a_separate_copy(policy):
    model, tok, ids, mask = policy
    trained = copy.deepcopy(model)
    copy_engine = HFRollout(copy.deepcopy(model), tok, owns_copy=True)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    params = SamplingParams(n=2, max_tokens=5, seed=1)
    prompts = unpad_prompts(ids, mask)
    reference = HFRollout(trained, tok).generate(prompts, params)
    assert copy_engine.generate(prompts, params) != reference
    copy_engine.sync_weights((n, p) for n, p in trained.named_parameters())
    assert copy_engine.generate(prompts, params) == reference  # bitwise, log-probs included
    named = list(trained.named_parameters())
    with pytest.raises(ValueError, match="not a parameter"):
        copy_engine.sync_weights([("model.nope.weight", named[0][1])])
    with pytest.raises(ValueError, match="shape"):
        copy_engine.sync_weights([(named[0][0], named[0][1][:1])])
    with pytest.raises(ValueError, match="not given"):
        copy_engine.sync_weights(named[:-1])


def test_sharing_the_training_model_makes_sync_a_no_op(policy):
    model, tok, _, _ = policy

    def must_not_run():
        raise AssertionError("a shared engine consumed the weights")
        yield

    engine = HFRollout(model, tok)
    engine.sync_weights(must_not_run())
    engine.sleep()
    engine.wake_up()
    assert engine.name == "hf" and isinstance(engine, RolloutBackend)


def test_bad_input_is_rejected_before_sampling(policy):
    model, tok, _, _ = policy
    engine = HFRollout(model, tok)
    vocab = model.get_input_embeddings().num_embeddings
    with pytest.raises(ValueError, match=r"prompts\[1\].*vocabulary"):
        engine.generate([[1, 2], [3, vocab]], SamplingParams())
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate([[1, 2]], SamplingParams(stop_token_ids=(vocab + 3,)))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate([[1, 2]], SamplingParams(), max_tokens=[2, 3])
    with pytest.raises(TypeError, match="owns_copy"):
        HFRollout(model, tok, owns_copy="yes")
