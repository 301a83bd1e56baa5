"""A checkpoint published already quantized: say what loading it does to the weights training holds."""

from __future__ import annotations

from torch import nn

from shardfit import method as methods
from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.dtypes import DTYPES
from shardfit.models import prequantized
from shardfit.models.anatomy import base_model


def prequantized_rules(model: nn.Module, cfg: Config) -> list[Finding]:
    """An MXFP4 or FP8 checkpoint trains from 16-bit weights, dequantized as they load (models/prequantized.py):
    its files are several times smaller than what each GPU then holds, which surprises a user who sized the run
    by the download. Formats that cannot be dequantized never get here: building the model refuses them."""
    published = getattr(base_model(model), prequantized.FLAG, None)
    if published is None:
        return []
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    width = next((name for name, d in DTYPES.items() if d == dtype), "16 bits")
    if methods.get(cfg.method).quantized:
        then = "method qlora then stores the decoder's weights in NF4 (4 bits) again, as it does for any base"
        fix = "nothing to do: the plan counts NF4 weights"
    else:
        then = "the plan counts them at that width, not at the checkpoint's"
        fix = "to keep the frozen weights in 4 bits: method: qlora (NF4, LoRA adapters); or plan with this method"
    return [Finding("prequantized_checkpoint", "info", f"{cfg.model}: config.json quantization_config",
                    f"the checkpoint stores {published.stores} ({published.method}); training needs 16-bit weights, "
                    f"so shardfit dequantizes them to {width} as they load, on every machine (transformers alone "
                    f"would keep {published.method} where the GPU has kernels for it, which cannot train); {then}",
                    fix)]
