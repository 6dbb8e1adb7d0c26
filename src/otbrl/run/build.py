"""Build a run from its ``Plan``: the model path (the warm start), the rollout backend and the
sampler over it, the engines (policy, critic, reference), the losses and the data stream.

Nothing here validates configuration (``otbrl.run.plan`` did, before any model loaded) and
nothing here runs a step (``otbrl.run.trainer`` does): each builder turns settings the plan
accepted into one object, and ``build_run`` composes them in the order a run needs.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

from otbrl.algos import loss_terms
from otbrl.config import Config, ConfigError
from otbrl.data import PromptDataset
from otbrl.engine import parallel
from otbrl.engine.engine import Engine
from otbrl.engine.optim import OptimConfig
from otbrl.engine.precision import get_precision
from otbrl.engine.world import World
from otbrl.models import (
    eos_token_ids,
    load_model,
    load_value_model,
    resolve_model_dir,
)
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
from otbrl.run.plan import Plan
from otbrl.run.sampling import Scoring
from otbrl.run.seeds import step_seed
from otbrl.run.sft import ensure_warm_start


def warm_start(cfg: Config) -> Path:
    """The built-in model after its cached supervised warm start (``otbrl sft``)."""
    return ensure_warm_start(cfg.sft.cache_dir, cfg.sft, task=cfg.data.task, seed=cfg.trainer.seed)


def model_path(cfg: Config) -> Path:
    """``model.path`` as a local directory (a hub id resolved in the local HF cache), or the
    warm-started built-in model when it is ``builtin``."""
    return warm_start(cfg) if cfg.model.path == "builtin" else resolve_model_dir(cfg.model.path)


def weights_dtype(precision: str, *, frozen: bool) -> str:
    """The dtype a model's weights load in under ``precision``: its storage (float32 master
    weights for bf16-mixed), except frozen weights under bf16-mixed, which need no master copy
    and stay bf16."""
    p = get_precision(precision)
    return "bfloat16" if frozen and p.mixed else p.storage_name


def policy_dtype(cfg: Config) -> str:
    """The dtype the policy's weights load in (``weights_dtype``): a LoRA model's base is frozen
    (its adapters are the float32 master weights)."""
    return weights_dtype(cfg.model.precision, frozen=bool(cfg.model.lora.rank))


def load_policy(cfg: Config, path: Path, tokenizer):
    """The policy at ``path`` in ``policy_dtype(cfg)``, its generation config from the run's
    ``tokenizer`` (``Plan.tokenizer``: loaded once, by the plan), with the LoRA adapters of
    ``model.lora`` injected (rank > 0)."""
    model = load_model(path, tokenizer, dtype=policy_dtype(cfg))
    if cfg.model.lora.rank:
        adapters = get_precision(cfg.model.precision).storage  # float32 under bf16-mixed
        add_lora(model, cfg.model.lora, adapter_dtype=adapters, seed=cfg.trainer.seed)
    return model


def policy_loss(cfg: Config, *, regularizers: bool = True) -> loss_terms.Loss:
    """The actor's loss from the ``actor`` group. ``regularizers=False`` leaves out the entropy
    and KL terms: the policy-gradient part alone, which ``otbrl variance`` measures — built here
    too, so the two cannot disagree (aggregation, clipping, horizon)."""
    a = cfg.actor
    return loss_terms.build_loss(
        policy_loss=a.policy_loss,
        loss_agg_mode=a.loss_agg_mode,
        horizon=cfg.rollout.max_new_tokens,
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coeff=a.entropy_coeff if regularizers else 0.0,
        kl_loss_coef=a.kl_loss_coef if a.use_kl_loss and regularizers else 0.0,
        kl_loss_type=a.kl_loss_type,
    )


def critic_loss(cfg: Config) -> loss_terms.Loss:
    """The critic's clipped value loss."""
    return loss_terms.build_value_loss(
        cliprange_value=cfg.critic.cliprange_value,
        loss_agg_mode=cfg.actor.loss_agg_mode,
        horizon=cfg.rollout.max_new_tokens,
    )


def scoring(
    cfg: Config, plan: Plan, reward_model: RewardModel | None = None, *, pool: bool = False
) -> Scoring:
    """How the run scores responses: the plan's reward function, ``reward.*`` and the loaded
    ``reward_model`` (``build_run`` loads it when the plan needs one). ``pool``: with
    ``reward.workers`` > 0, start the worker processes (the trainer does; ``close()`` them
    through ``Scoring.pool``)."""
    workers = RewardPool(cfg.reward) if pool and cfg.reward.workers > 0 else None
    return Scoring(plan.reward_fn, cfg.reward, pool=workers, reward_model=reward_model)


