"""The CUDA paths of otbrl against independent references, one test per path (`gpu` marker:
skipped without CUDA, run by `make gpu-check` through `benchmarks/gpu_check.py`).

Each test takes the ``device`` fixture (``cuda:<current>``) and is written for any device: the
bodies were run on CPU once with ``device=torch.device("cpu")`` (the Triton one under
``TRITON_INTERPRET=1``), but the suite runs them on CUDA only — the CPU suite covers the CPU.

- Triton token statistics (``token_stats`` on CUDA tensors) vs a float64 softmax, fp32 and bf16
  logits with rows at ±1000, a masked vocabulary and a fully masked row, packed and padded;
- the fused lm_head forward + backward vs materialized logits and float64 autograd;
- a ``bf16-mixed`` engine step vs ``32-true`` (the bounds of docs/concepts-precision.md);
- gradient checkpointing on/off; a LoRA step and its merged export;
- FSDP2 over NCCL at world size 1 vs the one-process engine;
- ``memory/peak_gb`` from ``torch.cuda.max_memory_allocated``;
- a 3-step ``otbrl train`` with the HF rollout on the GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dist_utils import (
    OUTPUTS,
    actor_config,
    actor_spec,
    check_ok,
    launch,
    policy_loss,
    ppo_batch,
    tiny_llama,
)
from otbrl import cli
from otbrl.engine.memory import GB, peak_memory_gb, reset_peak_memory
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.engine.trainable import TrainableEngine
from otbrl.engine.world import World
from otbrl.models.config import LoraConfig
from otbrl.models.lora import add_lora, unload_lora
from otbrl.models.weights import full_tensors
from otbrl.ops import IGNORE_INDEX, fused_linear_token_stats, token_stats
from run_utils import read_metrics
from test_dist_engine import full_grads, single_process_reference
from test_engine import ALL, make_batch, rl_batch, tiny_model
from test_precision import (
    LAYOUTS,
    _grads,
    _optimizer_dtypes,
    _ppo,
    actor,
    check_bf16_stats,
    engine_of,
    record_head_stats,
)
from test_token_stats import reference, tolerance

pytestmark = pytest.mark.gpu


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


# -- Triton token statistics -----------------------------------------------------------------


def triton_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float, monkeypatch):
    """``token_stats`` through the Triton kernels: on CUDA the public op, checked to have
    dispatched to them; on CPU (``TRITON_INTERPRET=1``) the kernels' entry it calls for CUDA
    tensors. logits [..., V], labels [...] -> ``(log_probs, entropy, sum_pi_squared)`` [...]."""
    from otbrl.ops import triton_token_stats as kernels

    if not logits.is_cuda:
        flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        ignored = flat_labels == IGNORE_INDEX
        out = kernels.triton_token_stats(
            flat, flat_labels.masked_fill(ignored, 0), ignored, 1 / temperature
        )
        return tuple(x.reshape(labels.shape) for x in out)
    calls = []
    real = kernels._TritonTokenStats.apply
    monkeypatch.setattr(kernels._TritonTokenStats, "apply", lambda *a: calls.append(1) or real(*a))
    out = token_stats(logits, labels, temperature=temperature)
    assert calls == [1], "token_stats did not dispatch CUDA logits to the Triton kernels"
    return tuple(out)


def hard_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[rows, V] logits (float64 values rounded to ``dtype``) with the cases that break a naive
    softmax: row 0 near +1000, row 1 near −1000, row 2 a masked vocabulary (−inf on every
    other entry), row 3 entirely −inf (no distribution: NaN statistics), row 4 its max in
    the last entry; the others randn × 4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 4
    x[0] += 1000.0
    x[1] -= 1000.0
    x[2, 1::2] = float("-inf")
    x[3] = float("-inf")
    x[4, -1] = 60.0
    return x.to(dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN row
@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_token_stats_match_float64(device, monkeypatch, dtype, layout):
    """Statistics and logit gradients of the Triton kernels vs float64 autograd on the same
    (fp32 / bf16) logits. Packed: [T, V] of three sequences, the last token of each ignored.
    Padded: [B, L, V] a row-strided view (``logits[:, :-1]``, as the engine's shift), padding
    ignored. Rows at ±1000 are held to 1e-4 absolute (fp32 spacing there is 6e-5)."""
    pytest.importorskip("triton")
    vocab = 151_936 if device.type == "cuda" else 2_500  # Qwen2.5's; CPU: the interpreter
    if layout == "packed":
        logits = hard_logits(24, vocab, dtype, seed=0)
        labels = torch.randint(0, vocab, (24,), generator=torch.Generator().manual_seed(1))
        labels[[6, 15, 23]] = IGNORE_INDEX  # sequence ends: 7 + 9 + 8 tokens
    else:
        full = hard_logits(4 * 7, vocab, dtype, seed=2).reshape(4, 7, vocab)
        logits = full[:, :-1]  # [4, 6, V]: not contiguous (batch stride 7·V)
        labels = torch.randint(0, vocab, (4, 6), generator=torch.Generator().manual_seed(3))
        labels[1, 4:] = labels[3, 2:] = IGNORE_INDEX  # right padding
    g = torch.Generator().manual_seed(4)
    w_lp, w_ent = torch.randn(2, *labels.shape, generator=g, dtype=torch.float64)
    flat = logits.reshape(-1, vocab)
    bad = flat.isinf().all(-1).reshape(labels.shape)  # the fully masked row: NaN
    # a label of the masked vocabulary's row points at a token it allows (column 0)
    on_masked = flat.isinf().gather(-1, labels.clamp_min(0).reshape(-1, 1)).reshape(labels.shape)
    labels[on_masked & ~bad & (labels != IGNORE_INDEX)] = 0
    finite_max = flat.double().nan_to_num(neginf=0.0).abs().amax(-1).reshape(labels.shape)
    extreme = finite_max > 500

    x = logits.detach().to(device).requires_grad_()
    got = triton_stats(x, labels.to(device), 0.7, monkeypatch)
    loss = (got[0] * w_lp.float().to(device) + got[1] * w_ent.float().to(device)).nansum()
    (grad,) = torch.autograd.grad(loss, x)

    # float64 reference; a masked entry's −inf becomes −1e4, whose exp is exactly 0 in float64
    # too, so autograd gives it the gradient 0 instead of 0·inf = NaN
    masked = flat.isinf().reshape(logits.shape) & ~bad[..., None]
    ref_x = logits.detach().double().masked_fill(masked, -1e4).requires_grad_()
    ref = reference(ref_x, labels, 0.7)
    ref_loss = (ref[0] * w_lp + ref[1] * w_ent)[~bad].sum()
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_x)
    for a, b in zip(got, ref):
        a = a.cpu()
        assert a.dtype == torch.float32 and a.shape == labels.shape
        assert bool(a[bad].isnan().all())
        ok = ~bad & ~extreme
        torch.testing.assert_close(a[ok].double(), b[ok].detach(), **tolerance(dtype, vocab))
        torch.testing.assert_close(a[extreme].double(), b[extreme].detach(), atol=1e-4, rtol=1e-5)
    assert grad.dtype == dtype
    grad = grad.cpu()
    # one rounding of the float32 gradient to `dtype`: that dtype's default tolerance
    torch.testing.assert_close(grad[~bad], ref_grad[~bad].to(dtype))
    assert bool((grad[masked] == 0).all())


# -- fused lm_head ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_head_matches_materialized_logits(device, dtype):
    """``fused_linear_token_stats`` forward + backward vs ``token_stats`` of the materialized
    ``hidden @ weight.T`` on the same device (1e-5; bf16 gradients a few bf16 ulps, the
    chunked weight-gradient sums round differently), and, in fp32, vs float64 autograd."""
    tokens, hidden_size, vocab = (300, 256, 151_936) if device.type == "cuda" else (40, 32, 500)
    g = torch.Generator().manual_seed(5)
    h = (torch.randn(tokens, hidden_size, generator=g, dtype=torch.float64)).to(dtype)
    w = (torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) / 16).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    labels[::7] = IGNORE_INDEX
    weights = torch.randn(2, tokens, generator=g, dtype=torch.float64)

    def run(fn):
        hidden, weight = (t.to(device).requires_grad_() for t in (h, w))
        stats = fn(hidden, weight)
        loss = (stats[0].double() * weights[0].to(device)).sum()
        loss = loss + (stats[1].double() * weights[1].to(device)).sum()
        grads = torch.autograd.grad(loss, [hidden, weight])
        return [s.detach().cpu() for s in stats], [x.cpu() for x in grads]

    y = labels.to(device)
    fused, fused_grads = run(lambda hd, wt: fused_linear_token_stats(hd, wt, y, temperature=0.9))
    mat, mat_grads = run(lambda hd, wt: token_stats(hd @ wt.T, y, temperature=0.9))
    for a, b in zip(fused, mat):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(fused_grads, mat_grads):
        assert a.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
    if dtype != torch.float32:
        return
    hd, wt = h.double().requires_grad_(), w.double().requires_grad_()
    ref = reference(hd @ wt.T, labels, 0.9)
    ref_loss = (ref[0] * weights[0]).sum() + (ref[1] * weights[1]).sum()
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a.double(), b.detach(), atol=1e-4, rtol=1e-4)
    for a, b in zip(fused_grads, torch.autograd.grad(ref_loss, [hd, wt])):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-4)


# -- the engine: precision, checkpointing, LoRA ----------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_bf16_mixed_step_matches_32_true(device, monkeypatch, layout):
    """Under CUDA autocast the head sees bf16 logits and its statistics equal float64 on them
    (1e-5 relative); the log-probs sit off ``32-true``'s by bf16 rounding (max gap in
    (1e-4, 0.1), docs/concepts-precision.md); the step keeps fp32 weights and AdamW state."""
    world = World(device=device)
    fp32 = engine_of(tiny_model(), world=world, **LAYOUTS[layout])
    mixed = engine_of(tiny_model(), world=world, precision="bf16-mixed", **LAYOUTS[layout])
    batch = make_batch()
    ref = fp32.compute(batch, ALL)
    seen = record_head_stats(monkeypatch)
    got = mixed.compute(batch, ALL)
    check_bf16_stats(seen)
    mask = batch["response_mask"].bool()
    gap = (ref["log_probs"] - got["log_probs"])[mask].abs()
    assert 1e-4 < gap.max() < 0.1, float(gap.max())
    metrics = mixed.update(rl_batch(mixed), _ppo())
    assert metrics["policy/skipped_steps"] == 0
    params = list(mixed.model.parameters())
    assert {p.device.type for p in params} == {device.type}
    assert {p.dtype for p in params} == {torch.float32}
    assert all(bool(p.isfinite().all()) for p in params)
    assert _optimizer_dtypes(mixed) == {"torch.float32"}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gradient_checkpointing_gives_the_same_gradients(device, layout):
    """fp32 gradients with ``gradient_checkpointing`` equal the plain backward's (1e-6)."""
    world = World(device=device)
    plain = engine_of(tiny_model(), world=world, **LAYOUTS[layout])
    ckpt = engine_of(tiny_model(), world=world, gradient_checkpointing=True, **LAYOUTS[layout])
    batch = rl_batch(plain)
    plain.model.train(), ckpt.model.train()
    want, got = _grads(plain, batch), _grads(ckpt, batch)
    assert set(want) == set(got) and want
    for name, g in want.items():
        assert g.device.type == device.type
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-6, msg=name)


