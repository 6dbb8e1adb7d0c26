"""The code sandbox: hostile programs end as failed test cases, counted, the trainer unharmed.

Small limits keep it quick: 1 s per test input, 1 CPU second, 256 MB. Run as root, the tests
also run the sandbox's own tests as an unprivileged user (``test_as_an_unprivileged_user``):
sandboxed both ways.
"""

import ast
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

from otbrl.rewards import SandboxConfig, SandboxUnavailable, score_responses
from otbrl.rewards import sandbox as sandbox_mod
from otbrl.rewards.cgroup import tree_caps
from otbrl.rewards.sandbox import mode, run_program, sandbox_problem

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
    """Sandbox processes still running (a forked program keeps the harness's command line)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "sandbox_harness" in line]


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
status = dict(line.split(":\t", 1) for line in open('/proc/self/status').read().splitlines())
caps = [int(status[k].strip(), 16) for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb")]
print(sorted(os.listdir('/root')), os.getuid() != 0 or not any(caps), os.getcwd())
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
    monkeypatch.setattr(sandbox_mod, "_probe", lambda: (None, "no user namespaces here"))
    with pytest.raises(SandboxUnavailable, match=r"no user namespaces.*allow_unsandboxed=true"):
        run_program("print(1)", [""], config=LIMITS)
    allowed = SandboxConfig(wall_s=2, memory_mb=256, allow_unsandboxed=True)
    run = run_program("import os\nprint(os.environ['HOME'] != '/root')", [""], config=allowed)
    assert run.cases == [{"status": "ok", "output": "True\n"}]
    # the resource limits still hold: 1 GB under memory_mb=256 is a MemoryError
    run = run_program("x = bytearray(1 << 30)\nprint(2)", [""], config=allowed)
    assert run.cases[0]["status"] == "error" and "memory" in run.violations, run
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


def test_limits_hold_over_the_whole_run(tmp_path):
    """Finding 4: System V shared memory dies with the run (an IPC namespace), ``/dev`` holds
    only harmless devices, and the host name is the sandbox's own."""
    program = """
import ctypes, os, socket
libc = ctypes.CDLL(None)
ids = [libc.shmget(0x07B0 + i, 32 << 20, 0o1600) for i in range(3)]  # IPC_CREAT | 0600
print(all(i >= 0 for i in ids), sorted(os.listdir('/dev')))
print(os.uname().nodename == socket.gethostname(), open('/dev/null', 'w').write('x'))
"""
    before = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    run = run_program(program, [""], config=LIMITS)
    assert run.cases[0]["status"] == "ok", run
    made, dev = run.cases[0]["output"].splitlines()[0].split(" ", 1)
    assert made == "True"  # the segments were made, then went with the namespace
    assert Path("/proc/sysvipc/shm").read_text().splitlines()[1:] == before
    assert set(ast.literal_eval(dev)) == {
        "fd",
        "full",
        "null",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "urandom",
        "zero",
    }


@pytest.mark.skipif(not isinstance(tree_caps(), tuple), reason=f"{tree_caps()}")
def test_memory_is_capped_over_the_process_tree():
    """Finding 4: three processes holding 200 MB each under ``memory_mb=256`` — each within its
    own address-space limit — are stopped together by the run's cgroup."""
    config = SandboxConfig(cpu_s=5, wall_s=5, memory_mb=256, max_workers=1)
    program = """
import ctypes, time
libc = ctypes.CDLL(None)
for _ in range(2):
    if libc.fork() == 0:
        break
block = bytearray(200 << 20)
block[::4096] = b"x" * len(block[::4096])
time.sleep(1)
print("held")
"""
    run = run_program(program, [""], config=config)
    assert "memory" in run.violations, run  # the kernel killed one of them (the cgroup's OOM)
    # one process of the same size is within the cap
    run = run_program(program.replace("range(2)", "range(0)"), [""], config=config)
    assert run.cases == [{"status": "ok", "output": "held\n"}], run
    assert not _leftover_processes()


