"""otbrl.engine: outputs in padded / packed / fused layouts, and the update with a loss."""

import pytest
import torch

import otbrl.engine.layout as layout_mod
from otbrl.algos.loss_terms import build_loss
from otbrl.config import load_config
from otbrl.engine.frozen import FrozenEngine
from otbrl.engine.layout import Layout, forward_outputs, sequence_inputs
from otbrl.engine.optim import OptimConfig, warmup_schedule
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.engine.trainable import TrainableEngine
from tiny_models import TEST_SIZE, tiny_causal_lm

ALL = frozenset({"log_probs", "entropy", "sum_pi_squared"})


def forward_token_stats(
    model, batch, *, temperature=1.0, entropy=False, sum_pi_squared=False, packed=False, fused=False
):
    """The layout forward with the old call shape of these tests."""
    outputs = {"log_probs"} | ({"entropy"} if entropy else set())
    outputs |= {"sum_pi_squared"} if sum_pi_squared else set()
    layout = Layout(packed=packed, head="fused" if fused else "logits")
    return forward_outputs(
        model, batch, layout, outputs=frozenset(outputs), temperature=temperature
    )


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


# The padded logits head either runs on every response column (few of them padding) or picks
# the scored rows out of the logits first (many): both ways, forced by the share it switches at.
PADDED_HEADS = {"padded_full_width": 1e9, "padded_picked": 1e-9}


@pytest.fixture(params=sorted(PADDED_HEADS))
def padded_head(request, monkeypatch):
    monkeypatch.setattr(layout_mod, "FULL_WIDTH_SHARE", PADDED_HEADS[request.param])
    return request.param


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_layouts_agree_with_float64_reference(arch, padded_head):
    model = tiny_model(arch).eval()
    batch = make_batch()
    batch["response_mask"][1, 0] = 0  # a hole inside an attended response (a tool's output)
    ref = reference_stats(model, batch, temperature=0.7)
    mask = batch["response_mask"].bool()
    layouts = {
        padded_head: {},
        "packed": {"packed": True},
        "fused": {"fused": True},
        "packed_fused": {"packed": True, "fused": True},
    }
    for name, kwargs in layouts.items():
        with torch.no_grad():
            stats = forward_token_stats(
                model, batch, temperature=0.7, entropy=True, sum_pi_squared=True, **kwargs
            )
        for key, ref_key in (("log_probs", "lp"), ("entropy", "h"), ("sum_pi_squared", "s")):
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
        assert set(stats) == {"log_probs"}
        stats = forward_token_stats(model, batch, entropy=True, sum_pi_squared=True, fused=fused)
        assert stats["log_probs"].requires_grad and stats["entropy"].requires_grad
        assert not stats["sum_pi_squared"].requires_grad


def test_packed_gradients_match_padded(monkeypatch):
    model = tiny_model()
    batch = make_batch(bsz=4)
    batch["response_mask"][0, 2] = 0  # a hole inside an attended response
    grads = []
    for share, kwargs in [(s, {}) for s in PADDED_HEADS.values()] + [
        (None, {"packed": True}),
        (None, {"fused": True}),
    ]:
        if share is not None:
            monkeypatch.setattr(layout_mod, "FULL_WIDTH_SHARE", share)
        model.zero_grad()
        stats = forward_token_stats(model, batch, entropy=True, **kwargs)
        (stats["log_probs"].sum() + 0.1 * stats["entropy"].sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], atol=1e-5, rtol=1e-4)


