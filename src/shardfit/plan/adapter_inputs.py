"""Which inputs a LoRA block keeps for its adapters, by the projections they adapt: the terms
plan/activations.py's block count takes from the job's `lora_targets` and `lora_dropout`."""

from __future__ import annotations

from shardfit.plan.adapters import adapts
from shardfit.plan.precision import casts_trainable_inputs
from shardfit.plan.shapes import ModelShape
from shardfit.plan.workload import Workload


def dense_adapters(shape: ModelShape, w: Workload) -> bool:
    """A LoRA or QLoRA run over dense softmax-attention blocks with a gated MLP: the blocks whose saved inputs
    `adapter_input_tensors` and `keeps_down_input` count by the adapted projections. (Mixtures, latent attention,
    Mamba and Gated DeltaNet blocks and single-part blocks keep the all-linear count.)"""
    return w.trains_adapters and not (shape.moe_layers or shape.mamba_mixers or shape.linear_layers
                                      or shape.single_part or shape.two_matrix or shape.mla is not None)


def adapter_input_tensors(w: Workload, strategy: str) -> int:
    """How many hidden-size 16-bit tensors a LoRA block keeps for its adapters' inputs, by which projections are
    adapted (`lora_targets`). A frozen linear keeps no input (autograd saves a matmul's input only for its weight's
    gradient), so only the adapters keep them:
    - without dropout or casts, each group's shared input once: the attention norm's output for q/k/v, the MLP
      norm's for gate/up (o's input is the attention output SDPA keeps anyway);
    - where peft casts the input to the fp32 adapter and autocast casts it back (`casts_trainable_inputs`), each
      adapter keeps its own 16-bit copy instead, o's included;
    - with dropout, each adapter keeps its dropped copy and mask (`lora_saved_bytes_per_token`) and none of these.
    All-linear gives 2 and 6, the counts of the full block. Measured with saved-tensor hooks on a transformers
    Llama block for each group of targets (tests/test_plan_lora_targets.py)."""
    if w.lora_dropout > 0:
        return 0
    attention = sum(adapts(n, w) for n in ("q", "k", "v"))
    mlp = sum(adapts(n, w) for n in ("gate", "up"))
    if casts_trainable_inputs(w, strategy):
        return attention + adapts("o", w) + mlp
    return (attention > 0) + (mlp > 0)


def keeps_down_input(shape: ModelShape, w: Workload) -> bool:
    """Whether a block keeps down's input (the product of the activation and up) for its backward: a trained down
    projection or its adapter (without dropout: with it the adapter keeps its dropped copy instead); under LoRA
    on dense blocks nothing else reads it (`dense_adapters`)."""
    return not dense_adapters(shape, w) or (adapts("down", w) and w.lora_dropout == 0)
