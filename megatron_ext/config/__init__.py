from megatron_ext.config.schema import (
    CheckpointConfig,
    Config,
    DataConfig,
    LauncherConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from megatron_ext.config.store import compose_config, config_schema, register_configs, to_object

__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LauncherConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "compose_config",
    "config_schema",
    "register_configs",
    "to_object",
]
