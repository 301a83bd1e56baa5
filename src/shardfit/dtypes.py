"""The one map from a precision's name (bf16 | fp16 | fp32, as configs and resolved jobs write it) to its torch
dtype."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
