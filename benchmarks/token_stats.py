"""Benchmark: per-token statistics (log π(y), entropy, Σπ²) side by side on this machine.

Times, in one process, warm, median of --repeats runs:
  log_softmax      torch.log_softmax alone (the floor: it writes a full [T, V] output)
  separate         the usual separate passes: log_softmax + gather for log π(y),
                   softmax and logsumexp for entropy, exp(lse(2z) − 2 lse(z)) for Σπ²
  token_stats      otbrl.ops.token_stats (one chunked pass)
and, forward + backward through an lm_head of [V, H]:
  materialized     logits = hidden @ weight.T, then token_stats
  fused            otbrl.ops.fused_linear_token_stats
Peak extra memory of the last two (beyond inputs and their gradients) is measured in a fresh
subprocess each: reset the peak-RSS mark (/proc/self/clear_refs), run, read VmHWM.

Last line: token_stats/log_softmax, separate/token_stats, fused_mem/materialized_mem ratios.
Run: python benchmarks/token_stats.py [--tokens 2048 --vocab 32768 --dtype float32]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from otbrl.ops import fused_linear_token_stats, token_stats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def median_seconds(fns: dict, repeats: int, warmup: int = 2, device=None) -> dict:
    """Median time of each callable, run round-robin so that load drift hits all alike: wall
    time, or CUDA events when ``device`` is a CUDA device (the work it queued, timed on it)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / 1e3)
            else:
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def separate_passes(logits, labels):
    """The field's usual code: one full-size pass (or more) per statistic."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    log_probs = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    probs = torch.softmax(logits.float(), dim=-1)
    lse = torch.logsumexp(logits.float(), dim=-1)
    entropy = lse - (probs * logits.float()).sum(-1)
    spp = torch.exp(torch.logsumexp(2 * logits.float(), dim=-1) - 2 * lse)
    return log_probs, entropy, spp


def lm_head_problem(tokens, vocab, hidden_size, dtype, seed=0, device="cpu"):
    """hidden [T, H], weight [V, H] (both ``dtype``, requiring grad) and labels [T] on
    ``device``, the same values on every device (drawn on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    return hidden, weight.requires_grad_(), labels


def lm_head_step(kind, hidden, weight, labels):
    """Forward + backward of Σ log π(y) + Σ H through the lm_head, fused or materialized."""
    if kind == "fused":
        stats = fused_linear_token_stats(hidden, weight, labels)
    else:
        stats = token_stats(hidden @ weight.T, labels)
    (stats.log_probs.sum() + stats.entropy.sum()).backward()
    hidden.grad = weight.grad = None


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_probe(kind: str, args) -> dict:
    """Run in a fresh process: peak RSS of one lm_head step above inputs and their grads."""
    dtype = DTYPES[args.dtype]
    # Warm up kernels, thread pools and the allocator on a tiny problem first.
    lm_head_step(kind, *lm_head_problem(64, 512, 64, dtype))
    hidden, weight, labels = lm_head_problem(args.fused_tokens, args.vocab, args.hidden, dtype)
    grads_bytes = (hidden.numel() + weight.numel()) * hidden.element_size()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS is what is live
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = rss_bytes("VmRSS")
    start = time.perf_counter()
    lm_head_step(kind, hidden, weight, labels)
    seconds = time.perf_counter() - start
    extra = rss_bytes("VmHWM") - base - grads_bytes
    return {"extra_bytes": extra, "seconds": seconds}


def run_probe(kind: str, args) -> dict:
    cmd = [sys.executable, __file__, "--probe", kind, "--vocab", str(args.vocab)]
    cmd += ["--hidden", str(args.hidden), "--fused-tokens", str(args.fused_tokens)]
    cmd += ["--dtype", args.dtype, "--threads", str(torch.get_num_threads())]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fused-tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--fused-repeats", type=int, default=3)
    parser.add_argument("--skip-fused", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--probe", choices=["fused", "materialized"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe:
        print(json.dumps(memory_probe(args.probe, args)))
        return

    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    fns = {
        "log_softmax": lambda: torch.log_softmax(logits, -1),
        "separate": lambda: separate_passes(logits, labels),
        "token_stats": lambda: token_stats(logits, labels),
    }
    with torch.no_grad():
        med = median_seconds(fns, args.repeats)
    rows = list(med.items())
    t_floor, t_sep, t_ours = med["log_softmax"], med["separate"], med["token_stats"]
    shape = f"T={args.tokens} V={args.vocab} {args.dtype}, {torch.get_num_threads()} threads"
    load = os.getloadavg()[0]
    print(f"per-token stats, forward, {shape}, median of {args.repeats} (load avg {load:.1f})")
    print(f"{'path':<32} {'ms':>10} {'× log_softmax':>14}")
    for name, t in rows:
        print(f"{name:<32} {t * 1e3:>10.1f} {t / t_floor:>14.2f}")

    mem_ratio = float("nan")
    if not args.skip_fused:
        problem = lm_head_problem(args.fused_tokens, args.vocab, args.hidden, dtype)
        steps = {k: (lambda k=k: lm_head_step(k, *problem)) for k in ("materialized", "fused")}
        times = median_seconds(steps, args.fused_repeats, warmup=1)
        del problem
        mem = {kind: run_probe(kind, args) for kind in ("materialized", "fused")}
        print(
            f"\nlm_head forward+backward, T={args.fused_tokens} V={args.vocab} H={args.hidden} "
            f"{args.dtype}, median of {args.fused_repeats}; memory: one run in a fresh process"
        )
        print(f"{'path':<32} {'s':>10} {'extra peak MiB':>16}")
        for kind in ("materialized", "fused"):
            extra = mem[kind]["extra_bytes"] / 2**20
            print(f"{kind:<32} {times[kind]:>10.2f} {extra:>16.1f}")
        print(f"fused/materialized time = {times['fused'] / times['materialized']:.2f}")
        mem_ratio = mem["fused"]["extra_bytes"] / mem["materialized"]["extra_bytes"]
    summary = f"token_stats/log_softmax = {t_ours / t_floor:.2f}  "
    summary += f"separate/token_stats = {t_sep / t_ours:.2f}  "
    summary += f"fused_mem/materialized_mem = {mem_ratio:.2f}"
    print(summary)


if __name__ == "__main__":
    main()
