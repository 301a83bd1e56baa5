"""Gated DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): the plan reads which blocks are linear attention and
counts the model transformers builds, the adapters peft makes on it, and a step's token mixing per kind of block."""

from __future__ import annotations

import dataclasses
import json
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5

from shardfit import kernels, strategy
from shardfit.cli.main import main
from shardfit.config import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.models.build import meta_model
from shardfit.plan.activations import (
    activation_bytes,
    block_activation_bytes_per_token,
    deltanet_saved_bytes_per_token,
)
from shardfit.plan.adapters import lora_params
from shardfit.plan.cards import card_of
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.dispatch import DELTA_CHUNK_OPS, DISPATCH_KERNEL_S, DISPATCH_VIEW_S, host_dispatch_s
from shardfit.plan.flops import attention_flops_per_token, delta_rule_flops_per_token
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.in_flight import down_projection_bytes_per_token
from shardfit.plan.model_shape import DELTA_CHUNK, ModelShape
from shardfit.plan.plan import make_plan
from shardfit.plan.reference_memory import reference_activation_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import reference_work
from shardfit.plan.workload import Workload
from shardfit.train.loss import CausalLMLoss
from tests.helpers import saved_tensor_bytes

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"]
# Tiny text models of each hybrid: 4 blocks (3 Gated DeltaNet, 1 softmax attention), 4 experts where it has them.
TINY = dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
            num_experts_per_tok=2)
TINY_TYPES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid"]
# The dense hybrids, and OLMo hybrid's padding token (its default, 100277, lies past the tiny vocabulary).
DENSE_TYPES = ("qwen3_5_text", "olmo_hybrid")
TINY_PAD = {"olmo_hybrid": dict(pad_token_id=0, eos_token_id=1)}
EXPERT_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok")


def _tiny(model_type: str) -> AutoConfig:
    """The tiny config of `model_type` (a dense family without the mixture's keys)."""
    moe = model_type not in DENSE_TYPES
    return AutoConfig.for_model(model_type, **{k: v for k, v in TINY.items() if moe or k not in EXPERT_KEYS},
                                **TINY_PAD.get(model_type, {}))


