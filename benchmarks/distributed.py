"""Distributed engines on CPU (gloo): what TP communicates, and what DP = 2 costs or saves.

    .venv/bin/python benchmarks/distributed.py            # ~2 min on 2 idle cores

1. TP = 2, one statistics call on vocabulary-sharded logits [N, V/2]: collectives, bytes sent
   into collectives per rank, and time; ours (`vocab_parallel_token_stats`, two all-reduces)
   vs gathering the vocabulary first (all_gather of the logits, then `token_stats`).
2. TP = 2 model collectives per forward / backward for 2 and 4 decoder blocks, measured with
   the profiler (one `gloo:*` event per collective) and a byte counter; the per-block and
   fixed terms are what docs/distributed.md extrapolates to 7B / 70B.
3. DP = 2 (FSDP2) vs one process on the same global PPO batch: compute + update time.

Prints tables and ends with one summary line of ratios measured in this run.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


# -- helpers ------------------------------------------------------------------------------
def traffic(fn, group_size: int) -> dict:
    """Run `fn` under the profiler: gloo collectives, their payload and per-rank wire bytes.

    One `gloo:<op>` event per collective, with its input shape (fp32 tensors here). Wire bytes
    are what a ring algorithm sends per rank: all-reduce 2(p-1)/p·S, all-gather (p-1)·S_local,
    reduce-scatter and all-to-all (p-1)/p·S.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    p = group_size
    count, payload, wire = 0, 0, 0.0
    for e in prof.events():
        if not e.name.startswith("gloo:"):
            continue
        size = 4 * math.prod(e.input_shapes[0]) if e.input_shapes and e.input_shapes[0] else 0
        count += 1
        payload += size
        if "all_reduce" in e.name:
            wire += 2 * (p - 1) / p * size
        elif "all_gather" in e.name:
            wire += (p - 1) * size
        else:
            wire += (p - 1) / p * size
    return {"calls": count, "payload": payload, "wire": wire}


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def tiny_llama(layers: int, hidden: int, vocab: int, seed: int = 0):
    from otbrl.models import random_causal_lm

    return random_causal_lm(
        "llama",
        seed=seed,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )


def launch(fn, world_size: int, *args) -> list:
    out = Path(tempfile.mkdtemp(prefix="otbrl-bench-"))
    from otbrl.engine.world import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, out, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"benchmark worker failed with exit code {p.exitcode}")
    return [torch.load(out / f"{r}.pt", weights_only=False) for r in range(world_size)]


def _entry(fn, rank, world_size, port, out, args):
    from otbrl.engine.world import init_distributed, teardown_distributed

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world_size))
    init_distributed(init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), out / f"{rank}.pt")
    finally:
        teardown_distributed()