def test_lora_step_and_merged_export(device):
    """Two LoRA steps on the device train only the adapters; the merged tensors
    (``full_tensors``) loaded into a plain model on the CPU, and peft's own merge, give the
    trained log-probs (1e-5)."""
    from test_lora import LP, _loss, log_probs

    engine = TrainableEngine(
        add_lora(tiny_model(), LoraConfig(rank=4, alpha=8.0)),
        actor(lr=5e-2),
        EngineSpec(micro=MicroBatchConfig(3)),
        world=World(device=device),
    )
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for seed in range(2):
        engine.update(rl_batch(engine, seed=seed), _loss())
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, base[n])}
    assert changed and all(".lora_A." in n or ".lora_B." in n for n in changed)
    batch = make_batch()
    want = engine.compute(batch, LP)["log_probs"]
    plain = tiny_model(seed=1)  # other weights: everything must come from the stream
    merged = dict(full_tensors(engine.model))
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(log_probs(plain, batch), want, atol=1e-5, rtol=0)
    unloaded = unload_lora(copy.deepcopy(engine.model)).cpu()
    torch.testing.assert_close(log_probs(unloaded, batch), want, atol=1e-5, rtol=0)


# -- FSDP2 over NCCL -------------------------------------------------------------------------


def _fsdp_nccl_worker(rank, world_size, port):
    """One rank of FSDP2 over NCCL (gloo on a CPU-only check): stats, gradients and clipped
    norm of the PPO batch, as ``single_process_reference`` returns them."""
    from otbrl.engine.parallel import build_mesh, clip_grad_norm
    from otbrl.engine.world import init_distributed

    info = init_distributed(rank=rank, world_size=world_size, timeout_s=60.0)
    mesh = build_mesh(world_size, device_type=info.device.type)
    world = World(rank=info.rank, size=info.world_size, device=info.device, mesh=mesh)
    batch = ppo_batch()
    spec = actor_spec(strategy="fsdp")
    engine = TrainableEngine(tiny_llama(), actor_config(), spec, world=world, mini_batch_size=8)
    stats = engine.compute(batch, OUTPUTS)
    mini = {**batch, "old_log_probs": stats["log_probs"]}
    tally = engine.accumulate_gradients(mini, policy_loss())
    grads = {k: v.cpu() for k, v in full_grads(engine.model).items()}
    norm = float(clip_grad_norm(engine.model.parameters(), 0.5))
    return {"backend": info.backend, "stats": stats, "tally": tally, "grads": grads, "norm": norm}


