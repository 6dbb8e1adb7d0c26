"""The algorithm's settings (``algorithm.*``) and the closed sets of values the algorithms act
on, declared here once: the math modules (``loss_math``, ``rollout_correction``, ``otb``)
import them, and the CLI's schema composes ``AlgorithmConfig``. No torch: the CLI starts
without it."""

from __future__ import annotations

from dataclasses import dataclass, field

from otbrl.errors import ConfigError
from otbrl.settings import PRECISIONS, refuse_unset, setting

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
# Every valid KL estimator name -> its canonical form. A "+" name is straight-through: the
# base estimator's value with the k2 estimator's gradient.
KL_KINDS = {"k1": "k1", "kl": "k1", "abs": "abs", "k2": "k2", "mse": "k2", "k3": "k3"}
KL_KINDS["low_var_kl"] = "k3"
KL_KINDS.update({"k1+": "k1+", "kl+": "k1+", "abs+": "abs+", "k3+": "k3+", "low_var_kl+": "k3+"})
# actor.policy_loss: PPO's clipped token ratio, GSPO's clipped sequence ratio (its token form,
# so token-level advantages keep their per-token signal), CISPO's clipped, stop-gradient weight
POLICY_LOSSES = ("ppo", "gspo", "cispo")
# the aggregation each defines (PPO: any of LOSS_AGG_MODES): GSPO averages each sequence's tokens
# then the sequences (its paper's 1/G Σ 1/|y| Σ); CISPO averages over every token of the batch
POLICY_LOSS_AGG = {"gspo": "seq-mean-token-mean", "cispo": "token-mean"}


def policy_loss_agg(policy_loss: str) -> str:
    """The aggregation ``policy_loss`` trains with when ``actor.loss_agg_mode`` is not set: the
    one it defines (``POLICY_LOSS_AGG``), else ``token-mean``."""
    return POLICY_LOSS_AGG.get(policy_loss, "token-mean")


# algorithm.rollout_correction: a weight on the rollout's samples with no proximal policy
CORRECTIONS = ("none", "token_tis", "seq_mis")
# algorithm.off_policy -> the mode that implements it (``tis`` is ``token_tis``)
OFF_POLICY_MODES = {"none": "none", "tis": "token_tis", "decoupled": "decoupled"}
OFF_POLICY = tuple(OFF_POLICY_MODES)
# algorithm.otb.energy: OTB's per-token weight W
ENERGIES = ("logit_gradient", "uniform")


@dataclass
class OTBConfig:
    # baseline of each sample from the other samples of its group only
    leave_one_out: bool = setting(False, resume="fixed", estimator_option="leave_one_out")
    # W_t weights: logit_gradient (1 - 2π + Σπ²) | uniform (a token-count baseline)
    energy: str = setting(
        "logit_gradient", choices=ENERGIES, resume="fixed", estimator_option="energy"
    )


@dataclass
class DistillConfig:
    """On-policy distillation: a frozen teacher scores every token the policy sampled and the
    per-token reverse KL's estimate ``log π_teacher − log π_student`` (× ``coef``) is added to
    the token rewards, which the configured estimator turns into advantages."""

    # an HF causal-LM directory (or a hub id in the local HF cache) whose tokenizer is the
    # policy's; None: no distillation
    teacher_path: str | None = setting(None, resume="fixed")
    # weight of the per-token signal coef · (log π_teacher − log π_student) in the rewards
    coef: float = setting(1.0, gt=0, resume="fixed")
    # false: pure distillation, the task's reward is still scored and logged but not trained on
    task_reward: bool = setting(True, resume="fixed")
    # the teacher engine's precision; None: the policy's (then teacher = policy gives 0 exactly)
    precision: str | None = setting(
        None, choices=PRECISIONS, null="model.precision", resume="fixed"
    )
    # sequences per teacher forward; None: actor.micro_batch_size
    micro_batch_size: int | None = setting(
        None, gt=0, null="actor.micro_batch_size", resume="may_differ"
    )

    def check(self, at: str) -> None:
        """Its keys only with a teacher."""
        if self.teacher_path is None:
            because = f"'{at}teacher_path' is not (no distillation)"
            refuse_unset(self, at, because, "set the teacher's model directory")


