"""The engine on FSDP2 / Ulysses / TP ranks vs the same engine in one process, same global batch."""

from __future__ import annotations

import pytest
import torch

from dist_utils import (
    OUTPUTS,
    actor_config,
    actor_spec,
    check_ok,
    launch,
    local_batch,
    policy_loss,
    ppo_batch,
    ppo_step,
    split_by_groups,
    start_test_world,
    tiny_llama,
)

pytestmark = pytest.mark.distributed


def full_grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def single_process_reference(batch, model_kwargs=None, engine_kwargs=None, loss="ppo", world=None):
    """Stats and mini-batch gradients of the one-process engine (in ``world``: the CPU by
    default; ``engine_kwargs``: fields of its ``actor_spec``) on the whole batch."""
    from otbrl.engine.parallel import clip_grad_norm
    from otbrl.engine.trainable import TrainableEngine

    model = tiny_llama(**(model_kwargs or {}))
    spec = actor_spec(**(engine_kwargs or {}))
    engine = TrainableEngine(
        model, actor_config(), spec, world=world, mini_batch_size=batch["uid"].numel()
    )
    stats = engine.compute(batch, OUTPUTS)
    mini = {**batch, "old_log_probs": stats["log_probs"]}
    tally = engine.accumulate_gradients(mini, policy_loss(loss))
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return stats, tally, grads, float(clip_grad_norm(model.parameters(), 0.5))


def _gloo_ops(prof) -> list[str]:
    return [e.name for e in prof.events() if e.name.startswith("gloo:")]


def _engine_worker(
    rank,
    world_size,
    port,
    strategy,
    sp,
    tp,
    packed,
    extra_steps=0,
    model_kwargs=None,
    engine_kwargs=None,
    loss="ppo",
):
    from otbrl.engine.parallel import clip_grad_norm
    from otbrl.engine.trainable import TrainableEngine

    world = start_test_world(rank, world_size, sp=sp, tp=tp)
    batch = ppo_batch()
    local = local_batch(batch, world)
    model = tiny_llama(**(model_kwargs or {}))
    shapes = []  # the logits each forward produced: their vocabulary / sequence extent
    model.register_forward_hook(lambda _m, _i, out: shapes.append(tuple(out.logits.shape[-2:])))
    # a token budget is a micro-batch setting of the spec, like the layout and precision
    spec = actor_spec(strategy=strategy, packed=packed, **(engine_kwargs or {}))
    actor = TrainableEngine(
        model, actor_config(), spec, world=world, mini_batch_size=batch["uid"].numel()
    )
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        stats = actor.compute(local, OUTPUTS)
    collectives = _gloo_ops(prof)
    logits_shape = shapes[-1]
    mini = {**local, "old_log_probs": stats["log_probs"]}
    tally = actor.accumulate_gradients(mini, policy_loss(loss))
    grads = full_grads(actor.model)
    norm = float(clip_grad_norm(actor.model.parameters(), 0.5))
    metrics = actor.update(mini, policy_loss(loss))  # a real step: AdamW
    from torch.distributed.tensor import DTensor

    dtypes = {  # what the optimizer steps: the local shards and AdamW's moments
        "params": {str(p.dtype) for p in actor.model.parameters()},
        "local": {
            str((p.to_local() if isinstance(p, DTensor) else p).dtype)
            for p in actor.model.parameters()
        },
        "state": {
            str(v.dtype)
            for s in actor.optimizer.state.values()
            for k, v in s.items()
            if k != "step"
        },
    }
    for _ in range(extra_steps):
        later = actor.update(mini, policy_loss(loss))
        assert all(torch.isfinite(torch.tensor(v)) for v in later.values()), later
    # the rollout copy's weights come from full_tensors(): the gathered current weights, a
    # tied parameter once, under its first name (otbrl.models.tied)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from otbrl.models.tied import tied_aliases
    from otbrl.models.weights import full_tensors

    streamed = dict(full_tensors(actor.model))
    full = get_model_state_dict(actor.model, options=StateDictOptions(full_state_dict=True))
    kept = set(full) - set(tied_aliases(actor.model))
    synced = set(streamed) == kept and all(torch.equal(streamed[k], full[k]) for k in kept)
    return {
        "rows": split_by_groups(batch["uid"], world.dp_rank, world.dp_size),
        "stats": stats,
        "tally": tally,
        "grads": grads if rank == 0 else None,
        "norm": norm,
        "metrics": metrics,
        "synced": synced,
        "logits_shape": logits_shape,
        "collectives": collectives,
        "dtypes": dtypes,
    }


