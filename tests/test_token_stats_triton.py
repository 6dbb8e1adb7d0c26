"""Triton kernels of token_stats, run on CPU under TRITON_INTERPRET=1 and compiled for sm_90.

Skipped when triton is not installed (it is an optional extra).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

# The interpreter is chosen when @triton.jit decorates, so set it before the kernels import;
# on a CUDA machine the kernels run for real.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from otbrl.ops import IGNORE_INDEX, token_stats  # noqa: E402
from otbrl.ops import triton_token_stats as kernels  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="triton kernels need CUDA or TRITON_INTERPRET=1",
)


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_chunked_token_stats(dtype):
    g = torch.Generator().manual_seed(0)
    # V spans three 1024-wide blocks, so the running-max rescaling is exercised.
    x = torch.randn(7, 2500, generator=g) * 4
    x[1, ::3] = float("-inf")  # masked vocabulary
    x[2, 5] = float("nan")  # NaN in one row only
    x[3] += 900.0  # far from zero
    x[5, 2400] = 60.0  # the max arrives in the last block
    x = x.to(dtype)
    labels = torch.randint(0, 2500, (7,), generator=g)
    labels[1] = 1
    labels[4] = IGNORE_INDEX
    w = torch.randn(2, 7, generator=g)
    before = x.clone()
    ref_x = x.clone().requires_grad_()
    ref = token_stats(ref_x, labels, temperature=0.7)
    (ref_grad,) = torch.autograd.grad((ref.log_probs * w[0] + ref.entropy * w[1]).nansum(), ref_x)

    xd = x.to(device()).requires_grad_()
    ignored = labels == IGNORE_INDEX
    safe = labels.masked_fill(ignored, 0).to(device())
    got = kernels.triton_token_stats(xd, safe, ignored.to(device()), 1 / 0.7)
    loss = (got[0] * w[0].to(device()) + got[1] * w[1].to(device())).nansum()
    (grad,) = torch.autograd.grad(loss, xd)
    for a, b in zip(got, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.cpu(), b, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.cpu(), ref_grad, equal_nan=True)
    torch.testing.assert_close(xd.detach().cpu(), before, rtol=0, atol=0, equal_nan=True)


# Triton 3.9 fixes "interpreted or compiled" for its own standard library when `import triton`
# runs: in a process that imported it under TRITON_INTERPRET=1 (this one, on a CPU machine)
# `triton.compile` fails (gluon's import asserts, or "'value' object has no attribute 'dtype'").
# So the real compilation runs in a fresh interpreter without TRITON_INTERPRET.
_COMPILE_FOR_HOPPER = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from otbrl.ops import triton_token_stats as kernels

out = {}
for dtype in ("fp32", "bf16"):
    common = {"x_ptr": f"*{dtype}", "x_stride": "i64"}
    fwd = common | {"label_ptr": "*i64", "out_ptr": "*fp32", "n_rows": "i32"}
    fwd |= {"n_cols": "i32", "scale2": "fp32", "BLOCK": "constexpr"}
    bwd = common | {"grad_ptr": f"*{dtype}", "label_ptr": "*i64", "saved_ptr": "*fp32"}
    bwd |= {"g_lp_ptr": "*fp32", "g_ent_ptr": "*fp32", "n_rows": "i32", "n_cols": "i32"}
    bwd |= {"scale": "fp32", "scale2": "fp32", "BLOCK": "constexpr"}
    asm = []
    try:
        for fn, sig in ((kernels._forward_kernel, fwd), (kernels._backward_kernel, bwd)):
            src = ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": 1024})
            asm.append(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
    except (RuntimeError, FileNotFoundError) as err:  # no ptxas / CUDA backend in this wheel
        out[dtype] = {"skip": f"{type(err).__name__}: {err}"[:300]}
    else:
        out[dtype] = {"asm": asm}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hopper_builds():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated (it warns otherwise)
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kernels_compile_for_hopper(dtype, hopper_builds):
    """The kernels lower through Triton's CUDA backend to a cubin for sm_90 (no GPU needed)."""
    result = hopper_builds[dtype]
    if "skip" in result:
        pytest.skip(f"CUDA backend unavailable: {result['skip']}")
    for stages in result["asm"]:  # forward, backward
        assert {"ttir", "ptx", "cubin"} <= set(stages)