# -- 1. one statistics call ---------------------------------------------------------------
def _stats_worker(rank, world_size, tokens, vocab, repeats):
    from otbrl.ops import token_stats, vocab_parallel_token_stats

    g = torch.Generator().manual_seed(0)
    full = torch.randn(tokens, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    local_v = vocab // world_size
    local = full[:, rank * local_v : (rank + 1) * local_v].contiguous()

    def ours():
        return vocab_parallel_token_stats(local, labels, vocab_start=rank * local_v)

    def gathered():
        buf = torch.empty(world_size * tokens, local_v)
        dist.all_gather_single(buf, local)
        logits = buf.view(world_size, tokens, local_v).permute(1, 0, 2).reshape(tokens, vocab)
        return token_stats(logits, labels)

    out = {}
    for name, fn in (("vocab-parallel (ours)", ours), ("gather vocabulary", gathered)):
        out[name] = {**traffic(fn, world_size), "seconds": median_time(fn, repeats)}
    a, b = ours(), gathered()
    out["max_abs_diff"] = max(float((x - y).abs().max()) for x, y in zip(a, b))
    return out


# -- 2. model collectives under TP -------------------------------------------------------
def _tp_model_worker(rank, world_size, layers, tokens, hidden, vocab):
    from otbrl.engine.parallel import apply_tp, build_mesh, vocab_shard_range
    from otbrl.ops import vocab_parallel_token_stats

    mesh = build_mesh(world_size, tp=world_size)
    model = apply_tp(tiny_llama(layers, hidden, vocab), mesh["tp"])
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
    out = {}

    def forward():
        out["logits"] = model(input_ids=ids).logits[0]

    fwd = traffic(forward, world_size)
    start, _ = vocab_shard_range(model, mesh["tp"])
    stats = vocab_parallel_token_stats(out["logits"], ids[0], vocab_start=start)
    bwd = traffic(lambda: stats.log_probs.sum().backward(), world_size)
    return {"fwd": fwd, "bwd": bwd}


# -- 3. DP = 2 step time ------------------------------------------------------------------
def ppo_batch(model, groups: int, n: int, prompt_len: int, resp_len: int, vocab: int):
    """A real rollout of `model` (n samples of `groups` random prompts) with random advantages."""
    from types import SimpleNamespace

    from otbrl.rollout import HFRollout, SamplingParams, completions_to_batch, unpad_prompts

    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(2, vocab, (groups, prompt_len), generator=g)
    mask = torch.ones_like(prompts)
    ids = SimpleNamespace(pad_token_id=0, eos_token_id=1)  # all sampling needs of a tokenizer
    params = SamplingParams(n=n, max_tokens=resp_len, stop_token_ids=(1,), seed=7)
    completions = HFRollout(model, ids).generate(unpad_prompts(prompts, mask), params)
    batch = completions_to_batch(prompts, mask, completions, pad_id=0)
    mask = batch["response_mask"]
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    return batch


def _actor(model, micro: int, mini_batch_size: int, world=None):
    """A trainable engine on ``model``: micro-batches of ``micro`` rows, one optimizer step per
    ``mini_batch_size`` (global) sequences."""
    from otbrl.engine.optim import OptimConfig
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig
    from otbrl.engine.trainable import TrainableEngine

    optim = OptimConfig(lr=1e-4, warmup_steps=0, grad_clip=1.0)
    spec = EngineSpec(micro=MicroBatchConfig(micro))
    return TrainableEngine(model, optim, spec, world=world, mini_batch_size=mini_batch_size)


OUTPUTS = frozenset({"log_probs", "entropy", "sum_pi_squared"})


def _step(engine, batch):
    from otbrl.algos.loss_terms import build_loss

    stats = engine.compute(batch, OUTPUTS)
    engine.update({**batch, "old_log_probs": stats["log_probs"]}, build_loss())


def _dp_worker(rank, world_size, model_args, batch_args, repeats):
    from otbrl.engine.parallel import build_mesh
    from otbrl.engine.world import World

    world = World(rank=rank, size=world_size, mesh=build_mesh(world_size))
    batch = ppo_batch(tiny_llama(*model_args), *batch_args)
    size = batch["uid"].numel()
    rows = torch.tensor(world.shard(range(size)))  # whole groups: they are contiguous
    local = {k: v[rows] for k, v in batch.items()}
    engine = _actor(tiny_llama(*model_args), size // world_size, size, world=world)
    return median_time(lambda: _step(engine, local), repeats)


def single_process_step(model_args, batch_args, repeats, threads: int) -> float:
    torch.set_num_threads(threads)
    batch = ppo_batch(tiny_llama(*model_args), *batch_args)
    size = batch["uid"].numel()
    engine = _actor(tiny_llama(*model_args), size, size)
    return median_time(lambda: _step(engine, batch), repeats)


MODELS = {  # name: (hidden, blocks, vocabulary, parameters)
    "7B (Llama-2-7B shape)": (4096, 32, 32000, 6.74e9),
    "70B (Llama-2-70B shape)": (8192, 80, 32000, 68.98e9),
}


def scaling_table(fwd_block, fwd_fixed, bwd_block, bwd_fixed, stats_per_token, tp=8):
    """Per-rank wire bytes of one PPO step for T tokens per TP group (one mini-batch)."""
    act_bytes, tokens = 2, 16384  # bf16 activations; 16k tokens (e.g. 64 x 256) per step
    ring = 2 * (tp - 1) / tp
    print(f"\n4. per-rank wire GB per PPO step at TP={tp}, T={tokens} tokens (docs/distributed.md)")
    print(f"{'model':<26}{'TP act.':>9}{'stats ours':>12}{'stats gather':>14}{'sync copy':>11}")
    for name, (h, blocks, vocab, params) in MODELS.items():
        # one no-grad forward (old stats) + one forward and backward (update)
        per_token = (2 * (fwd_block * blocks + fwd_fixed) + bwd_block * blocks + bwd_fixed) * h
        tp_act = ring * per_token * act_bytes * tokens
        ours = ring * 2 * stats_per_token * tokens  # two stats calls per step
        gather = 2 * (tp - 1) / tp * tokens * vocab * act_bytes  # all-gather of logits
        sync = (tp - 1) / tp * params * 4  # gather of the fp32 full state dict (rollout copy)
        print(
            f"{name:<26}{tp_act / 1e9:>9.1f}{ours / 1e9:>12.6f}{gather / 1e9:>14.2f}"
            f"{sync / 1e9:>11.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per statistics call")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tp = 2

    stats = launch(_stats_worker, tp, args.tokens, args.vocab, args.repeats)[0]
    print(f"\n1. one statistics call, TP={tp}, N={args.tokens} tokens, V={args.vocab}")
    print(f"{'method':<24}{'collectives':>12}{'payload B':>14}{'wire B/rank':>14}{'ms':>10}")
    for name in ("vocab-parallel (ours)", "gather vocabulary"):
        r = stats[name]
        print(
            f"{name:<24}{r['calls']:>12}{r['payload']:>14,}{r['wire']:>14,.0f}"
            f"{r['seconds'] * 1e3:>10.2f}"
        )
    print(f"max |ours - gathered| over the three statistics: {stats['max_abs_diff']:.2e}")

    t, h, v = 128, 128, 4096
    print(f"\n2. TP={tp} model collectives, T={t} tokens, H={h}, V={v} (payload bytes, fp32)")
    print(f"{'blocks':>6}{'fwd calls':>11}{'fwd bytes':>12}{'bwd calls':>11}{'bwd bytes':>12}")
    per = {}
    for layers in (2, 4):
        r = launch(_tp_model_worker, tp, layers, t, h, v)[0]
        per[layers] = r
        print(
            f"{layers:>6}{r['fwd']['calls']:>11}{r['fwd']['payload']:>12,}"
            f"{r['bwd']['calls']:>11}{r['bwd']['payload']:>12,}"
        )
    act = t * h * 4
    for key in ("fwd", "bwd"):
        block = (per[4][key]["calls"] - per[2][key]["calls"]) / 2
        fixed = per[2][key]["calls"] - 2 * block
        block_b = (per[4][key]["payload"] - per[2][key]["payload"]) / 2 / act
        fixed_b = per[2][key]["payload"] / act - 2 * block_b
        print(
            f"{key}: {block:g} collectives per block + {fixed:g} fixed; payload "
            f"{block_b:g} x [T, H] per block + {fixed_b:.4g} x [T, H] fixed"
        )

    model_args, batch_args = (4, 128, 2048), (8, 4, 24, 24, 2048)
    cores = os.cpu_count() or 2
    one = single_process_step(model_args, batch_args, 3, cores)
    one_thread = single_process_step(model_args, batch_args, 3, 1)
    two = max(launch(_dp_worker, 2, model_args, batch_args, 3))
    print("\n3. PPO step (compute + update), 32 sequences x 48 tokens, 4 blocks, H=128")
    print(f"{'layout':<36}{'s/step':>10}")
    print(f"{f'one process, {cores} threads':<36}{one:>10.3f}")
    print(f"{'one process, 1 thread':<36}{one_thread:>10.3f}")
    print(f"{'FSDP2 DP=2, 1 thread per rank':<36}{two:>10.3f}")

    # 4. Bytes per PPO step at scale, from the per-block / fixed counts measured in 2 and the
    # stats payload measured in 1 (per token), bf16 activations and logits on GPU.
    fwd_block = (per[4]["fwd"]["payload"] - per[2]["fwd"]["payload"]) / 2 / act
    bwd_block = (per[4]["bwd"]["payload"] - per[2]["bwd"]["payload"]) / 2 / act
    fwd_fixed = per[2]["fwd"]["payload"] / act - 2 * fwd_block
    bwd_fixed = per[2]["bwd"]["payload"] / act - 2 * bwd_block
    stats_per_token = stats["vocab-parallel (ours)"]["payload"] / args.tokens  # fp32 sums
    scaling_table(fwd_block, fwd_fixed, bwd_block, bwd_fixed, stats_per_token)
    ours, gathered = stats["vocab-parallel (ours)"], stats["gather vocabulary"]
    print(
        f"\nsummary: TP=2 stats wire bytes gathered/ours = {gathered['wire'] / ours['wire']:.0f}x, "
        f"time gathered/ours = {gathered['seconds'] / ours['seconds']:.2f}x; "
        f"DP=2 step time / best one-process time = {two / min(one, one_thread):.2f}x"
    )


if __name__ == "__main__":
    main()
