"""The GPU check (`make gpu-check`): the CUDA paths' tests, then their timings, one JSON of figures.

    python benchmarks/gpu_check.py --out gpu-check.json            # on a GPU (≤ 8 min on an H200)
    python benchmarks/gpu_check.py --dry-run --out /tmp/check.json  # on a CPU: the wiring, tiny

Parts, each in its own process with its own time limit (a part that fails or times out is
recorded and the next one runs):

- ``tests``: ``pytest -m gpu tests/test_gpu.py`` (every CUDA path against an independent
  reference); figures: passed / failed / skipped counts.
- ``token_stats``: ``otbrl.ops.token_stats`` (the Triton kernels on CUDA) at T = 8192,
  V = 151 936 in bf16 and fp32: forward time, its bandwidth as a fraction of a device-to-device
  copy's (one read of the logits vs a read + a write), the backward's, and the forward's time
  over ``torch.log_softmax`` alone.
- ``fused_head``: ``fused_linear_token_stats`` forward + backward vs ``token_stats`` of the
  materialized logits (Qwen2.5-0.5B's head: H = 896), bf16: time ratio and the memory each
  allocates above its inputs (CUDA allocator peaks).
- ``rl_step``: one RL step (sampling + statistics + update), otbrl vs TRL's ``GRPOTrainer`` on the
  same random Qwen2.5-0.5B-shaped model, prompts and lengths, bf16 (``benchmarks/memory.py``'s
  arms): step time, tokens/s, peak memory.

Timings use CUDA events (``time.perf_counter`` on a CPU) after warm-up, medians of repeats.
``--dry-run`` runs on the CPU at tiny sizes: ``tests`` and ``rl_step`` are skipped with their
reason, the timing parts time the eager CPU ops; same JSON, same summary. The JSON:
``{"schema", "dry_run", "device", "torch", "wall_s", "parts": {name: {"status": "passed" |
"failed" | "skipped", "reason": str | None, "wall_s", "figures": {name: number | None}}},
"targets": [{"name", "figure", "op", "bound", "value", "met"}]}``. One summary line per part
and one per target is printed. The exit status is 1 when a part failed (targets are figures,
not failures).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATUSES = ("passed", "failed", "skipped")
PARTS = ("tests", "token_stats", "fused_head", "rl_step")
# per-part limits in seconds on a GPU: together 8 minutes
TIMEOUTS = {"tests": 150, "token_stats": 60, "fused_head": 60, "rl_step": 210}
DRY_TIMEOUT = 60
# (name, figure "part.key", op, bound): issue 31's targets, measured, not asserted
TARGETS = (
    ("statistics bandwidth bf16 >= 80 % of copy", "token_stats.bf16_copy_fraction", ">=", 0.8),
    ("statistics bandwidth fp32 >= 80 % of copy", "token_stats.fp32_copy_fraction", ">=", 0.8),
    ("fused head extra memory <= 10 % of materialized", "fused_head.memory_ratio", "<=", 0.1),
    ("fused head time <= 1.2x materialized", "fused_head.time_ratio", "<=", 1.2),
    ("otbrl RL step <= 0.7x TRL's", "rl_step.step_ratio", "<=", 0.7),
)


# What the GPU machine's Python (3.12) holds: the packages issue 31 lists, at its versions where
# it names them, and what those packages themselves need (at this environment's versions).
# ``--check-wheels`` resolves otbrl against these plus the wheel folder, offline.
DEVICE_PACKAGES = {"torch": "2.11.0", "transformers": "5.17.0", "triton": "3.6.0"}
DEVICE_ALSO = (
    "peft", "pytest", "hypothesis", "pyarrow", "matplotlib", "safetensors", "tqdm",
    # their own requirements (torch, transformers, peft, matplotlib)
    "numpy", "huggingface-hub", "tokenizers", "pyyaml", "packaging", "filelock", "jinja2",
    "fsspec", "psutil", "regex", "requests", "httpx", "typing-extensions",
)  # fmt: skip
# what `make gpu-check` installs from the wheel folder (the second line may fail: rl_step skips)
GPU_INSTALL = ("-e", ".", "pytest-timeout", "antlr4-python3-runtime==4.9.3")
GPU_INSTALL_TRL = ("-e", ".[trl]")


class Skip(Exception):
    """A part that cannot run here; its message is the reason."""


# -- timing helpers (run inside a part's process) --------------------------------------------


def _bench():
    """``benchmarks/token_stats.py``, whose timer (``median_seconds``: round-robin medians, CUDA
    events on a GPU) and lm_head problem and step these timings use."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "otbrl_bench_token_stats", ROOT / "benchmarks" / "token_stats.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extra_peak_gb(fn, device) -> float | None:
    """GB ``fn()`` allocates above what is allocated when it starts (CUDA allocator peak);
    None on a CPU, where no allocator peak of tensors alone exists."""
    import torch

    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 1e9


