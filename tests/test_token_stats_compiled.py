"""compiled_token_stats equals token_stats (opt-in: compiling costs tens of seconds on CPU).

Run with OTBRL_TEST_COMPILE=1; the default `make test` never pays the compile time.
"""

import os

import pytest
import torch

from otbrl.ops import IGNORE_INDEX, compiled_token_stats, token_stats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("OTBRL_TEST_COMPILE") != "1", reason="set OTBRL_TEST_COMPILE=1"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_equals_eager(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 24, 300, generator=g) * 4).to(dtype)
    logits[0, 3, ::2] = float("-inf")
    logits[1, 5, 7] = float("nan")
    labels = torch.randint(0, 300, (2, 24), generator=g)
    labels[0, 3] = 4
    labels[1, 0] = IGNORE_INDEX
    w = torch.randn(2, 2, 24, generator=g)
    results = []
    for op in (compiled_token_stats, token_stats):
        x = logits.clone().requires_grad_()
        s = op(x, labels, temperature=0.8)
        loss = (s.log_probs * w[0]).nansum() + (s.entropy * w[1]).nansum()
        (grad,) = torch.autograd.grad(loss, x)
        results.append((*s, grad))
        # Bit-identical afterwards (the NaN entry compares equal to itself here).
        torch.testing.assert_close(x.detach(), logits, rtol=0, atol=0, equal_nan=True)
    (*stats_c, grad_c), (*stats_e, grad_e) = results
    for a, b in zip(stats_c, stats_e):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True)
    # Gradients are rounded to `dtype` once: its default tolerance (≈ 1 ulp).
    torch.testing.assert_close(grad_c, grad_e, equal_nan=True)