def test_bad_inputs():
    model = tiny_model()
    batch = make_batch(bsz=2)
    with pytest.raises(ValueError, match="temperature"):
        forward_token_stats(model, batch, temperature=0.0)
    with pytest.raises(ValueError, match="outputs"):
        forward_outputs(model, batch, Layout(), outputs=frozenset({"values"}))
    with pytest.raises(ValueError, match="head"):
        Layout(head="dense")
    with pytest.raises(ValueError, match="batch dim"):
        sequence_inputs(
            batch["prompts"][:1], batch["prompts"][:1], batch["responses"], batch["response_mask"]
        )
    # the micro-batches are the spec's, checked when it is built (frozen or trainable)
    with pytest.raises(ValueError, match="micro_batch_size"):
        EngineSpec(micro=MicroBatchConfig(micro_batch_size=0))
    for bad in ({"micro_batch_size": 2.0}, {"max_tokens_per_micro_batch": 0}):
        with pytest.raises(ValueError, match=f"'{next(iter(bad))}' must be"):
            EngineSpec(micro=MicroBatchConfig(**bad))
    for bad in (
        {"lr": 0.0},
        {"lr": float("nan")},
        {"warmup_steps": -1},
        {"ppo_epochs": 0},
        {"grad_clip": -1.0},
        {"weight_decay": float("inf")},
    ):
        with pytest.raises(ValueError, match=f"'{next(iter(bad))}' must be"):
            TrainableEngine(model, OptimConfig(**bad))
    # the engine takes its own settings (the actor's and critic's groups are OptimConfigs with
    # more keys: it keeps only its own), never an untyped mapping
    with pytest.raises(TypeError, match="OptimConfig"):
        TrainableEngine(model, {"lr": 1e-3})
    group = load_config(overrides=["actor.lr=0.5", "actor.micro_batch_size=3"]).actor
    assert OptimConfig.from_group(group) == OptimConfig(lr=0.5)
    assert MicroBatchConfig.from_group(group) == MicroBatchConfig(micro_batch_size=3)
    assert TrainableEngine(model, group).optim == OptimConfig(lr=0.5)
    engine = TrainableEngine(model, OptimConfig(), EngineSpec(micro=MicroBatchConfig(2)))
    batch = rl_batch(engine)
    del batch["ref_log_probs"]
    with pytest.raises(ValueError, match="ref_log_probs"):
        engine.update(batch, build_loss(kl_loss_coef=0.1))
    frozen = FrozenEngine(model)  # a frozen engine has the default micro-batches, no update
    assert frozen.spec.micro == MicroBatchConfig()
    assert not hasattr(frozen, "update") and not hasattr(frozen, "optimizer")