def _written_default(model_type: str, tmp_path: Path) -> Path:
    """A folder whose config.json is transformers' default config of `model_type`."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG_MAPPING[model_type]().to_dict()))
    return tmp_path


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_default_hybrid_configs_count_the_built_model(model_type: str, tmp_path: Path) -> None:
    """Before: every block counted as plain attention (Qwen3.5's default 8.79B against 9.41B built). The model is
    the one the rank builds (models/build.py `meta_model`): Qwen3.5's composites load text-only, without the tower."""
    shape = resolve_shape(str(_written_default(model_type, tmp_path)))
    config = CONFIG_MAPPING[model_type]()
    model = meta_model(config, torch.bfloat16, SimpleNamespace(model=model_type, trust_remote_code=False,
                                                               attn_implementation="auto"))
    built = sum(p.numel() for p in model.parameters())
    towers = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    assert shape.linear_layers == 3 * shape.layers // 4
    assert shape.params() == pytest.approx(built, rel=1e-4)
    assert shape.params() - shape.extra_params == pytest.approx(built - towers, rel=1e-4)
    assert shape.extra_params == pytest.approx(towers, rel=1e-3)


@pytest.mark.parametrize("model_type", TINY_TYPES)
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_plan_counts_the_adapters_peft_makes_on_a_hybrid(model_type: str, targets: str | list[str]) -> None:
    """shardfit's default all-linear targets reach the DeltaNet's projections and the shared experts' gate, which
    bear none of the q_proj...down_proj names; a list of those names reaches neither (the routed experts left out
    there: training adapts every expert weight whatever the list names, models/adapters.py), but for OLMo hybrid's
    DeltaNet, whose q, k, v and output projections bear softmax attention's names (before, the plan counted its
    DeltaNet as Qwen3.5's, with a fused qkv projection, and its softmax attention as gated)."""
    torch.manual_seed(0)
    config = _tiny(model_type)
    model = AutoModelForCausalLM.from_config(config)
    shape = shape_from_config(config.to_dict(), model_type)
    assert shape.params() == sum(p.numel() for p in model.parameters())
    experts = isinstance(targets, str)
    peft_model = apply_lora(model, LoraSettings(rank=4, targets=targets, experts=experts))
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    short = None if isinstance(targets, str) else tuple(t.removesuffix("_proj") for t in targets)
    assert trainable == lora_params(shape, Workload(lora_rank=4, lora_targets=short, lora_experts=experts))


def test_linear_attention_blocks_add_no_sequence_term() -> None:
    """Doubling the sequence grows only the softmax blocks' attention (a quarter of Qwen3.5's blocks); before, the
    planner grew every block's."""
    shape = shape_from_config(CONFIG_MAPPING["qwen3_5"]().to_dict(), "qwen3_5")
    short, long = (attention_flops_per_token(shape, Workload(seq_len=s, attention="flash")) for s in (4096, 8192))
    softmax_growth = 4.0 * (8192 - 4096) / 2 * shape.heads * shape.hd
    assert long - short == pytest.approx(softmax_growth * (shape.layers - shape.linear_layers) / shape.layers)
    every_block = dataclasses.replace(shape, linear_layers=0)
    assert attention_flops_per_token(every_block, Workload(seq_len=32768, attention="flash")) > \
        3 * attention_flops_per_token(shape, Workload(seq_len=32768, attention="flash"))


def test_delta_rule_count_is_the_kernels_products() -> None:
    """The delta rule's count against torch's FLOP counter on transformers' chunked delta rule: its matmuls, plus
    the two triangular solves (uncounted by torch) at the dense products fla's kernel runs in their place."""
    heads, dk, dv, tokens = 2, 32, 48, 512
    shape = dataclasses.replace(shape_from_config(_tiny("qwen3_5_text").to_dict(), "t"),
                                linear_k_heads=heads, linear_v_heads=heads, linear_k_dim=dk, linear_v_dim=dv)
    q, k, v = torch.randn(1, tokens, heads, dk), torch.randn(1, tokens, heads, dk), torch.randn(1, tokens, heads, dv)
    with FlopCounterMode(display=False) as counter:
        modeling_qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g=-torch.rand(1, tokens, heads),
                                                      beta=torch.rand(1, tokens, heads), use_qk_l2norm_in_kernel=True)
    solves = 2 * DELTA_CHUNK * (dk + dv) * heads
    conv = 2 * shape.linear_conv * heads * (2 * dk + dv)
    assert delta_rule_flops_per_token(shape) - conv == counter.get_total_flops() / tokens + solves


def _block_config(kind: str, layers: int, dk: int) -> AutoConfig:
    """A tiny Qwen3.5 text model whose `layers` blocks are all of `kind`."""
    return AutoConfig.for_model(
        "qwen3_5_text", hidden_size=256, intermediate_size=704, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=4096, tie_word_embeddings=False, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=dk, linear_value_head_dim=48, layer_types=[kind] * layers,
        attn_implementation="sdpa")


def _saved_per_token(config: AutoConfig, method: str, seq: int = 256) -> float:
    """Bytes autograd keeps for backward after one forward under bf16 autocast, per token (weights excluded)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32 if method == "full" else torch.bfloat16)
    if method == "lora":
        model = apply_lora(model, LoraSettings(rank=8, alpha=16))
    module = CausalLMLoss(model, all_labelled=True)
    ids = torch.randint(0, 4096, (1, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return saved_tensor_bytes(module, lambda: module(ids, None, ids)) / seq


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
@pytest.mark.parametrize(("method", "dk"), [("lora", 32), ("lora", 64), ("full", 32)])
def test_block_activations_match_saved_tensors(kind: str, method: str, dk: int) -> None:
    """One block's saved activations (a second block's, less the first's) against the plan's, within 5 %: a Gated
    DeltaNet block keeps its delta rule's fp32 chunks (before, the plan counted it as plain attention: half of what
    it keeps), a gated attention block its q/k norms and output gate."""
    measured = _saved_per_token(_block_config(kind, 2, dk), method) - _saved_per_token(_block_config(kind, 1, dk),
                                                                                        method)
    shape = shape_from_config(_block_config(kind, 2, dk).to_dict(), "tiny")
    w = Workload(method=method, precision="bf16", seq_len=256, micro_batch=1, grad_ckpt="none", lora_rank=8,
                 attention="flash", delta_rule="torch")
    planned = (activation_bytes(shape, w, 2) - activation_bytes(shape, w, 1)) / 256
    assert planned == pytest.approx(measured, rel=0.05)


def test_recomputed_block_is_the_gated_deltanet_block() -> None:
    """Under checkpointing backward recomputes each block in turn, so its peak holds a Gated DeltaNet block's saved
    tensors, not the mean of 3 DeltaNet blocks and 1 softmax block's (before, the plan held the mean: 15 % short on
    Qwen3.5-9B). The reference's forward, one block at a time, peaks on the same block."""
    measured = _saved_per_token(_block_config("linear_attention", 2, 64), "lora") - \
        _saved_per_token(_block_config("linear_attention", 1, 64), "lora")
    config = _block_config("linear_attention", 4, 64)
    config.layer_types = ["linear_attention"] * 3 + ["full_attention"]
    shape = shape_from_config(config.to_dict(), "tiny")
    assert shape.linear_layers == 3
    w = Workload(method="lora", precision="bf16", seq_len=256, micro_batch=1, grad_ckpt="full", lora_rank=8,
                 attention="flash", delta_rule="torch")
    # No checkpointed block: only the recomputed one, and what it holds at its down projection.
    recomputed = activation_bytes(shape, w, 0) / 256 - down_projection_bytes_per_token(shape, w, "single", True)
    assert recomputed >= 0.97 * measured
    assert recomputed > block_activation_bytes_per_token(shape, w)
    assert reference_activation_bytes(shape, w, "single") / 256 - 2 * 2 * 256 == pytest.approx(recomputed)


