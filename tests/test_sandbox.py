"""The code sandbox: hostile programs end as failed test cases, counted, the trainer unharmed.

Small limits keep it quick: 1 s per test input, 1 CPU second, 256 MB.
"""

import ast
import os
import subprocess
import threading

import pytest

from otbrl.rewards import SandboxConfig, SandboxUnavailable, score_responses
from otbrl.rewards import sandbox as sandbox_mod
from otbrl.rewards.sandbox import FIRST_UID, run_program, sandbox_problem

pytestmark = pytest.mark.skipif(
    sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}"
)
LIMITS = SandboxConfig(cpu_s=1, wall_s=1, memory_mb=256, max_workers=2)
CASES = '{"inputs": ["1\\n"], "outputs": ["2\\n"]}'

HOSTILE = {
    "fork bomb": "import os\nwhile True:\n    os.fork()\n",
    "fork bomb past the audit hook": (
        "import ctypes\nlibc = ctypes.CDLL(None)\nwhile True:\n    libc.fork()\n"
    ),
    "infinite loop": "while True:\n    pass\n",
    "10 GB allocation": "x = bytearray(10 * 1024**3)\nprint(2)\n",
    "rm -rf ~": 'import os\nos.system("rm -rf ~")\nprint(2)\n',
    "socket connect": (
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)\nprint(2)\n"
    ),
}


def _code_row(cases=CASES):
    return {"data_source": "apps", "reward_model": {"ground_truth": cases}, "extra_info": {}}


def _leftover_processes() -> list[str]:
    """Processes still running as a sandbox uid."""
    out = subprocess.run(["ps", "-eo", "uid=,pid=,comm="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if int(line.split()[0]) >= FIRST_UID]


def test_hostile_programs_fail_and_are_counted(tmp_path):
    canary = tmp_path / "canary"
    canary.write_text("still here")
    responses = [f"```python\n{code}```" for code in HOSTILE.values()]
    scores, info = score_responses(
        responses, [_code_row()] * len(responses), sandbox=LIMITS, timeout_s=0
    )
    assert scores == [0.0] * len(HOSTILE), dict(zip(HOSTILE, scores))
    assert info["reward/sandbox_violations"] == len(HOSTILE)
    assert info["reward/errors"] == 0.0  # a hostile program is a failed case, not an error
    assert canary.read_text() == "still here" and not _leftover_processes()
    # the same sandbox still scores an honest program
    scores, info = score_responses(
        ["```python\nprint(int(input()) * 2)\n```"], [_code_row()], sandbox=LIMITS
    )
    assert scores == [1.0] and info["reward/sandbox_violations"] == 0.0


def test_the_operating_system_stops_what_the_audit_hook_does_not(tmp_path):
    """Through ctypes (no audit event): files outside its directory, the network, root, the
    host's file system."""
    target = tmp_path / "keep"
    target.mkdir()
    (target / "file").write_text("x")
    os.chmod(tmp_path, 0o755)  # let the sandbox see the directory: only the uid protects it
    code = f"""
import ctypes, os, socket
libc = ctypes.CDLL(None)
libc.system(b"rm -rf {target} 2>/dev/null; echo pwned > {target}/new 2>/dev/null")
print(sorted(os.listdir('/root')), os.getuid() != 0, os.getcwd())
print(sorted(name for _, name in socket.if_nameindex()))
open('/tmp/inside', 'w').write('tmpfs')
print(sorted(k for k in os.environ))
print(os.path.exists("{target}"), sorted(os.listdir("/")))
"""
    os.environ["OTBRL_TEST_SECRET"] = "do not leak"
    try:
        run = run_program(code, [""], config=LIMITS)
    finally:
        del os.environ["OTBRL_TEST_SECRET"]
    assert run.cases[0]["status"] == "ok", run
    first, interfaces, env, visible = run.cases[0]["output"].splitlines()
    root, not_root, cwd = first.rsplit(" ", 2)
    assert (target / "file").read_text() == "x" and not (target / "new").exists()
    assert root in ("[]", "['.pyenv']") and not_root == "True" and cwd == "/tmp/work"
    assert interfaces == "['lo']"  # a network namespace of its own
    assert "OTBRL_TEST_SECRET" not in env and not os.path.exists("/tmp/inside")
    # a root of its own: the trainer's files (this test's directory, /work) are not there
    exists, top = visible.split(" ", 1)
    assert exists == "False" and {"usr", "tmp", "proc", "dev"} <= set(ast.literal_eval(top))
    assert not {"home", "mnt", "opt", "srv", "var"} & set(ast.literal_eval(top))


def test_at_most_max_workers_runs_at_once(monkeypatch):
    active, peak, lock = [0], [0], threading.Lock()
    real = sandbox_mod._run

    def counting(*args, **kwargs):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(sandbox_mod, "_run", counting)
    code = "import time\ntime.sleep(0.3)\nprint(1)"
    threads = [
        threading.Thread(target=run_program, args=(code, [""]), kwargs={"config": LIMITS})
        for _ in range(5)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] == LIMITS.max_workers


def test_unsandboxed_runs_only_when_allowed(monkeypatch):
    monkeypatch.setattr(sandbox_mod, "sandbox_problem", lambda: "no user namespaces here")
    with pytest.raises(SandboxUnavailable, match=r"no user namespaces.*allow_unsandboxed=true"):
        run_program("print(1)", [""], config=LIMITS)
    allowed = SandboxConfig(wall_s=2, allow_unsandboxed=True)
    run = run_program("import os\nprint(os.environ['HOME'] != '/root')", [""], config=allowed)
    assert run.cases == [{"status": "ok", "output": "True\n"}]
    # the audit hook still refuses to start processes
    run = run_program("import os\nos.system('true')", [""], config=allowed)
    assert run.cases[0]["status"] == "error" and "os.system" in run.violations


@pytest.mark.parametrize(
    ("written", "violation"),
    [
        (b'{"setup_error": "forged"}', "setup"),  # raised SandboxUnavailable on main
        (b"[]", "bad_reply"),  # AttributeError on main
        (b'{"cases": [1], "violations": []}', "bad_reply"),  # AttributeError when scored
        (b"[" * 100_000, "killed"),  # RecursionError on main
    ],
    ids=["setup_error", "a list", "bad cases", "deep nesting"],
)
def test_a_forged_reply_is_the_samples_failure_never_the_runs(written, violation):
    """The program under test writes the harness's reply channel (its fd 3) and leaves before
    the harness can answer: whatever it wrote fails that sample alone."""
    program = f"import os\nos.write(3, {written!r})\nos._exit(0)\n"
    run = run_program(program, [""], config=LIMITS)
    assert run.cases == [] and violation in run.violations and run.error
    row = _code_row()
    scores, _ = score_responses([f"```python\n{program}```"], [row], on_error="raise")
    assert scores == [0.0]
