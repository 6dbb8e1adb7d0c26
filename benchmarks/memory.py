"""One RL step per configuration, side by side: step time, peak memory and bytes per parameter of
otbrl's precisions / gradient checkpointing / LoRA and of TRL's GRPOTrainer with the matching
settings, on the same random Qwen2-shaped model, prompts and lengths.

    python benchmarks/memory.py                      # a scale this 2-core CPU finishes
    python benchmarks/memory.py --hidden 768 --layers 12 --vocab 32768 --prompts 8 \\
        --samples 4 --tokens 1024                    # the ~100 M shape of the issue
    python benchmarks/memory.py --shape 7b --arms lora16-bf16+ckpt --no-trl --prompts 4 \\
        --samples 2 --tokens 64 --steps 1            # the largest LoRA step in this machine

``--sizes 40m,160m`` runs the whole comparison once per model size (40m: hidden 512, 8 layers,
vocabulary 8192; 160m: hidden 768, 12 layers, 32 768), each in its own process, and ends with
one table of the otbrl / TRL step ratios — the RL-step figure of the performance page::

    python benchmarks/memory.py --sizes 40m,160m --arms 32-true,bf16-mixed --prompts 8 \
        --samples 4 --tokens 64 --steps 4

``--shape`` takes Qwen2.5's published sizes (0.5b, 1.5b, 3b, 7b: hidden, intermediate,
layers, heads, KV heads; the vocabulary is ``--vocab``, the tokenizer's BPE trained here) and
saves the random model in ``--model-dtype`` (bfloat16 for the large shapes: a 7 B model is
built, saved and loaded without ever holding an fp32 copy).

Every arm runs in its own process, on the GPU when there is one (peak resident memory is the
process's: Linux VmHWM, reset at each step; CUDA: ``max_memory_allocated``). Each arm trains
``--steps`` RL steps (sampling, statistics, update) and reports the median of the steps after
the first. otbrl's step time, peak and tokens/s come from its own ``metrics.jsonl``
(``timing/step``, ``memory/peak_gb``, ``throughput/tokens_per_s``: prompt + response tokens,
no padding); TRL's from a callback around its ``training_step`` (which samples too), measured
the same way, its tokens from the ``num_tokens`` it logs (the same count). The last lines print
the ratios; ``--json PATH`` writes the rows (``benchmarks/gpu_check.py`` reads them).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ARMS = {  # name -> (otbrl overrides, TRL settings) ; TRL None: no TRL arm
    "32-true": (["model.precision=32-true"], {"bf16": False}),
    "bf16-mixed": (["model.precision=bf16-mixed"], {"bf16": True}),
    "bf16-mixed+ckpt": (
        ["model.precision=bf16-mixed", "model.gradient_checkpointing=true"],
        {"bf16": True, "gradient_checkpointing": True},
    ),
    "lora16": (["model.lora.rank=16", "model.lora.alpha=32"], {"bf16": False, "lora": 16}),
    "lora16+ckpt": (
        ["model.lora.rank=16", "model.lora.alpha=32", "model.gradient_checkpointing=true"],
        {"bf16": False, "lora": 16, "gradient_checkpointing": True},
    ),
    # a single-GPU user's setting: bf16 base (no fp32 copy), fp32 adapters, checkpointing
    "lora16-bf16+ckpt": (
        [
            "model.precision=bf16-mixed",
            "model.lora.rank=16",
            "model.lora.alpha=32",
            "model.gradient_checkpointing=true",
        ],
        {"bf16": True, "lora": 16, "gradient_checkpointing": True},
    ),
}
# the RL-step comparison's model sizes: hidden, layers, vocabulary
SIZES = {"40m": (512, 8, 8192), "160m": (768, 12, 32768)}
# Qwen2.5's sizes: hidden, intermediate, layers, attention heads, KV heads
SHAPES = {
    "0.5b": (896, 4864, 24, 14, 2),
    "1.5b": (1536, 8960, 28, 12, 2),
    "3b": (2048, 11008, 36, 16, 2),
    "7b": (3584, 18944, 28, 28, 4),
}


def build(root: Path, args) -> tuple[Path, Path, Path]:
    """A random Qwen2 of the requested shape with a word-level tokenizer of its vocabulary,
    a parquet file of prompts and a reward file."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from otbrl.data import write_parquet_rows
    from otbrl.models import random_causal_lm

    requested_vocab = args.vocab
    # A byte-level BPE trained here on random words to the requested vocabulary (the Qwen2
    # tokenizer class transformers picks for a qwen2 config reads BPE files only)
    g = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lengths = torch.randint(2, 9, (60000,), generator=g).tolist()
    codes = torch.randint(0, 26, (sum(lengths),), generator=g).tolist()
    words, at = [], 0
    for n in lengths:
        words.append("".join(letters[c] for c in codes[at : at + n]))
        at += n
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tk.train_from_iterator((" ".join(words[i : i + 50]) for i in range(0, len(words), 50)), trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    args.vocab = len(tok)  # what the corpus allowed (at most the request)
    # the model's embedding keeps the requested size (Qwen's are padded past their tokenizer's
    # too): the parameter count of a named shape is the real one
    model_vocab = max(args.vocab, requested_vocab)
    heads = kv_heads = max(1, args.hidden // 64)
    if args.shape:
        args.hidden, args.intermediate, args.layers, heads, kv_heads = SHAPES[args.shape]
    model = random_causal_lm(
        "qwen2",
        seed=0,
        dtype=getattr(torch, args.model_dtype),
        vocab_size=model_vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or 4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=8 * args.prompt_tokens + args.tokens + 8,
        tie_word_embeddings=False,
        eos_token_id=1,
        pad_token_id=0,
    )
    params = sum(p.numel() for p in model.parameters())
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rows = []
    for i in range(args.prompts * (args.steps + 1)):
        text = " ".join(words[i * args.prompt_tokens : (i + 1) * args.prompt_tokens])
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}],
                "data_source": "bench",
                "reward_model": {"ground_truth": "0"},
                "extra_info": {"index": i},
            }
        )
    data = write_parquet_rows(rows, root / "train.parquet")
    reward = root / "reward.py"
    reward.write_text(
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(len(solution_str) % 7) / 7.0\n"
    )
    del model
    (root / "params.json").write_text(json.dumps({"params": params, "vocab": args.vocab}))
    return model_dir, data, reward


