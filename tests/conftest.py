import os

import pytest
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

# Deterministic, quiet CPU runs: two cores on CI, so keep torch from oversubscribing.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the test (modules with tiny models use it for all their tests:
    thread hand-offs cost more than the math, badly so on shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
