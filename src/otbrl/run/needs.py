"""What a run needs computed, and who computes it: the one table of batch statistics and
their sources (``SOURCES``), the needs of the configured estimator, losses and metrics
(``stat_needs``), the estimator's options from the config, and the checks that every need has a
provider switched on — each a one-line ``ConfigError`` naming the key to set, before any model
loads. ``otbrl.run.spec.resolve`` calls these; they read the config and the registries only.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from otbrl.algos import rollout_correction
from otbrl.algos.advantages import ESTIMATORS, get_estimator
from otbrl.config import Config, ConfigError
from otbrl.config.keys import ESTIMATOR_OPTION_KEYS, SCHEMA_FIELDS  # option -> its key


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


POLICY_STATS = frozenset(key for key, src in SOURCES.items() if src.engine == "policy")


def stats_in_update(cfg: Config, *, use_critic: bool, dp: int) -> str | None:
    """Whether the policy's statistics come from its update's own forwards (``actor.one_forward``)
    and how: exact where the batch trains in one optimizer step of one epoch, whose forwards run
    on the weights that would score it in a separate pass.

    ``"rows"``: the advantages read none of the policy's statistics (GRPO, RLOO, GAE...): they
    are computed before the update, whose micro-batches (any) hand out the statistics.
    ``"groups"``: they do (OTB's π and Σπ², a KL in the reward, a teacher's signal, importance
    weights the estimator reads): the update's micro-batches hold whole groups and each
    computes its groups' advantages from its own forward before its backward — an estimator
    whose advantages are ``group_local``, without a critic (its update comes first and needs the
    returns), with micro-batches that can hold a group. None: the separate pass — several
    optimizer steps or epochs (later forwards see updated weights), ``seq_mis`` (the rows it
    drops change the loss's normalisers), rows re-balanced over ``dp`` ranks, or switched off.
    """
    a = cfg.actor
    mini = a.ppo_mini_batch_size or cfg.data.train_batch_size
    mode = correction_mode(cfg)
    rebalance = a.max_tokens_per_micro_batch is not None and cfg.model.use_remove_padding
    one_step = a.ppo_epochs == 1 and mini == cfg.data.train_batch_size
    if not (a.one_forward and one_step) or mode == "seq_mis" or (rebalance and dp > 1):
        return None
    estimator = get_estimator(cfg.algorithm.adv_estimator)
    reads = set(estimator.needs_for(**estimator_options(cfg)))
    if mode != "none" and ("rollout_is_weights" in estimator.params or estimator.takes_any):
        reads.add("rollout_is_weights")
    algo = cfg.algorithm
    if not (reads & (POLICY_STATS | {"rollout_is_weights"})) and not (
        algo.use_kl_in_reward or algo.distill.teacher_path is not None
    ):
        return "rows"
    fits = a.max_tokens_per_micro_batch is not None or a.micro_batch_size >= cfg.rollout.n
    return "groups" if estimator.group_local and not use_critic and fits else None


def correction_mode(cfg: Config) -> str:
    """The ``rollout_is_weights`` mode of the run (``otbrl.algos.rollout_correction``'s
    ``correction_mode`` of ``algorithm.off_policy`` and ``algorithm.rollout_correction``)."""
    return rollout_correction.correction_mode(
        cfg.algorithm.off_policy, cfg.algorithm.rollout_correction
    )


def check_registries(cfg: Config) -> None:
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


def check_options(cfg: Config, estimators: Sequence[str]) -> None:
    """An estimator option set away from its default that none of the run's ``estimators``
    (registry names: the configured one for a training run, every one ``otbrl variance``
    measures) takes would change nothing: a ``ConfigError`` naming its key and the estimators
    that take it."""
    taken = [get_estimator(name) for name in estimators]
    if any(e.takes_any for e in taken):
        return
    for option, value in estimator_options(cfg).items():
        key = ESTIMATOR_OPTION_KEYS[option]
        if value == SCHEMA_FIELDS[key].default or any(option in e.params for e in taken):
            continue
        takers = sorted(n for n, e in ESTIMATORS.items() if option in e.params or e.takes_any)
        names = list(dict.fromkeys(estimators))
        if len(names) == 1:
            unused, fix = f"the estimator {names[0]} does not use it", "algorithm.adv_estimator"
        else:  # otbrl variance
            unused, fix = f"none of the estimators {', '.join(names)} uses it", "--estimators"
        raise ConfigError(
            f"'{key}' is set but {unused} (an option of {', '.join(takers)}); drop the key or "
            f"name one of those in {fix}",
            key,
        )


def check_providers(cfg: Config, needs: frozenset[str], use_critic: bool) -> None:
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