def otbrl_arm(name: str, root: Path, args) -> dict:
    out = root / f"otbrl-{name}"
    overrides = [
        f"model.path={root / 'model'}",
        f"data.train_files=[{root / 'train.parquet'}]",
        f"reward.function={root / 'reward.py'}:score",
        "data.apply_chat_template=false",
        f"data.max_prompt_length={8 * args.prompt_tokens}",  # words of 1-4 tokens
        f"data.max_response_length={args.tokens}",
        f"data.train_batch_size={args.prompts}",
        f"rollout.n={args.samples}",
        f"actor.micro_batch_size={args.micro_batch or args.prompts * args.samples}",
        "actor.ppo_mini_batch_size=null",
        "actor.lr=1e-6",
        "actor.warmup_steps=0",
        f"trainer.total_steps={args.steps}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={out}",
        "trainer.resume=never",
        "trainer.overwrite=true",
        *ARMS[name][0],
    ]
    done = subprocess.run(
        [sys.executable, "-m", "otbrl", "train", *overrides], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": _last_error(done.stderr)}
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["step"] > 0]
    later = steps[1:] or steps
    return {
        "step_s": statistics.median(r["timing/step"] for r in later),
        "peak_gb": max(r["memory/peak_gb"] for r in later),
        "tokens_per_s": statistics.median(r["throughput/tokens_per_s"] for r in later),
    }


def _last_error(stderr: str) -> str:
    lines = [x for x in stderr.strip().splitlines() if "Error" in x or "error" in x]
    return (lines or stderr.strip().splitlines() or ["failed"])[-1]


