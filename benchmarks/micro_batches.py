"""Micro-batches by token budget against micro-batches counted in rows, side by side: the
update's forward + backward on one mini-batch whose response lengths span 16-512 tokens.

    python benchmarks/micro_batches.py                  # ~3 min on 2 CPU cores
    python benchmarks/micro_batches.py --budget 4096 --rows 1,2,4,8,16 --layout packed

Each arm runs in its own process (peak resident memory is the process's: VmHWM, reset after
the model and batch are built) on the same random Llama-shaped model and the same batch, in
the padded layout (the default; each micro-batch runs cut to its own widths, so a budget that
keeps rows of like length together computes little padding) or the packed one
(``model.use_remove_padding=true``: no padding in either arm, so the comparison is the
micro-batching alone): ``TrainableEngine.accumulate_gradients`` ``--repeats`` times, the median time
reported. The row-counted arm compared with is the fastest ``micro_batch_size`` whose peak
memory is at most the token budget's: what a user would have to pick to fit the same memory.
The last line prints the ratio of times.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time


def _batch(rows: int, vocab: int, seed: int):
    import torch

    from otbrl.engine.layout import sequence_inputs

    rng = random.Random(seed)
    # most responses short, a few long (reasoning batches): 16 * 2^Exp(0.7), capped at 512
    lengths = [min(512, int(16 * 2 ** rng.expovariate(0.7))) for _ in range(rows)]
    width, prompt = max(lengths), 32
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (rows, prompt), generator=g)
    responses = torch.randint(1, vocab, (rows, width), generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).float()
    responses = responses * mask.long()
    batch = sequence_inputs(prompts, torch.ones_like(prompts), responses, mask)
    batch.update(responses=responses, response_mask=mask)
    batch["advantages"] = torch.randn(rows, width, generator=g) * mask
    return batch, lengths


def _arm(args) -> dict:
    import torch

    from otbrl.algos.loss_terms import build_loss
    from otbrl.engine.memory import peak_memory_gb, reset_peak_memory
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig
    from otbrl.engine.trainable import TrainableEngine
    from otbrl.models import random_causal_lm

    torch.set_num_threads(args.threads)
    model = random_causal_lm(
        "llama", seed=0, vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip
    kind, value = args.arm.split("=")
    budget = int(value) if kind == "tokens" else None
    micro = MicroBatchConfig(
        micro_batch_size=int(value) if kind == "rows" else 1, max_tokens_per_micro_batch=budget
    )
    spec = EngineSpec(packed=args.layout == "packed", micro=micro)
    engine = TrainableEngine(model, OptimConfig(), spec)
    batch, _ = _batch(args.batch_rows, args.vocab, args.seed)
    batch["old_log_probs"] = engine.compute(batch, frozenset({"log_probs"}))["log_probs"]
    loss = build_loss()
    engine.model.train()
    times, peaks = [], []
    for _ in range(args.repeats):
        reset_peak_memory("cpu")
        start = time.perf_counter()
        engine.accumulate_gradients(batch, loss)
        times.append(time.perf_counter() - start)
        peaks.append(peak_memory_gb("cpu"))
    return {
        "arm": args.arm,
        "seconds": statistics.median(times),
        "peak_gb": max(peaks),
        "micro_batches": len(engine.micro_batches(batch)),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch")
    p.add_argument("--rows", default="1,2,4,8", help="micro_batch_size arms")
    p.add_argument("--batch-rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=("padded", "packed"), default="padded")
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # one arm, in a child
    p.add_argument("--out", default=None, help="JSON of every arm")
    args = p.parse_args()
    if args.arm is not None:
        print(json.dumps(_arm(args)))
        return 0
    _, lengths = _batch(args.batch_rows, args.vocab, args.seed)
    tokens = sum(lengths) + 32 * len(lengths)
    span = f"{min(lengths)}-{max(lengths)} (median {statistics.median(lengths)})"
    print(f"{len(lengths)} rows, response lengths {span}, {tokens} tokens, {args.layout}")
    arms = [f"tokens={args.budget}", *[f"rows={r}" for r in args.rows.split(",")]]
    results = []
    for arm in arms:
        keys = ("vocab", "hidden", "layers", "repeats", "threads", "seed", "batch_rows", "layout")
        child = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]
        cmd = [sys.executable, __file__, *child, "--arm", arm]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{arm:>12}: {r['seconds']:.2f} s, peak {r['peak_gb']:.2f} GB, "
              f"{r['micro_batches']} micro-batches", flush=True)  # fmt: skip
    budget, rows = results[0], results[1:]
    fits = [r for r in rows if r["peak_gb"] <= budget["peak_gb"]]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if not fits:
        print("no micro_batch_size fits the token budget's peak memory")
        return 0
    best = min(fits, key=lambda r: r["seconds"])
    print(f"token budget {args.budget}: {budget['seconds'] / best['seconds']:.2f}x the time of "
          f"the fastest micro_batch_size within its peak ({best['arm']}, "
          f"{best['peak_gb']:.2f} GB vs {budget['peak_gb']:.2f} GB)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
