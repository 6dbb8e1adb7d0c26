"""Train/inference mismatch by precision, through otbrl, side by side: the same random Qwen2
(~30 M parameters, vocabulary 8 k), prompts and seeds, trained with ``rollout.name=vllm`` under
each pairing of vLLM's dtype (``rollout.vllm.dtype``) and the trainer's precision
(``model.precision``). Each arm runs ``--steps`` RL steps with ``token_tis`` on and reports, over
its steps, the mean and the largest ``rollout/logprob_abs_diff_mean`` / ``_max`` (sampled-token
log-probs of vLLM's engine against the trainer's forward) and the mean truncated-IS weight.

    python benchmarks/mismatch.py [--hidden 512 --layers 6 --vocab 8192 --prompts 16 --tokens 32]

The last line prints each bf16 arm's mean mismatch as a multiple of the fp32/fp32 arm's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from memory import build  # the same random Qwen2, tokenizer, prompts and reward

ARMS = {  # name -> (vLLM dtype, trainer precision)
    "fp32 / 32-true": ("float32", "32-true"),
    "bf16 / 32-true": ("bfloat16", "32-true"),
    "fp32 / bf16-mixed": ("float32", "bf16-mixed"),
    "bf16 / bf16-mixed": ("bfloat16", "bf16-mixed"),
}


def run_arm(name: str, root: Path, args) -> dict:
    dtype, precision = ARMS[name]
    out = root / name.replace(" / ", "-")
    overrides = [
        f"model.path={root / 'model'}",
        f"data.train_files=[{root / 'train.parquet'}]",
        f"reward.function={root / 'reward.py'}:score",
        "data.apply_chat_template=false",
        f"data.max_prompt_length={8 * args.prompt_tokens}",
        f"data.max_response_length={args.tokens}",
        f"data.train_batch_size={args.prompts}",
        f"rollout.n={args.samples}",
        "rollout.name=vllm",
        f"rollout.vllm.dtype={dtype}",
        f"model.precision={precision}",
        "algorithm.rollout_correction=token_tis",
        "actor.lr=1e-5",
        "actor.warmup_steps=0",
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "otbrl", "train", *overrides], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    return {
        "mean": statistics.mean(r["rollout/logprob_abs_diff_mean"] for r in steps),
        "max": max(r["rollout/logprob_abs_diff_max"] for r in steps),
        "is_weight": statistics.mean(r["rollout/is_weight_mean"] for r in steps),
        "truncated": statistics.mean(r["rollout/is_truncated_frac"] for r in steps),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16, help="words per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="response tokens")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    args.intermediate, args.shape, args.model_dtype = 0, None, "float32"
    with tempfile.TemporaryDirectory(prefix="otbrl-mismatch-") as tmp:
        root = Path(tmp)
        build(root, args)
        built = json.loads((root / "params.json").read_text())
        print(
            f"Qwen2 {built['params'] / 1e6:.1f} M parameters, vocabulary {built['vocab']}; "
            f"{args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, "
            f"{args.steps} steps, token_tis"
        )
        rows = {name: run_arm(name, root, args) for name in ARMS}
    print(
        f"{'vLLM / trainer':<20}{'mean |Δ|':>11}{'max |Δ|':>11}{'IS weight':>11}{'truncated':>11}"
    )
    for name, r in rows.items():
        if "error" in r:
            print(f"{name:<20}  failed: {r['error'][:120]}")
            continue
        print(
            f"{name:<20}{r['mean']:11.2e}{r['max']:11.2e}{r['is_weight']:11.4f}"
            f"{r['truncated']:11.4f}"
        )
    base = rows.get("fp32 / 32-true", {}).get("mean")
    if base:
        ratios = [
            f"{name} {r['mean'] / base:.0f}x"
            for name, r in rows.items()
            if "error" not in r and name != "fp32 / 32-true"
        ]
        print("mean mismatch / fp32-fp32: " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