def _device(dry: bool):
    import torch

    if dry:
        torch.set_num_threads(1)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skip("needs CUDA (use --dry-run on a CPU)")
    return torch.device("cuda", torch.cuda.current_device())


# -- the parts -------------------------------------------------------------------------------


def part_token_stats(dry: bool) -> dict:
    """token_stats forward (and backward) at T × V in bf16 and fp32 -> figures per dtype:
    ``{dtype}_fwd_ms``, ``{dtype}_bwd_ms``, ``{dtype}_copy_fraction`` (forward bandwidth, one
    read of [T, V], over a copy's, a read + a write), ``{dtype}_bwd_copy_fraction`` (backward:
    a read and a write), ``{dtype}_vs_log_softmax`` (forward time over log_softmax's)."""
    import torch

    device = _device(dry)
    tokens, vocab = (64, 4096) if dry else (8192, 151_936)
    g = torch.Generator(device=device).manual_seed(0)
    figures = {"tokens": tokens, "vocab": vocab}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        logits = (torch.randn(tokens, vocab, generator=g, device=device) * 3).to(dtype)
        labels = torch.randint(0, vocab, (tokens,), generator=g, device=device)
        figures.update(_time_token_stats(name, logits, labels, device))
    return figures


def _time_token_stats(name: str, logits, labels, device) -> dict:
    """``part_token_stats``'s figures for one dtype: logits [T, V], labels [T]."""
    import torch

    from otbrl.ops import token_stats

    scratch = torch.empty_like(logits)
    nbytes = logits.numel() * logits.element_size()
    x = logits.detach().requires_grad_()
    stats = token_stats(x, labels)
    loss = stats.log_probs.sum() + stats.entropy.sum()
    fns = {
        "copy": lambda: scratch.copy_(logits),
        "fwd": lambda: token_stats(logits, labels),
        "soft": lambda: torch.log_softmax(logits, -1),
        "bwd": lambda: torch.autograd.grad(loss, x, retain_graph=True),
    }
    t = _bench().median_seconds(fns, repeats=10, warmup=3, device=device)
    copy_s, fwd_s, soft_s, bwd_s = t["copy"], t["fwd"], t["soft"], t["bwd"]
    copy_bw = 2 * nbytes / copy_s  # a read and a write
    return {
        f"{name}_copy_gbps": copy_bw / 1e9,
        f"{name}_fwd_ms": fwd_s * 1e3,
        f"{name}_bwd_ms": bwd_s * 1e3,
        f"{name}_log_softmax_ms": soft_s * 1e3,
        f"{name}_copy_fraction": (nbytes / fwd_s) / copy_bw,
        f"{name}_bwd_copy_fraction": (2 * nbytes / bwd_s) / copy_bw,
        f"{name}_vs_log_softmax": fwd_s / soft_s,
    }