@pytest.mark.parametrize(("change", "key"), [
    ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval"),
    ({"linear_num_value_heads": None}, "linear_num_value_heads"),
    ({"linear_value_head_dim": "128"}, "linear_value_head_dim"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
])
def test_bad_hybrid_config_values_are_a_message(change: dict, key: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    """A hybrid's config.json with a 0 interval, a null or string size or layer_types of the wrong length is the
    user's to fix: exit 2 naming the file and the key (before, transformers' strict-validation errors and the
    ZeroDivisionError ended as 'a bug in shardfit', exit 1)."""
    cfg = {**_tiny("qwen3_5_text").to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                      if v is not None or k != "layer_types"}))
    try:
        code = main(["plan", "--model", str(tmp_path), "--gpus", "1x80GB", "--seq", "512"])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert "bug in shardfit" not in err and str(tmp_path) in err and key in err


@pytest.mark.parametrize("model_type", ["flint", "laguna"])
def test_ungated_shared_experts_have_no_gate(model_type: str, tmp_path: Path) -> None:
    """Families whose shared experts are not gated (no shared_expert_gate in their modeling) count none, though
    their configs name a shared_expert_intermediate_size (before, each MoE block gained a phantom hidden x 1
    linear and its LoRA adapter)."""
    shape = resolve_shape(str(_written_default(model_type, tmp_path)))
    assert shape.shared_intermediate and shape.moe_layers
    assert not shape.shared_gate
    assert "shared_gate" not in [n for n, _, _ in shape.named_linears(True)]


def _q35_9b(tmp_path: Path) -> ModelShape:
    """Qwen3.5-9B's text model (transformers' default Qwen3.5 text config: 24 DeltaNet blocks of 32)."""
    return resolve_shape(str(_written_default("qwen3_5_text", tmp_path)))


def test_torch_delta_rule_dispatches_each_chunk(tmp_path: Path) -> None:
    """transformers' torch fallback loops over each row's 64-token chunks in Python: its host time grows with the
    sequence (about 1.25 s per micro-batch at 4k on Qwen3.5-9B, where fla's kernel dispatches a fixed count).
    Before, the plan timed every hybrid as fla's, whichever kernel its memory was planned for."""
    shape = _q35_9b(tmp_path)

    def host(seq: int, kernel: str, ckpt: str = "full") -> float:
        return host_dispatch_s(shape, Workload(method="lora", seq_len=seq, grad_ckpt=ckpt, attention="flash",
                                               delta_rule=kernel))

    assert host(8192, "fla") == host(4096, "fla")
    (fk, fv), (sk, sv) = DELTA_CHUNK_OPS[True]
    per_chunk = 24 * ((sk + fk) * DISPATCH_KERNEL_S + (sv + fv) * DISPATCH_VIEW_S)
    assert host(8192, "torch") - host(4096, "torch") == pytest.approx(64 * per_chunk)
    assert host(4096, "torch") - host(4096, "fla") == pytest.approx(64 * per_chunk)
    assert host(4096, "torch", "none") < host(4096, "torch")  # nothing recomputed


