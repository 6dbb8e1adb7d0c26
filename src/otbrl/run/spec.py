"""Resolve a run: every decision the configuration alone fixes, taken once, into a ``RunSpec``.

``resolve(cfg, world_size)`` is pure — no file, no tokenizer, no network, no model: it reads
the config and the registries (estimators and their needs, KL kinds), decides which engine
provides each need (so a need no layer provides is a one-line ``ConfigError`` naming the key to
set, not a crash deep in a run), the parallel layout, the batch sizes, the estimator's options,
the off-policy correction, how overlong prompts are handled and how the rollout samples. The
I/O checks come after it, once (``otbrl.run.plan.preflight``); below the run layer the code gets
this spec or its own component config, never the raw config.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from otbrl.algos import rollout_correction
from otbrl.algos.advantages import ESTIMATORS, get_estimator
from otbrl.config import Config, ConfigError
from otbrl.config.keys import ESTIMATOR_OPTION_KEYS  # option -> the key that sets it
from otbrl.engine.dims import ParallelDims
from otbrl.rollout import SamplingParams


@dataclass(frozen=True)
class Source:
    """Where a batch statistic comes from: the ``engine`` that computes it (``policy``,
    ``reference``, ``teacher`` or ``critic``), the name of that engine's forward ``output``,
    and the config key that switches the provider on (None: always on)."""

    engine: str
    output: str
    switch: str | None = None


# batch key -> its source: the one table of who provides what (resolve reads it, the trainer
# asks each engine for exactly the outputs the spec lists)
SOURCES = {
    "old_log_probs": Source("policy", "log_probs"),
    "entropy": Source("policy", "entropy"),
    "sum_pi_squared": Source("policy", "sum_pi_squared", "actor.calculate_sum_pi_squared"),
    "ref_log_probs": Source("reference", "log_probs", "actor.use_kl_loss"),
    # the distillation teacher's log-probs of the sampled tokens (its own engine and precision)
    "teacher_log_probs": Source("teacher", "log_probs", "algorithm.distill.teacher_path"),
    "values": Source("critic", "values", "critic.enable"),
    # the learned reward model scores the decoded conversations in the sampling step (its own
    # tokenizer and template), before the policy's forward; it adds to token_level_scores
    "rm_scores": Source("reward_model", "scores", "reward.model.path"),
}


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
    in batches of ``validation_batch_size`` prompts. ``rollout_mode``: ``colocated`` or
    ``server`` (``rollout.mode``); ``stale_samples``: what the producer does with a batch past
    the staleness bound (``rollout.stale_samples``).
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
    rollout_mode: str
    stale_samples: str

    @property
    def use_reference(self) -> bool:
        """A frozen reference policy is built (a KL loss or KL reward needs its log-probs)."""
        return "ref_log_probs" in self.needs

    @property
    def use_teacher(self) -> bool:
        """A frozen distillation teacher is built (``algorithm.distill.teacher_path``)."""
        return "teacher_log_probs" in self.needs

    @property
    def use_reward_model(self) -> bool:
        """A learned reward model is loaded (``reward.model.path``)."""
        return "rm_scores" in self.needs

    @property
    def use_critic(self) -> bool:
        """A critic is built and trained (its values are needed)."""
        return "values" in self.needs

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


def estimator_options(cfg: Config) -> dict:
    """Options that change what the configured estimator computes (and may change its needs)."""
    return {
        option: functools.reduce(getattr, key.split("."), cfg)
        for option, key in ESTIMATOR_OPTION_KEYS.items()
    }


def stat_needs(cfg: Config) -> frozenset[str]:
    """The statistics the estimator (with its options), the losses and the enabled metrics
    need: ``entropy`` feeds ``policy/entropy_mean`` (always on); Σπ² is needed by OTB and, with
    ``actor.calculate_sum_pi_squared=true``, by the variance-proxy metrics of any estimator."""
    estimator = get_estimator(cfg.algorithm.adv_estimator)
    needs = set(estimator.needs_for(**estimator_options(cfg))) | {"old_log_probs", "entropy"}
    if cfg.actor.calculate_sum_pi_squared == "true":
        needs.add("sum_pi_squared")
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        needs.add("ref_log_probs")
    if cfg.algorithm.distill.teacher_path is not None:
        needs.add("teacher_log_probs")
    if cfg.reward.model.path is not None:
        needs.add("rm_scores")
    return frozenset(needs)


def correction_mode(cfg: Config) -> str:
    """The ``rollout_is_weights`` mode of the run (``otbrl.algos.rollout_correction``'s
    ``correction_mode`` of ``algorithm.off_policy`` and ``algorithm.rollout_correction``)."""
    return rollout_correction.correction_mode(
        cfg.algorithm.off_policy, cfg.algorithm.rollout_correction
    )


def _check_registries(cfg: Config) -> None:
    name = cfg.algorithm.adv_estimator
    if name not in ESTIMATORS:
        close = difflib.get_close_matches(name, list(ESTIMATORS), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(
            f"'algorithm.adv_estimator' must be one of {sorted(ESTIMATORS)}, got '{name}'{hint}",
            "algorithm.adv_estimator",
        )
    if cfg.algorithm.dynamic_sampling and not ESTIMATORS[name].group_relative:
        grouped = sorted(k for k, e in ESTIMATORS.items() if e.group_relative)
        raise ConfigError(
            f"'algorithm.dynamic_sampling' drops the groups whose rewards are all equal, which "
            f"still carry a signal under '{name}' (its baseline is not the group's); use one "
            f"of {grouped}",
            "algorithm.dynamic_sampling",
        )


def _check_providers(cfg: Config, needs: frozenset[str], use_critic: bool) -> None:
    """Every need has a provider that is switched on; else a ConfigError naming the key."""
    name = cfg.algorithm.adv_estimator
    for need in sorted(needs):
        if need not in SOURCES:
            raise ConfigError(
                f"'algorithm.adv_estimator' '{name}' needs '{need}', which no engine provides "
                f"(providers: {sorted(SOURCES)})",
                "algorithm.adv_estimator",
            )
    if "sum_pi_squared" in needs and cfg.actor.calculate_sum_pi_squared == "false":
        raise ConfigError(
            f"'actor.calculate_sum_pi_squared' is false but 'algorithm.adv_estimator' "
            f"'{name}' needs Σπ²; use 'auto' or 'true'",
            "actor.calculate_sum_pi_squared",
        )
    if "values" in needs and not use_critic:
        raise ConfigError(
            f"'critic.enable' is false but 'algorithm.adv_estimator' '{name}' needs values "
            "from a critic; use 'auto' or 'true'",
            "critic.enable",
        )


def resolve(cfg: Config, world_size: int = 1) -> RunSpec:
    """Every decision the (schema-checked) config fixes, for ``world_size`` processes; raises
    ``ConfigError`` naming the key. Pure: it opens no file and loads nothing."""
    _check_registries(cfg)
    needs = stat_needs(cfg)
    enable = cfg.critic.enable
    use_critic = enable == "true" or (enable == "auto" and "values" in needs)
    _check_providers(cfg, needs, use_critic)
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
    algo = cfg.algorithm
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
        rollout_mode=r.mode,
        stale_samples=r.stale_samples,
    )
