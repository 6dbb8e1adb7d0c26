"""pack / unpack / packed_position_ids against plain loops; packed stats == padded stats."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otbrl.data.packing import pack, packed_position_ids, unpack
from otbrl.ops import token_stats


def random_mask(g, batch, seq_len, layout):
    if layout == "random":
        return torch.rand(batch, seq_len, generator=g) < 0.6
    # Left-padded prompt then right-padded response: valid entries are not contiguous.
    mask = torch.zeros(batch, seq_len, dtype=torch.bool)
    for b in range(batch):
        start = int(torch.randint(0, seq_len + 1, (1,), generator=g))
        stop = int(torch.randint(start, seq_len + 1, (1,), generator=g))
        mask[b, start:stop] = True
        if layout == "prompt+response" and stop < seq_len:
            mask[b, stop + 1 :] = torch.rand(seq_len - stop - 1, generator=g) < 0.5
    return mask


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(0, 5),
    seq_len=st.integers(0, 9),
    layout=st.sampled_from(["random", "contiguous", "prompt+response"]),
    seed=st.integers(0, 2**16),
)
def test_pack_matches_loop_and_unpack_inverts(batch, seq_len, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq_len, 3, generator=g)
    mask = random_mask(g, batch, seq_len, layout)
    packed = pack(x, mask.long())
    want_values = [x[b, t] for b in range(batch) for t in range(seq_len) if mask[b, t]]
    want_cu = [0]
    for b in range(batch):
        want_cu.append(want_cu[-1] + int(mask[b].sum()))
    assert packed.values.shape == (len(want_values), 3)
    if want_values:
        assert torch.equal(packed.values, torch.stack(want_values))
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.tolist() == want_cu
    lengths = [want_cu[i + 1] - want_cu[i] for i in range(batch)]
    assert packed.max_seqlen == max(lengths, default=0)
    restored = unpack(packed.values, packed.indices, batch, seq_len, fill=-7.0)
    assert torch.equal(restored, torch.where(mask[..., None], x, -7.0))
    positions = packed_position_ids(packed.cu_seqlens)
    assert positions.tolist() == [t for n in lengths for t in range(n)]


@settings(max_examples=20, deadline=None)
@given(
    batch=st.integers(1, 4),
    seq_len=st.integers(1, 8),
    vocab=st.integers(1, 40),
    layout=st.sampled_from(["random", "prompt+response"]),
    seed=st.integers(0, 2**16),
)
def test_packed_stats_equal_padded_on_valid_tokens(batch, seq_len, vocab, layout, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, seq_len, vocab, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, vocab, (batch, seq_len), generator=g)
    mask = random_mask(g, batch, seq_len, layout)
    padded = token_stats(logits, labels, temperature=0.9)
    packed_logits = pack(logits, mask)
    packed = token_stats(
        packed_logits.values, pack(labels, mask).values, temperature=0.9, chunk_size=3
    )
    for p, q in zip(padded, packed):
        back = unpack(q, packed_logits.indices, batch, seq_len)
        torch.testing.assert_close(back[mask], p[mask], atol=1e-6, rtol=1e-6)
        assert bool((back[~mask] == 0).all())
    # Gradients reach the padded logits through pack, and only on valid tokens.
    (grad_padded,) = torch.autograd.grad((padded.log_probs * mask).sum(), logits)
    (grad_packed,) = torch.autograd.grad(packed.log_probs.sum(), logits)
    torch.testing.assert_close(grad_packed, grad_padded, atol=1e-6, rtol=1e-6)


def test_unpack_is_differentiable():
    values = torch.randn(4, requires_grad=True)
    out = unpack(values, torch.tensor([5, 0, 3, 2]), 2, 3)
    (out * torch.arange(6.0).reshape(2, 3)).sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([5.0, 0.0, 3.0, 2.0]))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: pack(torch.zeros(2, 3), torch.ones(2, 4)), ValueError, "x: expected shape"),
        (lambda: pack(torch.zeros(2, 3), torch.ones(6)), ValueError, "attention_mask: expected"),
        (lambda: pack(torch.zeros(2, 3), torch.full((2, 3), 2)), ValueError, "only 0/1"),
        (lambda: pack(torch.zeros(2, 3), [[1, 1, 1]]), TypeError, "attention_mask"),
        (lambda: unpack(torch.zeros(2), torch.tensor([0, 6]), 2, 3), ValueError, "indices"),
        (lambda: unpack(torch.zeros(3), torch.tensor([0, 1]), 2, 3), ValueError, "values"),
        (lambda: unpack(torch.zeros(1), torch.tensor([0]), -1, 3), ValueError, "batch_size"),
        (lambda: packed_position_ids(torch.tensor([1, 3])), ValueError, "cu_seqlens"),
        (lambda: packed_position_ids(torch.tensor([0, 3, 2])), ValueError, "cu_seqlens"),
    ],
)
def test_bad_input_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()
