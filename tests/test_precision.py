"""model.precision and model.gradient_checkpointing on one process: the statistics from bf16
logits against float64 on the same logits, fp32 master weights and AdamW state, gradient
checkpointing against the plain backward, and the configuration errors."""

from __future__ import annotations

import pytest
import torch

from otbrl import cli
from otbrl.config import ConfigError, load_config
from otbrl.engine import layout as layout_module
from otbrl.engine.optim import OptimConfig
from otbrl.engine.precision import check_precision_device, get_precision
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.engine.trainable import TrainableEngine
from otbrl.ops import IGNORE_INDEX
from test_engine import make_batch, rl_batch, tiny_model

ALL = frozenset({"log_probs", "entropy", "sum_pi_squared"})
LAYOUTS = {"padded": {}, "packed": {"packed": True}, "fused": {"fused": True}}


def actor(**kw):
    settings = dict(lr=1e-3, warmup_steps=0, grad_clip=1.0)
    return OptimConfig(**{**settings, **kw})


def engine_of(model, *, world=None, **spec):
    """A trainable engine on ``model`` (in ``world``: one process by default) with ``actor()``,
    micro-batches of 3 rows and the ``EngineSpec`` fields ``spec`` (layout, precision, gradient
    checkpointing)."""
    spec = EngineSpec(micro=MicroBatchConfig(3), **spec)
    return TrainableEngine(model, actor(), spec, world=world)