def test_fsdp2_over_nccl_matches_one_process(device, tmp_path):
    """FSDP2 at world size 1 over NCCL gives the one-process engine's statistics (2e-6),
    metrics and gradients (1e-6) on the same device, as the gloo tests hold two ranks to."""
    got = check_ok(launch(_fsdp_nccl_worker, 1, tmp_path, timeout_s=240.0))[0]
    assert got["backend"] == ("nccl" if device.type == "cuda" else "gloo")
    batch = ppo_batch()
    stats, tally, grads, norm = single_process_reference(batch, world=World(device=device))
    mask = batch["response_mask"].bool()
    for key in sorted(OUTPUTS):
        torch.testing.assert_close(got["stats"][key][mask], stats[key][mask], atol=2e-6, rtol=0)
    for key, value in tally.items():
        assert got["tally"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, g in grads.items():
        torch.testing.assert_close(got["grads"][name], g.cpu(), atol=1e-6, rtol=1e-5, msg=name)
    assert got["norm"] == pytest.approx(norm, rel=1e-5)


# -- memory and a whole run ------------------------------------------------------------------


def test_peak_memory_comes_from_the_device_allocator(device):
    """``peak_memory_gb`` after ``reset_peak_memory`` sees a freed 256 MiB allocation (its byte
    count, the independent reference) and nothing of it after the next reset."""
    if device.type != "cuda":
        pytest.skip("the CPU peak is tests/test_memory.py's")
    torch.cuda.synchronize(device)
    reset_peak_memory(device)
    before = torch.cuda.memory_allocated(device)
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    nbytes = block.numel()
    del block
    peak = peak_memory_gb(device)
    assert peak == pytest.approx(torch.cuda.max_memory_allocated(device) / GB)
    assert peak * GB >= before + nbytes
    reset_peak_memory(device)
    assert peak_memory_gb(device) * GB < before + nbytes


def test_three_step_train_with_the_hf_rollout(device, tiny_run, tmp_path):
    """``otbrl train`` (one process, HF rollout) runs on the GPU: three steps, finite
    metrics, ``memory/peak_gb`` from the CUDA allocator (at most the process's CUDA peak, which
    a CPU run would leave at 0), and the rollout's log-probs equal the trainer's forward on
    the same weights within the fp32 floor (``rollout/logprob_abs_diff_max`` ≤ 1e-4)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out = tmp_path / "run"
    overrides = tiny_run(out, "trainer.total_steps=3", "trainer.val_every=0")
    assert cli.main(["train", *overrides, "trainer.save_every=0"]) == 0
    steps = [r for r in read_metrics(out) if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert r["policy/grad_norm"] is not None and r["policy/grad_norm"] >= 0
        assert r["rollout/logprob_abs_diff_max"] <= 1e-4
        assert r["memory/peak_gb"] > 0
    if device.type == "cuda":
        process_peak = torch.cuda.max_memory_allocated(device) / GB
        assert 0 < max(r["memory/peak_gb"] for r in steps) <= process_peak
