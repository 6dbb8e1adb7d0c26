"""Third-party start-up noise cut to what a user needs (beside the floors: imports nothing from
otbrl, so the rollout engines and the integrations can both call it)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings

# torch's C++ warning (``TORCH_WARN``, printed by c10's logger below Python's, so no warnings
# filter or logger reaches it) that vLLM's CPU worker triggers at every engine start: the NUMA
# memory policy it set for its own process. Nothing a user can act on.
NUMA_BINDING_NOTE = re.compile(
    rb"(\[rank\d+\]:)?\[W\S* \S+ utils\.cpp:\d+\] Warning: NUMA binding: "  # ranks: "[rank0]:"
)
# TRL warns at import that the installed vLLM is outside the range it tested; otbrl tests TRL's
# integration against the vLLM it installs (tests/test_integrations_trl.py)
TRL_VLLM_RANGE = r"TRL currently supports vLLM versions from"

_SET_HERE: dict[str, str] = {}  # environment variables quiet_vllm set (not the user)


def quiet_vllm() -> None:
    """vLLM's logging at ERROR unless the user set ``VLLM_LOGGING_LEVEL`` (it is read when vLLM
    is first imported: call this before any ``import vllm``, the config checks' too). A CPU
    start-up otherwise prints ~23 warning lines, none of them actionable here: the global seed
    (our RNG state is restored), chunked prefill off and eager mode (our settings), no Triton /
    tcmalloc / iomp (performance hints: set ``VLLM_LOGGING_LEVEL=WARNING`` to see them),
    ``set_num_threads`` skipped (five times). torch's C++ NUMA-binding note is dropped by
    ``drop_cpp_log_lines`` around the engine's start."""
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = _SET_HERE["VLLM_LOGGING_LEVEL"] = "ERROR"
    if os.environ["VLLM_LOGGING_LEVEL"].upper() == "ERROR":  # here, or a launcher's, inherited
        # logged at import, before vLLM configures its loggers (no CPU backend in Triton)
        logging.getLogger("vllm.triton_utils.importing").setLevel(logging.ERROR)
    warnings.filterwarnings(
        "ignore", message=r".*torch.distributed.reduce_op.*", category=FutureWarning
    )


def user_env(name: str) -> str | None:
    """``os.environ[name]`` as the user set it: None when ``quiet_vllm`` set it (a server's
    log keeps vLLM's warnings unless the user asked otherwise)."""
    value = os.environ.get(name)
    return None if value is not None and _SET_HERE.get(name) == value else value


def quiet_trl() -> None:
    """No warning that the installed vLLM is outside TRL's tested range (``TRL_VLLM_RANGE``):
    exactly that one UserWarning, from wherever TRL checks."""
    warnings.filterwarnings("ignore", message=TRL_VLLM_RANGE, category=UserWarning)


@contextlib.contextmanager
def drop_cpp_log_lines(pattern: re.Pattern[bytes]):
    """While the block runs, lines written to file descriptor 2 that start with ``pattern`` (a
    C++ log line: c10's start with "[") are dropped; every other byte goes through, in order.
    At the file descriptor because C++ writes there directly, past ``sys.stderr``; a partial
    line is held back only while it may be a C++ log line (progress bars keep moving)."""
    sys.stderr.flush()
    saved = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    thread = threading.Thread(
        target=_pump, args=(read_end, saved, pattern), name="otbrl-stderr-filter", daemon=True
    )
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end closes: the pump drains it and stops
        # a child that inherited the pipe would keep it open: the pump then goes on alone
        thread.join(timeout=10)


def _pump(read_end: int, out: int, pattern: re.Pattern[bytes]) -> None:
    """Copy ``read_end`` to ``out`` without the lines that start with ``pattern``; close both
    at end of file."""
    pending = b""
    try:
        while chunk := os.read(read_end, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            kept = b"".join(line + b"\n" for line in lines if not pattern.match(line))
            if pending and not pending.startswith(b"["):
                kept, pending = kept + pending, b""
            _write_all(out, kept)
        if pending and not pattern.match(pending):
            _write_all(out, pending)
    finally:
        os.close(read_end)
        os.close(out)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
