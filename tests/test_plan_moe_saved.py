"""What a mixture-of-experts block saves for backward, planned (plan/activations.py `moe_saved_bytes_per_token`,
`router_saved_bytes_per_token`, `router_copy_bytes`) against saved-tensor hooks on tiny real models with transformers'
grouped experts (what a run sets). DeepSeek-V3's router (GLM-4.5's, Nemotron-H's) runs in fp32 over an upcast input
and keeps its group choice, which the plan left out (GLM-4.5 and DeepSeek-V3 18 % light); Nemotron-H's latent
experts gather latent-wide rows (its latent mixture planned 24 % heavy, its plain one 10 % light); a full
fine-tune's mixture made the router's cast where the plan counted a dense MLP's two (Qwen3-MoE 5 % heavy)."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, NemotronHConfig

from shardfit.config.schema import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.plan.activations import (
    activation_bytes,
    block_activation_bytes_per_token,
    moe_saved_bytes_per_token,
    router_copy_bytes,
)
from shardfit.plan.estimate import planned_workload
from shardfit.plan.model_shape import MOE, Block
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from shardfit.train.loss import CausalLMLoss
from tests.families import tiny_text_config
from tests.helpers import saved_tensor_bytes
from tests.test_nemotron_h import LATENT_MOE, PATTERN_MOE, cfg_path

SEQ = 100


def _saved(module: torch.nn.Module, x: torch.Tensor, autocast: bool, with_input: bool = False) -> float:
    """Bytes per token autograd keeps over `module(x)`: each storage once, the module's weights and autocast's 16-bit
    copies of them left out (the plan counts those with every weight's cast: `activation_bytes`' `cast`), and `x`
    unless `with_input` (a block's norm keeps it as its fp32 upcast where it is fp32 already). SEQ tokens make no
    activation shaped as a weight."""
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()}
    shapes = {tuple(p.shape) for p in module.parameters() if p.dim() == 2}
    if not with_input:
        skip.add(x.untyped_storage().data_ptr())
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        cast = t.dtype == torch.bfloat16 and (tuple(t.shape) in shapes or tuple(t.shape)[::-1] in shapes)
        if t.untyped_storage().data_ptr() not in skip and not (autocast and cast):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(kept.values()) / SEQ


def _routing(module: torch.nn.Module) -> None:
    """Random router weights (some families initialise them to zero, which sends every token to the same experts)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "gate" in name and "experts" not in name and p.dim() == 2:
                p.normal_(0, 0.5)


def _workload(autocast: bool) -> Workload:
    """A full fine-tune in bf16: pure 16-bit weights, or fp32 masters under autocast."""
    return Workload(seq_len=SEQ, method="full", precision="bf16", pure_16bit=not autocast, attention="flash",
                    mamba_scan="torch")


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize(("family", "top_k"), [("GLM-4.5", 2), ("DeepSeek-V3", 4), ("Qwen3-MoE", 2), ("gpt-oss", 2)])
def test_a_mixture_module_saves_what_the_plan_counts(family: str, top_k: int, autocast: bool) -> None:
    """The mixture module of a tiny model (8 experts, its input left out: the block's norm output) within 1 % of the
    plan, with the router's weight copy per block; under autocast also the dense MLP's two input casts the block
    count holds."""
    config = tiny_text_config(family)
    config.num_experts_per_tok = top_k
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, key, None) is not None:
            setattr(config, key, 8)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32 if autocast else torch.bfloat16)
    module = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    _routing(module)
    x = torch.randn(1, SEQ, config.hidden_size, dtype=next(module.parameters()).dtype, requires_grad=True) * 1.0
    measured = _saved(module, x, autocast)
    folder = Path(tempfile.mkdtemp())
    config.save_pretrained(folder)
    shape = resolve_shape(str(folder))
    w = _workload(autocast)
    planned = moe_saved_bytes_per_token(shape, w, "single") + router_copy_bytes(shape, w, "single") / SEQ
    if autocast:
        planned += 2 * 2 * shape.hidden
    assert planned == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("cfg", [LATENT_MOE, PATTERN_MOE], ids=["latent", "pattern"])