def part_fused_head(dry: bool) -> dict:
    """Fused lm_head vs materialized logits, forward + backward (log-prob and entropy
    gradients to hidden [T, H] and weight [V, H]) -> ``fused_ms``, ``materialized_ms``,
    ``time_ratio`` (fused / materialized), ``fused_extra_gb`` / ``materialized_extra_gb``
    (allocated above the inputs; None on a CPU) and ``memory_ratio``."""
    import torch

    bench = _bench()
    device = _device(dry)
    tokens, hidden_size, vocab = (128, 64, 2048) if dry else (8192, 896, 151_936)
    dtype = torch.float32 if dry else torch.bfloat16  # bf16 is emulated on most CPUs
    problem = bench.lm_head_problem(tokens, vocab, hidden_size, dtype, device=device)
    fused = functools.partial(bench.lm_head_step, "fused", *problem)
    materialized = functools.partial(bench.lm_head_step, "materialized", *problem)
    t = bench.median_seconds(
        {"fused": fused, "materialized": materialized}, repeats=5, warmup=2, device=device
    )
    figures = {"tokens": tokens, "hidden": hidden_size, "vocab": vocab}
    figures["fused_ms"] = t["fused"] * 1e3
    figures["materialized_ms"] = t["materialized"] * 1e3
    figures["time_ratio"] = figures["fused_ms"] / figures["materialized_ms"]
    figures["fused_extra_gb"] = extra_peak_gb(fused, device)
    figures["materialized_extra_gb"] = extra_peak_gb(materialized, device)
    both = figures["fused_extra_gb"], figures["materialized_extra_gb"]
    figures["memory_ratio"] = None if None in both else both[0] / both[1]
    return figures


# benchmarks/memory.py's command line for the RL step: Qwen2.5-0.5B's shape and vocabulary
RL_STEP_ARGS = [
    "--shape", "0.5b", "--vocab", "151936", "--arms", "bf16-mixed",
    "--prompts", "8", "--samples", "8", "--prompt-tokens", "16", "--tokens", "256",
    "--steps", "3",
]  # fmt: skip


def part_rl_step(dry: bool) -> dict:
    """otbrl vs TRL, one RL step, through ``benchmarks/memory.py`` (each framework in its own
    process) -> ``{otbrl,trl}_step_s``, ``{otbrl,trl}_tokens_per_s``, ``{otbrl,trl}_peak_gb``,
    ``step_ratio`` (otbrl / TRL) and ``params``."""
    if dry:
        raise Skip("needs CUDA (benchmarks/memory.py compares otbrl and TRL on a CPU)")
    _device(dry)
    try:
        import trl  # noqa: F401
    except ImportError as err:
        why = f"TRL is not installed ({err}); otbrl alone: benchmarks/memory.py --no-trl"
        raise Skip(why) from None
    with tempfile.TemporaryDirectory(prefix="otbrl-gpu-rl-") as tmp:
        out = Path(tmp) / "rows.json"
        done = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "memory.py"), *RL_STEP_ARGS, "--json", out],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"benchmarks/memory.py failed: {done.stderr.strip()[-500:]}")
        table = json.loads(out.read_text())
    figures = {"params": table["params"]}
    for framework, key in (("otbrl", "otbrl/bf16-mixed"), ("trl", "TRL/bf16-mixed")):
        row = table["rows"][key]
        if "error" in row:
            raise RuntimeError(f"{key}: {row['error']}")
        for field in ("step_s", "tokens_per_s", "peak_gb"):
            figures[f"{framework}_{field}"] = row.get(field)
    figures["step_ratio"] = figures["otbrl_step_s"] / figures["trl_step_s"]
    return figures


PART_FUNCTIONS = {
    "token_stats": part_token_stats,
    "fused_head": part_fused_head,
    "rl_step": part_rl_step,
}


def run_tests_part(dry: bool, timeout_s: float) -> dict:
    """``pytest -m gpu tests/test_gpu.py`` in its own process; the counts from its JUnit XML
    (on a CPU every test skips: the part is skipped with pytest's reason)."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="otbrl-gpu-tests-") as tmp:
        xml = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={xml}", "tests/test_gpu.py"]
        done, wall = _child(cmd, timeout_s, start)
        if done is None:
            return _result("failed", f"timed out after {timeout_s:.0f} s", {}, timeout_s)
        if not xml.exists():
            return _result("failed", _last_line(done.stdout + done.stderr), {}, wall)
        counts, failures, skips = _junit(xml)
    if counts["failed"]:
        status, reason = "failed", "; ".join(failures[:3])
    elif counts["passed"] == 0:
        status, reason = "skipped", "; ".join(sorted(set(skips))[:3]) or "no test ran"
    else:
        status, reason = "passed", None
    return _result(status, reason, counts, wall)


def _child(
    cmd: list[str], timeout_s: float, start: float
) -> tuple[subprocess.CompletedProcess | None, float]:
    """``cmd`` run from the repository root within ``timeout_s`` (None when it ran past it, and
    was killed) and the seconds since ``start``."""
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        done = None
    return done, time.monotonic() - start


def _junit(xml: Path) -> tuple[dict, list[str], list[str]]:
    """Counts ``{passed, failed, skipped}`` and the failed tests' ``name: message`` and the skip
    messages of a pytest JUnit XML file."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failures, skips = [], []
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            message = (bad.get("message") or "").splitlines()
            failures.append(f"{case.get('name')}: {message[0][:200] if message else 'failed'}")
        elif skipped is not None:
            counts["skipped"] += 1
            skips.append(skipped.get("message") or "skipped")
        else:
            counts["passed"] += 1
    return counts, failures, skips


