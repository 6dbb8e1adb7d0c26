"""LoRA → vLLM, the two sync modes side by side: merged weights through ``reload_weights`` vs the
adapter alone through vLLM's LoRA support (``model.lora.sync``), one in-process vLLM engine at a
time on the same random Qwen2-shaped model, adapter and prompts.

    python benchmarks/lora_sync.py [--hidden 512 --layers 8 --vocab 8192 --rank 16]

Columns: sync (median of ``--syncs`` updates of the trained adapter), generation time and tokens/s
(median of ``--repeats`` calls of prompts × samples × tokens), and the mismatch of vLLM's log-probs
against the trainer's forward on the same samples. The last line prints the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from otbrl.engine.frozen import FrozenEngine
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.models import load_model_and_tokenizer, random_causal_lm
from otbrl.models.config import LoraConfig
from otbrl.models.lora import add_lora
from otbrl.rollout import SamplingParams, VLLMRollout, completions_to_batch, sync_from


def build_model(out: Path, hidden: int, layers: int, vocab: int) -> Path:
    model = random_causal_lm(
        "qwen2",
        seed=0,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model.save_pretrained(out)
    return out


def perturb(engine: FrozenEngine, seed: int) -> None:
    """A stand-in for an optimizer step: new adapter values (B ≠ 0, so the merge matters)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def measure(mode: str, model_dir: Path, args) -> dict:
    model, _ = load_model_and_tokenizer(model_dir)
    add_lora(model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank))
    engine = FrozenEngine(model, EngineSpec(micro=MicroBatchConfig(16)))
    from otbrl.models.lora import adapter_config

    lora = adapter_config(model, str(model_dir)) if mode == "adapter" else None
    backend = VLLMRollout(model_dir, max_model_len=256, kv_cache_gib=2.0, lora=lora)
    try:
        syncs = []
        for k in range(args.syncs):
            perturb(engine, k)
            start = time.perf_counter()
            sync_from(backend, engine.model)
            syncs.append(time.perf_counter() - start)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, args.vocab, (16,), generator=g).tolist()]
        prompts = prompts * args.prompts
        params = SamplingParams(n=args.samples, max_tokens=args.tokens, seed=3)
        backend.generate(prompts[:2], params)  # warm-up (the adapter loads on first use)
        times, result = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = backend.generate(prompts, params)
            times.append(time.perf_counter() - start)
        ids = torch.tensor(prompts)
        batch = completions_to_batch(ids, torch.ones_like(ids), result, pad_id=0)
        trainer_lp = engine.compute(batch, frozenset({"log_probs"}))["log_probs"]
        mask = batch["response_mask"].bool()
        diff = (trainer_lp - batch["rollout_log_probs"])[mask].abs()
        tokens = float(mask.sum())
        return {
            "sync_s": statistics.median(syncs),
            "gen_s": statistics.median(times),
            "tok_per_s": tokens / statistics.median(times),
            "mismatch_max": float(diff.max()),
        }
    finally:
        backend.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model", args.hidden, args.layers, args.vocab)
        params = sum(p.numel() for p in load_model_and_tokenizer(model_dir)[0].parameters())
        print(f"Qwen2 {params / 1e6:.1f} M parameters, LoRA r={args.rank} on all linear layers")
        rows = {mode: measure(mode, model_dir, args) for mode in ("merged", "adapter")}
    print(f"{'sync':8} {'sync ms':>9} {'gen s':>8} {'tok/s':>8} {'|Δ logp| max':>13}")
    for mode, r in rows.items():
        print(
            f"{mode:8} {r['sync_s'] * 1e3:9.1f} {r['gen_s']:8.2f} {r['tok_per_s']:8.0f} "
            f"{r['mismatch_max']:13.2e}"
        )
    m, a = rows["merged"], rows["adapter"]
    print(
        f"adapter / merged: sync {a['sync_s'] / m['sync_s']:.2f} x, generation time "
        f"{a['gen_s'] / m['gen_s']:.2f} x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
