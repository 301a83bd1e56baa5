"""Config: the YAML schema, loading with `--set` overrides, and validation."""

from shardfit.config.load import load_config
from shardfit.config.schema import Config, LoraSettings

__all__ = ["Config", "LoraSettings", "load_config"]
