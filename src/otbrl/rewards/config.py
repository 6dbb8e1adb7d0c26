"""The reward's settings (``reward.*``): which function scores, how its errors count, the code
sandbox's limits (``otbrl.rewards.sandbox.CodeRewardConfig``, declared by the sandbox), DAPO's
overlong shaping and a learned reward model. The CLI's schema composes ``RewardConfig``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from otbrl.errors import ConfigError
from otbrl.rewards.builtin import MATH_BACKENDS
from otbrl.rewards.sandbox import CodeRewardConfig, SandboxConfig
from otbrl.rewards.scoring import ON_ERROR
from otbrl.settings import refuse_unset, setting


@dataclass
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: the last ``len`` tokens of the response budget
    (``rollout.max_new_tokens``) cost linearly up to ``penalty`` (0 = off)."""

    # tokens before the budget's end where the penalty ramps up; 0 = off
    len: int = setting(0, ge=0, resume="fixed")
    # the penalty at the budget's end (the reward loses up to this much)
    penalty: float = setting(1.0, ge=0, resume="fixed")

    def check(self, at: str) -> None:
        """``penalty`` only with shaping on."""
        if self.len == 0:
            fix = f"set {at}len to the tokens before the budget's end where the penalty ramps up,"
            refuse_unset(self, at, f"'{at}len' is 0 (shaping off)", fix, ["penalty"])


@dataclass
class RewardModelConfig:
    """A learned reward model (``otbrl.rewards.reward_model``): an HF
    ``AutoModelForSequenceClassification`` directory with one label; the trained reward is the
    rule reward + ``weight`` × its score."""

    path: str | None = setting(None, resume="fixed")  # None: no reward model
    # the trained reward is the rule reward + weight x the model's score
    weight: float = setting(1.0, resume="fixed")
    micro_batch_size: int = setting(16, gt=0, resume="may_differ")  # conversations per forward

    def check(self, at: str) -> None:
        """Its keys only with a model."""
        if self.path is None:
            fix = "set the reward model's directory"
            refuse_unset(self, at, f"'{at}path' is not", fix, ["weight", "micro_batch_size"])


@dataclass
class RewardConfig:
    # built-in name or "path/to/file.py:fn"; None -> by data_source
    function: str | None = setting(None, resume="fixed")
    on_error: str = setting("raise", choices=ON_ERROR, resume="fixed")  # "raise" | "zero"
    # a call that runs longer is an error, handled by on_error (a hung verifier would otherwise
    # stall the run forever); 0 = no limit
    timeout_s: float = setting(60.0, ge=0, resume="fixed")
    # how the MATH sources (lighteval/MATH, MATH-500) are checked: "verl" (string
    # normalisation, verl's default) | "math_verify" (the math-verify package)
    math_backend: str = setting("verl", choices=MATH_BACKENDS, resume="fixed")
    # score in this many worker processes while the policy computes its statistics (0: in
    # the trainer's process, after sampling)
    workers: int = setting(0, ge=0, resume="may_differ")
    # reward.function takes lists (data_sources, solution_strs, ground_truths, extra_infos)
    # and returns one result per sample: one call per batch (per worker chunk)
    batched: bool = setting(False, resume="fixed")
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    model: RewardModelConfig = field(default_factory=RewardModelConfig)

    def check(self, at: str) -> None:
        """A batched reward is the user's own function; a function's file exists."""
        if self.batched and self.function is None:
            raise ConfigError(
                f"'{at}batched' is true but '{at}function' is unset: a batched reward is "
                "your function taking lists (the built-in rewards score one sample at a time)",
                f"{at}batched",
            )
        if self.function is not None and ":" in self.function:
            file = self.function.rsplit(":", 1)[0]
            if not Path(file).is_file():
                raise ConfigError(f"'{at}function' file not found: '{file}'", f"{at}function")

    def scoring_options(self) -> dict[str, Any]:
        """The keywords of ``otbrl.rewards.score_responses`` / ``score_each`` these settings
        give: ``function`` (the spec string), ``on_error``, ``timeout_s``, ``math_backend``,
        ``batched`` and the ``sandbox`` (the user's limits, the sandbox's own kept)."""
        return {
            "function": self.function,
            "on_error": self.on_error,
            "timeout_s": self.timeout_s,
            "math_backend": self.math_backend,
            "sandbox": SandboxConfig(**asdict(self.code)),
            "batched": self.batched,
        }
