"""Ulysses sequence parallel (SP = 2) on packed sequences of uneven lengths vs one process."""

from __future__ import annotations

import pytest
import torch

from dist_utils import (
    check_ok,
    launch,
    packed_layout,
    reference_stats,
    tiny_llama,
    uneven_sequences,
)

pytestmark = pytest.mark.distributed

LR = 1.0  # SGD: parameter differences are gradient differences (see test_dist_fsdp)
LENGTHS = (5, 9, 3)  # nnz = 17: odd, so SP = 2 pads one token
KV_HEADS = (2, 1)  # 2 KV heads split over SP = 2; 1 KV head must be replicated first


def _advantages(nnz: int) -> torch.Tensor:
    return torch.randn(nnz, generator=torch.Generator().manual_seed(5))


def _loss(stats, advantages, mask):
    return -(advantages * stats["log_probs"].float() * mask).sum() / mask.sum()


def _sp_worker(rank, world_size, port):
    import torch.nn.functional as F
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from otbrl.engine.parallel import apply_fsdp, build_mesh, clip_grad_norm, fsdp_mesh
    from otbrl.engine.ulysses import (
        apply_ulysses,
        gather_and_unpad,
        packed_forward_kwargs,
        slice_for_rank,
    )
    from otbrl.engine.world import init_distributed

    init_distributed(rank=rank, world_size=world_size, timeout_s=60.0)
    mesh = build_mesh(world_size, sp=world_size, device_type="cpu")
    group = mesh["sp"].get_group()
    ids, pos, cu, labels, mask = packed_layout(uneven_sequences(LENGTHS))
    advantages = _advantages(ids.shape[1])
    out = {}
    for kv in KV_HEADS:
        model = apply_ulysses(tiny_llama(num_key_value_heads=kv), group)
        model = apply_fsdp(model, fsdp_mesh(mesh))
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        local_ids, local_pos, pad = slice_for_rank(ids, pos, group)
        n = local_ids.shape[1]
        local_labels = F.pad(labels, (0, pad))[rank * n : (rank + 1) * n]
        logits = model(
            input_ids=local_ids,
            position_ids=local_pos,
            **packed_forward_kwargs(cu, world_size),
        ).logits[0]
        assert logits.shape == (n, 64)  # each rank computes only its slice of tokens
        local = reference_stats(logits, local_labels)
        stats = {k: gather_and_unpad(v, group, pad) for k, v in local.items()}
        _loss(stats, advantages, mask).backward()
        norm = clip_grad_norm(model.parameters(), 0.5)
        optimizer.step()
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        out[kv] = {
            "stats": {k: v.detach() for k, v in stats.items()},
            "norm": float(norm),
            "state": full,
            "pad": pad,
        }
    return out


def test_ulysses_sp2_matches_single_process(tmp_path):
    results = check_ok(launch(_sp_worker, 2, tmp_path))
    seqs = uneven_sequences(LENGTHS)
    _, _, _, labels, mask = packed_layout(seqs)
    advantages = _advantages(labels.shape[0])
    for kv in KV_HEADS:
        # independent reference: every sequence on its own, standard HF sdpa attention
        model = tiny_llama(num_key_value_heads=kv)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        logits = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
        ref = reference_stats(logits, labels)
        _loss(ref, advantages, mask).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5))
        optimizer.step()
        for rank in (0, 1):
            got = results[rank][kv]
            assert got["pad"] == 1
            for key in ("log_probs", "entropy", "sum_pi_squared"):
                assert got["stats"][key].shape == ref[key].shape  # gathered and unpadded
                torch.testing.assert_close(
                    got["stats"][key], ref[key].detach(), atol=1e-6, rtol=0, msg=key
                )
            assert got["norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert ref_norm > 0.5
        state = results[0][kv]["state"]
        for name, value in model.state_dict().items():
            torch.testing.assert_close(state[name], value, atol=1e-5, rtol=0, msg=name)