def _result(status: str, reason: str | None, figures: dict, wall_s: float) -> dict:
    return {"status": status, "reason": reason, "wall_s": round(wall_s, 2), "figures": figures}


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def run_part(name: str, dry: bool, timeout_s: float) -> dict:
    """Run part ``name`` in a child process (``--part``) within ``timeout_s``; its result."""
    if name == "tests":
        return run_tests_part(dry, timeout_s)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="otbrl-gpu-part-") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--part", name, "--result", str(result_file)]
        cmd += ["--dry-run"] if dry else []
        done, wall = _child(cmd, timeout_s, start)
        if done is None:
            return _result("failed", f"timed out after {timeout_s:.0f} s", {}, timeout_s)
        if not result_file.exists():
            return _result("failed", _last_line(done.stderr or done.stdout), {}, wall)
        result = json.loads(result_file.read_text())
    result["wall_s"] = round(wall, 2)
    return result


def child(name: str, dry: bool, result_file: Path) -> int:
    """The body of a part's process: its figures (or why it skipped or failed) to
    ``result_file``."""
    try:
        figures = PART_FUNCTIONS[name](dry)
    except Skip as why:
        result = _result("skipped", str(why), {}, 0.0)
    except Exception as err:
        traceback.print_exc()
        result = _result("failed", f"{type(err).__name__}: {err}"[:500], {}, 0.0)
    else:
        result = _result("passed", None, figures, 0.0)
    result_file.write_text(json.dumps(result))
    return 0


def evaluate_targets(parts: dict, dry: bool) -> list[dict]:
    """Each target's figure from the parts, and whether it met its bound (None: not
    measured, or a dry run's CPU figure, which no GPU target judges)."""
    out = []
    for name, figure, op, bound in TARGETS:
        part, key = figure.split(".")
        value = parts.get(part, {}).get("figures", {}).get(key)
        met = None if value is None or dry else (value >= bound if op == ">=" else value <= bound)
        out.append({"name": name, "figure": figure, "op": op, "bound": bound, "value": value})
        out[-1]["met"] = met
    return out


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def summary_lines(report: dict) -> list[str]:
    """One line per part (``part <name>: <status> ...``) and one per target
    (``target <name>: <value> met|missed|not measured``)."""
    lines = []
    for name in PARTS:
        part = report["parts"][name]
        f = part["figures"]
        line = f"part {name:<11} {part['status']:<7} ({part['wall_s']:.1f} s)"
        if part["status"] != "passed":
            line += f": {part['reason']}"
        elif name == "tests":
            line += f": {f['passed']} passed, {f['skipped']} skipped"
        elif name == "token_stats":
            line += "".join(
                f"; {d}: {f[f'{d}_copy_fraction']:.0%} of copy bandwidth, "
                f"{f[f'{d}_vs_log_softmax']:.2f}x log_softmax"
                for d in ("bf16", "fp32")
            )
        elif name == "fused_head":
            line += (
                f": time {f['time_ratio']:.2f}x materialized, "
                f"extra memory {_fmt(f['fused_extra_gb'])} vs {_fmt(f['materialized_extra_gb'])} GB"
            )
        elif name == "rl_step":
            line += (
                f": otbrl {f['otbrl_step_s']:.2f} s/step ({_fmt(f['otbrl_tokens_per_s'])} tok/s), "
                f"TRL {f['trl_step_s']:.2f} s/step ({_fmt(f['trl_tokens_per_s'])} tok/s), "
                f"ratio {f['step_ratio']:.2f}"
            )
        lines.append(line)
    for t in report["targets"]:
        verdict = {True: "met", False: "missed", None: "not measured"}[t["met"]]
        if report["dry_run"] and t["value"] is not None:
            verdict = "not judged (dry run: a CPU figure)"
        lines.append(
            f"target {t['name']}: {_fmt(t['value'])} (needs {t['op']} {t['bound']}) {verdict}"
        )
    return lines


