"""Every shell and Python block of README.md and docs/*.md runs as written, so the docs cannot
rot (a block the docs mark ``<!-- docs-test: skip REASON -->`` is not run, and
``<!-- docs-test: check REASON -->`` only checks its configuration and flags; each says why).

How "as written" is kept honest and cheap:
- Commands run in a scratch directory that links ``examples/`` and ``.venv/`` (this venv), so
  relative paths mean what they mean from the repository root, and nothing is written there.
- A hub id (``Qwen/Qwen2.5-0.5B-Instruct``) resolves through a local Hugging Face cache made
  here (``HF_HUB_CACHE``, offline) that holds a tiny user-style stand-in model under that id —
  exactly the lookup a user with the real model in their cache gets.
- ``otbrl train|demo|eval`` run in-process with their arguments unchanged plus a budget
  (``BUDGET``: one step, a few validation prompts, a short warm start), appended last so it
  wins; ``otbrl variance`` gets a few repeats. Blocks marked ``check`` (the measurements that
  take 20 minutes, servers, several processes) are parsed by the CLI and validated as the
  command would, without training — and each names, as ``tests/FILE.py::test_name``, the test
  that runs the same command line, or says why it cannot run here (other hosts, a GPU, more
  processes than this machine has cores): ``test_every_checked_block_names_the_test_that_runs_it``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from otbrl import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"
MARK = re.compile(r"<!--\s*docs-test:\s*(skip|check)\s+(.+?)\s*-->")
BUDGET = {
    "train": ["trainer.total_steps=1", "trainer.val_every=1", "data.val_size=4"],
    "demo": ["trainer.total_steps=1", "trainer.val_every=1", "data.val_size=4"],
    "eval": ["data.val_size=4"],
    "variance": ["--repeats", "2", "--reference-samples", "8", "--prompts", "2"],
}
WARM_START = ["sft.max_steps=10", "sft.eval_every=10"]


def blocks() -> list[tuple[str, str, str, str | None, str | None]]:
    """(id "file:line", language, code, mark, reason) of every bash / python block."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = re.match(r"^```(\w+)\s*$", lines[i])
            if not fence:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            lang = fence.group(1)
            if lang in ("bash", "sh", "python"):
                before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                mark = MARK.search(before)
                out.append(
                    (
                        f"{path.relative_to(ROOT)}:{i + 1}",
                        lang,
                        "\n".join(lines[i + 1 : end]),
                        mark.group(1) if mark else None,
                        mark.group(2) if mark else None,
                    )
                )
            i = end + 1
    return out


def commands(code: str) -> list[list[str]]:
    """The shell commands of a block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [args for line in joined.splitlines() if (args := shlex.split(line, comments=True))]


@pytest.fixture(scope="module")
def place(tmp_path_factory):
    """The scratch directory commands run in, the stand-in's HF cache, the warm-start cache."""
    from user_model import TOOLS_CHATML, build_user_style_model

    root = tmp_path_factory.mktemp("docs")
    work = root / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    (work / ".venv").symlink_to(Path(sys.prefix))
    cache = root / "hf"
    snapshot = cache / f"models--{HUB_ID.replace('/', '--')}" / "snapshots" / ("0" * 40)
    build_user_style_model(snapshot, max_positions=2048, chat_template=TOOLS_CHATML)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    return {"work": work, "hf": cache, "sft": root / "sft"}


@pytest.fixture
def env(place, monkeypatch):
    monkeypatch.chdir(place["work"])
    from huggingface_hub import constants

    # the environment for the child processes; huggingface_hub read it at import, so this
    # process's copy is set too
    monkeypatch.setenv("HF_HUB_CACHE", str(place["hf"]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(place["hf"]))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return place


def _otbrl(args: list[str], mark: str | None, place) -> None:
    command, rest = args[0], args[1:]
    if mark == "check":
        return _check(command, rest)
    extra = BUDGET.get(command, [])
    if command in ("train", "demo", "eval", "variance"):
        config_args = [f"sft.cache_dir={place['sft']}", *WARM_START]
        extra = [*extra, *config_args] if command != "variance" else [*config_args, *extra]
    code = cli.main([command, *rest, *extra])
    assert code == 0, f"otbrl {shlex.join(args)} exited {code}"


def _check(command: str, rest: list[str], world_size: int = 1) -> None:
    """Parse the command line with the CLI's own parser and validate its configuration as the
    command would (for ``world_size`` processes), without training."""
    from otbrl.config import load_config
    from otbrl.run.plan import plan_run

    if command == "compare":
        from otbrl.research.compare import build_parser

        ns = build_parser().parse_intermixed_args(rest)  # as compare.main parses
    else:
        ns = cli._build_parser().parse_args([command, *rest])
        world_size = max(world_size, getattr(ns, "nproc_per_node", 1))  # otbrl's own launcher
    plan_run(load_config(ns.config, ns.overrides), world_size=world_size)


def _torchrun(args: list[str]) -> None:
    """``torchrun [flags] -m otbrl COMMAND ...``: checked for nnodes x nproc_per_node ranks."""
    flags, module = args[: args.index("-m")], args[args.index("-m") + 1 :]
    assert module[0] == "otbrl", f"torchrun of {module[0]!r}: not an otbrl command"
    sizes = {"--nproc_per_node": 1, "--nnodes": 1}
    for flag in flags:
        name, _, value = flag.partition("=")
        if name in sizes:
            sizes[name] = int(value)
    _check(module[1], module[2:], sizes["--nproc_per_node"] * sizes["--nnodes"])


def _run_shell(args: list[str], mark: str | None, place) -> None:
    if args[0] == "time":
        args = args[1:]
    program = Path(args[0]).name
    if program == "otbrl":
        return _otbrl(args[1:], mark, place)
    if mark == "check" and program == "torchrun":
        return _torchrun(args[1:])
    if mark == "check" and program in ("make", "pip"):
        return None  # they change the environment: the block's marker says so
    if program == "python" or program.startswith("python3"):
        done = subprocess.run([sys.executable, *args[1:]], capture_output=True, text=True)
        assert done.returncode == 0, f"{shlex.join(args)}: {done.stderr[-2000:]}"
        return None
    raise AssertionError(
        f"{shlex.join(args)}: no way to run {program!r} in the docs test; mark the block "
        "<!-- docs-test: skip REASON --> if it cannot run here"
    )


def _imports_only(code: str) -> str:
    """The import statements of a Python block (what a ``check`` runs)."""
    import ast

    tree = ast.parse(code)
    return "\n".join(
        ast.unparse(node) for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom)
    )


BLOCKS = blocks()


@pytest.mark.parametrize(
    ("where", "lang", "code", "mark", "reason"), BLOCKS, ids=[b[0] for b in BLOCKS]
)
def test_documented_block_runs(where, lang, code, mark, reason, env):
    if mark == "skip":
        assert len(reason) > 10, f"{where}: say why the block cannot run here"
        pytest.skip(reason)
    if lang == "python":
        program = _imports_only(code) if mark == "check" else code
        done = subprocess.run(
            [sys.executable, "-c", program], capture_output=True, text=True, env=dict(os.environ)
        )
        assert done.returncode == 0, f"{where}: {done.stderr[-3000:]}"
        return
    assert mark != "check" or reason, f"{where}: say why the block is only checked"
    for args in commands(code):
        _run_shell(args, mark, env)


TEST_REF = re.compile(r"tests/(\w+\.py)::(\w+)")


def test_every_checked_block_names_the_test_that_runs_it():
    """A ``check`` block is only parsed here: the command a user runs must run somewhere. Its
    reason names the test that runs the same command line (which must exist), or says that it
    "cannot run here" and why."""
    for where, _, _, mark, reason in BLOCKS:
        if mark != "check":
            continue
        refs = TEST_REF.findall(reason)
        assert refs or "cannot run here" in reason, (
            f"{where}: name the test that runs this block (tests/FILE.py::test_name) or say why "
            "it cannot run here"
        )
        for file, name in refs:
            path = ROOT / "tests" / file
            assert path.is_file(), f"{where}: {file} does not exist"
            assert re.search(rf"^def {name}\(", path.read_text(), re.M), (
                f"{where}: {file} has no test {name}"
            )


def test_the_block_finder_sees_every_block():
    """The parser finds the blocks a reader sees (a miscount would skip docs silently)."""
    found = blocks()
    for path in DOCS:
        text = path.read_text()
        fences = len(re.findall(r"^```(?:bash|sh|python)\s*$", text, flags=re.M))
        assert sum(b[0].startswith(str(path.relative_to(ROOT)) + ":") for b in found) == fences
    assert commands("a \\\n  b # c\n\n# d\ne 'f g'") == [["a", "b"], ["e", "f g"]]
