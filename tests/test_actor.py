"""otbrl.engine: token statistics in padded / packed / fused layouts, and the PPO update."""

import dataclasses

import pytest
import torch

from otbrl.config import ActorConfig
from otbrl.engine.actor import Actor, warmup_schedule
from otbrl.engine.forward import block_causal_mask, forward_token_stats, sequence_inputs
from tiny_models import tiny_causal_lm

VOCAB = 37


def tiny_model(arch="llama", seed=0):
    return tiny_causal_lm(arch, seed, vocab_size=VOCAB, tie_word_embeddings=False)


def make_batch(bsz=6, prompt_len=5, resp_len=7, seed=0):
    """Left-padded prompts and right-padded responses of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (bsz, prompt_len), generator=g)
    responses = torch.randint(1, VOCAB, (bsz, resp_len), generator=g)
    p_len = torch.randint(1, prompt_len + 1, (bsz,), generator=g)
    r_len = torch.randint(1, resp_len + 1, (bsz,), generator=g)
    r_len[0] = resp_len  # at least one full-length response
    cols_p, cols_r = torch.arange(prompt_len), torch.arange(resp_len)
    prompt_mask = (cols_p[None] >= prompt_len - p_len[:, None]).long()
    response_mask = (cols_r[None] < r_len[:, None]).float()
    prompts = prompts * prompt_mask
    responses = responses * response_mask.long()
    batch = {"prompts": prompts, "responses": responses, "response_mask": response_mask}
    batch.update(sequence_inputs(prompts, prompt_mask, responses, response_mask))
    return batch


def reference_stats(model, batch, temperature):
    """float64 softmax over the full padded logits, a plain loop over tokens."""
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits.double()
    resp_len = batch["responses"].shape[1]
    prompt_len = batch["input_ids"].shape[1] - resp_len
    out = {k: torch.zeros(batch["responses"].shape, dtype=torch.float64) for k in ("lp", "h", "s")}
    for b in range(logits.shape[0]):
        for t in range(resp_len):
            if batch["response_mask"][b, t] == 0:
                continue
            z = logits[b, prompt_len + t - 1] / temperature
            p = torch.softmax(z, -1)
            out["lp"][b, t] = torch.log(p[batch["responses"][b, t]])
            out["h"][b, t] = -(p * torch.log(p)).sum()
            out["s"][b, t] = (p * p).sum()
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_layouts_agree_with_float64_reference(arch):
    model = tiny_model(arch).eval()
    batch = make_batch()
    ref = reference_stats(model, batch, temperature=0.7)
    mask = batch["response_mask"].bool()
    layouts = {
        "padded": {},
        "packed": {"packed": True},
        "packed_explicit_mask": {"packed": True, "packed_mask": "explicit"},
        "fused": {"fused": True},
        "packed_fused": {"packed": True, "fused": True},
    }
    for name, kwargs in layouts.items():
        with torch.no_grad():
            stats = forward_token_stats(
                model, batch, temperature=0.7, entropy=True, sum_pi_squared=True, **kwargs
            )
        for key, ref_key in (("old_log_probs", "lp"), ("entropy", "h"), ("sum_pi_squared", "s")):
            got = stats[key]
            assert got.dtype == torch.float32 and got.shape == mask.shape, (name, key)
            torch.testing.assert_close(
                got[mask].double(), ref[ref_key][mask], atol=1e-5, rtol=1e-5, msg=f"{name} {key}"
            )
            assert (got[~mask] == 0).all(), (name, key)


def test_only_requested_stats_and_gradients():
    model = tiny_model()
    batch = make_batch(bsz=3)
    for fused in (False, True):
        stats = forward_token_stats(model, batch, fused=fused)
        assert set(stats) == {"old_log_probs"}
        stats = forward_token_stats(model, batch, entropy=True, sum_pi_squared=True, fused=fused)
        assert stats["old_log_probs"].requires_grad and stats["entropy"].requires_grad
        assert not stats["sum_pi_squared"].requires_grad


def test_packed_gradients_match_padded():
    model = tiny_model()
    batch = make_batch(bsz=4)
    grads = []
    for kwargs in ({}, {"packed": True}, {"fused": True}):
        model.zero_grad()
        stats = forward_token_stats(model, batch, entropy=True, **kwargs)
        (stats["old_log_probs"].sum() + 0.1 * stats["entropy"].sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[2], grads[0], atol=1e-5, rtol=1e-4)


def test_block_causal_mask():
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))
    allowed = mask[0, 0] == 0
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[:2, :2] = torch.ones(2, 2).tril().bool()
    expected[2:, 2:] = torch.ones(3, 3).tril().bool()
    assert torch.equal(allowed, expected)


def test_bad_inputs():
    model = tiny_model()
    batch = make_batch(bsz=2)
    with pytest.raises(ValueError, match="temperature"):
        forward_token_stats(model, batch, temperature=0.0)
    with pytest.raises(ValueError, match="packed_mask"):
        forward_token_stats(model, batch, packed=True, packed_mask="dense")
    with pytest.raises(ValueError, match="batch dim"):
        sequence_inputs(
            batch["prompts"][:1], batch["prompts"][:1], batch["responses"], batch["response_mask"]
        )
    cfg = ActorConfig(micro_batch_size=3)
    with pytest.raises(ValueError, match="micro_batch_size"):
        Actor(model, cfg, ppo_mini_batch_size=4)
    with pytest.raises(ValueError, match="ref_model"):
        Actor(model, ActorConfig(use_kl_loss=True, micro_batch_size=2), ppo_mini_batch_size=4)


def rl_batch(actor, bsz=8, seed=0):
    batch = make_batch(bsz=bsz, seed=seed)
    stats = actor.compute_stats(batch, frozenset({"old_log_probs"}))
    g = torch.Generator().manual_seed(seed + 1)
    batch["old_log_probs"] = stats["old_log_probs"] - 0.05 * torch.rand(
        stats["old_log_probs"].shape, generator=g
    )
    batch["advantages"] = (
        torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    )
    batch["ref_log_probs"] = stats["old_log_probs"] + 0.1 * torch.randn(
        stats["old_log_probs"].shape, generator=g
    )
    return batch


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_gradient_accumulation_is_exact(mode):
    """Micro-batches of 2 accumulate exactly the gradient of the whole mini-batch at once."""
    cfg = ActorConfig(
        loss_agg_mode=mode,
        entropy_coeff=0.01,
        use_kl_loss=True,
        kl_loss_coef=0.1,
        micro_batch_size=8,
    )
    grads = []
    for micro in (8, 2):
        model, ref = tiny_model(), tiny_model(seed=1)
        actor = Actor(
            model,
            dataclasses.replace(cfg, micro_batch_size=micro),
            ppo_mini_batch_size=8,
            ref_model=ref,
        )
        batch = rl_batch(actor)
        actor.model.train()
        actor.accumulate_gradients(batch)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)


def test_update_metrics_and_steps():
    model = tiny_model()
    cfg = ActorConfig(lr=1e-3, warmup_steps=2, ppo_epochs=2, micro_batch_size=2, grad_clip=0.5)
    actor = Actor(model, cfg, ppo_mini_batch_size=4)
    batch = rl_batch(actor)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = actor.update(batch)
    for key in ("policy/grad_norm", "policy/clip_frac", "policy/approx_kl", "policy/lr"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key]))
    assert 0.0 <= metrics["policy/clip_frac"] <= 1.0
    # 2 epochs x 2 mini-batches = 4 optimizer steps; warmup of 2 -> full lr afterwards
    assert actor.scheduler.last_epoch == 4
    assert metrics["policy/lr"] == pytest.approx(1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_warmup_schedule():
    f = warmup_schedule(3)
    assert [f(i) for i in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_state_dict_round_trip():
    cfg = ActorConfig(micro_batch_size=4)
    a = Actor(tiny_model(), cfg, ppo_mini_batch_size=4, seed=3)
    a.update(rl_batch(a))
    b = Actor(tiny_model(), cfg, ppo_mini_batch_size=4, seed=99)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert a.scheduler.last_epoch == b.scheduler.last_epoch


def test_update_moves_log_probs_along_the_advantage():
    """After PPO steps, responses with A > 0 gain log-probability relative to A < 0 ones."""
    model = tiny_model()
    cfg = ActorConfig(lr=3e-3, warmup_steps=0, ppo_epochs=3, micro_batch_size=8)
    actor = Actor(model, cfg, ppo_mini_batch_size=8)
    batch = make_batch(bsz=8, seed=3)
    mask = batch["response_mask"]
    old = actor.compute_stats(batch, frozenset({"old_log_probs"}))["old_log_probs"]
    sign = torch.tensor([1.0, -1.0] * 4)
    batch["old_log_probs"] = old
    batch["advantages"] = sign[:, None] * mask
    actor.update(batch)
    new = actor.compute_stats(batch, frozenset({"old_log_probs"}))["old_log_probs"]
    delta = ((new - old) * mask).sum(1)
    assert delta[sign > 0].mean() > 0 > delta[sign < 0].mean()