def test_a_nemotron_mixture_block_saves_what_the_plan_counts(cfg: dict[str, Any], autocast: bool) -> None:
    """A NemotronHBlock of kind "moe" (its norm, router, grouped experts, latent projections and shared expert)
    within 1 % of the plan's block of that kind."""
    cfg = {**cfg, "mlp_bias": False, "use_bias": False}
    config = NemotronHConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "hybrid_override_pattern",
                                                                          "layers_block_type")},
                             layers_block_type=["moe"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32 if autocast else torch.bfloat16)
    block = model.model.layers[0]
    _routing(block)
    x = torch.randn(1, SEQ, config.hidden_size, dtype=next(block.parameters()).dtype, requires_grad=True)
    measured = _saved(block, x, autocast, with_input=True)
    shape = resolve_shape(cfg_path(cfg))
    w = _workload(autocast)
    planned = block_activation_bytes_per_token(shape, w, part=Block(True, part=MOE)) + \
        router_copy_bytes(shape, w, "single") / SEQ
    assert planned == pytest.approx(measured, rel=0.01)


def _all_mixture_config(family: str, layers: int) -> Any:
    """A tiny `family` config of `layers` blocks, every one a mixture (the 4-less-2 difference is two of them)."""
    config = tiny_text_config(family)
    config.num_hidden_layers = layers
    if getattr(config, "first_k_dense_replace", None) is not None:
        config.first_k_dense_replace = 0
    for key in ("layer_types", "mlp_layer_types"):
        if getattr(config, key, None) is not None:
            setattr(config, key, [getattr(config, key)[-1]] * layers)
    # SDPA over rows of one example builds no mask (the plan's `flash`); gpt-oss's sinks run eager only (so
    # does its plan: estimate.py `planned_workload`).
    config._attn_implementation = "eager" if family == "gpt-oss" else "sdpa"
    return config


def _model_saved_per_token(family: str, method: str, layers: int) -> float:
    """Bytes per token autograd keeps over one forward of a tiny `family` model of `layers` mixture blocks through
    the training loss (shardfit's adapters for LoRA), under CPU bf16 autocast over fp32 weights (LoRA: 16-bit
    base weights, fp32 adapters)."""
    config = _all_mixture_config(family, layers)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if method == "full" else torch.bfloat16)
    for layer in model.model.layers:
        _routing(layer.mlp)
    if method == "lora":
        model = apply_lora(model, LoraSettings(rank=8, alpha=16))
    module = CausalLMLoss(model, all_labelled=True)
    ids = torch.randint(0, config.vocab_size, (1, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return saved_tensor_bytes(module, lambda: module(ids, None, ids)) / SEQ


# LoRA over Qwen3-MoE and GLM-4.5 is planned 3.2 % and 10 % under these hooks (3611 vs 3731, 3551 vs 3948 B/token
# a block): not yet traced, so not held here.
@pytest.mark.parametrize(("family", "method"), [("Qwen3-MoE", "full"), ("GLM-4.5", "full"), ("gpt-oss", "full"),
                                                ("gpt-oss", "lora")])
def test_a_whole_model_saves_what_the_plan_counts_per_mixture_block(family: str, method: str) -> None:
    """Two more mixture blocks of a real tiny model (4 less 2, the embedding, head and loss cancel) keep what the
    plan's block count sums for two, within 3 %: what the plan adds up, not the mixture's count alone. A full
    fine-tune's grouped experts run in fp32 and autocast keeps no 16-bit copy of their weights (the plan counted
    one: Qwen3-MoE 12 % and GLM-4.5 10 % heavy)."""
    measured = (_model_saved_per_token(family, method, 4) - _model_saved_per_token(family, method, 2)) / 2
    folder = Path(tempfile.mkdtemp())
    _all_mixture_config(family, 4).save_pretrained(folder)
    shape = resolve_shape(str(folder))
    w = Workload(seq_len=SEQ, micro_batch=1, method=method, precision="bf16", attention="flash", lora_rank=8,
                 grad_ckpt="none")
    w = planned_workload(shape, dataclasses.replace(w, attention="eager")
                         if family == "gpt-oss" else w)
    # 4 less 2 blocks, as measured: the block alive at a time adds its eager scores' peak once, not per block
    planned = (activation_bytes(shape, w, 4, "single") - activation_bytes(shape, w, 2, "single")) / 2 / w.tokens
    assert planned == pytest.approx(measured, rel=0.03)
