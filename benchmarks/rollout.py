"""Rollout throughput of the HF and vLLM backends side by side, plus vLLM's weight-sync cost.

For each model (the demo's architecture, and a ~30M-parameter Llama) both backends generate
the same prompts × samples × new tokens (no stop id, so every completion has exactly
``--new-tokens`` tokens); tokens/s is the median over ``--reps`` timed calls after one warm-up
call. "step" = one vLLM rollout + one ``sync_weights`` of the whole model (what the trainer
adds per optimizer step); the sync share is sync / step. The mismatch column is the max
|trainer − engine| log-prob over the timed batch's tokens (the trainer's forward, fp32).

    python benchmarks/rollout.py [--prompts 64] [--n 8] [--new-tokens 64] [--reps 3]
        [--threads 2] [--models demo,30m] [--max-num-seqs N]

Last line: the vllm/hf tokens/s ratio per model and the sync share of a step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from otbrl.data import encode_prompts, get_task
from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import build_tiny_model, load_model_and_tokenizer
from otbrl.rollout import (
    HFRollout,
    SamplingParams,
    VLLMRollout,
    completions_to_batch,
    unpad_prompts,
)

LOG_PROBS = frozenset({"log_probs"})  # the trainer forward's sampled-token log-probs

# The demo's model, with room for 64 new tokens (the demo itself uses 64 positions).
MODELS = {
    "demo": {"max_position_embeddings": 128},
    "30m": {
        "hidden_size": 512,
        "intermediate_size": 1792,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "max_position_embeddings": 128,
    },
}


def timed(fn, reps: int) -> tuple[float, object]:
    fn()  # warm-up: allocator, thread pool, vLLM's first-call compilation
    times, out = [], None
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def mismatch(model, enc, comps, pad_id, temperature) -> float:
    batch = completions_to_batch(enc["input_ids"], enc["attention_mask"], comps, pad_id=pad_id)
    with torch.no_grad():
        stats = forward_outputs(model, batch, Layout(), outputs=LOG_PROBS, temperature=temperature)
    m = batch["response_mask"].bool()
    return float((stats["log_probs"] - batch["rollout_log_probs"])[m].abs().max())


def bench_model(name: str, args, root: Path) -> dict:
    path = build_tiny_model(root / name, **MODELS[name])
    model, tok = load_model_and_tokenizer(path)
    size = sum(p.numel() for p in model.parameters())
    rows = get_task("arithmetic").rows("val", args.prompts, seed=0)
    enc = encode_prompts(rows, tok, max_prompt_length=32)
    prompts = unpad_prompts(enc["input_ids"], enc["attention_mask"])
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.new_tokens, seed=0)
    tokens = args.prompts * args.n * args.new_tokens
    out = {"name": name, "params": size, "tokens": tokens}

    hf = HFRollout(model, tok)
    out["hf_s"], comps = timed(lambda: hf.generate(prompts, params), args.reps)
    out["hf_mismatch"] = mismatch(model, enc, comps, tok.pad_token_id, params.temperature)

    extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    engine = VLLMRollout(path, max_model_len=128, seed=0, **extra)
    try:
        out["vllm_s"], comps = timed(lambda: engine.generate(prompts, params), args.reps)
        out["vllm_mismatch"] = mismatch(model, enc, comps, tok.pad_token_id, params.temperature)
        out["sync_s"], _ = timed(lambda: engine.sync_weights(model.named_parameters()), args.reps)
    finally:
        engine.close()
    got = sum(len(c.token_ids) for group in comps for c in group)
    assert got == tokens, (got, tokens)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="timed calls per backend")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--max-num-seqs", type=int, default=None,
        help="vLLM's batch of sequences (its CPU default is 256)",
    )  # fmt: skip
    parser.add_argument("--models", default="demo,30m", help=f"comma list of {sorted(MODELS)}")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        parser.error(f"--models: unknown {unknown}; expected some of {sorted(MODELS)}")
    torch.set_num_threads(args.threads)
    print(
        f"{args.prompts} prompts x {args.n} samples x {args.new_tokens} new tokens, fp32, "
        f"{args.threads} threads, median of {args.reps}"
    )
    header = f"{'model':>6} {'params':>8} {'backend':>7} {'s':>8} {'tok/s':>8} {'mismatch':>9}"
    print(header + f" {'sync ms':>8} {'sync/step':>9}")
    results = []
    with tempfile.TemporaryDirectory(prefix="otbrl-bench-rollout-") as root:
        for name in names:
            r = bench_model(name, args, Path(root))
            results.append(r)
            step = r["vllm_s"] + r["sync_s"]
            for backend in ("hf", "vllm"):
                s = r[f"{backend}_s"]
                line = (
                    f"{name:>6} {r['params'] / 1e6:7.2f}M {backend:>7} {s:8.2f} "
                    f"{r['tokens'] / s:8.0f} {r[f'{backend}_mismatch']:9.1e}"
                )
                if backend == "vllm":
                    line += f" {r['sync_s'] * 1e3:8.1f} {r['sync_s'] / step:8.2%}"
                print(line, flush=True)
    summary = ", ".join(
        f"{r['name']}: vllm/hf tok/s = {r['hf_s'] / r['vllm_s']:.2f}x, "
        f"sync = {r['sync_s'] / (r['vllm_s'] + r['sync_s']):.2%} of a step"
        for r in results
    )
    print(f"ratios: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