def check_against_reference(results, world_size, model_kwargs=None, loss="ppo"):
    """Every rank's stats, metrics and gradients equal the one-process fp32 engine's (no
    gradient checkpointing there: a checkpointing worker must give the same gradients)."""
    batch = ppo_batch()
    ref_stats, ref_tally, ref_grads, ref_norm = single_process_reference(
        batch, model_kwargs, loss=loss
    )
    mask = batch["response_mask"].bool()
    for rank in range(world_size):
        got = results[rank]
        rows = got["rows"]
        assert torch.equal(batch["uid"][rows].unique(), batch["uid"][rows].unique_consecutive())
        for key in sorted(OUTPUTS):
            torch.testing.assert_close(
                got["stats"][key][mask[rows]], ref_stats[key][rows][mask[rows]], atol=2e-6, rtol=0
            )
        assert got["norm"] == pytest.approx(ref_norm, rel=1e-5)
        assert got["synced"]
        assert all(torch.isfinite(torch.tensor(v)) for v in got["metrics"].values())
    # each DP rank backpropagates its share of the global mini-batch loss; the metrics it
    # reports are summed over the DP group: every rank sees the global mini-batch values
    for rank in range(world_size):
        for key, value in ref_tally.items():
            assert results[rank]["tally"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for name, g in ref_grads.items():
        torch.testing.assert_close(results[0]["grads"][name], g, atol=1e-6, rtol=1e-5, msg=name)
    for rank in range(world_size):
        assert results[rank]["metrics"]["policy/loss"] == pytest.approx(
            ref_tally["policy/loss"], abs=1e-6
        )


def test_split_by_groups_keeps_groups_whole():
    uid = torch.tensor([7, 7, 3, 3, 9, 9, 1, 1])
    parts = [split_by_groups(uid, r, 2) for r in range(2)]
    assert parts[0].tolist() == [0, 1, 2, 3] and parts[1].tolist() == [4, 5, 6, 7]
    shuffled = torch.tensor([5, 2, 5, 2, 8, 8])
    got = [split_by_groups(shuffled, r, 3).tolist() for r in range(3)]
    assert got == [[0, 2], [1, 3], [4, 5]]
    with pytest.raises(ValueError, match="divisible"):
        split_by_groups(uid, 0, 3)
    with pytest.raises(ValueError, match="equal size"):
        split_by_groups(torch.tensor([1, 1, 2]), 0, 1)


def test_fsdp_engine_matches_actor(tmp_path):
    results = check_ok(launch(_engine_worker, 2, tmp_path, "fsdp", 1, 1, False))
    check_against_reference(results, 2)


def test_ulysses_engine_matches_actor(tmp_path):
    results = check_ok(launch(_engine_worker, 2, tmp_path, "fsdp", 2, 1, True))
    check_against_reference(results, 2)
    # each SP rank ran the model on half of the packed tokens of the last micro-batch of
    # compute_stats (rows 4..7), rounded up: one pad token when nnz is odd
    nnz = int(ppo_batch()["attention_mask"][4:].sum())
    assert results[0]["logits_shape"][0] == -(-nnz // 2)


@pytest.mark.parametrize(
    ("engine", "sp", "tp", "packed", "loss"),
    [("fsdp", 2, 1, True, "gspo"), ("tp", 1, 2, False, "gspo"), ("tp", 1, 2, False, "cispo")],
    ids=["ulysses-gspo", "tp-gspo", "tp-cispo"],
)
def test_sequence_and_weight_losses_match_one_process(tmp_path, engine, sp, tp, packed, loss):
    """GSPO's per-row mean over Ulysses ranks, which each run half of every packed sequence
    (the engine gathers whole rows before the loss), and GSPO / CISPO with the vocabulary
    sharded by tensor parallelism: stats, tally and gradients are the one-process ones."""
    args = (engine, sp, tp, packed, 0, None, None, loss)
    results = check_ok(launch(_engine_worker, 2, tmp_path, *args))
    check_against_reference(results, 2, loss=loss)
    tally = results[0]["tally"]
    assert "policy/clip_frac" in tally and (loss != "gspo" or "policy/seq_clip_frac" in tally)


@pytest.mark.parametrize(
    ("engine", "tp", "packed", "budget"),
    [("fsdp", 1, True, 10), ("fsdp", 1, False, 18), ("tp", 2, False, 18)],
    ids=["fsdp-packed", "fsdp-padded", "tp"],
)
def test_token_budget_micro_batches_match_one_process(tmp_path, engine, tp, packed, budget):
    """Micro-batches by token budget on 2 ranks: under FSDP2 packed the ranks' rows need 3 and 4
    micro-batches of 10 tokens, so both run 4 (the collective forwards pair up); stats, tally and
    gradients are the one-process engine's, whose micro-batches are counted in rows."""
    worker_args = (engine, 1, tp, packed, 0, None, {"max_tokens_per_micro_batch": budget})
    results = check_ok(launch(_engine_worker, 2, tmp_path, *worker_args))
    check_against_reference(results, 2)
    # the update (packed: its rows dealt out again over the ranks by token load first) takes
    # the same gradient
    norm = single_process_reference(ppo_batch())[3]
    for rank in range(2):
        assert results[rank]["metrics"]["policy/grad_norm"] == pytest.approx(norm, rel=1e-5)


CHECKPOINTING = {"gradient_checkpointing": True}


@pytest.mark.parametrize(
    ("engine", "sp", "tp", "packed"),
    [("fsdp", 1, 1, False), ("fsdp", 2, 1, True), ("tp", 1, 2, False)],
    ids=["fsdp", "ulysses", "tp"],
)
def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, engine, sp, tp, packed):
    """Recomputed activations (non-reentrant, per block) give the fp32 gradients of the
    one-process engine without checkpointing, to 1e-6, in each sharded layout."""
    worker_args = (engine, sp, tp, packed, 0, None, CHECKPOINTING)
    results = check_ok(launch(_engine_worker, 2, tmp_path, *worker_args))
    check_against_reference(results, 2)


def _close_bf16(got, want, what):
    """Agreement at bf16 resolution (8 bits of mantissa, a few roundings deep)."""
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=what)


