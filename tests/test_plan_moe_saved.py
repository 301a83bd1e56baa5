"""What a mixture-of-experts block saves for backward, planned (plan/estimate.py `moe_saved_bytes_per_token`,
`router_saved_bytes_per_token`, `router_copy_bytes`) against saved-tensor hooks on tiny real models with transformers'
grouped experts (what a run sets). DeepSeek-V3's router (GLM-4.5's, Nemotron-H's) runs in fp32 over an upcast input
and keeps its group choice, which the plan left out (GLM-4.5 and DeepSeek-V3 18 % light); Nemotron-H's latent
experts gather latent-wide rows (its latent mixture planned 24 % heavy, its plain one 10 % light); a full
fine-tune's mixture made the router's cast where the plan counted a dense MLP's two (Qwen3-MoE 5 % heavy)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, NemotronHConfig

from shardfit.plan.estimate import block_activation_bytes_per_token, moe_saved_bytes_per_token, router_copy_bytes
from shardfit.plan.model_shape import MOE, Block
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload
from tests.families import tiny_text_config
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
