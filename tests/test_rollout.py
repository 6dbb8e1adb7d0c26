import pytest
import torch

from hf_sample import generate
from otbrl.rollout import (
    HFRollout,
    SamplingParams,
    decode_responses,
    sample_next_token,
    unpad_prompts,
)
from tiny_models import sharpened_policy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def policy(request, tmp_path_factory):
    # greedy has no near-ties, and EOS is likely enough to show up
    root = tmp_path_factory.mktemp("tiny")
    return sharpened_policy(root, request.param, scale=60.0, eos_boost=0.5, prompts=12)


def _mask_reference(responses, eos):
    out = torch.zeros(responses.shape)
    for i, row in enumerate(responses.tolist()):
        for j, t in enumerate(row):
            out[i, j] = 1.0
            if t in eos:
                break
    return out


def test_greedy_matches_an_uncached_plain_loop(policy):
    model, tok, ids, mask = policy
    out = generate(model, tok, ids, mask, n=2, max_new_tokens=6, do_sample=False)
    ids, mask = ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    seq, att = ids.clone(), mask.clone()
    steps = []
    with torch.no_grad():
        for _ in range(6):
            pos = (att.cumsum(-1) - 1).clamp(min=0)
            logits = model(input_ids=seq, attention_mask=att, position_ids=pos).logits[:, -1]
            nxt = logits.double().argmax(-1, keepdim=True)
            steps.append(nxt)
            seq, att = torch.cat([seq, nxt], 1), torch.cat([att, torch.ones_like(nxt)], 1)
    ref = torch.cat(steps, 1)
    ref_mask = _mask_reference(ref, [tok.eos_token_id])
    width = out["responses"].shape[1]
    assert torch.equal(out["response_mask"], ref_mask[:, :width])
    assert not ref_mask[:, width:].any()
    kept = out["response_mask"].bool()
    assert torch.equal(out["responses"][kept], ref[:, :width][kept])
    assert (out["responses"][~kept] == tok.pad_token_id).all()
    assert 0 < ref_mask.sum() < ref_mask.numel()  # some rows end early, the test covers both


def test_layout_of_the_returned_batch(policy):
    model, tok, ids, mask = policy
    out = generate(model, tok, ids, mask, n=3, max_new_tokens=5, seed=1)
    b, lp = ids.shape[0] * 3, ids.shape[1]
    lr = out["responses"].shape[1]
    assert out["prompts"].shape == (b, lp) and lr <= 5
    assert torch.equal(out["prompts"], ids.repeat_interleave(3, 0))
    assert out["uid"].tolist() == [i for i in range(ids.shape[0]) for _ in range(3)]
    assert out["response_mask"].dtype == torch.float32
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    full_mask = torch.cat([mask.repeat_interleave(3, 0), out["response_mask"].long()], 1)
    assert torch.equal(out["attention_mask"], full_mask)
    for i in range(b):  # positions count real tokens only
        real = full_mask[i].bool()
        assert out["position_ids"][i][real].tolist() == list(range(int(real.sum())))
    # Right-padded responses: the mask is a prefix of ones in every row.
    assert torch.equal(out["response_mask"], out["response_mask"].cummin(1).values)
    texts = decode_responses(tok, out["responses"], out["response_mask"])
    assert len(texts) == b and all("<eos>" not in t and "<pad>" not in t for t in texts)


def test_sampling_is_deterministic_under_a_seed(policy):
    model, tok, ids, mask = policy
    torch.manual_seed(99)
    expected_global = torch.rand(2)
    torch.manual_seed(99)
    model.train()
    a = generate(model, tok, ids, mask, n=4, max_new_tokens=5, seed=7)
    assert model.training  # mode restored
    assert torch.equal(torch.rand(2), expected_global)  # caller's RNG untouched
    b = generate(model, tok, ids, mask, n=4, max_new_tokens=5, seed=7)
    c = generate(model, tok, ids, mask, n=4, max_new_tokens=5, seed=8)
    model.eval()
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])