@pytest.mark.parametrize(
    ("engine", "sp", "tp", "packed"),
    [("fsdp", 1, 1, False), ("fsdp", 2, 1, True), ("tp", 1, 2, False)],
    ids=["fsdp", "ulysses", "tp"],
)
def test_bf16_mixed_sharded_step_matches_one_process(tmp_path, engine, sp, tp, packed):
    """bf16-mixed on two ranks: fp32 master weights and AdamW moments (the local shards
    too), and the statistics and gradients of the one-process bf16-mixed engine to bf16
    tolerance (FSDP2 casts the gathered shards, one process runs under autocast)."""
    mixed = {"precision": "bf16-mixed"}
    results = check_ok(launch(_engine_worker, 2, tmp_path, engine, sp, tp, packed, 0, None, mixed))
    batch = ppo_batch()
    ref_stats, ref_tally, ref_grads, _ = single_process_reference(batch, None, mixed)
    fp32_stats, *_ = single_process_reference(batch)
    mask = batch["response_mask"].bool()
    for rank in range(2):
        got = results[rank]
        assert got["dtypes"] == {
            "params": {"torch.float32"},
            "local": {"torch.float32"},
            "state": {"torch.float32"},
        }
        rows = got["rows"]
        for key in sorted(OUTPUTS):
            _close_bf16(got["stats"][key][mask[rows]], ref_stats[key][rows][mask[rows]], key)
        assert got["metrics"]["policy/loss"] == pytest.approx(ref_tally["policy/loss"], abs=2e-2)
    # the compute really was bf16: the log-probs moved off the fp32 ones by bf16 rounding
    gap = (results[0]["stats"]["log_probs"] - fp32_stats["log_probs"][results[0]["rows"]]).abs()
    assert gap.max() > 1e-4
    for name, g in ref_grads.items():
        got = results[0]["grads"][name]
        scale = g.abs().max().clamp_min(1e-3)
        assert (got - g).abs().max() / scale < 0.1, name