def rl_batch(engine, bsz=8, seed=0):
    batch = make_batch(bsz=bsz, seed=seed)
    stats = engine.compute(batch, frozenset({"log_probs"}))
    g = torch.Generator().manual_seed(seed + 1)
    batch["old_log_probs"] = stats["log_probs"] - 0.05 * torch.rand(
        stats["log_probs"].shape, generator=g
    )
    batch["advantages"] = (
        torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    )
    batch["ref_log_probs"] = stats["log_probs"] + 0.1 * torch.randn(
        stats["log_probs"].shape, generator=g
    )
    return batch


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("micro", [2, 3])
def test_gradient_accumulation_is_exact(mode, micro):
    """Micro-batches (of 2, or a cap of 3 with a smaller last one) accumulate exactly the
    gradient and the metrics of the whole mini-batch at once."""
    loss = build_loss(
        loss_agg_mode=mode, horizon=7, entropy_coeff=0.01, kl_loss_coef=0.1, kl_loss_type="k3"
    )
    grads, metrics = [], []
    for cap in (8, micro):
        model = tiny_model()
        engine = TrainableEngine(model, OptimConfig(), EngineSpec(micro=MicroBatchConfig(cap)))
        batch = rl_batch(engine)
        engine.model.train()
        metrics.append(engine.accumulate_gradients(batch, loss))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)
    assert metrics[1].keys() == metrics[0].keys()
    for key, value in metrics[0].items():
        assert metrics[1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_padded_micro_batches_run_cut_to_their_own_widths():
    """In the padded layout each micro-batch runs on the columns its rows attend to (short rows
    no longer pay for the batch's longest) and its outputs equal the float64 reference taken
    on the whole padded batch; a response_mask outside the attended tokens is refused."""
    model = tiny_model().eval()
    batch = make_batch(bsz=6, prompt_len=5, resp_len=7)
    am = batch["attention_mask"]
    am[1:, :3] = 0  # rows 1-5: prompts of at most 2 tokens, responses of at most 3
    am[1:, 5 + 3 :] = 0
    batch["response_mask"] = batch["response_mask"] * am[:, 5:]
    batch["position_ids"] = (am.cumsum(1) - 1).clamp(min=0)
    widths = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    engine = TrainableEngine(model, OptimConfig(), EngineSpec(micro=MicroBatchConfig(2)))
    out = engine.compute(batch, frozenset({"log_probs", "entropy", "sum_pi_squared"}))
    hook.remove()
    spans = [am[rows].any(0).nonzero() for rows in ([0, 1], [2, 3], [4, 5])]
    assert widths == [int(c.max() - c.min() + 1) for c in spans]
    assert widths[0] > 7 and max(widths[1:]) <= 2 + 3  # row 0's whole response; the others cut
    ref = reference_stats(model, batch, temperature=1.0)
    for key, name in (("log_probs", "lp"), ("entropy", "h"), ("sum_pi_squared", "s")):
        assert out[key].shape == batch["responses"].shape
        torch.testing.assert_close(out[key].double(), ref[name], atol=1e-5, rtol=1e-5)
    bad = dict(batch, response_mask=batch["response_mask"].clone())
    bad["response_mask"][3, 6] = 1.0  # a trained token where no row of its micro-batch attends
    with pytest.raises(ValueError, match="response_mask: marks tokens past column 3"):
        engine.compute(bad, frozenset({"log_probs"}))


def _micro_tokens(batch, rows, packed: bool) -> int:
    """What a micro-batch of ``rows`` costs: its real tokens packed; padded, its rows x the
    span of the columns any of them attends to (it runs cut to that)."""
    mask = batch["attention_mask"][rows]
    if packed:
        return int(mask.sum())
    cols = mask.any(0).nonzero()
    return len(rows) * int(cols.max() - cols.min() + 1)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_token_budget_micro_batches_give_the_whole_batch_gradient(mode, packed):
    """Rows packed by length under a token budget (several micro-batches, rows out of order)
    accumulate the gradient and metrics of the mini-batch at once, and the statistics forward
    returns each row's outputs in the batch's order."""
    loss = build_loss(
        loss_agg_mode=mode, horizon=7, entropy_coeff=0.01, kl_loss_coef=0.1, kl_loss_type="k3"
    )
    budget = 30  # packed: ~3-5 rows of 2-12 tokens; padded: rows x the micro-batch's width
    grads, metrics, stats = [], [], []
    for micro in (MicroBatchConfig(8), MicroBatchConfig(max_tokens_per_micro_batch=budget)):
        model = tiny_model()
        engine = TrainableEngine(model, OptimConfig(), EngineSpec(packed=packed, micro=micro))
        batch = rl_batch(engine)
        bins = engine.micro_batches(batch)
        assert sorted(torch.cat(bins).tolist()) == list(range(8))
        if micro.max_tokens_per_micro_batch:
            assert len(bins) > 1
            assert all(_micro_tokens(batch, b, packed) <= budget for b in bins)
        stats.append(engine.compute(batch, frozenset({"log_probs", "entropy"})))
        engine.model.train()
        metrics.append(engine.accumulate_gradients(batch, loss))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-4)
    for key, value in metrics[0].items():
        assert metrics[1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for key in stats[0]:
        torch.testing.assert_close(stats[1][key], stats[0][key], atol=1e-5, rtol=1e-5)
    longest = max(_micro_tokens(batch, [i], packed) for i in range(8))
    too_small = EngineSpec(
        packed=packed, micro=MicroBatchConfig(max_tokens_per_micro_batch=longest - 1)
    )
    with pytest.raises(ValueError, match=f"max_tokens_per_micro_batch: a row of {longest} tokens"):
        TrainableEngine(tiny_model(), OptimConfig(), too_small).micro_batches(batch)


def test_update_metrics_and_steps():
    model = tiny_model()
    cfg = OptimConfig(lr=1e-3, warmup_steps=2, ppo_epochs=2, grad_clip=0.5)
    spec = EngineSpec(micro=MicroBatchConfig(2))
    engine = TrainableEngine(model, cfg, spec, mini_batch_size=4)
    batch = rl_batch(engine)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = engine.update(batch, build_loss())
    for key in ("policy/grad_norm", "policy/clip_frac", "policy/approx_kl", "policy/lr"):
        assert key in metrics and torch.isfinite(torch.tensor(metrics[key]))
    assert 0.0 <= metrics["policy/clip_frac"] <= 1.0
    assert metrics["policy/skipped_steps"] == 0
    # 2 epochs x 2 mini-batches = 4 optimizer steps; warmup of 2 -> full lr afterwards
    assert engine.scheduler.last_epoch == 4
    assert metrics["policy/lr"] == pytest.approx(1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="mini-batch"):
        TrainableEngine(tiny_model(), cfg, spec, mini_batch_size=3).update(batch, build_loss())


def test_non_finite_gradient_skips_the_step():
    model = tiny_model()
    engine = TrainableEngine(model, OptimConfig(), EngineSpec(micro=MicroBatchConfig(8)))
    batch = rl_batch(engine)
    batch["advantages"] = torch.where(batch["response_mask"] > 0, float("inf"), 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = engine.update(batch, build_loss())
    assert metrics["policy/skipped_steps"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_warmup_schedule():
    f = warmup_schedule(3)
    assert [f(i) for i in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])


def test_state_dict_round_trip():
    cfg, spec = OptimConfig(), EngineSpec(micro=MicroBatchConfig(4))
    a = TrainableEngine(tiny_model(), cfg, spec, mini_batch_size=4, seed=3)
    a.update(rl_batch(a), build_loss())
    b = TrainableEngine(tiny_model(), cfg, spec, mini_batch_size=4, seed=99)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    assert a.scheduler.last_epoch == b.scheduler.last_epoch


def test_update_moves_log_probs_along_the_advantage():
    """After PPO steps, responses with A > 0 gain log-probability relative to A < 0 ones."""
    model = tiny_model()
    cfg = OptimConfig(lr=3e-3, warmup_steps=0, ppo_epochs=3)
    engine = TrainableEngine(model, cfg, EngineSpec(micro=MicroBatchConfig(8)), mini_batch_size=8)
    batch = make_batch(bsz=8, seed=3)
    mask = batch["response_mask"]
    old = engine.compute(batch, frozenset({"log_probs"}))["log_probs"]
    sign = torch.tensor([1.0, -1.0] * 4)
    batch["old_log_probs"] = old
    batch["advantages"] = sign[:, None] * mask
    engine.update(batch, build_loss())
    new = engine.compute(batch, frozenset({"log_probs"}))["log_probs"]
    delta = ((new - old) * mask).sum(1)
    assert delta[sign > 0].mean() > 0 > delta[sign < 0].mean()


def test_value_head_outputs_match_the_model():
    """A value model's outputs: the score of the position before each response token."""
    batch = make_batch()
    for packed in (False, True):
        value = _value_model()
        spec = EngineSpec(value=True, packed=packed, micro=MicroBatchConfig(4))
        engine = FrozenEngine(value, spec)
        got = engine.compute(batch, frozenset({"values"}))["values"]
        with torch.no_grad():
            scores = value(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"],
            ).logits[..., 0]
        lp = batch["input_ids"].shape[1] - batch["responses"].shape[1]
        mask = batch["response_mask"].bool()
        want = scores[:, lp - 1 : -1]
        torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
        assert (got[~mask] == 0).all()


def _value_model():
    from transformers import LlamaConfig, LlamaForTokenClassification

    torch.manual_seed(0)
    config = LlamaConfig(**{**TEST_SIZE, "vocab_size": VOCAB}, num_labels=1)  # the tests' size
    config.classifier_dropout = 0.0
    return LlamaForTokenClassification(config).eval()
