"""OTB in verl's V1 trainer (issue 58): verl's own step functions, TransferQueue and data
containers, with a stand-in for the actor's Ray worker group (real verl, CPU).

verl 0.9.1's V1 trainer never asks the actor for Σπ² nor fetches it for the advantage step.
These tests run ``_compute_old_log_prob``, ``_compute_ref_log_prob`` and ``_compute_advantage``
of each V1 trainer class on a batch laid out as verl's agent loop writes it into a real
TransferQueue (Ray actors on 127.0.0.1), and check the Σπ² the estimator received and the
advantages it wrote against an independent float64 reference: with the plug-in, without it
(verl's failure), and with the upstream patch applied to a copy of verl's trainer.
"""

from __future__ import annotations

import copy
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")

# the `verl` extra installs it: an environment with verl and without it is incomplete
import ray  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from tensordict import NonTensorData, TensorDict  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopMetrics,
    AgentLoopOutput,
)
from verl.trainer.ppo.v1 import get_trainer_cls, trainer_base  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.transferqueue_utils import tqbridge  # noqa: E402

from otbrl.algos import compute_advantage  # noqa: E402
from otbrl.algos.advantages import ESTIMATORS, Estimator  # noqa: E402
from otbrl.errors import ConfigError  # noqa: E402
from otbrl.integrations.verl import estimators, trainer_v1  # noqa: E402
from otbrl.ops import token_stats  # noqa: E402
from tiny_models import tiny_causal_lm  # noqa: E402
from verl_v1_helpers import load_patched_trainer_base, verl_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPERATURE = 0.7
N = 4  # rollout.n: rows per prompt
OTB, TIR = "optimal_token_baseline", "tir_optimal_token_baseline"


