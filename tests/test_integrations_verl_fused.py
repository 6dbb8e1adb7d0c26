"""The ``impl_backend=otbrl`` fused forward and the FSDP engine's Σπ² on the fused path, against
verl's torch fused backend (log-probs, entropy) and verl's eager Σπ² (real verl, CPU)."""

from __future__ import annotations

import pytest
import torch

verl = pytest.importorskip("verl")

from types import SimpleNamespace  # noqa: E402

from tensordict import TensorDict  # noqa: E402
from verl.models.transformers import monkey_patch  # noqa: E402
from verl.models.transformers.monkey_patch import apply_monkey_patch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.dataset.dataset_utils import DatasetPadMode  # noqa: E402
from verl.utils.torch_functional import (  # noqa: E402
    calculate_sum_pi_squared_from_logits,
    entropy_from_logits,
)
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

from tiny_models import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPERATURE = 0.7


@pytest.fixture(params=["qwen2", "llama"])
def model(request):
    """A tiny model whose class forward is restored afterwards (verl patches the class)."""
    m = tiny_causal_lm(request.param, seed=3, vocab_size=96, attn_implementation="sdpa")
    original = type(m).forward
    yield m
    type(m).forward = original


def _packed(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    ids = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return seqs, ids, pos


def _eager(model, ids, pos):
    """verl's eager statistics from the plain HF forward (the model's own logits)."""
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos).logits[0] / TEMPERATURE
    labels = torch.roll(ids[0], -1)
    lp = torch.log_softmax(logits.double(), -1).gather(-1, labels[:, None])[:, 0].float()
    return lp, entropy_from_logits(logits), calculate_sum_pi_squared_from_logits(logits)


def test_fused_forward_matches_verl_torch_backend_and_eager(model):
    _, ids, pos = _packed([7, 12, 5], model.config.vocab_size)
    eager_lp, eager_ent, eager_spp = _eager(model, ids, pos)
    kwargs = dict(input_ids=ids, position_ids=pos, temperature=TEMPERATURE, return_dict=True)

    apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="torch")
    theirs = model(**kwargs)
    (theirs.log_probs.sum() + theirs.entropy.sum()).backward()
    grad_theirs = model.lm_head.weight.grad.clone()
    model.zero_grad()

    apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="otbrl")
    ours = model(**kwargs)
    (ours.log_probs.sum() + ours.entropy.sum()).backward()

    torch.testing.assert_close(ours.log_probs, theirs.log_probs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy, theirs.entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.sum_pi_squared[0], eager_spp, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.log_probs[0].detach(), eager_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.entropy[0].detach(), eager_ent, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model.lm_head.weight.grad, grad_theirs, atol=1e-5, rtol=1e-4)
    assert ours.sum_pi_squared.requires_grad is False


def _engine(pad_to_length: int | None):
    """An FSDPEngineWithLMHead with only the state its input/output layout methods read (the
    FSDP engine is registered for CUDA/NPU devices only, so it cannot be built on CPU)."""
    engine = object.__new__(FSDPEngineWithLMHead)
    engine.pad_to_length = pad_to_length is not None
    engine.pad_to_length_bucket = pad_to_length or 1
    engine.use_ulysses_sp = False
    engine.ulysses_sequence_parallel_size = 1
    engine.engine_config = SimpleNamespace(
        entropy_checkpointing=False, entropy_from_logits_with_chunking=False
    )
    engine.compute_entropy_from_logits = entropy_from_logits
    return engine


def _micro_batch(seqs, *, fused: bool, packed: bool = True):
    ids = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    pos = torch.nested.as_nested_tensor([torch.arange(len(s)) for s in seqs], layout=torch.jagged)
    mb = TensorDict({"input_ids": ids, "position_ids": pos}, batch_size=[len(seqs)])
    tu.assign_non_tensor(
        mb,
        use_remove_padding=packed,
        pad_mode=DatasetPadMode.NO_PADDING,
        use_fused_kernels=fused,
        calculate_entropy=True,
        calculate_sum_pi_squared=True,
        temperature=TEMPERATURE,
    )
    return mb


def _run(engine, model, mb):
    inputs, out_args = engine.prepare_model_inputs(mb)
    with torch.no_grad():
        raw = model(**inputs, use_cache=False)
    return engine.prepare_model_outputs(raw, out_args, mb, None)


@pytest.mark.parametrize("pad_to_length", [None, 16])
def test_engine_sum_pi_squared_on_fused_packed_micro_batch(model, pad_to_length):
    seqs, _, _ = _packed([9, 4, 13, 6], model.config.vocab_size, seed=1)
    engine = _engine(pad_to_length)
    # verl's eager path (logits materialized) is the reference for all three statistics.
    eager = _run(engine, model, _micro_batch(seqs, fused=False))
    apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="otbrl")
    mb = _micro_batch(seqs, fused=True)
    fused = _run(engine, model, mb)
    assert tu.get_non_tensor_data(mb, key="calculate_sum_pi_squared", default=None) is True
    for key in ("log_probs", "entropy", "sum_pi_squared"):
        a, b = fused[key], eager[key]
        assert a.is_nested and a.offsets().tolist() == b.offsets().tolist(), key
        torch.testing.assert_close(a.values(), b.values(), atol=1e-5, rtol=1e-5, msg=key)
    spp = fused["sum_pi_squared"].values()
    assert bool(((spp > 0) & (spp <= 1)).all())


def test_engine_errors_name_the_fix(model):
    seqs, _, _ = _packed([5, 8], model.config.vocab_size, seed=2)
    engine = _engine(None)
    apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="torch")
    with pytest.raises(NotImplementedError, match="impl_backend=otbrl"):
        _run(engine, model, _micro_batch(seqs, fused=True))
    apply_monkey_patch(model, use_fused_kernels=True, fused_kernels_backend="otbrl")
    mb = _micro_batch(seqs, fused=True)
    inputs, out_args = engine.prepare_model_inputs(mb)
    raw = model(**inputs, use_cache=False)
    tu.assign_non_tensor(mb, use_remove_padding=False)
    with pytest.raises(NotImplementedError, match="use_remove_padding=True"):
        engine.prepare_model_outputs(raw, out_args, mb, None)


def test_vision_language_model_refused():
    from transformers import Qwen2VLConfig

    cfg = Qwen2VLConfig()
    fake = SimpleNamespace(config=cfg, lm_head=None, model=None)
    with pytest.raises(NotImplementedError, match="vision-language"):
        monkey_patch.patch_forward_with_backends(
            fake, use_fused_kernels=True, fused_kernels_backend="otbrl"
        )