def check_wheels(folder: Path, python: str) -> int:
    """Whether ``make gpu-check``'s installs resolve offline from ``folder`` on a Python like
    the GPU machine's: a throwaway venv of ``python`` (3.12) holding stand-ins of
    ``DEVICE_PACKAGES`` / ``DEVICE_ALSO`` (metadata only), then ``pip install --dry-run
    --no-index --find-links folder`` of ``GPU_INSTALL`` and ``GPU_INSTALL_TRL``, pip's own
    configuration ignored. Prints what each would install; 0 when both resolve."""
    from importlib import metadata

    versions = dict(DEVICE_PACKAGES)
    for name in DEVICE_ALSO:
        versions.setdefault(name, metadata.version(name))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no extra index, find-links or constraints
    with tempfile.TemporaryDirectory(prefix="otbrl-wheels-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        site = subprocess.run(
            [pip[0], "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        for name, version in versions.items():
            dist = Path(site) / f"{name.replace('-', '_')}-{version}.dist-info"
            dist.mkdir()
            (dist / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            )
            (dist / "INSTALLER").write_text("stand-in\n")
            (dist / "RECORD").write_text("")
        status = 0
        for request in (GPU_INSTALL, GPU_INSTALL_TRL):
            cmd = [*pip, "install", "--dry-run", "--no-index", "--find-links", str(folder)]
            cmd += ["--disable-pip-version-check", *request]
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            would = [x for x in done.stdout.splitlines() if x.startswith("Would install")]
            print(f"{' '.join(request)}: " + (would[0] if would else "nothing to install"))
            if done.returncode != 0:
                print(_last_line(done.stderr))
                status = 1
    print(f"wheels: {folder} {'resolves' if status == 0 else 'does NOT resolve'} offline")
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-check.json", help="the JSON of figures")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: the wiring")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated part names")
    parser.add_argument("--check-wheels", metavar="DIR", help="check a wheel folder, then exit")
    parser.add_argument("--python", default="python3.12", help="with --check-wheels")
    parser.add_argument("--part", choices=sorted(PART_FUNCTIONS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        return child(args.part, args.dry_run, Path(args.result))
    if args.check_wheels:
        return check_wheels(Path(args.check_wheels).resolve(), args.python)
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; expected some of {list(PARTS)}")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    start = time.monotonic()
    report = {
        "schema": 1,
        "dry_run": args.dry_run,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **_environment(),
        "parts": {},
    }
    for name in PARTS:
        if name not in parts:
            report["parts"][name] = _result("skipped", "not selected (--parts)", {}, 0.0)
            continue
        timeout = DRY_TIMEOUT if args.dry_run else TIMEOUTS[name]
        report["parts"][name] = run_part(name, args.dry_run, timeout)
        print(summary_lines_for(report, name), flush=True)
    report["wall_s"] = round(time.monotonic() - start, 2)
    report["targets"] = evaluate_targets(report["parts"], args.dry_run)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print("summary:")
    for line in summary_lines(report):
        print("  " + line)
    print(f"figures: {args.out} ({report['wall_s']:.0f} s)")
    return int(any(p["status"] == "failed" for p in report["parts"].values()))


def summary_lines_for(report: dict, name: str) -> str:
    """The progress line of one finished part."""
    part = report["parts"][name]
    return f"{name}: {part['status']} in {part['wall_s']:.1f} s" + (
        f" ({part['reason']})" if part["reason"] else ""
    )


def _environment() -> dict:
    """The device and versions the figures come from (a child process: this one imports no
    torch)."""
    code = (
        "import json, torch; cuda = torch.cuda.is_available(); "
        "print(json.dumps({'device': torch.cuda.get_device_name() if cuda else 'cpu', "
        "'torch': torch.__version__, 'cuda': torch.version.cuda}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return {"device": None, "torch": None, "cuda": None}
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(main())
