import os

import pytest
import torch
from hypothesis import settings

# Property tests draw the same examples on every run: CI is reproducible, a failure replays.
settings.register_profile("otbrl", derandomize=True, deadline=None)
settings.load_profile("otbrl")

# Deterministic, quiet CPU runs: two cores on CI, so keep torch from oversubscribing.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