def build_backend(
    cfg: Config, model, tokenizer, world: World, model_dir: Path, context: int
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
    compute = get_precision(cfg.model.precision)
    autocast = compute.compute if compute.mixed else None
    if cfg.rollout.name == "hf":
        if world.mesh is None:
            return HFRollout(model, tokenizer, autocast=autocast)
        # a plain copy (adapters merged): the sync streams plain HF names
        copy_ = unload_lora(copy.deepcopy(model)).eval().requires_grad_(False).to(world.device)
        return HFRollout(copy_, tokenizer, owns_copy=True, autocast=autocast)
    v = cfg.rollout.vllm
    if cfg.rollout.mode == "server":
        server = cfg.rollout.server
        # several data-parallel ranks: each its share of the urls (or servers of its own) and
        # its own bucket directory
        shared = server.weights_dir
        server = dataclasses.replace(
            server,
            urls=list(server.urls)[world.dp_rank :: world.dp_size],
            weights_dir=None if shared is None else str(weights_subdir(cfg, shared, world)),
        )
        return ServerRollout(
            model_dir,
            server,
            v,
            max_model_len=context,
            seed=step_seed(cfg.trainer.seed, 0, world.dp_rank),
            log_dir=Path(cfg.trainer.output_dir) / "servers",
            partial_rollout=cfg.rollout.partial_rollout,
        )
    serve_adapter = bool(cfg.model.lora.rank) and cfg.model.lora.sync == "adapter"
    return VLLMRollout(
        model_dir,
        v,
        max_model_len=context,
        seed=step_seed(cfg.trainer.seed, 0, world.dp_rank),
        lora=adapter_config(model, str(model_dir)) if serve_adapter else None,
    )


def sync_rollout(backend: RolloutBackend, policy: Engine) -> None:
    """Stream the policy's weights into ``backend``: its adapters alone when the backend serves
    them (``model.lora.sync=adapter``), else the plain (LoRA: merged) weights. Collective on
    several processes."""
    adapter = bool(getattr(backend, "serves_adapter", False))
    backend.sync_weights(policy.full_tensors(adapter_only=adapter))


def build_sampler(
    cfg: Config, tools, backend: RolloutBackend, tokenizer, eos_ids, model_name: str
) -> Sampler:
    """What the run samples with: the agent loop of ``rollout.multi_turn`` over ``backend``
    when ``tools`` (the plan's) are set (with ``rollout.mode=server`` one loop per sample,
    the colocated engine's loop turn-synchronous), else the backend itself."""
    if not tools:
        return backend
    return make_agent(
        backend,
        tokenizer,
        tools,
        cfg.rollout.multi_turn,
        eos_token_ids=eos_ids,
        model=model_name,
        per_trajectory=cfg.rollout.mode == "server",  # one agent loop per sample
        max_concurrent_trajectories=cfg.rollout.max_concurrent_trajectories,
    )


def weights_subdir(cfg: Config, shared: str, world: World) -> Path:
    """This rank's bucket directory under a shared ``rollout.server.weights_dir``: one per run
    (named by a hash of the run's absolute output directory) and per data-parallel rank, so two
    runs that share the directory never write, or delete, each other's buckets."""
    run = hashlib.sha256(str(Path(cfg.trainer.output_dir).resolve()).encode()).hexdigest()[:12]
    return Path(shared) / f"run-{run}" / f"rank-{world.dp_rank}"


def build_reward_model(cfg: Config, world: World) -> RewardModel:
    """The frozen reward model of ``reward.model.path`` on this rank's device. On several
    processes its parameters are FSDP2-sharded over the data-parallel ranks, as the
    reference's are (every rank scores its own rows, the same number of forwards); with
    tensor parallelism each rank keeps a full copy (its TP plan is the causal LM's)."""
    model = RewardModel(
        cfg.reward.model.path,
        dtype=get_precision(cfg.model.precision).storage_name,
        device=world.device,
        micro_batch_size=cfg.reward.model.micro_batch_size,
    )
    mesh = world.mesh
    if mesh is not None and mesh["tp"].size() == 1:
        policy = get_precision(cfg.model.precision).fsdp_policy()
        parallel.apply_fsdp(model.model, parallel.fsdp_mesh(mesh), policy)
    return model


def build_teacher(cfg: Config, tokenizer, common: dict) -> Engine:
    """The frozen teacher of ``algorithm.distill``: an engine of its own (sharded as the
    reference is), in its own precision — the policy's weights dtype when unset, so that a
    teacher equal to the policy scores exactly as the policy does — and micro-batches. Loaded
    with the run's ``tokenizer`` (the preflight checked that the teacher's is the same)."""
    d = cfg.algorithm.distill
    if d.precision is None:
        dtype, precision = policy_dtype(cfg), cfg.model.precision
    else:
        dtype, precision = weights_dtype(d.precision, frozen=True), d.precision
    model = load_model(resolve_model_dir(d.teacher_path), tokenizer, dtype=dtype)
    micro = d.micro_batch_size or cfg.actor.micro_batch_size
    options = {**common, "precision": precision}
    budget = cfg.actor.max_tokens_per_micro_batch
    return Engine(
        model,
        None,
        name="teacher",
        micro_batch_size=micro,
        max_tokens_per_micro_batch=budget,
        **options,
    )


@dataclass
class RunParts:
    """Everything a run is built from. ``engines``: the trained ones (``policy``, and
    ``critic`` when the plan needs values), checkpointed together; ``reference``: the frozen
    reference policy or None; ``teacher``: the frozen distillation teacher or None.
    ``sampler``: ``backend``, or the agent loop over it. ``reward_model``: the frozen learned
    reward model (``reward.model.path``) or None."""

    tokenizer: object
    eos_ids: list[int]
    dataset: PromptDataset
    backend: RolloutBackend
    sampler: Sampler
    engines: dict[str, Engine]
    reference: Engine | None
    teacher: Engine | None
    policy_loss: loss_terms.Loss
    critic_loss: loss_terms.Loss | None
    reward_model: RewardModel | None = None


def build_run(cfg: Config, plan: Plan, world: World, path: Path) -> RunParts:
    """Load the policy from ``path`` and build the parts of the run for this process, in the
    order they must come: the rollout backend before the engine shards the model (an HF backend
    on several processes copies it), then the engines."""
    tokenizer = plan.tokenizer
    model = load_policy(cfg, path, tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    dataset = PromptDataset(  # the plan measured every prompt already: no tokenizer here
        plan.train_rows,
        None,
        max_prompt_length=cfg.data.max_prompt_length,
        batch_size=cfg.data.train_batch_size,
        seed=cfg.data.seed,
        tools=plan.tools,
    )
    backend = build_backend(
        cfg, model, tokenizer, world, path, plan.longest_prompt + cfg.rollout.max_new_tokens
    )
    sampler = build_sampler(cfg, plan.tools, backend, tokenizer, eos_ids, str(path))
    a = cfg.actor
    common = {
        "world": world,
        "strategy": plan.spec.dims.strategy,
        "packed": cfg.model.use_remove_padding,
        "temperature": cfg.rollout.temperature,
        "seed": cfg.trainer.seed,
        "precision": cfg.model.precision,
        "gradient_checkpointing": cfg.model.gradient_checkpointing,
    }
    sequences = plan.spec.mini_batch_size * cfg.rollout.n
    engines = {
        "policy": Engine(
            model,
            OptimConfig.from_group(a),
            name="policy",
            fused=a.use_fused_kernels,
            mini_batch_size=sequences,
            **common,
        )
    }
    if plan.spec.use_critic:
        # the critic stays full-parameter (a fresh value head has nothing to adapt from)
        value_model = load_value_model(
            cfg.critic.model_path or path, dtype=get_precision(cfg.model.precision).storage_name
        )
        engines["critic"] = Engine(
            value_model,
            OptimConfig.from_group(cfg.critic),
            name="critic",
            value=True,
            mini_batch_size=sequences,
            **common,
        )
    reference = None
    if plan.spec.use_reference and cfg.model.lora.rank:
        # the base model is the policy with its adapters disabled: no second copy
        reference = engines["policy"].without_adapters(micro_batch_size=a.micro_batch_size)
    elif plan.spec.use_reference:
        # the policy's precision, so that KL = 0 before the first update
        ref_model = load_model(path, tokenizer, dtype=policy_dtype(cfg))
        reference = Engine(
            ref_model,
            None,
            name="reference",
            micro_batch_size=a.micro_batch_size,
            max_tokens_per_micro_batch=a.max_tokens_per_micro_batch,
            **common,
        )
    teacher = build_teacher(cfg, tokenizer, common) if plan.spec.use_teacher else None
    if cfg.model.lora.adapter_path is not None and cfg.rollout.name == "vllm":
        # the engine started from the base model: it must sample with the saved adapter
        sync_rollout(backend, engines["policy"])
    reward_model = None
    if plan.spec.use_reward_model:
        reward_model = build_reward_model(cfg, world)
    return RunParts(
        tokenizer=tokenizer,
        eos_ids=eos_ids,
        dataset=dataset,
        backend=backend,
        sampler=sampler,
        engines=engines,
        reference=reference,
        teacher=teacher,
        policy_loss=policy_loss(cfg),
        critic_loss=critic_loss(cfg) if plan.spec.use_critic else None,
        reward_model=reward_model,
    )
