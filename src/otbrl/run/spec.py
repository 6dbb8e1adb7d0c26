"""Resolve a run: every decision the configuration alone fixes, taken once, into a ``RunSpec``.

``resolve(cfg, world_size)`` is pure — no file, no tokenizer, no network, no model: it reads
the config and the registries (estimators and their needs, KL kinds), decides which engine
provides each need (``otbrl.run.needs``: a need no layer provides is a one-line ``ConfigError``
naming the key to set, not a crash deep in a run), the parallel layout, the batch sizes, the
estimator's options, the off-policy correction, how overlong prompts are handled, how the
rollout samples, which engines exist and how each runs (precision, micro-batches, the LoRA
reference as a view), where the policy's weights come from and the losses' options. The I/O
checks come after it, once (``otbrl.run.plan.preflight``); ``otbrl.run.build`` turns the spec
into objects and the trainer follows it: below the run layer the code gets this spec or its own
component config, never the raw config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from otbrl.algos.advantages import ESTIMATORS
from otbrl.config import Config, SFTConfig, TrainerConfig, to_dict
from otbrl.engine.dims import ParallelDims
from otbrl.engine.optim import OptimConfig
from otbrl.engine.precision import get_precision
from otbrl.engine.spec import EngineSpec, MicroBatchConfig
from otbrl.models.config import LoraConfig
from otbrl.rewards.config import RewardConfig
from otbrl.rollout import SamplingParams
from otbrl.rollout.config import RolloutConfig
from otbrl.run.needs import (
    SOURCES,
    check_options,
    check_providers,
    check_registries,
    correction_mode,
    estimator_options,
    stat_needs,
    stats_in_update,
)


@dataclass(frozen=True)
class WarmStart:
    """The built-in model's supervised warm start (``model.path=builtin``): ``otbrl sft`` with
    ``settings`` on ``task``, seeded by ``seed``, cached under ``cache_dir``."""

    cache_dir: str
    settings: SFTConfig
    task: str
    seed: int


@dataclass(frozen=True)
class ModelSpec:
    """The policy's model as ``otbrl.run.build`` loads it: from ``path`` (a local directory or a
    hub id; ``warm_start`` instead when it is ``builtin``), its weights in ``dtype``, with the
    LoRA adapters of ``lora`` added in ``adapter_dtype`` (None: full fine-tuning)."""

    path: str
    warm_start: WarmStart | None
    dtype: str
    lora: LoraConfig | None = None
    adapter_dtype: str | None = None


@dataclass(frozen=True)
class EnginePlan:
    """One engine of the run: how it runs (``spec``), where its model loads from (``path``;
    None: the policy's model directory) in which ``dtype``; ``view``: it is the policy's own
    model with its adapters disabled (the LoRA reference: nothing loaded). A trainable engine
    has its ``optim`` settings, *global* sequences per optimizer step (``mini_batch_size``) and
    the ``seed`` of its mini-batch shuffling."""

    spec: EngineSpec
    path: str | None = None
    dtype: str = "float32"
    view: bool = False
    optim: OptimConfig | None = None
    mini_batch_size: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class RunSpec:
    """What ``resolve`` decided; ``otbrl.run.build`` builds exactly this and the trainer follows it.

    ``needs``: batch statistics the estimator, the losses and the enabled metrics need (each has
    a ``SOURCES`` entry). ``dims``: the parallel layout. ``mini_batch_size``: prompts per
    optimizer step. ``estimator`` and ``estimator_options``: the registry's advantage estimator
    and the keyword options it is called with. ``correction``: the ``rollout_is_weights`` mode
    (``algorithm.off_policy`` or ``algorithm.rollout_correction``), ``correction_cap`` its C.
    ``kl_in_reward_coef``: the in-reward KL's weight (None: off). ``distill_coef``: the weight
    of the teacher's per-token signal in the rewards (None: no distillation);
    ``distill_task_reward``: whether the task's reward is trained on beside it.
    ``max_sample_rounds``: under dynamic sampling, the rounds of prompts a step may sample to
    fill its batch with groups that carry signal (None: no dynamic sampling). ``overlong``:
    the sampling step's mode for prompts over ``data.max_prompt_length`` (the preflight drops
    them under ``filter``: any left then would be a bug, ``error``) and ``max_prompt_length``
    the limit. ``sampling`` / ``validation``: how training and validation sample (the stop ids
    and each batch's seed are added where they are known: ``dataclasses.replace``), validation
    in batches of ``validation_batch_size`` prompts.

    What build makes: ``model`` (the policy's weights), ``engines`` (``policy``, and
    ``critic``, ``reference``, ``teacher`` where the needs call for them), ``rollout`` (the
    rollout's own settings, ``rollout.*``) with ``serve_adapter`` (the vLLM engine serves the
    LoRA adapter and takes it alone at each sync), ``sync_at_start`` (the rollout may start
    with other weights than the policy's: servers the user started, or a vLLM engine started
    from the base model of a saved adapter — the policy's are synced before the first step)
    and ``rollout_autocast`` (the dtype an HF
    rollout samples in under mixed precision, None: the weights'), ``reward`` (``reward.*``)
    with ``reward_model_dtype``, the losses' options ``policy_loss`` / ``critic_loss``
    (``otbrl.algos.loss_terms.build_loss`` / ``build_value_loss``; None: no critic).
    The run: ``seed`` (``trainer.seed``), ``train_batch_size`` prompts a step and the data
    stream's ``data_seed``, ``trainer`` (the loop's own settings, ``trainer.*``), and
    ``record``: the whole configuration as plain values, kept with checkpoints and logs (a
    record, never read for a decision).
    """

    needs: frozenset[str]
    dims: ParallelDims
    mini_batch_size: int
    estimator: str
    estimator_options: Mapping[str, Any]
    correction: str
    correction_cap: float
    kl_in_reward_coef: float | None
    distill_coef: float | None
    distill_task_reward: bool
    max_sample_rounds: int | None
    overlong: str
    max_prompt_length: int
    sampling: SamplingParams
    validation: SamplingParams
    validation_batch_size: int
    seed: int
    train_batch_size: int
    data_seed: int
    model: ModelSpec
    engines: Mapping[str, EnginePlan]
    rollout: RolloutConfig
    serve_adapter: bool
    sync_at_start: bool
    rollout_autocast: str | None
    reward: RewardConfig
    reward_model_dtype: str
    policy_loss: Mapping[str, Any]
    critic_loss: Mapping[str, Any] | None
    trainer: TrainerConfig
    stats_in_update: str | None = None
    record: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def uses(self, engine: str) -> bool:
        """Whether the run has ``engine`` (``policy``, ``critic``, ``reference``, ``teacher``:
        ``engines`` holds each one the needs call for) or a ``reward_model`` (its scores)."""
        return engine in self.engines or any(SOURCES[k].engine == engine for k in self.needs)

    @property
    def response_space(self) -> bool:
        """The estimator's baseline counts positions in response space (TIR-OTB): the step's
        metrics count its zero tail there too (``Estimator.response_space``)."""
        return ESTIMATORS[self.estimator].response_space

    def outputs(self, engine: str) -> frozenset[str]:
        """The forward outputs ``engine`` computes for the step's batch (may be empty)."""
        return frozenset(SOURCES[k].output for k in self.needs if SOURCES[k].engine == engine)

    def batch_stats(self, engine: str, outputs: dict) -> dict:
        """``engine``'s forward ``outputs`` renamed to the batch keys the spec needs."""
        return {
            key: outputs[src.output]
            for key, src in SOURCES.items()
            if src.engine == engine and key in self.needs
        }


def weights_dtype(precision: str, *, frozen: bool) -> str:
    """The dtype a model's weights load in under ``precision``: its storage (float32 master
    weights for bf16-mixed), except frozen weights under bf16-mixed, which need no master copy
    and stay bf16."""
    p = get_precision(precision)
    return "bfloat16" if frozen and p.mixed else p.storage_name


def model_spec(cfg: Config) -> ModelSpec:
    """Where the policy's weights come from and how they load: a LoRA model's base is frozen
    (its adapters, in the precision's storage dtype, are the float32 master weights)."""
    m = cfg.model
    warm = None
    if m.path == "builtin":
        warm = WarmStart(cfg.sft.cache_dir, cfg.sft, cfg.data.task, cfg.trainer.seed)
    lora = m.lora if m.lora.rank else None
    return ModelSpec(
        path=m.path,
        warm_start=warm,
        dtype=weights_dtype(m.precision, frozen=lora is not None),
        lora=lora,
        adapter_dtype=get_precision(m.precision).storage_name if lora is not None else None,
    )


def engine_plans(
    cfg: Config, dims: ParallelDims, needs: frozenset[str], mini_batch_size: int
) -> dict[str, EnginePlan]:
    """The engines the ``needs`` call for, each with how it runs: the policy (always) and the
    critic train, with ``mini_batch_size`` prompts × ``rollout.n`` sequences per optimizer
    step; the reference (a KL) runs in the policy's precision so that KL = 0 before the first
    update — with LoRA, as a view of the policy with its adapters off (no second copy); the
    teacher in its own precision (the policy's weights dtype when unset: a teacher equal to the
    policy then scores exactly as the policy does) and micro-batches."""
    a, m = cfg.actor, cfg.model
    policy_dtype = model_spec(cfg).dtype
    common = EngineSpec(
        strategy=dims.strategy,
        precision=m.precision,
        packed=m.use_remove_padding,
        temperature=cfg.rollout.temperature,
        gradient_checkpointing=m.gradient_checkpointing,
        micro=MicroBatchConfig.from_group(a),
    )
    trains = {"mini_batch_size": mini_batch_size * cfg.rollout.n, "seed": cfg.trainer.seed}
    plans = {
        "policy": EnginePlan(
            replace(common, fused=a.use_fused_kernels),
            dtype=policy_dtype,
            optim=OptimConfig.from_group(a),
            **trains,
        )
    }
    if "values" in needs:  # the critic stays full-parameter: a fresh value head has no base
        c = cfg.critic
        plans["critic"] = EnginePlan(
            replace(common, value=True, micro=MicroBatchConfig.from_group(c)),
            path=c.model_path,
            dtype=get_precision(m.precision).storage_name,
            optim=OptimConfig.from_group(c),
            **trains,
        )
    if "ref_log_probs" in needs:
        plans["reference"] = EnginePlan(common, dtype=policy_dtype, view=bool(m.lora.rank))
    d = cfg.algorithm.distill
    if "teacher_log_probs" in needs:
        precision = d.precision or m.precision
        micro = MicroBatchConfig(
            d.micro_batch_size or a.micro_batch_size, a.max_tokens_per_micro_batch
        )
        plans["teacher"] = EnginePlan(
            replace(common, precision=precision, micro=micro),
            path=d.teacher_path,
            dtype=policy_dtype if d.precision is None else weights_dtype(precision, frozen=True),
        )
    return plans


def loss_options(cfg: Config) -> tuple[dict, dict | None]:
    """The options of the actor's loss (``loss_terms.build_loss``) and of the critic's clipped
    value loss (``build_value_loss``; None without a critic is decided by the caller)."""
    a = cfg.actor
    policy = {
        "policy_loss": a.policy_loss,
        "loss_agg_mode": a.loss_agg_mode,
        "horizon": cfg.rollout.max_new_tokens,
        "clip_ratio_low": a.clip_ratio_low,
        "clip_ratio_high": a.clip_ratio_high,
        "clip_ratio_c": a.clip_ratio_c,
        "entropy_coeff": a.entropy_coeff,
        "kl_loss_coef": a.kl_loss_coef if a.use_kl_loss else 0.0,
        "kl_loss_type": a.kl_loss_type,
    }
    critic = {
        "cliprange_value": cfg.critic.cliprange_value,
        "loss_agg_mode": a.loss_agg_mode,
        "horizon": cfg.rollout.max_new_tokens,
    }
    return policy, critic


def resolve(cfg: Config, world_size: int = 1, *, estimators: Sequence[str] = ()) -> RunSpec:
    """Every decision the (schema-checked) config fixes, for ``world_size`` processes; raises
    ``ConfigError`` naming the key. ``estimators``: the registry names that will read the
    estimator options (none given: ``algorithm.adv_estimator``; ``otbrl variance``: those it
    measures). Pure: it opens no file and loads nothing."""
    check_registries(cfg)
    check_options(cfg, estimators or [cfg.algorithm.adv_estimator])
    needs = stat_needs(cfg)
    enable = cfg.critic.enable
    use_critic = enable == "true" or (enable == "auto" and "values" in needs)
    check_providers(cfg, needs, use_critic)
    if use_critic:  # critic.enable=true with any estimator: the value loss reads the values
        needs = needs | {"values"}
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    dims = ParallelDims(
        world_size=world_size,
        tp=a.tensor_parallel_size,
        sp=a.ulysses_sequence_parallel_size,
        strategy=a.strategy,
        fused=a.use_fused_kernels,
    )
    mini = a.ppo_mini_batch_size or cfg.data.train_batch_size
    dims.check_divisible("data.train_batch_size", cfg.data.train_batch_size)
    dims.check_divisible("actor.ppo_mini_batch_size", mini)
    algo, precision = cfg.algorithm, get_precision(cfg.model.precision)
    policy_loss, critic_loss = loss_options(cfg)
    return RunSpec(
        needs=needs,
        dims=dims,
        mini_batch_size=mini,
        estimator=algo.adv_estimator,
        estimator_options=MappingProxyType(estimator_options(cfg)),
        correction=correction_mode(cfg),
        correction_cap=algo.rollout_is_cap,
        kl_in_reward_coef=algo.kl_coef if algo.use_kl_in_reward else None,
        distill_coef=algo.distill.coef if algo.distill.teacher_path is not None else None,
        distill_task_reward=algo.distill.task_reward,
        max_sample_rounds=algo.max_sample_rounds if algo.dynamic_sampling else None,
        overlong="truncate_left" if cfg.data.overlong_prompts == "truncate_left" else "error",
        max_prompt_length=cfg.data.max_prompt_length,
        sampling=SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_tokens=r.max_new_tokens,
        ),
        validation=SamplingParams(
            n=1, temperature=t.val_temperature, max_tokens=r.max_new_tokens, greedy=t.val_greedy
        ),
        validation_batch_size=t.val_batch_size,
        seed=t.seed,
        train_batch_size=cfg.data.train_batch_size,
        data_seed=cfg.data.seed,
        model=model_spec(cfg),
        engines=MappingProxyType(engine_plans(cfg, dims, needs, mini)),
        rollout=r,
        serve_adapter=bool(cfg.model.lora.rank) and cfg.model.lora.sync == "adapter",
        sync_at_start=r.mode == "server"
        or (r.name == "vllm" and cfg.model.lora.adapter_path is not None),
        rollout_autocast=str(precision.compute).removeprefix("torch.") if precision.mixed else None,
        reward=cfg.reward,
        reward_model_dtype=precision.storage_name,
        policy_loss=MappingProxyType(policy_loss),
        critic_loss=MappingProxyType(critic_loss) if use_critic else None,
        trainer=t,
        stats_in_update=stats_in_update(cfg, use_critic=use_critic, dp=dims.dp),
        record=MappingProxyType(to_dict(cfg)),
    )
