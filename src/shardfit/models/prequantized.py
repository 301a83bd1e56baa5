"""Checkpoints published already quantized (gpt-oss's MXFP4 experts, the FP8 releases of Qwen3, DeepSeek-V3 and
GLM-4.5): which of them training can start from, and how they load.

Training needs 16-bit weights: FSDP2 shards plain tensors, autograd needs a backward for every op, and an adapter
merges into a dense weight. transformers can dequantize MXFP4 and block-wise FP8 as it loads, but only does so on
its own where the device has no kernels for the format (a CPU; an H100 with triton and `kernels` keeps MXFP4, an
Ada/Hopper card keeps FP8), so the same job would load differently per machine. shardfit asks for dequantization
always: the model that trains is the same everywhere, and what the plan counts (16-bit weights) is what loads.
Other formats (bitsandbytes, GPTQ, AWQ, ...) cannot be dequantized on load: the run is refused before loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardfit.errors import UserError

# quant_method -> what the format stores, for messages. transformers dequantizes these on load when asked
# (`dequantize=True` of their quantization config).
DEQUANTIZABLE = {
    "mxfp4": "4-bit MXFP4 experts",
    "fp8": "block-wise FP8 weights",
}
# Formats a config.json may name that are not a published quantization (GGUF files are read by their own path).
NOT_QUANTIZED = {"gguf"}
# Attribute a built model carries (train and check alike) when its checkpoint was quantized; read by check.
FLAG = "shardfit_prequantized"


@dataclass(frozen=True)
class Prequantized:
    """A checkpoint's published quantization, as its config.json names it."""

    method: str  # quant_method, e.g. mxfp4, fp8, bitsandbytes, gptq, awq

    @property
    def dequantizable(self) -> bool:
        return self.method in DEQUANTIZABLE

    @property
    def stores(self) -> str:
        return DEQUANTIZABLE.get(self.method, f"{self.method} weights")


def _settings(config: Any) -> dict[str, Any] | None:
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def of(config: Any) -> Prequantized | None:
    """The published quantization of the checkpoint `config` (a transformers config) was read from, or None."""
    settings = _settings(config)
    if not settings:
        return None
    method = str(settings.get("quant_method") or "").lower()
    if settings.get("load_in_4bit") or settings.get("load_in_8bit"):
        method = "bitsandbytes"
    return None if not method or method in NOT_QUANTIZED else Prequantized(method)


def refusal(name: str, p: Prequantized) -> str:
    """Why a checkpoint in a format training cannot start from is refused, and what to use instead."""
    return (f"'model': {name} is a {p.method}-quantized checkpoint; training needs 16-bit weights and transformers "
            f"cannot dequantize {p.method} as it loads. Point 'model' at the unquantized base checkpoint (the same "
            "name without -GPTQ/-AWQ/-bnb-4bit, usually); for 4-bit frozen weights use method: qlora, which stores "
            "them in NF4 itself. shardfit dequantizes MXFP4 and FP8 checkpoints on load.")


def load_kwargs(config: Any, name: str) -> dict[str, Any]:
    """What `from_pretrained` needs to load `config`'s checkpoint in 16 bits: its own quantization config with
    dequantization on, or nothing for an unquantized checkpoint. A format that cannot be dequantized is a
    UserError."""
    p = of(config)
    if p is None:
        return {}
    if not p.dequantizable:
        raise UserError(refusal(name, p))
    from transformers.quantizers.auto import AutoQuantizationConfig

    qc = AutoQuantizationConfig.from_dict(_settings(config))
    qc.dequantize = True
    return {"quantization_config": qc}
