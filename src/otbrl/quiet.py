"""Third-party start-up noise cut to what a user needs (beside the floors: imports nothing from
otbrl, so the rollout engines and the integrations can both call it)."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_vllm() -> None:
    """vLLM's logging at ERROR unless the user set ``VLLM_LOGGING_LEVEL`` (it is read when vLLM
    is first imported: call this before). A CPU start-up otherwise prints ~23 warning lines,
    none of them actionable here: the global seed (our RNG state is restored), chunked prefill
    off and eager mode (our settings), no Triton / tcmalloc / iomp (performance hints: set
    ``VLLM_LOGGING_LEVEL=WARNING`` to see them), ``set_num_threads`` skipped (five times).
    What stays: errors, and torch's C++ NUMA-binding note (printed below Python's logging)."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
        # logged at import, before vLLM configures its loggers (no CPU backend in Triton)
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    warnings.filterwarnings(
        "ignore", message=r".*torch.distributed.reduce_op.*", category=FutureWarning
    )
