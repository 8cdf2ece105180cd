"""The run configuration: config.py (the typed config every command reads, re-exported here: `Config`,
its sections, `load_config`, `from_args`, ...). Beside it, the tables it validates against: archs.py
(the archs), schemes.py (the TP schemes and mesh axes), presets.py (the model presets) and study.py
(the `study` section's checks); hardware.py reads the GPUs of `boost_jax/configs/hardware.yaml` and
prices their collectives; packages.py names the optional packages a config needs and lacks. Nothing
here imports JAX.
"""

from boost_jax.config.config import (
    MAX_INT32_VOCAB,
    Arch,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DType,
    LogConfig,
    MixtureEntry,
    ModelConfig,
    MuonComm,
    MuonConfig,
    OptimizerName,
    ParallelConfig,
    RopeScalingConfig,
    SchemeName,
    ServeConfig,
    SpectronConfig,
    TrainConfig,
    from_args,
    from_dict,
    hardware_names,
    load_config,
    load_yaml,
    mixture_name,
    raw_args,
    raw_config,
)

__all__ = ["MAX_INT32_VOCAB", "Arch", "CheckpointConfig", "Config", "ConfigError", "DType", "DataConfig", "LogConfig",
           "MixtureEntry", "ModelConfig", "MuonComm", "MuonConfig", "OptimizerName", "ParallelConfig", "RopeScalingConfig",
           "SchemeName",
           "ServeConfig", "SpectronConfig", "TrainConfig", "from_args", "from_dict", "hardware_names", "load_config", "load_yaml",
           "mixture_name", "raw_args", "raw_config"]
