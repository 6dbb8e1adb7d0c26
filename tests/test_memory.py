"""engine.memory: the sizes of weights and optimizer state against byte counts taken by hand,
shared storage counted once, and the CPU peak that a reset really restarts."""

from __future__ import annotations

import pytest
import torch

from memory_utils import needs_peak_reset
from otbrl.engine.memory import (
    optimizer_gb,
    params_gb,
    peak_memory_gb,
    reset_peak_memory,
    tensors_gb,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 50, bias=False)
    )
    model[2].weight = model[0].weight  # tied, as an LM head often is
    model[1].to(torch.bfloat16)
    return model


def test_params_and_optimizer_bytes_match_a_count_by_hand():
    model = _model()
    # embedding (tied with the head) in fp32, the middle layer in bf16
    by_hand = 50 * 8 * 4 + (8 * 16 + 16) * 2
    assert params_gb(model) * 1e9 == pytest.approx(by_hand)
    optimizer = torch.optim.AdamW(model.parameters())
    assert optimizer_gb(optimizer) == 0.0 == optimizer_gb(None)  # no state before a step
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    # two moments shaped like each parameter, plus a float32 step counter per parameter
    moments = 2 * by_hand + 3 * 4
    assert optimizer_gb(optimizer) * 1e9 == pytest.approx(moments)


def test_tensors_sharing_a_storage_count_once():
    base = torch.zeros(1000)
    assert tensors_gb([base, base[:10], base.view(10, 100)]) * 1e9 == 4000
    assert tensors_gb([base, torch.zeros(1000)]) * 1e9 == 8000
    assert tensors_gb([]) == 0.0


@needs_peak_reset
def test_cpu_peak_sees_a_freed_allocation_until_reset():
    import mmap

    reset_peak_memory("cpu")
    start = peak_memory_gb("cpu")
    # 0.2 GB of fresh pages, every one touched, then unmapped. Not a torch tensor: an allocator
    # may serve it from pages it already holds (resident since an earlier test in the same
    # process, so the peak does not move: seen after the vLLM tests)
    big = mmap.mmap(-1, 200_000_000)
    for offset in range(0, len(big), mmap.PAGESIZE):
        big[offset] = 1
    big.close()
    peak = peak_memory_gb("cpu")
    assert peak >= start + 0.19
    reset_peak_memory("cpu")  # the freed 0.2 GB is no longer the peak
    assert peak_memory_gb("cpu") <= peak - 0.15
