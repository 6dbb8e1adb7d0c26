"""benchmarks/gpu_check.py's CPU dry run (`make gpu-check`'s wiring on every commit): one JSON
with every part and target, valid statuses, numeric figures where a part passed, the CUDA-only
parts skipped with a reason, and one summary line per part and per target."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _load_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_every_part_and_its_summary(tmp_path):
    gc = _load_script()  # its tables: the names the JSON must hold
    out = tmp_path / "check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        cwd=tmp_path,  # the script finds the repository itself
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert list(report["parts"]) == list(gc.PARTS)
    for name, part in report["parts"].items():
        assert part["status"] in gc.STATUSES, name
        assert isinstance(part["wall_s"], float | int) and part["wall_s"] >= 0
        figures = part["figures"]
        assert all(v is None or isinstance(v, int | float) for v in figures.values()), name
        if part["status"] == "passed":
            assert part["reason"] is None
            numbers = [v for v in figures.values() if v is not None]
            assert numbers and all(math.isfinite(v) and v >= 0 for v in numbers), name
        else:
            assert isinstance(part["reason"], str) and part["reason"], name
    # the CUDA-only parts skip on a CPU, with why; the timing parts time the CPU ops
    assert report["parts"]["tests"]["status"] == "skipped"
    assert "CUDA" in report["parts"]["tests"]["reason"]
    assert report["parts"]["tests"]["figures"]["skipped"] > 0  # pytest ran, every test skipped
    assert report["parts"]["rl_step"]["status"] == "skipped"
    assert "CUDA" in report["parts"]["rl_step"]["reason"]
    for name in ("token_stats", "fused_head"):
        assert report["parts"][name]["status"] == "passed", report["parts"][name]["reason"]
    stats = report["parts"]["token_stats"]["figures"]
    for dtype in ("bf16", "fp32"):
        assert stats[f"{dtype}_copy_fraction"] > 0 and stats[f"{dtype}_vs_log_softmax"] > 0
    fused = report["parts"]["fused_head"]["figures"]
    assert fused["time_ratio"] == fused["fused_ms"] / fused["materialized_ms"]
    assert fused["memory_ratio"] is None  # no allocator peak on a CPU
    # every target is reported, none judged on a CPU's figures
    assert [t["figure"] for t in report["targets"]] == [t[1] for t in gc.TARGETS]
    assert all(t["met"] is None for t in report["targets"])
    # the summary: one line per part, then one per target
    summary = done.stdout.split("summary:\n", 1)[1].splitlines()
    parts = [x.strip() for x in summary if x.strip().startswith("part ")]
    targets = [x.strip() for x in summary if x.strip().startswith("target ")]
    assert [x.split()[1] for x in parts] == list(gc.PARTS)
    for line, part in zip(parts, report["parts"].values()):
        assert line.split()[2] == part["status"], line
    assert len(targets) == len(gc.TARGETS)
    assert all(t[0] in line for t, line in zip(gc.TARGETS, targets))
