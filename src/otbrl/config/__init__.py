"""otbrl.config (beside the run layer, floor 4: nothing below it imports this package): the
CLI's schema (``schema``: the groups users set, each the typed settings of the component that
reads them, composed), loading from YAML and dotted overrides (``load``), the checks across
groups (``checks``), the commented listing of every key (``describe``) and the tables derived
from what each key's field declares (``keys``: which may change on resume, the estimator
options, the list keys). Importing it imports no torch. ``otbrl.run.plan.plan_run`` makes the
checks that need more."""

from otbrl.config.checks import check_config
from otbrl.config.load import load_config, upgrade_saved
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
    "upgrade_saved",
]
