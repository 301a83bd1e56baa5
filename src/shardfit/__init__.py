"""shardfit: fine-tune open LLMs on the GPUs you have."""

__version__ = "0.1.0"
