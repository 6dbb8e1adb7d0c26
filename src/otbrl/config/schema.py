"""The CLI's configuration schema: the groups users set with dotted keys, each the typed
settings of the component that reads them, composed here (OmegaConf structured dataclasses).

- ``data``: ``DataConfig`` (``otbrl.data.config``);
- ``model``: ``ModelConfig`` (``otbrl.engine.config``), its ``lora``: ``LoraConfig``
  (``otbrl.models.config``);
- ``rollout``: ``RolloutConfig`` with ``vllm``, ``server``, ``multi_turn``
  (``otbrl.rollout.config``);
- ``actor``, ``critic``: ``ActorConfig``, ``CriticConfig``, both an ``OptimConfig`` with keys
  added (``otbrl.engine.config``);
- ``algorithm``: ``AlgorithmConfig`` with ``otb`` (``otbrl.algos.config``);
- ``reward``: ``RewardConfig`` with ``code``, ``overlong_buffer``, ``model``
  (``otbrl.rewards.config``);
- ``trainer``, ``sft``: ``TrainerConfig``, ``SFTConfig``, the run's own (here).

A field declares its allowed values and what it is (may it change on resume, the estimator
option it sets) where it is declared (``otbrl.settings.setting``; ``otbrl.config.keys`` derives
the tables) and its description as its comment; a group's rules across its own fields are its
``check`` method.
Loading (YAML + dotted overrides) is ``otbrl.config.load``; the checks across groups are
``otbrl.config.checks``. Importing this imports no torch: the CLI starts without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from otbrl.algos.config import AlgorithmConfig, OTBConfig
from otbrl.data.config import DataConfig
from otbrl.engine.config import ActorConfig, CriticConfig, ModelConfig
from otbrl.errors import ConfigError
from otbrl.models.config import LoraConfig
from otbrl.report.metrics_log import BACKENDS as LOGGERS
from otbrl.rewards.config import (
    CodeRewardConfig,
    OverlongBufferConfig,
    RewardConfig,
    RewardModelConfig,
)
from otbrl.rollout.config import MultiTurnConfig, RolloutConfig, ServerConfig, VLLMConfig
from otbrl.settings import setting

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CodeRewardConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OTBConfig",
    "OverlongBufferConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "SFTConfig",
    "ServerConfig",
    "TrainerConfig",
    "VLLMConfig",
    "all_keys",
    "to_dict",
]


@dataclass
class TrainerConfig:
    # RL steps (each: sample, score, update)
    total_steps: int = setting(800, gt=0, resume="may_differ")
    val_every: int = setting(50, ge=0, resume="may_differ")  # 0 = no validation
    # steps between checkpoints (and one at the end); 0 = none
    save_every: int = setting(50, ge=0, resume="may_differ")
    # delete older checkpoints beyond the newest N (the disk this takes is printed at start);
    # 0 = keep all
    keep_last_checkpoints: int = setting(2, ge=0, resume="may_differ")
    # the run directory: metrics, summary, plots, checkpoints
    output_dir: str = setting("runs/default", resume="may_differ")
    # console | jsonl | tensorboard | wandb
    logger: list[str] = setting(
        default_factory=lambda: ["console", "jsonl"], choices=LOGGERS, resume="may_differ"
    )
    # seeds sampling, dropout and the warm start
    seed: int = setting(0, resume="fixed")
    resume: str = setting("auto", resume="may_differ")  # "auto" | "never" | path to a checkpoint
    # with resume=never: move an existing run in output_dir aside (to <output_dir>.old-<time>)
    # instead of refusing to start; nothing is deleted
    overwrite: bool = setting(False, resume="may_differ")
    # greedy validation (false: sample at val_temperature)
    val_greedy: bool = setting(True, resume="fixed")
    val_temperature: float = setting(1.0, gt=0, resume="fixed")  # used when val_greedy is false
    # prompts per validation generate call
    val_batch_size: int = setting(64, gt=0, resume="may_differ")
    # at each validation, the first N validation samples (prompt, response or transcript,
    # reward) go to generations.jsonl (and TensorBoard / W&B tables); 0 = none
    log_generations: int = setting(4, ge=0, resume="may_differ")
    # stop early (after a final validation and checkpoint) once fit() has run this long;
    # 0 = no limit. The demo uses it to keep its 10-minute promise on a slower machine.
    max_wall_seconds: float = setting(0.0, ge=0, resume="may_differ")
    # abort when more optimizer steps than this were skipped in a row (non-finite gradients):
    # a run that only skips learns nothing
    max_skipped_steps: int = setting(5, ge=0, resume="may_differ")
    # how long a rank waits for the others in a collective, e.g. while rank 0 alone writes a
    # checkpoint's full model (a dead peer usually fails sooner: its sockets close)
    dist_timeout_s: float = setting(1800.0, gt=0, resume="may_differ")
    # asynchronous RL (rollout.mode=server): the producer samples and scores up to k batches
    # ahead of the update, so a sample's weights may be up to k updates old; 0 = synchronous
    max_staleness: int = setting(0, ge=0, resume="fixed")

    def check(self, at: str) -> None:
        """``overwrite`` starts a new run; ``resume`` is a mode or an existing checkpoint."""
        if self.overwrite and self.resume != "never":
            raise ConfigError(
                f"'{at}overwrite' starts a new run (moving the old one aside): it needs "
                f"{at}resume=never, got {at}resume={self.resume}",
                f"{at}overwrite",
            )
        if self.resume not in ("auto", "never") and not Path(self.resume).exists():
            raise ConfigError(
                f"'{at}resume' must be 'auto', 'never' or an existing checkpoint path, "
                f"got '{self.resume}'",
                f"{at}resume",
            )


@dataclass
class SFTConfig:
    """The built-in model's supervised warm start (``otbrl.run.sft.run_sft``): AdamW on the
    trainer's ``Engine`` with the ``nll`` loss, stopped at a greedy validation accuracy."""

    # the built-in model's warm start: learning rate (3e-3 sat on the edge of stability:
    # seeds that never learned on AMD EPYC hosts; 1e-3 reached 0.3 in 370-870 steps, 3 seeds)
    lr: float = setting(1e-3, gt=0, resume="fixed")
    # warm start: linear warmup of the learning rate over this many steps (0 for arithmetic:
    # with 20 steps and clip 1.0 its warm start came sooner but RL then gained nothing, 3 seeds)
    warmup_steps: int = setting(0, ge=0, resume="fixed")
    # warm start: global gradient-norm clip; 0 = none
    grad_clip: float = setting(0.0, ge=0, resume="fixed")
    # warm start: demonstrations per step
    batch_size: int = setting(64, gt=0, resume="fixed")
    # warm start: the most steps
    max_steps: int = setting(2000, gt=0, resume="fixed")
    # warm start: stop at this greedy validation accuracy
    target_accuracy: float = setting(0.3, ge=0, le=1, resume="fixed")
    # warm start: steps between accuracy checks
    eval_every: int = setting(25, gt=0, resume="fixed")
    # warm-started models are cached here, keyed by their settings
    cache_dir: str = setting(".cache/otbrl", resume="may_differ")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)


def to_dict(cfg: Config) -> dict:
    """The resolved configuration as plain containers (for checkpoints and logs)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def all_keys(node: Any = None, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema (``["data.train_files", ...]``)."""
    node = OmegaConf.structured(Config) if node is None else node
    keys = []
    for name in node:
        value = node._get_node(name)
        dotted = f"{prefix}{name}"
        if isinstance(value, DictConfig) and OmegaConf.get_type(value) not in (dict, None):
            keys.extend(all_keys(value, dotted + "."))  # a group (a dict-valued key is a leaf)
        else:
            keys.append(dotted)
    return keys