def float64_stats(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Log-prob, entropy and Σπ² of [N, V] logits by a float64 softmax (log-prob 0 where the
    label is ``IGNORE_INDEX``: the padded head's unscored columns)."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    p = logp.exp()
    ignored = labels == IGNORE_INDEX
    picked = logp.gather(-1, labels.masked_fill(ignored, 0)[:, None])[:, 0]
    return {
        "log_probs": picked.masked_fill(ignored, 0.0),
        "entropy": -(p * logp).sum(-1),
        "sum_pi_squared": (p * p).sum(-1),
    }


def record_head_stats(monkeypatch) -> list:
    """Spy on the engine's statistics head: every call appends ``(logits [N, V], labels [N],
    {output: [N] float32})``, the logits being what the head reduced (for the fused head the
    ``features @ weight.T`` it forms, in its compute dtype). Returns the list it fills."""
    seen = []
    real = layout_module._stats_of

    def spy(model, features, labels, lay, outputs, temperature, compute):
        out = real(model, features, labels, lay, outputs, temperature, compute)
        if lay.head == "fused":
            w = model.get_output_embeddings().weight
            dtype = compute or features.dtype
            logits = features.to(dtype) @ w.to(dtype).T  # the fused op's matmul, in bf16
        else:
            logits = features
        seen.append((logits.detach(), labels, {k: v.detach() for k, v in out.items()}))
        return out

    monkeypatch.setattr(layout_module, "_stats_of", spy)
    return seen


def check_bf16_stats(seen: list) -> None:
    """Each recorded head call saw bf16 logits and its float32 statistics equal a float64
    softmax of those very logits within 1e-5 relative (to max(|ref|, 1e-3))."""
    assert seen
    for logits, labels, stats in seen:
        assert logits.dtype == torch.bfloat16
        want = float64_stats(logits, labels)
        for key in sorted(ALL):
            got = stats[key].double()
            assert stats[key].dtype == torch.float32
            err = ((got - want[key]).abs() / want[key].abs().clamp_min(1e-3)).max()
            assert err <= 1e-5, (key, float(err))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_stats_from_bf16_logits_equal_float64_on_the_same_logits(monkeypatch, precision, layout):
    """Whatever the layout, the head sees bf16 logits (bf16 hidden states and weight for the
    fused head) and the three statistics equal a float64 softmax of exactly those values."""
    seen = record_head_stats(monkeypatch)
    model = tiny_model()
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    engine = engine_of(model, precision=precision, **LAYOUTS[layout])
    out = engine.compute(make_batch(), ALL)
    assert all(v.dtype == torch.float32 for v in out.values())
    check_bf16_stats(seen)


def _optimizer_dtypes(engine):
    return {
        str(v.dtype) for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"
    }


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_mixed_keeps_fp32_master_weights_and_state(layout):
    """The step updates fp32 weights with fp32 moments; the forward is bf16 (log-probs move
    off the fp32 ones by bf16 rounding, not more); the PPO ratio is taken in fp32."""
    fp32 = engine_of(tiny_model(), **LAYOUTS[layout])
    mixed = engine_of(tiny_model(), precision="bf16-mixed", **LAYOUTS[layout])
    batch = make_batch()
    ref, got = fp32.compute(batch, ALL), mixed.compute(batch, ALL)
    mask = batch["response_mask"].bool()
    gap = (ref["log_probs"] - got["log_probs"])[mask].abs()
    assert 1e-4 < gap.max() < 0.1
    metrics = mixed.update(rl_batch(mixed), _ppo())
    assert metrics["policy/skipped_steps"] == 0
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    assert _optimizer_dtypes(mixed) == {"torch.float32"}


def test_bf16_true_keeps_everything_in_bf16():
    engine = engine_of(tiny_model().to(torch.bfloat16), precision="bf16-true")
    engine.update(rl_batch(engine), _ppo())
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert _optimizer_dtypes(engine) == {"torch.bfloat16"}


def test_bf16_mixed_refuses_bf16_weights():
    with pytest.raises(ValueError, match=r"bf16-mixed trains torch\.float32 parameters"):
        engine_of(tiny_model().to(torch.bfloat16), precision="bf16-mixed")
    with pytest.raises(ValueError, match="precision: expected one of"):
        get_precision("16-mixed")


def _ppo():
    from otbrl.algos.loss_terms import build_loss

    return build_loss(entropy_coeff=0.01, kl_loss_coef=0.1)


def _grads(engine, batch):
    engine.accumulate_gradients(batch, _ppo())
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradient_checkpointing_gives_the_same_gradients(layout):
    plain = engine_of(tiny_model(), **LAYOUTS[layout])
    ckpt = engine_of(tiny_model(), gradient_checkpointing=True, **LAYOUTS[layout])
    batch = rl_batch(plain)
    plain.model.train(), ckpt.model.train()
    want, got = _grads(plain, batch), _grads(ckpt, batch)
    assert set(want) == set(got) and want
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-6, msg=name)
    assert all(layer.gradient_checkpointing for layer in ckpt.model.model.layers)


def test_checkpointing_recomputes_the_blocks():
    """With checkpointing each decoder block runs twice per backward (forward + recompute)."""
    calls = []
    engine = engine_of(tiny_model(), gradient_checkpointing=True)
    engine.model.model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))
    engine.model.train()
    _grads(engine, rl_batch(engine))
    micro_batches = -(-make_batch()["input_ids"].shape[0] // 3)
    forwards = len(calls) - micro_batches  # rl_batch's compute ran once per micro-batch
    assert forwards == 2 * micro_batches


def test_config_keys_and_the_removed_dtype():
    cfg = load_config(None, ["model.precision=bf16-mixed", "model.gradient_checkpointing=true"])
    assert cfg.model.precision == "bf16-mixed" and cfg.model.gradient_checkpointing
    with pytest.raises(ConfigError, match=r"'model\.dtype'.*removed.*model\.precision"):
        load_config(None, ["model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="did you mean 'bf16-mixed'"):
        load_config(None, ["model.precision=bf16-mix"])
    # a checkpoint's config.yaml from before the rename still loads (otbrl eval of old runs)
    saved = load_config(None, base={"model": {"path": "builtin", "dtype": "bfloat16"}})
    assert saved.model.precision == "bf16-true"


def test_a_device_without_bf16_is_refused_before_any_model_loads(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda **_: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Tesla V100-SXM2-16GB")
    with pytest.raises(ConfigError, match=r"V100.*cannot compute in bfloat16"):
        check_precision_device("bf16-mixed", "cuda")
    assert check_precision_device("32-true", "cuda") is None

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("otbrl.run.build.load_policy", no_model)
    monkeypatch.setattr("otbrl.run.build.ensure_warm_start", no_model)
    assert cli.main(["train", "model.precision=bf16-mixed"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'model.precision'" in err and "V100" in err


def test_emulated_bf16_is_a_note_not_an_error(monkeypatch):
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    note = check_precision_device("bf16-mixed", "cpu")
    assert note is not None and "32-true is faster here" in note
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    assert check_precision_device("bf16-mixed", "cpu") is None
