"""``otbrl.quiet``: exactly the known third-party lines are cut, everything else goes through
(the runs that print them: tests/test_trainer_vllm.py, tests/test_integrations_trl.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from otbrl import quiet

NUMA = (
    "[W1207 16:22:40.978351355 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for "
    "memory allocation on the NUMA nodes (0). (function init_cpu_memory_env)\n"
)
SCRIPT = f"""
import os, sys
from otbrl import quiet
note = {NUMA.encode()!r}
with quiet.drop_cpp_log_lines(quiet.NUMA_BINDING_NOTE):
    os.write(2, b"before\\n" + note + b"[W1207 16:22:41 foo.cpp:9] Warning: other (f)\\n")
    print("from python", file=sys.stderr)
    os.write(2, note[:30])  # a note written in pieces is still one line
    os.write(2, note[30:])
    os.write(2, b"[rank1]:" + note)  # a rank of a distributed run prefixes its own
    os.write(2, b"bar  50%\\r")
os.write(2, b"after\\n")
"""


def test_the_numa_note_is_cut_at_the_file_descriptor_and_nothing_else():
    """C++ writes to fd 2 past sys.stderr: the filter sits there (a process of its own: pytest
    moves sys.stderr off fd 2). Other C++ warnings, Python's own lines and a progress bar's
    partial line (no newline yet) go through, in order."""
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        b"before\n[W1207 16:22:41 foo.cpp:9] Warning: other (f)\nfrom python\nbar  50%\rafter\n"
    )


def test_a_server_log_keeps_warnings_unless_the_user_set_a_level(monkeypatch):
    """quiet_vllm sets VLLM_LOGGING_LEVEL for this process; the servers otbrl starts should not
    inherit that as if the user had asked for it."""
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(quiet, "_SET_HERE", {})
    quiet.quiet_vllm()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert quiet.user_env("VLLM_LOGGING_LEVEL") is None
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert quiet.user_env("VLLM_LOGGING_LEVEL") == "DEBUG"


def test_an_inherited_error_level_still_cuts_the_triton_line(monkeypatch):
    """Processes a launcher starts inherit its VLLM_LOGGING_LEVEL=ERROR: Triton's import-time
    line (logged before vLLM configures its loggers) is cut there too (it printed once per
    rank under otbrl train --nproc-per-node)."""
    import logging

    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    monkeypatch.setattr(quiet, "_SET_HERE", {})
    logger = logging.getLogger("vllm.triton_utils.importing")
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    quiet.quiet_vllm()
    assert logger.level == logging.ERROR