@dataclass
class AlgorithmConfig:
    # optimal_token_baseline | tir_optimal_token_baseline | grpo | rloo | gae | ...
    adv_estimator: str = setting("optimal_token_baseline", resume="fixed")
    # discount (gae)
    gamma: float = setting(1.0, ge=0, le=1, resume="fixed", estimator_option="gamma")
    # GAE lambda
    lam: float = setting(1.0, ge=0, le=1, resume="fixed", estimator_option="lam")
    # GRPO: divide by the group's reward std (false: Dr. GRPO)
    norm_adv_by_std_in_grpo: bool = setting(
        True, resume="fixed", estimator_option="norm_adv_by_std_in_grpo"
    )
    # OTB: no baseline where a group has no samples left
    handle_zero_tail: bool = setting(True, resume="fixed", estimator_option="handle_zero_tail")
    # subtract kl_coef · KL(policy || reference) from the token rewards
    use_kl_in_reward: bool = setting(False, resume="fixed")
    # weight of the in-reward KL
    kl_coef: float = setting(0.001, ge=0, resume="fixed")
    # correction for sampling with a rollout engine whose log-probs differ from the trainer's:
    # "none" | "token_tis" (w = min(exp(old − rollout), C)) | "seq_mis" (drop sequences whose
    # ratio exp(Σ(old − rollout)) leaves [1/C, C]); C = rollout_is_cap
    rollout_correction: str = setting("none", choices=CORRECTIONS, resume="fixed")
    # C of rollout_correction and off_policy (>= 1)
    rollout_is_cap: float = setting(2.0, ge=1, resume="fixed")
    # the objective for samples drawn by an older policy (trainer.max_staleness > 0):
    # "none" (PPO ratio against the trainer's log-probs, no behaviour weight) | "tis"
    # (× min(π_prox/π_behave, C): rollout_correction=token_tis) | "decoupled" (AReaL: PPO ratio
    # against π_prox, × π_prox/π_behave where ≤ C, else 0); π_prox = the trainer's log-probs at
    # the start of the update, π_behave = the rollout's; OTB's W takes the weights squared
    off_policy: str = setting("none", choices=OFF_POLICY, resume="fixed")
    # DAPO's dynamic sampling: drop each group whose trained rewards are all equal (it carries no
    # signal for a group-relative estimator) and sample more prompts until the step holds
    # data.train_batch_size groups with signal, or max_sample_rounds rounds were sampled
    dynamic_sampling: bool = setting(False, resume="fixed")
    # rounds of data.train_batch_size prompts one step may sample under dynamic_sampling; a step
    # still short after them fills up with groups without signal, none of whose tokens is
    # trained (dynamic_sampling/filled_frac)
    max_sample_rounds: int = setting(10, ge=1, resume="fixed")
    otb: OTBConfig = field(default_factory=OTBConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    def check(self, at: str) -> None:
        """``off_policy`` and ``rollout_correction`` both weight the samples: one at a time;
        dynamic sampling's keys only with it, and not with a teacher (whose signal varies
        inside every group); the in-reward KL's weight only with it."""
        if not self.use_kl_in_reward:
            because = f"'{at}use_kl_in_reward' is false (no KL in the reward)"
            refuse_unset(self, at, because, "set it true", ["kl_coef"])
        if not self.dynamic_sampling:
            because = f"'{at}dynamic_sampling' is false"
            refuse_unset(self, at, because, "set it true", ["max_sample_rounds"])
        elif self.distill.teacher_path is not None:
            raise ConfigError(
                f"'{at}dynamic_sampling' drops the groups whose rewards are all equal, but the "
                f"teacher of '{at}distill.teacher_path' gives every token a signal of its own; "
                "set one of them",
                f"{at}dynamic_sampling",
            )
        if self.off_policy != "none" and self.rollout_correction != "none":
            raise ConfigError(
                f"'{at}off_policy={self.off_policy}' and "
                f"'{at}rollout_correction={self.rollout_correction}' both weight the "
                "rollout's samples: set one of them (off_policy=tis is "
                "rollout_correction=token_tis)",
                f"{at}off_policy",
            )