def trl_arm(name: str, root: Path, args) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, lengths and batch (run in its own
    process: ``--trl-arm``)."""
    done = subprocess.run(
        [sys.executable, __file__, "--trl-arm", name, "--root", str(root), *sys.argv[1:]],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        return {"error": _last_error(done.stderr)}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_trl(name: str, root: Path, args) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from otbrl.data import read_parquet_rows
    from otbrl.engine.memory import peak_memory_gb, reset_peak_memory

    micro = args.micro_batch or args.prompts * args.samples
    if (args.prompts * args.samples) % micro:
        raise SystemExit("--micro-batch must divide prompts x samples")
    settings = dict(ARMS[name][1])
    lora = settings.pop("lora", 0)
    rows = read_parquet_rows([root / "train.parquet"])
    data = Dataset.from_dict({"prompt": [r["prompt"][0]["content"] for r in rows]})

    def reward(completions, **_):
        return [float(len(c) % 7) / 7.0 for c in completions]

    config = GRPOConfig(
        output_dir=str(root / f"trl-{name}"),
        # one optimizer step per generation of prompts x samples, micro-batched as otbrl's
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=args.prompts * args.samples // micro,
        num_generations=args.samples,
        max_completion_length=args.tokens,
        max_steps=args.steps,
        learning_rate=1e-6,
        beta=0.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        gradient_checkpointing=settings.pop("gradient_checkpointing", False),
        **settings,
    )
    peft = None
    if lora:
        from peft import LoraConfig

        peft = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    times, peaks, seen = [], [], [0.0]  # seen: TRL's cumulative num_tokens at each log

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            reset_peak_memory(device)
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - self.start)
            peaks.append(peak_memory_gb(device))

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "num_tokens" in logs:
                seen.append(float(logs["num_tokens"]))

    trainer = GRPOTrainer(
        model=str(root / "model"),
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        peft_config=peft,
        callbacks=[Timer()],
    )
    trainer.train()
    later = slice(1, None) if len(times) > 1 else slice(None)
    tokens = [b - a for a, b in itertools.pairwise(seen)]  # per step (logging_steps=1)
    rates = [n / t for n, t in zip(tokens, times)][later] if len(tokens) == len(times) else []
    print(
        json.dumps(
            {
                "step_s": statistics.median(times[later]),
                "peak_gb": max(peaks[later]),
                "tokens_per_s": statistics.median(rates) if rates else None,
            }
        )
    )


def by_size(args, argv: list[str]) -> int:
    """This benchmark once per size of ``--sizes`` (its own process each, the other options as
    given), then the otbrl / TRL step ratios of every size and arm in one table."""
    rest, skip = [], False
    for arg in argv:  # drop --sizes and the shape options the sizes set
        if skip:
            skip = False
        elif arg in ("--sizes", "--hidden", "--layers", "--vocab", "--json", "--keep"):
            skip = True
        elif not arg.startswith(("--sizes=", "--hidden=", "--layers=", "--vocab=", "--json=")):
            rest.append(arg)
    table = {}
    with tempfile.TemporaryDirectory(prefix="otbrl-sizes-") as tmp:
        for size in args.sizes.split(","):
            hidden, layers, vocab = SIZES[size]
            out = Path(tmp) / f"{size}.json"
            shape = ["--hidden", str(hidden), "--layers", str(layers), "--vocab", str(vocab)]
            command = [sys.executable, __file__, *shape, *rest, "--json", str(out)]
            subprocess.run(command, check=True)
            table[size] = json.loads(out.read_text())
    print(f"{'size':<6}{'params':>9}  {'arm':<18}{'otbrl s':>9}{'TRL s':>9}{'ratio':>8}")
    for size, result in table.items():
        rows = result["rows"]
        for arm in args.arms.split(","):
            mine, theirs = rows.get(f"otbrl/{arm}", {}), rows.get(f"TRL/{arm}", {})
            if "step_s" not in mine or "step_s" not in theirs:
                print(f"{size:<6}{result['params'] / 1e6:>8.1f}M  {arm:<18}  failed")
                continue
            ratio = mine["step_s"] / theirs["step_s"]
            print(f"{size:<6}{result['params'] / 1e6:>8.1f}M  {arm:<18}{mine['step_s']:9.2f}"
                  f"{theirs['step_s']:9.2f}{ratio:8.2f}")  # fmt: skip
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=0, help="default 4 x hidden")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a Qwen2.5 size (overrides)")
    parser.add_argument("--model-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16, help="words per prompt")
    parser.add_argument("--tokens", type=int, default=128, help="response tokens")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=0, help="sequences per forward")
    parser.add_argument("--keep", help="build the model here once and reuse it (a folder)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arm names")
    parser.add_argument("--no-trl", action="store_true", help="otbrl's arms only")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--sizes", help=f"comma list of {sorted(SIZES)}: one run per size")
    parser.add_argument("--trl-arm", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.trl_arm:
        run_trl(args.trl_arm, Path(args.root), args)
        return 0
    if args.sizes:
        return by_size(args, argv if argv is not None else sys.argv[1:])
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    arms = [a for a in args.arms.split(",") if a]
    with tempfile.TemporaryDirectory(prefix="otbrl-memory-") as tmp:
        root = Path(args.keep or tmp)
        if not (root / "params.json").exists():
            root.mkdir(parents=True, exist_ok=True)
            build(root, args)
        built = json.loads((root / "params.json").read_text())
        params, args.vocab = built["params"], built["vocab"]
        if args.shape:
            args.hidden, args.intermediate, args.layers = SHAPES[args.shape][:3]
        print(
            f"Qwen2 {params / 1e6:.1f} M parameters (hidden {args.hidden}, {args.layers} layers, "
            f"tokenizer vocabulary {args.vocab}, saved as {args.model_dtype}); "
            f"{args.prompts} prompts x {args.samples} samples x "
            f"{args.tokens} tokens; median of steps 2..{args.steps}"
        )
        rows = {}
        for name in arms:
            rows[("otbrl", name)] = otbrl_arm(name, root, args)
            if not args.no_trl:
                rows[("TRL", name)] = trl_arm(name, root, args)
    print(f"{'arm':<18}{'framework':<10}{'step s':>9}{'peak GB':>9}{'B/param':>9}")
    for (framework, name), r in rows.items():
        if "error" in r:
            print(f"{name:<18}{framework:<10}  failed: {r['error'][:120]}")
            continue
        per_param = r["peak_gb"] * 1e9 / params
        print(f"{name:<18}{framework:<10}{r['step_s']:9.2f}{r['peak_gb']:9.2f}{per_param:9.1f}")
    if args.json:
        table = {f"{framework}/{name}": r for (framework, name), r in rows.items()}
        Path(args.json).write_text(json.dumps({"params": params, "rows": table}, indent=1))
    ok = {k: v for k, v in rows.items() if "error" not in v}
    base = ok.get(("otbrl", "32-true"))

    def ratio(a, b, key):
        return f"{ok[a][key] / ok[b][key]:.2f}" if a in ok and b in ok else "n/a"

    if base:
        print(
            "ratios: bf16-mixed / 32-true step "
            + ratio(("otbrl", "bf16-mixed"), ("otbrl", "32-true"), "step_s")
            + ", checkpointing peak "
            + ratio(("otbrl", "bf16-mixed+ckpt"), ("otbrl", "bf16-mixed"), "peak_gb")
            + ", LoRA / full peak "
            + ratio(("otbrl", "lora16"), ("otbrl", "32-true"), "peak_gb")
        )
    for name in arms:
        if ("TRL", name) in ok and ("otbrl", name) in ok:
            print(
                f"otbrl / TRL {name}: step {ratio(('otbrl', name), ('TRL', name), 'step_s')}, "
                f"peak {ratio(('otbrl', name), ('TRL', name), 'peak_gb')}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
