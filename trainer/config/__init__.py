"""`harness train config.yaml`: the keys (keys.py), reading the YAML into them (load.py), the keys as data
(reference.py) and the checks (checks.py). `python -m trainer.config [--markdown]` prints the key reference."""

from trainer.config.load import (
    ADV_ESTIMATORS,
    GROUP_ESTIMATORS,
    KL_TYPES,
    LOSS_AGG_MODES,
    ConfigError,
    DataConfig,
    DebugConfig,
    EngineConfig,
    FsdpConfig,
    LoggingConfig,
    Mode,
    ModelConfig,
    RolloutConfig,
    TaskJudgeConfig,
    TrainConfig,
    TrainerConfig,
    ValidationSampling,
    config_to_dict,
    describe_config,
    iter_keys,
    load_config,
    read_config,
    role_rules,
    run_dir,
    save_resolved,
    trains,
)

__all__ = ["ConfigError", "role_rules", "trains", "load_config", "read_config", "config_to_dict", "save_resolved",
           "describe_config", "run_dir", "iter_keys", "Mode", "TrainConfig", "ModelConfig", "DataConfig",
           "TaskJudgeConfig", "RolloutConfig", "ValidationSampling", "EngineConfig", "TrainerConfig", "FsdpConfig",
           "LoggingConfig", "DebugConfig", "ADV_ESTIMATORS", "LOSS_AGG_MODES", "KL_TYPES", "GROUP_ESTIMATORS"]