def test_uid_blocks_are_claimed_never_shared(tmp_path):
    """Finding 4: two live processes whose pids agree modulo the block count get different
    uid blocks (the lock of the first is held until it ends)."""
    if mode() != "root":
        pytest.skip("uid blocks are for root mode; a user namespace needs none")
    claim = (
        "import sys, time; from otbrl.rewards import sandbox as s; "
        "print(s._claim_uid_block(7), flush=True); time.sleep(30)"
    )
    first = subprocess.Popen([sys.executable, "-c", claim], stdout=subprocess.PIPE, text=True)
    try:
        held = int(first.stdout.readline())
        second = subprocess.run(
            [sys.executable, "-c", claim.replace("time.sleep(30)", "pass")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        # (block 7 itself, unless a process of this session holds it)
        assert held != int(second.stdout) and (held - sandbox_mod.FIRST_UID) % 64 == 0
    finally:
        first.kill()
        first.wait()
    again = subprocess.run(
        [sys.executable, "-c", claim.replace("time.sleep(30)", "pass")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert int(again.stdout) == held  # released with the process that held it


UNPRIVILEGED = 65534


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as an unprivileged user: needs root to switch")
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_as_an_unprivileged_user():
    """The sandbox's tests again, as uid 65534: the sandbox is made in a user namespace and
    holds the same. An interpreter under a home directory others cannot enter (pyenv in
    ``/root``) is made reachable in a private mount namespace of the test's own."""
    # pytest's folder is root-only, and so may be TMPDIR (make test's scratch folder is)
    tmp_path = Path(tempfile.mkdtemp(prefix="otbrl-unprivileged-", dir=_enterable_tmp()))
    try:
        os.chmod(tmp_path, 0o777)
        _run_as_unprivileged(tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _enterable_tmp() -> str:
    """A temporary folder that other users may enter: TMPDIR's when every folder on its way
    lets them, else /var/tmp or /tmp (world-writable by convention)."""
    for folder in (tempfile.gettempdir(), "/var/tmp", "/tmp"):
        path = Path(folder).resolve()
        if path.is_dir() and all(os.stat(a).st_mode & 0o001 for a in (path, *path.parents)):
            return str(path)
    return tempfile.gettempdir()


def _reveal(paths: list[Path], stash: Path) -> str:
    """Shell commands that, run as root in a private mount namespace, let other users reach
    ``paths`` (an interpreter in ``/root/.pyenv``, a clone in a ``mkdtemp`` folder): each
    ancestor others may not enter is covered by a 0755 tmpfs that holds only the entries on
    the way, bound from the original. Nothing outside that namespace changes."""
    ways: dict[Path, set[str]] = {}
    for path in paths:
        for parent, child in zip(path.parents, [path, *path.parents]):
            if not os.stat(parent).st_mode & 0o001:
                ways.setdefault(parent, set()).add(child.name)
    lines = []
    for i, parent in enumerate(sorted(ways, key=lambda p: len(p.parts))):
        keep = stash / str(i)
        keep.mkdir(parents=True)
        lines.append(f"mount --bind '{parent}' '{keep}' && "
                     f"mount -t tmpfs -o mode=755 tmpfs '{parent}' && ")  # fmt: skip
        for name in sorted(ways[parent]):
            lines.append(
                f"mkdir '{parent}/{name}' && mount --bind '{keep}/{name}' '{parent}/{name}' && "
            )
    return "".join(lines)


def _run_as_unprivileged(tmp_path: Path) -> None:
    tests = [
        "test_hostile_programs_fail_and_are_counted",
        "test_the_operating_system_stops_what_the_audit_hook_does_not",
        "test_limits_hold_over_the_whole_run",
        "test_a_forged_reply_is_the_samples_failure_never_the_runs",
        "test_a_user_namespace_is_what_a_normal_user_gets",
        "test_a_child_that_leaves_the_session_still_ends_with_the_run",
    ]
    pytest_args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        f"--basetemp={tmp_path / 'base'}",
        __file__,
        "-k",
        " or ".join(tests),
    ]
    drop = [
        "setpriv",
        f"--reuid={UNPRIVILEGED}",
        f"--regid={UNPRIVILEGED}",
        "--clear-groups",
        "env",
        f"HOME={tmp_path}",
        "PYTHONDONTWRITEBYTECODE=1",
        "OTBRL_EXPECT_SANDBOX=userns",
    ]
    repo = Path(__file__).resolve().parent.parent
    needed = [Path(os.path.realpath(sys.base_prefix)), Path(sys.prefix).resolve(), repo]
    mounts = _reveal(needed, tmp_path / "stash")
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
               mounts + 'exec "$@"', "sh", *drop, *pytest_args]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=repo)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr
    assert "skipped" not in done.stdout.splitlines()[-1], done.stdout[-3000:]


def test_a_user_namespace_is_what_a_normal_user_gets():
    """Run by ``test_as_an_unprivileged_user``: there the sandbox must be the user-namespace
    one (not the unsandboxed fallback); as root here, the root one."""
    expected = os.environ.get("OTBRL_EXPECT_SANDBOX", "root" if os.geteuid() == 0 else "userns")
    assert mode() == expected and sandbox_problem() is None


def test_a_child_that_leaves_the_session_still_ends_with_the_run():
    """Finding 3: a child that calls ``setsid()`` escapes a process-group kill, not the PID
    namespace: it is gone when the run returns."""
    program = """
import ctypes, time
libc = ctypes.CDLL(None)
if libc.fork() == 0:
    libc.setsid()
    time.sleep(120)
print(3)
"""
    run = run_program(program, [""], config=LIMITS)
    assert run.cases == [{"status": "ok", "output": "3\n"}], run
    assert not _leftover_processes()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root")
def test_root_without_cap_sys_admin_gets_the_user_namespace():
    """Finding 3: root in a default container (no ``CAP_SYS_ADMIN``) cannot make the
    namespaces itself; it gets the user-namespace sandbox, not a refusal."""
    probe = (
        "from otbrl.rewards import sandbox as s; from otbrl.rewards.sandbox import SandboxConfig;"
        "r = s.run_program('print(7)', [''], config=SandboxConfig(wall_s=5)); "
        "print(s.mode(), r.cases[0]['output'].strip())"
    )
    done = subprocess.run(
        [
            "setpriv",
            "--bounding-set",
            "-sys_admin",
            "--inh-caps",
            "-sys_admin",
            sys.executable,
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.split() == ["userns", "7"], done.stdout + done.stderr
