"""One rank of ``test_rollout_vllm_lifecycle.py``'s torchrun test (run under ``torchrun``).

The trainer's gloo group exists first; then each rank builds its own in-process VLLMRollout,
generates, takes two data-parallel AdamW steps (gradients all-reduced over the trainer's
group), syncs the engine after each and measures the log-prob mismatch. Finally the engine is
closed and the trainer's group is used once more. Writes ``<out>/rank<r>.json``.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from otbrl.engine.layout import Layout, forward_outputs
from otbrl.models import load_model_and_tokenizer
from otbrl.rollout import SamplingParams, VLLMRollout, completions_to_batch, left_pad

LOG_PROBS = frozenset({"log_probs"})  # the trainer forward's sampled-token log-probs


def main(model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, tok = load_model_and_tokenizer(model_dir)
    start = time.perf_counter()
    engine = VLLMRollout(model_dir, max_model_len=64, seed=rank)
    result = {"rank": rank, "world": world, "startup_s": time.perf_counter() - start}
    prompts = [[tok.bos_token_id, 5 + rank, 7, 9 + i] for i in range(4)]
    params = SamplingParams(n=2, temperature=0.8, max_tokens=8, seed=rank)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def batch_and_mismatch():
        ids, mask = left_pad(prompts, tok.pad_token_id)
        comps = engine.generate(prompts, params)
        batch = completions_to_batch(ids, mask, comps, pad_id=tok.pad_token_id)
        with torch.no_grad():
            stats = forward_outputs(
                model, batch, Layout(), outputs=LOG_PROBS, temperature=params.temperature
            )
        m = batch["response_mask"].bool()
        return batch, float((stats["log_probs"] - batch["rollout_log_probs"])[m].abs().max())

    batch, result["mismatch_initial"] = batch_and_mismatch()
    result["mismatch_after_sync"] = []
    for _ in range(2):
        stats = forward_outputs(
            model, batch, Layout(), outputs=LOG_PROBS, temperature=params.temperature
        )
        m = batch["response_mask"]
        (-(stats["log_probs"] * m).sum() / m.sum()).backward()
        for p in model.parameters():  # the trainer's group, after vLLM built its own groups
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        engine.sync_weights(model.named_parameters())
        batch, mismatch = batch_and_mismatch()
        result["mismatch_after_sync"].append(mismatch)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    result["same_weights_on_ranks"] = all(torch.equal(gathered[0], g) for g in gathered)
    engine.close()
    one = torch.ones(1)
    dist.all_reduce(one)  # vLLM's shutdown must have left the trainer's group alone
    result["allreduce_after_close"] = one.item()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
