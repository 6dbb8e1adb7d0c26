"""The rollout protocol's data types, argument checks and completions_to_batch (no model)."""

import pytest
import torch

from otbrl.rollout import (
    Completion,
    SamplingParams,
    completions_to_batch,
    left_pad,
    unpad_prompts,
)
from otbrl.rollout.protocol import check_generate_args


def _random_completions(g, counts, max_len, stop=3):
    out = []
    for c in counts:
        group = []
        for _ in range(c):
            k = int(torch.randint(1, max_len + 1, (1,), generator=g))
            ids = torch.randint(4, 20, (k,), generator=g).tolist()
            reason = "length"
            if torch.rand(1, generator=g) < 0.5:
                ids[-1], reason = stop, "stop"
            group.append(Completion(ids, (-torch.rand(k, generator=g)).tolist(), reason))
        out.append(group)
    return out


def test_completions_to_batch_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12], [13, 14]]
    ids, mask = left_pad(prompts, pad_id=1)
    counts = [2, 3, 1, 2]  # ragged groups are allowed
    comps = _random_completions(g, counts, max_len=6)
    batch = completions_to_batch(ids, mask, comps, pad_id=1)
    rows = [(i, c) for i, group in enumerate(comps) for c in group]
    lr = max(len(c.token_ids) for _, c in rows)
    assert batch["responses"].shape == (len(rows), lr)
    for r, (i, c) in enumerate(rows):
        k = len(c.token_ids)
        assert batch["prompts"][r].tolist() == ids[i].tolist()
        assert batch["responses"][r].tolist() == c.token_ids + [1] * (lr - k)
        assert batch["response_mask"][r].tolist() == [1.0] * k + [0.0] * (lr - k)
        expected_lp = torch.tensor(c.logprobs + [0.0] * (lr - k), dtype=torch.float32)
        assert torch.equal(batch["rollout_log_probs"][r], expected_lp)
        assert batch["uid"][r].item() == i
        assert batch["truncated"][r].item() == (c.finish_reason == "length")
        full = prompts[i] + c.token_ids
        real = batch["attention_mask"][r].bool()
        assert batch["input_ids"][r][real].tolist() == full
        assert batch["position_ids"][r][real].tolist() == list(range(len(full)))
    assert batch["response_mask"].dtype == batch["rollout_log_probs"].dtype == torch.float32
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "uid"):
        assert batch[key].dtype == torch.int64, key
    assert batch["truncated"].dtype == torch.bool


def test_unpad_and_left_pad_round_trip():
    prompts = [[3, 4], [5, 6, 7, 8], [9]]
    ids, mask = left_pad(prompts, pad_id=0)
    assert ids.tolist() == [[0, 0, 3, 4], [5, 6, 7, 8], [0, 0, 0, 9]]
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]]
    assert unpad_prompts(ids, mask) == prompts
    with pytest.raises(ValueError, match="prompt_mask"):
        unpad_prompts(ids, mask[:, 1:])


def test_sampling_params_validate_each_field():
    p = SamplingParams(n=2, stop_token_ids=[3, 4], seed=5)
    assert p.stop_token_ids == (3, 4) and hash(p)  # stored as a tuple: hashable
    bad = [
        ({"n": 0}, ValueError, "n"),
        ({"n": 2.0}, TypeError, "n"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"max_tokens": 0}, ValueError, "max_tokens"),
        ({"stop_token_ids": "2"}, TypeError, "stop_token_ids"),
        ({"stop_token_ids": (1, -2)}, ValueError, "stop_token_ids"),
        ({"greedy": 1}, TypeError, "greedy"),
        ({"seed": -1}, ValueError, "seed"),
    ]
    for kwargs, err, name in bad:
        with pytest.raises(err, match=name):
            SamplingParams(**kwargs)


def test_generate_arguments_are_checked_before_any_model_runs():
    p = SamplingParams(max_tokens=4, stop_token_ids=(2,))
    assert check_generate_args([[1, 2], [3]], p, None, vocab_size=10) == [4, 4]
    assert check_generate_args([[1, 2], [3]], p, [1, 6], vocab_size=10) == [1, 6]
    assert check_generate_args([[1]], p, torch.tensor([3]), vocab_size=10) == [3]
    cases = [
        (([[1, 12]], p, None), {}, ValueError, r"prompts\[0\].*token id 12.*vocabulary"),
        (([[1], [-1]], p, None), {}, ValueError, r"prompts\[1\].*token id -1"),
        (([[1], []], p, None), {}, ValueError, r"prompts\[1\]"),
        (([[1], [2.0]], p, None), {}, TypeError, r"prompts\[1\]"),
        (([], p, None), {}, ValueError, "prompts"),
        ((torch.ones(2, 3, dtype=torch.long), p, None), {}, ValueError, "prompts"),
        (([[1]], p, [1, 2]), {}, ValueError, "max_tokens"),
        (([[1]], p, [0]), {}, ValueError, "max_tokens"),
        (([[1]], {"n": 1}, None), {}, TypeError, "params"),
        (([[1]], SamplingParams(stop_token_ids=(10,)), None), {}, ValueError, "stop_token_ids"),
        (([[1] * 6], p, None), {"max_model_len": 9}, ValueError, "max_model_len"),
    ]
    for args, kw, err, pattern in cases:
        with pytest.raises(err, match=pattern):
            check_generate_args(*args, vocab_size=10, **kw)
    # Exactly at the context length is fine.
    assert check_generate_args([[1] * 5], p, None, vocab_size=10, max_model_len=9) == [4]


def test_completions_to_batch_rejects_malformed_completions():
    ids, mask = left_pad([[3, 4], [5]], pad_id=0)
    good = Completion([7, 2], [-0.1, -0.2], "stop")
    cases = [
        ([[good]], "completions"),  # one group for two prompts
        ([[good], []], r"completions\[1\]"),
        ([[good], [Completion([], [], "length")]], r"completions\[1\]\[0\].*at least one"),
        ([[good], [Completion([1, 2], [-1.0], "stop")]], r"completions\[1\]\[0\].*log-prob"),
        ([[good], [Completion([1], [-1.0], "eos")]], r"completions\[1\]\[0\].*finish_reason"),
    ]
    for comps, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            completions_to_batch(ids, mask, comps, pad_id=0)
    with pytest.raises(TypeError, match=r"completions\[1\]\[0\]"):
        completions_to_batch(ids, mask, [[good], [(1, 2)]], pad_id=0)
    with pytest.raises(ValueError, match="pad_id"):
        completions_to_batch(ids, mask, [[good], [good]], pad_id=-1)
