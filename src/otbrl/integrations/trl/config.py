"""``OTBGRPOConfig``: TRL's ``GRPOConfig`` plus the Optimal Token Baseline options.

Every option that would change meaning once advantages are per token is refused here, when
the config is built, before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from otbrl.algos.otb import ENERGIES

OTB_ESTIMATORS = ("auto", "optimal_token_baseline", "tir_optimal_token_baseline")


@dataclass
class OTBGRPOConfig(GRPOConfig):
    """GRPOConfig + OTB. The advantage of every completion token comes from
    ``otbrl.algos`` (OTB, or TIR-OTB for tool-calling rollouts) over the whole gathered
    generation batch; the reward is TRL's weighted sum of the reward functions, unscaled.
    """

    otb_estimator: str = field(
        default="auto",
        metadata={
            "help": "'auto' (TIR-OTB when TRL's tool mask is present, else OTB), "
            "'optimal_token_baseline' or 'tir_optimal_token_baseline'."
        },
    )
    otb_leave_one_out: bool = field(
        default=False, metadata={"help": "Baseline from the other rows of the group only."}
    )
    otb_energy: str = field(
        default="logit_gradient",
        metadata={"help": "'logit_gradient' (w = 1 − 2π + Σπ²) or 'uniform' (w = 1, no Σπ²)."},
    )
    otb_handle_zero_tail: bool = field(
        default=True,
        metadata={"help": "Baseline 0 past the second-longest completion of a group."},
    )
    otb_use_vllm_is_weights: bool = field(
        default=False,
        metadata={
            "help": "Use TRL's vLLM importance-sampling ratios as OTB's rollout_is_weights "
            "(needs use_vllm and vllm_importance_sampling_correction)."
        },
    )
    # OTB's advantage is a reward-to-go minus a baseline: it is not rescaled per group.
    scale_rewards: str = field(
        default="none", metadata={"help": "Must be 'none' with OTB (the default here)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.otb_estimator not in OTB_ESTIMATORS:
            raise ValueError(
                f"otb_estimator: expected one of {OTB_ESTIMATORS}, got {self.otb_estimator!r}"
            )
        if self.otb_energy not in ENERGIES:
            raise ValueError(f"otb_energy: expected one of {ENERGIES}, got {self.otb_energy!r}")
        if self.scale_rewards not in ("none", False):
            raise ValueError(
                f"scale_rewards: OTB advantages are not rescaled, expected 'none', "
                f"got {self.scale_rewards!r}"
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "multi_objective_aggregation: OTB uses the weighted sum of the raw rewards, "
                f"expected 'sum_then_normalize', got {self.multi_objective_aggregation!r}"
            )
        if self.loss_type == "vespo":
            raise ValueError(
                "loss_type: 'vespo' picks its sequence weight from the sign of a per-sequence "
                "advantage, which per-token OTB advantages do not have; use 'dapo', 'grpo', "
                "'bnpo', 'dr_grpo', 'cispo' or 'sapo'"
            )
        if self.importance_sampling_level != "token":
            raise ValueError(
                "importance_sampling_level: 'sequence' (GSPO, LUSPO) optimizes a per-sequence "
                "objective; OTB advantages are per token, expected 'token', "
                f"got {self.importance_sampling_level!r} (GSPO's token form, which keeps "
                "per-token advantages, is `otbrl train actor.policy_loss=gspo`)"
            )
        if self.off_policy_mask_threshold is not None:
            raise ValueError(
                "off_policy_mask_threshold: the off-policy sequence mask keeps or drops a "
                "sequence by the sign of its advantage, undefined for per-token OTB advantages; "
                f"expected None, got {self.off_policy_mask_threshold!r}"
            )
        if self.otb_use_vllm_is_weights and not (
            self.use_vllm and self.vllm_importance_sampling_correction
        ):
            raise ValueError(
                "otb_use_vllm_is_weights: needs use_vllm=True and "
                "vllm_importance_sampling_correction=True (TRL computes the ratios only then)"
            )

    @property
    def otb_options(self) -> dict:
        """The keyword options handed to ``otbrl.algos.compute_advantage``."""
        return {
            "handle_zero_tail": self.otb_handle_zero_tail,
            "leave_one_out": self.otb_leave_one_out,
            "energy": self.otb_energy,
        }