def _lora_worker(rank, world_size, port):
    from otbrl.engine.spec import MicroBatchConfig
    from otbrl.engine.trainable import TrainableEngine
    from otbrl.models.config import LoraConfig
    from otbrl.models.lora import add_lora
    from otbrl.models.weights import full_tensors

    world = start_test_world(rank, world_size)
    batch = ppo_batch()
    local = local_batch(batch, world)
    model = add_lora(tiny_llama(), LoraConfig(rank=4, alpha=8.0))
    actor = TrainableEngine(
        model, actor_config(lr=5e-2), actor_spec(), world=world, mini_batch_size=8
    )
    reference = actor.without_adapters(micro=MicroBatchConfig(4))
    for _ in range(2):
        ppo_step(actor, batch)
    return {
        "rows": split_by_groups(batch["uid"], world.dp_rank, world.dp_size),
        "policy": actor.compute(local, OUTPUTS)["log_probs"],
        "reference": reference.compute(local, OUTPUTS)["log_probs"],
        "merged": dict(full_tensors(actor.model)),
        "trainable": sorted(n for n, p in actor.model.named_parameters() if p.requires_grad),
    }


def test_lora_under_fsdp2_matches_one_process(tmp_path):
    """Two FSDP2 ranks train the adapters as one process does; the reference view (adapters
    disabled) gives the base model's log-probs; the merged stream is the one-process one."""
    from otbrl.engine.frozen import FrozenEngine
    from otbrl.engine.spec import EngineSpec, MicroBatchConfig
    from otbrl.engine.trainable import TrainableEngine
    from otbrl.models.config import LoraConfig
    from otbrl.models.lora import add_lora
    from otbrl.models.weights import full_tensors

    results = check_ok(launch(_lora_worker, 2, tmp_path))
    batch = ppo_batch()
    actor = TrainableEngine(
        add_lora(tiny_llama(), LoraConfig(rank=4, alpha=8.0)),
        actor_config(lr=5e-2),
        actor_spec(),
        mini_batch_size=8,
    )
    for _ in range(2):
        ppo_step(actor, batch)
    want = actor.compute(batch, OUTPUTS)["log_probs"]
    base_engine = FrozenEngine(tiny_llama(), EngineSpec(micro=MicroBatchConfig(4)))
    base = base_engine.compute(batch, OUTPUTS)["log_probs"]
    merged = dict(full_tensors(actor.model))
    mask = batch["response_mask"].bool()
    for rank in range(2):
        got = results[rank]
        rows = got["rows"]
        assert got["trainable"] and all(".lora_" in n for n in got["trainable"])
        torch.testing.assert_close(
            got["policy"][mask[rows]], want[rows][mask[rows]], atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            got["reference"][mask[rows]], base[rows][mask[rows]], atol=1e-6, rtol=0
        )
        assert (want - base)[mask].abs().max() > 1e-3
        assert set(got["merged"]) == set(merged)
        for name, value in merged.items():
            torch.testing.assert_close(got["merged"][name], value, atol=1e-5, rtol=1e-5, msg=name)