def test_first_token_distribution_follows_temperature_and_top_p(policy):
    model, tok, ids, mask = policy
    one, one_mask = ids[:1], mask[:1]
    with torch.no_grad():
        pos = (one_mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=one, attention_mask=one_mask, position_ids=pos).logits[0, -1]
    n = 3000
    for temperature in (0.7, 1.5):
        probs = torch.softmax(logits.double() / temperature, -1)
        out = generate(
            model, tok, one, one_mask, n=n, max_new_tokens=1, temperature=temperature, seed=3
        )
        freq = torch.bincount(out["responses"][:, 0], minlength=probs.numel()).double() / n
        assert (freq - probs).abs().max() < 0.04
    probs = torch.softmax(logits.double(), -1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = set(order[: int((sorted_p.cumsum(0) < 0.6).sum()) + 1].tolist())
    out = generate(model, tok, one, one_mask, n=500, max_new_tokens=1, top_p=0.6, seed=4)
    assert set(out["responses"][:, 0].tolist()) <= nucleus
    top1 = generate(model, tok, one, one_mask, n=50, max_new_tokens=1, top_k=1, seed=5)
    assert (top1["responses"][:, 0] == logits.argmax()).all()


def test_top_k_and_top_p_support_matches_a_plain_loop():
    torch.manual_seed(0)
    logits = torch.randn(6, 11) * 2
    for top_k, top_p in [(3, 1.0), (0, 0.5), (4, 0.7), (11, 0.999)]:
        rows = logits.repeat_interleave(400, 0)
        drawn = sample_next_token(rows, do_sample=True, temperature=0.8, top_p=top_p, top_k=top_k)
        for i in range(6):
            # Reference support: rank by float64 probability, keep the top_k, then the nucleus.
            p = torch.softmax(logits[i].double() / 0.8, -1)
            ranked = sorted(range(11), key=lambda t: -p[t].item())[: top_k or 11]
            q = p[ranked] / p[ranked].sum()
            support, mass = set(), 0.0
            for t, pt in zip(ranked, q.tolist()):
                if mass >= top_p:
                    break
                support.add(t)
                mass += pt
            assert set(drawn[i * 400 : (i + 1) * 400].tolist()) <= support
    greedy = sample_next_token(logits, do_sample=False, temperature=1.0, top_p=1.0, top_k=0)
    assert torch.equal(greedy, logits.argmax(-1))


def test_bad_arguments(policy):
    model, tok, ids, mask = policy
    cases = [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
    ]
    for kwargs, name in cases:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="prompt_mask"):
        unpad_prompts(ids, mask[:, 1:])
    with pytest.raises(ValueError, match="prompt_ids"):
        unpad_prompts(ids[0], mask[0])
    with pytest.raises(TypeError, match="prompts"):
        HFRollout(model, tok).generate(unpad_prompts(ids.float(), mask), SamplingParams())
    with pytest.raises(ValueError, match="response_mask"):
        decode_responses(tok, ids, mask[:, 1:])


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16-autocast"])
def test_the_reserved_kv_cache_decodes_as_the_growing_one(policy, monkeypatch, autocast):
    """Keys and values written in place into reserved buffers (in the autocast dtype under
    autocast) give the tokens and log-probs of HF's concatenating cache, bit for bit."""
    import otbrl.rollout.hf as hf

    model, tok, ids, mask = policy
    calls = []
    reserve = hf.reserve_cache

    def counting(cache, capacity):
        reserve(cache, capacity)
        calls.append(sum(isinstance(layer, hf._ReservedLayer) for layer in cache.layers))

    def run():
        with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16,
                                             enabled=autocast is not None):  # fmt: skip
            return hf.shared_prefix_sample(
                model, ids, mask, 3, 12, [], tok.pad_token_id, False,
                {"temperature": 1.0, "top_p": 1.0, "top_k": 0}, with_logprobs=True,
            )  # fmt: skip

    monkeypatch.setattr(hf, "reserve_cache", counting)
    reserved = run()
    assert calls and calls[0] == model.config.num_hidden_layers  # every layer took the path
    monkeypatch.setattr(hf, "reserve_cache", lambda cache, capacity: None)
    growing = run()
    assert torch.equal(reserved[0], growing[0])
    assert torch.equal(reserved[1], growing[1])


def test_a_sample_draws_each_token_with_its_probability():
    """The inverse-CDF draw: frequencies within 5 standard errors of the softmax, tokens of
    probability 0 (masked logits, a top-k cut) never drawn, one-hot rows exact."""
    torch.manual_seed(0)
    logits = torch.randn(3, 9) * 1.5
    logits[0, 2] = float("-inf")
    logits[2] = float("-inf")
    logits[2, 8] = 0.0  # all the mass on the last token
    rows = logits.repeat_interleave(20000, 0)
    drawn = sample_next_token(rows, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    for i in range(3):
        got = torch.bincount(drawn[i * 20000 : (i + 1) * 20000], minlength=9).double() / 20000
        p = torch.softmax(logits[i].double(), -1)
        assert ((got - p).abs() <= 5 * (p * (1 - p) / 20000).sqrt() + 1e-12).all(), (i, got, p)
        assert (got[p == 0] == 0).all()
    cut = sample_next_token(rows[:20000], do_sample=True, temperature=1.0, top_p=1.0, top_k=3)
    assert set(cut.tolist()) <= set(logits[0].topk(3).indices.tolist())
    with pytest.raises(ValueError, match="NaN or infinite"):
        sample_next_token(torch.full((2, 4), float("nan")), do_sample=True, temperature=1.0,
                          top_p=1.0, top_k=0)  # fmt: skip