def test_torch_delta_rule_reference_forward_dispatches_each_chunk(tmp_path: Path) -> None:
    """DPO's reference forward runs the fallback's chunk loop too, forward only: its host time grows with the
    sequence by DELTA_CHUNK_OPS' forward count per chunk and DeltaNet block."""
    shape, card, single = _q35_9b(tmp_path), card_of(parse_gpus("1xH200")), strategy.get("single")

    def host(seq: int, kernel: str) -> float:
        w = Workload(method="lora", seq_len=seq, attention="flash", objective="dpo", delta_rule=kernel)
        return reference_work(shape, w, card, single).host

    (fk, fv), _ = DELTA_CHUNK_OPS[True]
    per_chunk = 24 * (fk * DISPATCH_KERNEL_S + fv * DISPATCH_VIEW_S)
    assert host(4096, "fla") == host(2048, "fla")
    # 32 more chunks per row; the pair's two rows run side by side, through the same loop
    assert host(4096, "torch") - host(2048, "torch") == pytest.approx(32 * per_chunk)


def test_delta_rule_chunk_ops_are_counted() -> None:
    """DELTA_CHUNK_OPS is what bench/delta_rule_ops.py counts on transformers' torch fallback (bf16 autocast)."""
    from bench.delta_rule_ops import per_chunk

    assert per_chunk(True, True) == DELTA_CHUNK_OPS[True][1]


def test_fla_plans_its_own_saved_tensors(tmp_path: Path) -> None:
    """With flash-linear-attention the DeltaNet's kernel keeps q, k, v, the decay, beta and one C-wide matrix per
    head, not the torch fallback's fp32 chunks: time and memory are planned for the same kernel."""
    shape = _q35_9b(tmp_path)
    w = Workload(method="lora", seq_len=32768, grad_ckpt="full", attention="flash", delta_rule="fla")
    torch_w = dataclasses.replace(w, delta_rule="torch")
    fla, fallback = deltanet_saved_bytes_per_token(shape, w), deltanet_saved_bytes_per_token(shape, torch_w)
    # Per value head: q, k, v, the solved C x C chunk matrix and beta in bf16, 12 fp32 bytes of decay and norms;
    # around the kernel the gated norm and out_proj's input (16 dv), the decay and beta (32); the convolution.
    heads, dk, dv = 32, 128, 128
    assert fla == heads * (2 * (2 * dk + dv + DELTA_CHUNK + 1) + 12 + 16 * dv + 32) + 4 * (2 * 16 * dk + heads * dv)
    assert fla < fallback / 3
    assert activation_bytes(shape, w, shape.layers) < activation_bytes(shape, torch_w, shape.layers)


@pytest.mark.parametrize(("kernel", "noted"), [("torch", True), ("fla", False)])
def test_fallback_plan_says_how_to_get_the_fused_kernel(kernel: str, noted: bool, tmp_path: Path) -> None:
    """A hybrid planned for the torch fallback says so and names the packages of the fused kernels."""
    plan = make_plan(_q35_9b(tmp_path), Workload(method="lora", seq_len=4096, delta_rule=kernel),
                     parse_gpus("1xH200"), ("single",))
    assert any("pip install flash-linear-attention causal-conv1d" in n for n in plan.notes) == noted


@pytest.mark.parametrize(("spec", "version", "kernel"), [
    (None, None, "torch"), ("fla", "0.4.0", "fla"), ("fla", "0.2.1", "torch"), ("fla", "", "fla")])
def test_delta_rule_kernel_is_what_is_installed(spec: str | None, version: str | None, kernel: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """fla where transformers would call it (the package, 0.2.2 or later), read without importing torch."""
    def version_of(name: str) -> str:
        if not version:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(kernels.importlib.util, "find_spec", lambda name: spec if name == "fla" else None)
    monkeypatch.setattr(kernels.metadata, "version", version_of)
    kernels.delta_rule_kernel.cache_clear()
    try:
        assert kernels.delta_rule_kernel() == kernel
    finally:
        kernels.delta_rule_kernel.cache_clear()