@pytest.fixture(scope="module")
def transfer_queue():
    """A local Ray (2 logical CPUs) and TransferQueue, every address on 127.0.0.1: Ray keeps
    the loopback address (rather than this machine's outward one) when told it is no cluster,
    read at import by the workers and at ``ray.init`` by this process (imported already)."""
    from ray._private import ray_constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        # Ray starts its workers at nice 15: beside a busy CPU (make test's other suite) the
        # TransferQueue actors then took 190 s to start instead of 9 s
        mp.setenv("RAY_worker_niceness", "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        started = not ray.is_initialized()
        if started:
            ray.init(
                num_cpus=2,
                _node_ip_address="127.0.0.1",
                include_dashboard=False,
                log_to_driver=False,
                object_store_memory=100 * 1024**2,
            )
        units = {"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}
        conf = tq.init(OmegaConf.create(units))
        try:
            assert conf.controller.zmq_info.ip == "127.0.0.1"
            yield
        finally:
            tq.close()
            if started:
                ray.shutdown()


class StandInWorkerGroup:
    """What verl's RayWorkerGroup of ``ActorRolloutRefWorker`` does for ``compute_log_prob``,
    without Ray and FSDP (not available on CPU). The batch reaches the forward as a worker's
    does: verl's own ``tqbridge`` reads it from the TransferQueue into a TensorDict with the
    batch's ``extra_info`` as non-tensor flags, and puts the returned fields back. The forward
    is a tiny HF model per sequence and ``otbrl.ops.token_stats``; like verl's engines, it
    returns statistics over prompt + response (position t: the distribution of token t+1), and
    Σπ² only when the flag ``calculate_sum_pi_squared`` asks for it.
    """

    def __init__(self, model):
        self.model, self.flags, self.cpu_models = model, [], {}
        self.compute_log_prob = tqbridge()(self._forward)
        self.compute_ref_log_prob = self.compute_log_prob

    def _forward(self, data: TensorDict) -> TensorDict:
        want = bool(tu.get_non_tensor_data(data, "calculate_sum_pi_squared", False))
        temperature = tu.get_non_tensor_data(data, "temperature", 1.0)
        self.flags.append(want)
        out = {"log_probs": [], "entropy": [], "sum_pi_squared": []}
        with torch.no_grad():
            for seq in data["input_ids"].unbind():
                logits = self.model(input_ids=seq[None]).logits[0]
                stats = token_stats(logits, torch.roll(seq, -1), temperature=temperature)
                out["log_probs"].append(stats.log_probs)
                out["entropy"].append(stats.entropy)
                out["sum_pi_squared"].append(stats.sum_pi_squared)
        if not want:
            del out["sum_pi_squared"]
        nested = {k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in out.items()}
        td = TensorDict(nested, batch_size=[len(data)])
        td["metrics"] = NonTensorData({})
        return td

    # separate-async keeps π_old on the CPU between the mini-batches of one sync step
    def save_model_to_cpu(self, slot):
        self.cpu_models[slot] = copy.deepcopy(self.model.state_dict())

    def restore_model_from_cpu(self, slot):
        self.model.load_state_dict(self.cpu_models[slot])

    def clear_cpu_model(self, slot):
        del self.cpu_models[slot]


def _policy(seed: int):
    """A tiny model whose token distributions are peaked and differ from token to token (a
    random init is near-uniform: Σπ² ≈ 1/V everywhere would hide a misaligned token)."""
    model = tiny_causal_lm("llama", seed=seed).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    return model


def _put_rollouts(seed: int, *, holes: bool, prompts: int = 3) -> tuple[list[str], dict]:
    """Rollouts written into the TransferQueue as verl's ``AgentLoopWorkerTQ`` writes them
    (``AgentLoopOutput.as_dict`` plus its fields, keys ``{uid}_{session}_0``); returns the
    keys and the rows (ids, masks, rewards, uids) for the reference."""
    g = torch.Generator().manual_seed(seed)
    keys, fields, tags, rows = [], [], [], []
    for p in range(prompts):
        uid = f"{uuid.uuid4().hex[:8]}-p{p}"  # fresh keys for every test
        prompt = torch.randint(0, 64, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
        for s in range(N):
            length = int(torch.randint(1, 12, (1,), generator=g))
            response = torch.randint(0, 64, (length,), generator=g)
            mask = torch.ones(length, dtype=torch.int64)
            if holes and length > 3:  # a tool observation inside the response
                mask[1 : 1 + length // 3] = 0
            reward = float(torch.randn(1, generator=g))
            out = AgentLoopOutput(
                prompt_ids=prompt.tolist(),
                response_ids=response.tolist(),
                response_mask=mask.tolist(),
                response_logprobs=(-torch.rand(length, generator=g)).tolist(),
                reward_score=reward,
                num_turns=2,
                metrics=AgentLoopMetrics(),
            )
            field = out.as_dict()
            input_ids = torch.cat([prompt, response])
            field.update(uid=uid, session_id=s, loss_mask=field["response_mask"])
            field.update(input_ids=input_ids, position_ids=torch.arange(len(input_ids)))
            keys.append(f"{uid}_{s}_0")
            fields.append(field)
            tags.append({"status": "success", "seq_len": len(input_ids)})
            rows.append(dict(uid=uid, prompt=prompt, response=response, mask=mask, reward=reward))
    td = tu.list_of_dict_to_tensordict(fields)
    tq.kv_batch_put(keys=keys, partition_id="train", fields=td, tags=tags)
    return keys, rows


def _reference(model, rows) -> dict:
    """float64 log π(y) and Σπ² of each response token from a plain forward of prompt +
    response, OTB's inputs padded to [B, Lr] (built without verl's layout code)."""
    B, L = len(rows), max(len(r["response"]) for r in rows)
    ref = {k: torch.zeros(B, L, dtype=torch.float64) for k in ("old_log_probs", "sum_pi_squared")}
    mask, rewards = torch.zeros(B, L), torch.zeros(B, L)
    with torch.no_grad():
        for i, r in enumerate(rows):
            P, R = len(r["prompt"]), len(r["response"])
            logits = model(input_ids=torch.cat([r["prompt"], r["response"]])[None]).logits[0]
            logp = torch.log_softmax(logits.double() / TEMPERATURE, -1)[P - 1 : P + R - 1]
            ref["old_log_probs"][i, :R] = logp.gather(-1, r["response"][:, None])[:, 0]
            ref["sum_pi_squared"][i, :R] = logp.exp().pow(2).sum(-1)
            mask[i, :R] = r["mask"].float()
            rewards[i, R - 1] = r["reward"]  # verl's as_dict: the last response token
    ref.update(response_mask=mask, token_level_rewards=rewards)
    ref["index"] = np.array([r["uid"] for r in rows], dtype=object)
    return ref


def _read(keys, *names) -> dict:
    data = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=list(names))
    return {k: data[k].to_padded_tensor(0.0) for k in names}


def _trainer(cls, config, actor, ref_group):
    """A V1 trainer with what its step functions read (its ``__init__`` starts Ray worker
    groups, LLM servers and a dataloader)."""
    trainer = object.__new__(cls)
    trainer.config = config
    trainer.actor_rollout_wg, trainer.ref_policy_wg = actor, ref_group
    trainer.ref_in_actor, trainer.local_trigger_step = False, 0
    return trainer


def _run_steps(trainer, keys):
    """``_step_once``'s steps 4, 5 and 7 in its order (the rest needs GPUs and servers)."""
    batch = trainer_base.KVBatchMeta(
        keys=keys, tags=[{}] * len(keys), partition_id="train", extra_info={}
    )
    metrics = {}
    batch = trainer._compute_old_log_prob(batch, metrics)
    batch = trainer._compute_ref_log_prob(batch, metrics)
    return trainer._compute_advantage(batch, metrics), metrics


def _check_against_reference(keys, rows, pi_old, name, *, is_weights: bool):
    got = _read(keys, "sum_pi_squared", "old_log_probs", "advantages", "response_mask")
    ref = _reference(pi_old, rows)
    m = ref["response_mask"] > 0
    spread = ref["sum_pi_squared"][m]
    assert spread.max() - spread.min() > 0.3  # a one-token shift could not pass
    torch.testing.assert_close(got["response_mask"].float(), ref["response_mask"])
    for stat in ("sum_pi_squared", "old_log_probs"):
        assert got[stat].dtype == torch.float32
        torch.testing.assert_close(got[stat][m], ref[stat][m].float(), atol=1e-5, rtol=0)
    inputs = {k: v.float() if torch.is_tensor(v) else v for k, v in ref.items()}
    if is_weights:  # verl's rollout correction wrote them; OTB must have used them
        weights = _read(keys, "rollout_is_weights")["rollout_is_weights"]
        assert (weights[m] - 1).abs().max() > 0.1
        inputs["rollout_is_weights"] = weights
    want, _ = compute_advantage(name, **inputs)
    torch.testing.assert_close(got["advantages"], want, atol=1e-5, rtol=0)
    assert got["advantages"][m].abs().max() > 0.1


MODES = [
    ("sync", OTB, None),
    ("colocate_async", TIR, None),
    ("separate_async", OTB, "token"),
]


@pytest.mark.parametrize("mode,name,rollout_is", MODES)
def test_v1_steps_carry_sum_pi_squared_with_plugin(transfer_queue, mode, name, rollout_is):
    assert trainer_base.PPOTrainer._compute_old_log_prob.__module__ == trainer_v1.__name__
    config = verl_config(mode, name, temperature=TEMPERATURE, n=N, rollout_is=rollout_is)
    assert config.actor_rollout_ref.actor.calculate_sum_pi_squared is False  # the need asks
    keys, rows = _put_rollouts(seed=len(mode), holes=name == TIR)
    actor, ref_group = StandInWorkerGroup(_policy(1)), StandInWorkerGroup(_policy(2))
    trainer = _trainer(get_trainer_cls(mode), config, actor, ref_group)
    pi_old = copy.deepcopy(actor.model)
    if mode == "separate_async":
        # the second mini-batch of a sync step: the weights moved on since π_old was saved
        actor.save_model_to_cpu(0)
        with torch.no_grad():
            for param in actor.model.parameters():
                param.add_(0.05 * torch.randn_like(param))
        trainer.local_trigger_step = 1
    current = copy.deepcopy(actor.model.state_dict())
    _, metrics = _run_steps(trainer, keys)
    assert actor.flags == [True] and ref_group.flags == [False]
    assert "actor/entropy" in metrics
    _check_against_reference(keys, rows, pi_old, name, is_weights=rollout_is is not None)
    for key, value in actor.model.state_dict().items():  # separate-async put them back
        assert torch.equal(value, current[key]), key


def test_without_plugin_verl_fails_in_compute_advantage(transfer_queue):
    config = verl_config("sync", OTB, temperature=TEMPERATURE, n=N)
    keys, _ = _put_rollouts(seed=11, holes=False)
    actor = StandInWorkerGroup(_policy(1))
    trainer = _trainer(get_trainer_cls("sync"), config, actor, StandInWorkerGroup(_policy(2)))
    trainer_v1.unpatch_trainer_module(trainer_base)
    try:
        with pytest.raises(AssertionError, match="requires sum_pi_squared from actor"):
            _run_steps(trainer, keys)
    finally:
        trainer_v1.install_v1_trainer_patch()  # the module is imported: patched at once
    assert actor.flags == [False]  # verl's V1 trainer never asked for Σπ²
    assert trainer_base.PPOTrainer._compute_old_log_prob.__module__ == trainer_v1.__name__


def test_upstream_patch_applies_and_carries_sum_pi_squared(transfer_queue, tmp_path):
    """The patch in integrations/verl/ on a copy of verl's V1 trainer, neither the plug-in's
    trainer patch (another module) nor its estimators (verl's own OTB runs) in play."""
    patched = load_patched_trainer_base(tmp_path)
    assert not hasattr(patched.PPOTrainer._compute_old_log_prob, "_otbrl_original")
    hooks = {"on_step_end": lambda self: None, "on_sample_end": lambda self: None}
    Trainer = type("PatchedSync", (patched.PPOTrainer,), hooks)  # the abstract hooks only
    config = verl_config("sync", OTB, temperature=TEMPERATURE, n=N)
    config.actor_rollout_ref.actor.calculate_sum_pi_squared = True  # verl's own switch
    keys, rows = _put_rollouts(seed=12, holes=False)
    actor, ref_group = StandInWorkerGroup(_policy(1)), StandInWorkerGroup(_policy(2))
    trainer = _trainer(Trainer, config, actor, ref_group)
    pi_old = copy.deepcopy(actor.model)
    estimators.uninstall_estimators()
    try:
        _run_steps(trainer, keys)
    finally:
        estimators.install_estimators()
    assert actor.flags == [True] and ref_group.flags == [False]
    _check_against_reference(keys, rows, pi_old, OTB, is_weights=False)


SEPARATE_ASYNC_OK = {  # what PPOTrainerSeparateAsync.__init__ asserts before the base's
    "actor_rollout_ref.rollout.nnodes": 1,
    "actor_rollout_ref.rollout.checkpoint_engine.backend": "nccl",
}
REFUSED = [
    ("sync", OTB, {"algorithm.rollout_correction.bypass_mode": True}),
    ("colocate_async", TIR, {"actor_rollout_ref.actor.strategy": "torchtitan"}),
    (
        "separate_async",
        OTB,
        {**SEPARATE_ASYNC_OK, "actor_rollout_ref.model.use_fused_kernels": True},
    ),
    (
        "sync",
        "grpo",
        {
            "actor_rollout_ref.actor.calculate_sum_pi_squared": True,
            "actor_rollout_ref.actor.strategy": "megatron",
            "actor_rollout_ref.model.use_fused_kernels": True,
        },
    ),
    (
        "sync",
        OTB,
        {
            "actor_rollout_ref.model.use_fused_kernels": True,
            "actor_rollout_ref.model.fused_kernel_options.impl_backend": "otbrl",
            "actor_rollout_ref.model.use_remove_padding": False,
        },
    ),
]
KEYS = [
    "algorithm.rollout_correction.bypass_mode",
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend",
    "actor_rollout_ref.model.use_fused_kernels",
    "actor_rollout_ref.model.use_remove_padding",
]


def _config(mode, name, overrides):
    config = verl_config(mode, name, temperature=TEMPERATURE, n=N)
    for key, value in overrides.items():
        OmegaConf.update(config, key, value)
    return config


@pytest.mark.parametrize("case,key", list(zip(REFUSED, KEYS, strict=True)))
def test_path_that_cannot_carry_sum_pi_squared_is_refused_at_start(case, key):
    mode, name, overrides = case
    config = _config(mode, name, overrides)
    with pytest.raises(ConfigError) as err:
        get_trainer_cls(mode)(config)  # the check runs before verl builds anything
    assert err.value.key == key and key in str(err.value) and "\n" not in str(err.value)
    # a trainer built around __init__ is refused at its first old-log-prob step
    keeps_pi_old = SimpleNamespace(save_model_to_cpu=lambda slot: None)  # separate-async's
    trainer = _trainer(get_trainer_cls(mode), config, keeps_pi_old, None)
    with pytest.raises(ConfigError, match=key):
        trainer._compute_old_log_prob(None, {})


def test_paths_that_carry_it_are_accepted():
    fused = {
        "actor_rollout_ref.model.use_fused_kernels": True,
        "actor_rollout_ref.model.fused_kernel_options.impl_backend": "otbrl",
    }
    for mode, name, overrides in [
        ("sync", OTB, fused),
        ("separate_async", TIR, {"actor_rollout_ref.actor.strategy": "megatron"}),
        ("sync", "grpo", {"algorithm.rollout_correction.bypass_mode": True}),  # no Σπ² wanted
    ]:
        trainer_v1.check_v1_config(_config(mode, name, overrides))


def test_the_request_follows_otbrl_registry_not_names(monkeypatch):
    wanted = trainer_v1.sum_pi_squared_wanted
    assert wanted(_config("sync", OTB, {})) and wanted(_config("sync", TIR, {}))
    assert not wanted(_config("sync", "grpo", {})) and not wanted(_config("sync", "remax", {}))
    flag = {"actor_rollout_ref.actor.calculate_sum_pi_squared": True}
    assert wanted(_config("sync", "grpo", flag))  # the user's switch, as in the legacy trainer
    # verl's remax registered in otbrl with a need for Σπ²: now the V1 trainer asks for it
    needs = frozenset({"old_log_probs", "sum_pi_squared"})
    monkeypatch.setitem(ESTIMATORS, "remax", Estimator("remax", lambda **_: None, needs))
    assert wanted(_config("sync", "remax", {}))
