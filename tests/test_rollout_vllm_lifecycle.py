"""VLLMRollout's life cycle: install check, start-up errors, close, rebuilds, and torchrun.

Engines here are built one after the other (one live engine per process), after the module
engines of ``test_rollout_vllm.py`` are closed.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from otbrl.models import build_tiny_model
from otbrl.rollout import SamplingParams, VLLMRollout, check_vllm_installed
from otbrl.rollout.config import VLLMConfig

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (make setup)")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_missing_vllm_is_an_import_error_with_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    with pytest.raises(ImportError, match=r"rollout\.name=vllm.*pip install"):
        check_vllm_installed()


@needs_vllm
def test_the_install_check_imports_nothing():
    code = (
        "import sys; from otbrl.rollout import check_vllm_installed; check_vllm_installed(); "
        "print('vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@needs_vllm
def test_start_up_errors_name_the_argument(tiny_dir, tmp_path):
    check_vllm_installed()
    with pytest.raises(ValueError, match="model_dir"):
        VLLMRollout(tmp_path)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VLLMRollout(tiny_dir, VLLMConfig(gpu_memory_utilization=1.5))
    with pytest.raises(ValueError, match="kv_cache_gib"):
        VLLMRollout(tiny_dir, VLLMConfig(kv_cache_gib=0))
    with pytest.raises(ValueError, match="dtype"):
        VLLMRollout(tiny_dir, VLLMConfig(dtype="fp8"))
    with pytest.raises(ValueError, match="max_model_len"):
        VLLMRollout(tiny_dir, max_model_len=1)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        VLLMRollout(tiny_dir, VLLMConfig(enable_sleep_mode=True))  # CPU: no sleep mode


@needs_vllm
def test_unsupported_cpu_head_size_fails_at_start_up(tiny_dir, tmp_path):
    path = build_tiny_model(tmp_path, hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    with pytest.raises(ValueError, match="head_dim 16"):
        VLLMRollout(path, max_model_len=64)
    # The failed start-up closed its engine: a new one may start.
    VLLMRollout(tiny_dir, max_model_len=64).close()


@needs_vllm
def test_close_one_engine_at_a_time_and_rebuilds_reproduce(tiny_dir):
    prompts = [[1, 8, 9, 10], [1, 11, 12]]
    params = SamplingParams(n=3, max_tokens=8, seed=5)
    first = VLLMRollout(tiny_dir, max_model_len=64)
    a = first.generate(prompts, params)
    with pytest.raises(RuntimeError, match="another engine is alive"):
        VLLMRollout(tiny_dir, max_model_len=64)
    first.close()
    first.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        first.generate(prompts, params)
    # A resumed run builds a fresh engine from the same weights: the seeded batch is the same,
    # bit for bit.
    second = VLLMRollout(tiny_dir, max_model_len=64)
    try:
        assert second.generate(prompts, params) == a
    finally:
        second.close()


@needs_vllm
@pytest.mark.distributed
def test_one_engine_per_rank_under_torchrun(tmp_path):
    model_dir = build_tiny_model(tmp_path / "model")
    out = tmp_path / "out"
    out.mkdir()
    worker = Path(__file__).with_name("vllm_dist_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(worker), str(model_dir), str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["world"] == 2
        assert r["mismatch_initial"] <= 1e-5
        assert len(r["mismatch_after_sync"]) == 2 and max(r["mismatch_after_sync"]) <= 1e-5
        assert r["same_weights_on_ranks"]
        assert r["allreduce_after_close"] == 2.0
    assert "Traceback" not in proc.stderr  # nothing failed at exit either
