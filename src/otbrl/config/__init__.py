"""otbrl.config (beside the run layer, floor 4: nothing below it imports this package; importing
it imports nothing else from otbrl but the error type): the schema
(``schema``), loading from YAML and dotted overrides (``load``) and the schema-level checks
(``checks``, which read each key's allowed values from the component that owns them when they
run). ``otbrl.run.plan.plan_run`` makes the checks that need more."""

from otbrl.config.checks import check_config
from otbrl.config.load import load_config
from otbrl.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    ConfigError,
    CriticConfig,
    DataConfig,
    ModelConfig,
    MultiTurnConfig,
    OTBConfig,
    RewardConfig,
    RolloutConfig,
    SFTConfig,
    TrainerConfig,
    VLLMConfig,
    all_keys,
    to_dict,
)

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OTBConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "TrainerConfig",
    "VLLMConfig",
    "all_keys",
    "check_config",
    "load_config",
    "to_dict",
]
