"""Build a run from its ``Plan``: the policy's model (after the warm start), the rollout backend
and the sampler over it, the batch source, the engines (policy, critic, reference, teacher),
the losses and the scoring.

Nothing here validates configuration or decides anything (``otbrl.run.spec.resolve`` did,
before any model loaded: every builder reads the ``RunSpec`` and the plan, never the raw
config) and nothing here runs a step (``otbrl.run.trainer`` does): each builder turns what the
spec decided into one object, and ``build_run`` composes them in the order a run needs.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from otbrl.algos import loss_terms
from otbrl.config import ConfigError
from otbrl.data import PromptDataset
from otbrl.engine import parallel
from otbrl.engine.frozen import FrozenEngine
from otbrl.engine.precision import get_precision
from otbrl.engine.trainable import TrainableEngine
from otbrl.engine.world import World
from otbrl.models import eos_token_ids, load_model, load_value_model, resolve_model_dir
from otbrl.models.lora import adapter_config, add_lora, unload_lora
from otbrl.rewards.pool import RewardPool
from otbrl.rewards.reward_model import RewardModel
from otbrl.rollout import (
    HFRollout,
    RolloutBackend,
    Sampler,
    ServerRollout,
    VLLMRollout,
    make_agent,
)
from otbrl.run.evaluate import Validator
from otbrl.run.plan import Plan
from otbrl.run.sampling import Scoring
from otbrl.run.seeds import step_seed
from otbrl.run.sft import ensure_warm_start
from otbrl.run.sources import AsyncSource, BatchSource, DynamicSampling, Rounds, SyncSource
from otbrl.run.spec import EnginePlan, ModelSpec, RunSpec


def model_path(model: ModelSpec) -> Path:
    """The policy's weights as a local directory: ``model.path`` (a hub id resolved in the
    local HF cache), or the built-in model after its cached supervised warm start (``otbrl
    sft``) when it is ``builtin``."""
    w = model.warm_start
    if w is not None:
        return ensure_warm_start(w.cache_dir, w.settings, task=w.task, seed=w.seed)
    return resolve_model_dir(model.path)


def load_policy(spec: RunSpec, path: Path, tokenizer) -> nn.Module:
    """The policy at ``path`` in ``spec.model.dtype``, its generation config from the run's
    ``tokenizer`` (``Plan.tokenizer``: loaded once, by the plan), with the LoRA adapters of
    ``spec.model.lora`` injected (seeded by the run's seed)."""
    m = spec.model
    model = load_model(path, tokenizer, dtype=m.dtype)
    if m.lora is not None:
        add_lora(model, m.lora, adapter_dtype=getattr(torch, m.adapter_dtype), seed=spec.seed)
    return model


def policy_loss(spec: RunSpec, *, regularizers: bool = True) -> loss_terms.Loss:
    """The actor's loss (``spec.policy_loss``). ``regularizers=False`` leaves out the entropy
    and KL terms: the policy-gradient part alone, which ``otbrl variance`` measures — built here
    too, so the two cannot disagree (aggregation, clipping, horizon)."""
    options = dict(spec.policy_loss)
    if not regularizers:
        options.update(entropy_coeff=0.0, kl_loss_coef=0.0)
    return loss_terms.build_loss(**options)


def critic_loss(spec: RunSpec) -> loss_terms.Loss | None:
    """The critic's clipped value loss (``spec.critic_loss``), or None without a critic."""
    if spec.critic_loss is None:
        return None
    return loss_terms.build_value_loss(**spec.critic_loss)


def scoring(plan: Plan, reward_model: RewardModel | None = None, *, pool: bool = False) -> Scoring:
    """How the run scores responses: the plan's reward function, ``reward.*`` and the loaded
    ``reward_model`` (``build_run`` loads it when the spec needs one). ``pool``: with
    ``reward.workers`` > 0, start the worker processes (the trainer does; ``close()`` them
    through ``Scoring.pool``)."""
    settings = plan.spec.reward
    workers = RewardPool(settings) if pool and settings.workers > 0 else None
    return Scoring(plan.reward_fn, settings, pool=workers, reward_model=reward_model)


def build_backend(
    spec: RunSpec, model, tokenizer, world: World, model_dir: Path, context: int
) -> RolloutBackend:
    """The rollout backend of ``rollout.name`` for this process.

    ``hf``: one process samples with the training ``model`` itself (no weight sync); several
    keep an unsharded copy made here, before the engine shards the model, synced after every
    update. ``vllm``: one in-process engine per rank, started from ``model_dir`` (the policy's
    initial weights) with a context of ``context`` tokens (the longest prompt + the response
    budget). Every rank calls this at the same point (vLLM's start-up is collective).
    """
    if len(tokenizer) > model.config.vocab_size:
        raise ConfigError(
            f"'model.path': the tokenizer has {len(tokenizer)} tokens, the model's vocabulary "
            f"{model.config.vocab_size}: they do not belong together",
            "model.path",
        )
    r = spec.rollout
    seed = step_seed(spec.seed, 0, world.dp_rank)
    if r.name == "hf":
        autocast = None if spec.rollout_autocast is None else getattr(torch, spec.rollout_autocast)
        if world.mesh is None:
            return HFRollout(model, tokenizer, autocast=autocast)
        # a plain copy (adapters merged): the sync streams plain HF names
        copy_ = unload_lora(copy.deepcopy(model)).eval().requires_grad_(False).to(world.device)
        return HFRollout(copy_, tokenizer, owns_copy=True, autocast=autocast)
    if r.mode == "server":
        # several data-parallel ranks: each its share of the urls (or servers of its own) and
        # its own bucket directory
        shared = r.server.weights_dir
        server = dataclasses.replace(
            r.server,
            urls=list(r.server.urls)[world.dp_rank :: world.dp_size],
            weights_dir=None if shared is None else str(weights_subdir(spec, shared, world)),
        )
        return ServerRollout(
            model_dir,
            server,
            r.vllm,
            max_model_len=context,
            seed=seed,
            log_dir=Path(spec.trainer.output_dir) / "servers",
            partial_rollout=r.partial_rollout,
        )
    lora = adapter_config(model, str(model_dir)) if spec.serve_adapter else None
    return VLLMRollout(model_dir, r.vllm, max_model_len=context, seed=seed, lora=lora)


def build_sampler(
    spec: RunSpec, tools, backend: RolloutBackend, tokenizer, eos_ids, model_name: str, env=None
) -> Sampler:
    """What the run samples with: the agent loop of ``rollout.multi_turn`` over ``backend``
    when ``tools`` (the plan's) or an environment factory ``env`` (the plan's) is set (with
    ``rollout.mode=server`` one loop per sample, the colocated engine's loop
    turn-synchronous), else the backend itself."""
    if not tools and env is None:
        return backend
    r = spec.rollout
    return make_agent(
        backend,
        tokenizer,
        tools,
        r.multi_turn,
        eos_token_ids=eos_ids,
        model=model_name,
        env=env,
        per_trajectory=r.mode == "server",  # one agent loop per sample
        max_concurrent_trajectories=r.max_concurrent_trajectories,
    )


def weights_subdir(spec: RunSpec, shared: str, world: World) -> Path:
    """This rank's bucket directory under a shared ``rollout.server.weights_dir``: one per run
    (named by a hash of the run's absolute output directory) and per data-parallel rank, so two
    runs that share the directory never write, or delete, each other's buckets."""
    out = str(Path(spec.trainer.output_dir).resolve())
    return (
        Path(shared)
        / f"run-{hashlib.sha256(out.encode()).hexdigest()[:12]}"
        / (f"rank-{world.dp_rank}")
    )


def build_reward_model(spec: RunSpec, world: World) -> RewardModel:
    """The frozen reward model of ``reward.model.path`` on this rank's device. On several
    processes its parameters are FSDP2-sharded over the data-parallel ranks, as the
    reference's are (every rank scores its own rows, the same number of forwards); with
    tensor parallelism each rank keeps a full copy (its TP plan is the causal LM's)."""
    settings = spec.reward.model
    model = RewardModel(
        settings.path,
        dtype=spec.reward_model_dtype,
        device=world.device,
        micro_batch_size=settings.micro_batch_size,
    )
    mesh = world.mesh
    if mesh is not None and mesh["tp"].size() == 1:
        policy = get_precision(spec.engines["policy"].spec.precision).fsdp_policy()
        parallel.apply_fsdp(model.model, parallel.fsdp_mesh(mesh), policy)
    return model


def build_source(
    spec: RunSpec, plan: Plan, sampler: Sampler, backend: RolloutBackend, eos_ids, score, world
) -> BatchSource:
    """The batch source of the spec: synchronous rounds, DAPO's dynamic sampling over them, and
    a producer ahead of training when ``trainer.max_staleness`` > 0 (its rounds agree with no
    other rank: each rank's servers sample alone)."""
    dataset = PromptDataset(  # the plan measured every prompt already: no tokenizer here
        plan.train_rows,
        None,
        max_prompt_length=spec.max_prompt_length,
        batch_size=spec.train_batch_size,
        seed=spec.data_seed,
        tools=plan.tools,
    )
    rounds = Rounds(
        sampler=sampler,
        rollout=backend,
        tokenizer=plan.tokenizer,
        dataset=dataset,
        scoring=score,
        world=world,
        params=spec.sampling,
        stop_token_ids=tuple(eos_ids),
        seed=spec.seed,
        quota=spec.train_batch_size // world.dp_size,
        max_prompt_length=spec.max_prompt_length,
        overlong=spec.overlong,
    )
    staleness = spec.trainer.max_staleness
    source = SyncSource(rounds)
    if spec.max_sample_rounds is not None:
        source = DynamicSampling(rounds, max_rounds=spec.max_sample_rounds, agree=staleness == 0)
    if staleness > 0:
        return AsyncSource(
            source, max_staleness=staleness, stale_samples=spec.rollout.stale_samples
        )
    return source


def build_engine(
    plan: EnginePlan, model: nn.Module, name: str, world: World
) -> FrozenEngine | TrainableEngine:
    """The engine ``plan`` describes over ``model``: trainable with its optimizer settings,
    frozen without."""
    if plan.optim is None:
        return FrozenEngine(model, plan.spec, world=world, name=name)
    return TrainableEngine(
        model,
        plan.optim,
        plan.spec,
        world=world,
        name=name,
        mini_batch_size=plan.mini_batch_size,
        seed=plan.seed,
    )


@dataclass
class RunParts:
    """Everything a run is built from. ``engines``: the trained ones (``policy``, and
    ``critic`` when the spec needs values), checkpointed together; ``frozen``: the frozen ones
    the spec needs (``reference``, ``teacher``). ``sampler``: ``backend``, or the agent loop
    over it; ``source``: where the trainer's batches come from; ``scoring``: how responses are
    scored (with its worker pool, when ``reward.workers`` > 0); ``validator``: the run's
    validation on the plan's validation rows."""

    tokenizer: object
    eos_ids: list[int]
    backend: RolloutBackend
    sampler: Sampler
    source: BatchSource
    engines: dict[str, TrainableEngine]
    frozen: dict[str, FrozenEngine]
    policy_loss: loss_terms.Loss
    critic_loss: loss_terms.Loss | None
    scoring: Scoring
    validator: Validator

    def close(self) -> None:
        """Stop what the parts run, in the order it must go: the source's producer before the
        servers, the rollout before the process group (a vLLM engine holds groups), the reward
        workers."""
        self.source.close()
        self.backend.close()
        if self.scoring.pool is not None:
            self.scoring.pool.close()


def build_run(plan: Plan, world: World, path: Path) -> RunParts:
    """Load the policy from ``path`` and build the parts of the run for this process, in the
    order they must come: the rollout backend before the engine shards the model (an HF backend
    on several processes copies it), then the engines, each loaded as its ``EnginePlan`` says
    (from ``path`` unless it names another model; the LoRA reference a view of the policy)."""
    spec, tokenizer = plan.spec, plan.tokenizer
    model = load_policy(spec, path, tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    backend = build_backend(
        spec, model, tokenizer, world, path, plan.longest_prompt + spec.sampling.max_tokens
    )
    sampler = build_sampler(spec, plan.tools, backend, tokenizer, eos_ids, str(path), plan.env)
    engines = {"policy": build_engine(spec.engines["policy"], model, "policy", world)}
    if "critic" in spec.engines:
        critic = spec.engines["critic"]
        value_model = load_value_model(critic.path or path, dtype=critic.dtype)
        engines["critic"] = build_engine(critic, value_model, "critic", world)
    frozen: dict[str, FrozenEngine] = {}
    for name in ("reference", "teacher"):
        if name not in spec.engines:
            continue
        e = spec.engines[name]
        if e.view:
            frozen[name] = engines["policy"].without_adapters(name=name, micro=e.spec.micro)
        else:
            where = path if e.path is None else resolve_model_dir(e.path)
            frozen[name] = build_engine(e, load_model(where, tokenizer, dtype=e.dtype), name, world)
    reward_model = build_reward_model(spec, world) if spec.uses("reward_model") else None
    score = scoring(plan, reward_model, pool=True)
    return RunParts(
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        backend=backend,
        sampler=sampler,
        source=build_source(spec, plan, sampler, backend, eos_ids, score, world),
        engines=engines,
        frozen=frozen,
        policy_loss=policy_loss(spec),
        critic_loss=critic_loss(spec),
        scoring=score,
        validator=Validator(
            sampler, backend, tokenizer, plan.val_rows, spec, world, tuple(eos_ids), score
        ),
    )
