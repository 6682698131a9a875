"""Configuration: verl's key tree with OmegaConf overrides (loading), and the cross-field checks
and parallel layout that need the world size (checks).

    cfg = load_config(["--config", "configs/tiny.yaml", "data.train_batch_size=16"])
    layout = validate_config(cfg, world_size)      # parallel.layout.RunLayout
"""
from hybridengine.config.checks import derive_layout, uses_critic, uses_reference, validate_config
from hybridengine.config.errors import ConfigError
from hybridengine.config.loading import DEFAULTS_FILE, describe_layers, load_config

__all__ = ["DEFAULTS_FILE", "ConfigError", "derive_layout",
           "describe_layers", "load_config", "uses_critic", "uses_reference", "validate_config"]
