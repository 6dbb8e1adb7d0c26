"""Did a refactor change what a step computes? The demo's first steps, bit for bit, against a
base commit run side by side on this machine.

    python benchmarks/regression.py                    # the working tree against HEAD
    python benchmarks/regression.py --base main --task arithmetic,chain_sum

The base commit is checked out in a temporary ``git worktree``; each tree runs the same short
demo runs (the demo's preset, a cut-short warm start, a few RL steps: ``RUNS``) in its own
process, with its own ``src`` first on ``PYTHONPATH``, on this machine, with the same thread
count. Every logged metric but wall-clock ones (timing, throughput, memory) must be equal bit
for bit: a refactor that only moves code leaves them so. Bit-exact equality holds on one
machine, one thread count and one library build — which is why this compares two trees in one
run here and is a developer tool, not a test (``tests/test_demo_regression.py`` checks what
holds on any machine: the metric names of every step and their ranges).

Prints one line per differing metric and a summary line; exits 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTIAL_REWARD = ROOT / "tests" / "data" / "partial_reward.py"
# the demo's preset and defaults (32 prompts x 8 samples, 2 optimizer steps per RL step) with a
# warm start cut short (60 steps, one evaluation) and a short validation, so both phases stay
# seconds long; the tool task with a dense reward (tests/data/partial_reward.py), which gives
# its updates a gradient where the cut-short warm start rarely gets a product right
RUNS = {
    "arithmetic": [
        "trainer.total_steps=10",
        "trainer.val_every=5",
        "data.val_size=64",
        "sft.max_steps=60",
        "sft.eval_every=60",
    ],
    # the tool task through its preset: the agent loop, holes in the mask, TIR-OTB
    "tool_arithmetic": [
        "data.task=tool_arithmetic",
        "trainer.total_steps=4",
        "trainer.val_every=2",
        "data.val_size=32",
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=8",
        "sft.max_steps=60",
        "sft.eval_every=60",
        f"reward.function={PARTIAL_REWARD}:digits_in_place",
    ],
    # the long-response task (136 tokens): padded micro-batches cut to their own widths
    "chain_sum": [
        "data.task=chain_sum",
        "trainer.total_steps=3",
        "trainer.val_every=3",
        "data.val_size=16",
        "data.train_batch_size=8",
        "actor.ppo_mini_batch_size=4",
        "sft.max_steps=30",
        "sft.eval_every=30",
    ],
}
WALL_CLOCK = ("timing/", "throughput/", "memory/")


def demo_argv(task: str, out: Path, cache: Path) -> list[str]:
    """``otbrl train`` arguments of the short demo run ``task`` writing to ``out``."""
    from otbrl.cli import DEMO_PRESET

    preset = [
        o for o in DEMO_PRESET if not o.startswith(("trainer.output_dir", "trainer.max_wall"))
    ]
    return [
        "train",
        *preset,
        *RUNS[task],
        f"trainer.output_dir={out}",
        f"sft.cache_dir={cache}",
        "trainer.logger=[jsonl]",
    ]


def read_metrics(out: Path) -> dict[str, dict[str, float]]:
    """{step: {metric: value}} of a run's metrics.jsonl, wall-clock metrics left out."""
    steps: dict[str, dict[str, float]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = str(row.pop("step"))
        kept = {k: v for k, v in row.items() if not k.startswith(WALL_CLOCK) and k != "time"}
        steps.setdefault(step, {}).update(kept)
    return steps


def differences(base: dict, new: dict) -> list[str]:
    """One line per step or metric that is not equal bit for bit (NaN equals NaN)."""
    lines = []
    for step in sorted(set(base) | set(new), key=int):
        if step not in new or step not in base:
            lines.append(f"step {step}: only in {'base' if step in base else 'new'}")
            continue
        for key in sorted(set(base[step]) | set(new[step])):
            a, b = base[step].get(key), new[step].get(key)
            both_nan = (
                isinstance(a, float) and isinstance(b, float) and math.isnan(a) and (math.isnan(b))
            )
            if a != b and not both_nan:
                lines.append(f"step {step} {key}: base {a!r} new {b!r}")
    return lines


def _run_tree(tree: Path, task: str, work: Path, threads: int) -> dict:
    out, cache = work / task, work / "cache"
    code = (
        "import sys, json, torch\n"
        f"torch.set_num_threads({threads})\n"
        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
        "from regression import demo_argv\n"
        "from pathlib import Path\n"
        "from otbrl.cli import main\n"
        "raise SystemExit(main(demo_argv(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(
        [sys.executable, "-c", code, task, str(out), str(cache)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree}: the {task} run failed:\n{done.stderr[-3000:]}")
    return read_metrics(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="HEAD", help="the commit to compare with (HEAD)")
    parser.add_argument(
        "--task", default="arithmetic,tool_arithmetic,chain_sum", help="comma-separated"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    tasks = args.task.split(",")
    unknown = sorted(set(tasks) - set(RUNS))
    if unknown:
        parser.error(f"--task: unknown {unknown}; expected some of {sorted(RUNS)}")
    with tempfile.TemporaryDirectory(prefix="otbrl-regression-") as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(base_tree), args.base],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        try:
            total, lines = 0, []
            for task in tasks:
                base = _run_tree(base_tree, task, Path(tmp) / "base-runs", args.threads)
                new = _run_tree(ROOT, task, Path(tmp) / "new-runs", args.threads)
                total += sum(len(m) for m in base.values())
                lines += [f"{task}: {line}" for line in differences(base, new)]
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT, check=False
            )
    print("\n".join(lines) or "no metric differs")
    print(f"summary: {total - len(lines)} of {total} metrics of {args.base} equal bit for bit")
    return 1 if lines else 0


if __name__ == "__main__":
    raise SystemExit(main())
