"""FP8 matmuls for training (`float8: true`): the decoder blocks' linear layers become torchao's Float8Linear,
which casts each matmul's input, weight and output gradient to FP8 with a per-tensor scale (dynamic scaling) and
multiplies them on the FP8 tensor cores of compute capability 8.9+ (Ada, Hopper, Blackwell), accumulating in fp32.

Only the blocks' own nn.Linear layers convert: the head, the embeddings and vision or audio towers stay in the
run's precision (the head's logits are where low precision hurts the loss most, and torchtitan leaves it out too),
a mixture's router too (its few columns decide the routing), and LoRA's A/B adapters (peft's frozen `base_layer`
inside each adapted layer converts; the adapters train in the run's precision). torchao's FP8 matmul needs both
dims of the weight to be multiples of 16. FSDP2 all-gathers the bf16 shards as usual (no FP8 all-gather): one
code path for every strategy.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from shardfit.config.support import TORCHAO_HINT
from shardfit.errors import UserError
from shardfit.models.anatomy import transformer_blocks
from shardfit.models.nf4 import torchao_available

log = logging.getLogger(__name__)

MULTIPLE = 16  # torch._scaled_mm's requirement on both dims of an FP8 operand
MIN_CAPABILITY = (8, 9)  # the first GPUs with FP8 tensor cores (Ada); Hopper 9.0, Blackwell 10.0


def convertible(module: nn.Module, fqn: str) -> bool:
    """Whether the linear layer at `fqn` (inside a decoder block) runs its matmuls in FP8: a plain nn.Linear (not a
    quantized subclass, nor one with a quantized weight), not a router (`gate` alone, or a name with `router`;
    Llama's `gate_proj` is an MLP projection and converts), not a LoRA adapter, with both dims multiples of 16."""
    parts = fqn.split(".")
    if parts[-1] == "gate" or any("router" in p or p.startswith("lora_") for p in parts):
        return False
    # torchao's NF4 layers are plain nn.Linear modules holding an NF4Tensor weight, which has no FP8 cast.
    plain = type(module) is nn.Linear and type(module.weight) is nn.Parameter
    return plain and module.in_features % MULTIPLE == 0 and module.out_features % MULTIPLE == 0


def float8_linears(model: nn.Module) -> list[str]:
    """The names (within `model`) of the layers that compute in FP8 now."""
    return [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def require_fp8_device(device: torch.device) -> None:
    """A CUDA device without FP8 tensor cores cannot run torchao's FP8 matmul (exit 2); a CPU emulates it. ROCm
    reports its own architecture numbers as a capability (MI250X, without FP8, as 9.0), so an AMD GPU is refused by
    name, as check refuses it (plan/cards.py NO_FP8_AMD)."""
    if device.type == "cuda" and torch.version.hip:
        raise UserError(f"config key float8: true on {torch.cuda.get_device_name(device)}: shardfit's FP8 path is "
                        "tried on NVIDIA GPUs only (Ada, Hopper, Blackwell), not on ROCm. Fix: float8: false.")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(f"config key float8: true needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                        f"Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}. Fix: float8: false.")


def float8_config(device: torch.device) -> object:
    """torchao's Float8LinearConfig for `device`. The weight gradient's matmul has the micro-batch's tokens as its
    inner dimension, which torch._scaled_mm needs to be a multiple of 16 on a GPU: rows padded to their longest
    one rarely are, so torchao pads that dimension with zeros (a copy of the two FP8 operands, 1 byte an element,
    only when it is not a multiple already). Emulated off CUDA (the same casts and scales, the matmul in high
    precision), for tests."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(emulate=device.type != "cuda", pad_inner_dim=True)


def convert_to_float8(model: nn.Module, device: torch.device) -> int:
    """Swap the convertible linear layers of `model`'s decoder blocks for Float8Linear (weights shared, not copied);
    returns how many."""
    if not torchao_available():
        raise UserError(f"config key float8: true needs torchao for its FP8 matmuls: {TORCHAO_HINT}.")
    require_fp8_device(device)
    from torchao.float8 import convert_to_float8_training

    config = float8_config(device)
    for block in transformer_blocks(model):
        convert_to_float8_training(block, module_filter_fn=convertible, config=config)
    count = len(float8_linears(model))
    if device.type != "cuda":
        log.info("float8 on %s: %d linear layers emulate FP8 (the matmul itself stays in high precision); only "
                 "GPUs of compute capability 8.9+ (sm_89) run it faster", device.type, count)
    return count
