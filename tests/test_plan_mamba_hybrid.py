"""Mamba hybrids whose blocks pair a Mamba mixer with an MLP (Jamba, Bamba, Falcon-H1, IBM Granite 4.0): what a
block saves for backward, planned (plan/activations.py `paired_mamba_bytes_per_token`) against saved-tensor hooks on
each family's tiny model as a user without mamba_ssm runs it (transformers' reference torch scans). The Mamba
blocks were planned as attention blocks: 4.9 kB a token where Bamba's keeps 23.7 kB, Jamba's 68 kB."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from shardfit.cli import plan_cmd
from shardfit.cli.main import main
from shardfit.config.schema import LoraSettings
from shardfit.models.adapters import apply_lora
from shardfit.plan.activations import (
    activation_bytes,
    block_activation_bytes_per_token,
    largest_block_activation_bytes_per_token,
    score_peak_bytes_per_token,
)
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.model_shape import Block
from shardfit.plan.workload import Workload
from tests.helpers import saved_tensor_bytes

SEQ = 96
BASE = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            pad_token_id=0)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
              mamba_chunk_size=32)


def _config(family: str, mamba: bool, layers: int) -> Any:
    """A tiny `family` config of `layers` blocks, all with a Mamba mixer (`mamba`) or all with attention alone."""
    if family == "bamba":
        keys = dict(MAMBA2, attn_layer_indices=[] if mamba else list(range(layers)))
    elif family == "granitemoehybrid":
        keys = dict(MAMBA2, shared_intermediate_size=256, num_local_experts=0,
                    layer_types=["mamba" if mamba else "full_attention"] * layers)
    elif family == "falcon_h1":  # every block runs both; no gated norm unless mamba_rms_norm
        keys = dict(MAMBA2, head_dim=32, mamba_d_ssm=256)
    else:  # jamba: Mamba-1, attention every `period`-th block from `offset`
        keys = dict(attn_layer_period=layers + 1 if mamba else 1, attn_layer_offset=layers if mamba else 0,
                    num_experts=1, mamba_d_state=16, mamba_expand=2, mamba_dt_rank=8, mamba_d_conv=4)
    config = CONFIG_MAPPING[family](**BASE, **keys, num_hidden_layers=layers)
    config._attn_implementation = "sdpa"
    return config


def _saved_per_token(config: Any) -> float:
    """Bytes autograd keeps per token over one forward of the bf16 model (weights left out, each storage once)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    ids = torch.randint(1, 256, (1, SEQ))
    return saved_tensor_bytes(model, lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False)) / SEQ


def _measured_and_planned(family: str, mamba: bool) -> tuple[float, float]:
    """One block's saved activations per token (a two-block model less a one-block one: the embedding and head
    cancel) and the plan's for its kind: a pure-bf16 full fine-tune, the reference scans, SDPA without a mask."""
    measured = _saved_per_token(_config(family, mamba, 2)) - _saved_per_token(_config(family, mamba, 1))
    shape = shape_from_config(_config(family, mamba, 2).to_dict(), family)
    w = Workload(seq_len=SEQ, method="full", precision="bf16", pure_16bit=True, attention="flash",
                 mamba_scan="torch")
    planned = block_activation_bytes_per_token(shape, w, part=Block(False, mamba=mamba))
    assert block_activation_bytes_per_token(shape, w) == pytest.approx(planned)  # every block is of that kind
    return measured, planned


@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid", "falcon_h1", "jamba"])
def test_a_mamba_block_saves_what_its_mixer_keeps(family: str) -> None:
    """Within 3 % of the hooks: the Mamba-2 mixer as Nemotron-H's (Falcon-H1's without its gated norm, beside
    its attention), Jamba's Mamba-1 by its sequential scan; and Jamba's attention block as before."""
    measured, planned = _measured_and_planned(family, True)
    assert planned == pytest.approx(measured, rel=0.03)
    if family == "jamba":
        measured, planned = _measured_and_planned(family, False)
        assert planned == pytest.approx(measured, rel=0.03)


def test_the_mean_and_largest_block_weigh_the_mixers() -> None:
    """A Bamba of one Mamba block in four: its mean block a quarter of the way from attention's to the Mamba
    block's, and the block checkpointing recomputes the Mamba one."""
    config = CONFIG_MAPPING["bamba"](**BASE, **MAMBA2, num_hidden_layers=4, attn_layer_indices=[1, 2, 3])
    shape = shape_from_config(config.to_dict(), "bamba")
    w = Workload(seq_len=SEQ, method="lora", precision="bf16", mamba_scan="torch")
    mamba, attention = (block_activation_bytes_per_token(shape, w, part=Block(False, mamba=m)) for m in (True, False))
    assert mamba > 2.5 * attention  # the hooks: 17.1 kB against 5.9 kB under LoRA and autocast
    assert block_activation_bytes_per_token(shape, w) == pytest.approx((mamba + 3 * attention) / 4)
    assert largest_block_activation_bytes_per_token(shape, w) == pytest.approx(mamba)


def _plan_bamba(tmp_path: Path, capsys: pytest.CaptureFixture, gpus: str) -> dict[str, Any]:
    """`plan --json` of transformers' default Bamba config (9B) on `gpus`: LoRA, 4096 x 1, no checkpointing."""
    CONFIG_MAPPING["bamba"]().save_pretrained(tmp_path)
    main(["plan", "--model", str(tmp_path), "--gpus", gpus, "--seq", "4096", "--batch", "1", "--grad-ckpt", "none",
          "--json"])
    return json.loads(capsys.readouterr().out)


def test_the_mamba_test_is_for_targets_and_it_asks_about_the_gpus_only_for_a_mamba_model() -> None:
    """The CLI tested "has Mamba blocks" beside for_target's own test; for_target now takes the block count and
    asks whether the GPUs are elsewhere (which may load torch) only for a model that has them."""
    def never() -> bool:
        raise AssertionError("asked about the GPUs for a model without Mamba blocks")

    w = Workload()
    assert plan_cmd.for_target(w, 0, never) is w
    assert plan_cmd.for_target(w, 4, lambda: False) is w  # the GPUs are this machine's: its probe stands
    assumed = plan_cmd.for_target(w, 4, lambda: True)
    assert (assumed.mamba_scan, assumed.mamba_scan_assumed) == ("mamba_ssm", True)


def test_the_fallbacks_figure_is_of_a_strategy_the_plan_was_made_of() -> None:
    """mamba_notes looks up the plan's pick among the strategies it estimates again: a pick outside them was a bare
    StopIteration; it is an assertion saying which strategy and which strategies (no user input reaches it)."""
    from shardfit.plan.hardware import parse_gpus
    from shardfit.plan.plan import mamba_notes

    shape = shape_from_config(_config("bamba", True, 2).to_dict(), "bamba")
    w = Workload(mamba_scan="mamba_ssm", mamba_scan_assumed=True)
    hw = parse_gpus("1xH100")
    assert "single would need" in mamba_notes(shape, w, hw, "single", ("single",))[0]
    with pytest.raises(AssertionError, match=r"ddp is not among the strategies \('single',\)"):
        mamba_notes(shape, w, hw, "ddp", ("single",))


def test_gpus_named_from_elsewhere_are_planned_with_the_fused_scan(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning 8xH100 from a machine without them (or without mamba_ssm) plans what the GPU machine runs,
    mamba_ssm's fused scan (ddp in ~47 GiB, not the torch fallback's 235 GiB and model parallelism), and a note
    gives the fallback's figure; on the GPU machine itself the probe's torch answer stands."""
    assert Workload().mamba_scan == "torch"  # no mamba_ssm in the test environment
    monkeypatch.setattr(plan_cmd, "cards_here", lambda hw: False)
    out = _plan_bamba(tmp_path, capsys, "8xH100")
    ddp = next(c for c in out["candidates"] if c["strategy"] == "ddp")
    assert out["recommended"] == "ddp"
    assert ddp["per_gpu_gib"]["total"] == pytest.approx(47, abs=3)
    note = next(n for n in out["notes"] if "Mamba-2 blocks" in n)
    fallback = float(re.search(r"torch fallback.*?ddp would need (\d+\.\d) GiB", note)[1])
    assert fallback > 150
    monkeypatch.setattr(plan_cmd, "cards_here", lambda hw: True)
    here = _plan_bamba(tmp_path, capsys, "8xH100")
    assert here["recommended"] != "ddp"
    assert any("reference torch scan" in n for n in here["notes"])


def _saved_under_autocast(config: Any, method: str) -> float:
    """Bytes autograd keeps per token over one forward under bf16 autocast: LoRA (peft's default adapters, fp32
    over bf16 weights) or a full fine-tune over fp32 weights; autocast's weight casts are kept, as the plan counts
    them (`activation_bytes`)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32 if method == "full" else torch.bfloat16)
    if method == "lora":
        model = apply_lora(model, LoraSettings(rank=8, alpha=16))
    ids = torch.randint(1, 256, (1, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return saved_tensor_bytes(model, lambda: model(input_ids=ids, logits_to_keep=1, use_cache=False)) / SEQ


@pytest.mark.parametrize("method", ["lora", "full"])
@pytest.mark.parametrize(("family", "rel"), [("bamba", 0.06), ("granitemoehybrid", 0.06), ("falcon_h1", 0.03)])
def test_a_mamba_block_under_autocast(family: str, rel: float, method: str) -> None:
    """Under bf16 autocast a Mamba block's scan keeps its einsums' 16-bit input copies, not the fp32 ones a
    pure-bf16 run keeps, LoRA leaves out_proj's input unsaved (no adapter there), and the block casts three
    hidden-size inputs, not an attention block's six: the plan was 20-34 % over the hooks with LoRA. Within 6 %
    (Falcon-H1: 3 %, its fp32 exp of the segment sums and in_proj's output kept whole counted; it was 8 % under),
    and never more than 3 % under, LoRA and full, one block (a two-block model less one)."""
    measured = _saved_under_autocast(_config(family, True, 2), method) - \
        _saved_under_autocast(_config(family, True, 1), method)
    shape = shape_from_config(_config(family, True, 2).to_dict(), family)
    w = Workload(seq_len=SEQ, method=method, precision="bf16", attention="flash", mamba_scan="torch", lora_rank=8,
                 grad_ckpt="none")
    planned = (activation_bytes(shape, w, 2) - activation_bytes(shape, w, 1)) / SEQ
    assert planned == pytest.approx(measured, rel=rel)
    assert planned >= 0.97 * measured  # a memory plan may err over, hardly under


ZAMBA = dict(vocab_size=256, hidden_size=64, attention_hidden_size=128, attention_head_dim=16, num_attention_heads=4,
             num_key_value_heads=4, intermediate_size=256, mamba_d_state=16, pad_token_id=0)
# Each family's keys; a [Mamba, hybrid] model against a [Mamba, Mamba] one (Zamba ties its shared block's weights
# across hybrid blocks, so it needs two of them besides: [Mamba, hybrid, hybrid, hybrid | Mamba]).
ZAMBAS = {"zamba2": (dict(ZAMBA, n_mamba_heads=4, mamba_ngroups=1, adapter_rank=8, chunk_size=32), []),
          "zamba": (dict(ZAMBA, n_mamba_heads=2, mamba_dt_rank=8), ["hybrid", "hybrid"])}


def _zamba(family: str, last: str) -> Any:
    keys, middle = ZAMBAS[family]
    types = ["linear_attention", *middle, last]
    config = CONFIG_MAPPING[family](**keys, num_hidden_layers=len(types), layers_block_type=types)
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("family", ["zamba2", "zamba"])
def test_a_zamba_hybrid_block_saves_its_shared_block(family: str) -> None:
    """A hybrid block runs the shared transformer block (attention over the hidden state and the embedding, a gated
    MLP, Zamba2's adapter) and its own linear: what they save, within 3 % of the hooks (a model whose last block is
    hybrid less one whose last block is Mamba; pure-bf16 full fine-tune). The plan counted none of it: 4.3 kB a
    token on this Zamba2, 4.8 kB on this Zamba."""
    measured = _saved_per_token(_zamba(family, "hybrid")) - _saved_per_token(_zamba(family, "linear_attention"))
    w = Workload(seq_len=SEQ, method="full", precision="bf16", pure_16bit=True, attention="flash",
                 mamba_scan="torch", grad_ckpt="none")
    with_shared, without = (shape_from_config(_zamba(family, last).to_dict(), family)
                            for last in ("hybrid", "linear_attention"))
    layers = with_shared.layers
    planned = (activation_bytes(with_shared, w, layers) - activation_bytes(without, w, layers)) / SEQ
    assert planned == pytest.approx(measured, rel=0.03)
    # the block checkpointing recomputes is a hybrid one
    assert largest_block_activation_bytes_per_token(with_shared, w) == pytest.approx(
        largest_block_activation_bytes_per_token(without, w) + (planned if family == "zamba2" else 0))


def _saved_per_token_as_run(config: Any, method: str, autocast: bool, adapters_16bit: bool) -> float:
    """Bytes autograd keeps per token over one forward: a full fine-tune over fp32 weights under bf16 autocast or of
    the bf16 model without it; LoRA over bf16 weights, its adapters fp32 under autocast or bf16 without it. Only
    tensors with a sequence dimension: autocast's weight casts, cast once per forward whatever the tokens, are no
    per-token activation."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float32 if method == "full" and autocast else torch.bfloat16)
    if method == "lora":
        model = apply_lora(model, LoraSettings(rank=8, alpha=16))
        if adapters_16bit:
            model = model.to(torch.bfloat16)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if SEQ in t.shape and t.untyped_storage().data_ptr() not in weights:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(1, 256, (1, SEQ))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, logits_to_keep=1, use_cache=False)
    return sum(kept.values()) / SEQ


@pytest.mark.parametrize(("family", "method", "autocast", "attention"), [
    ("zamba2", "lora", True, "flash"), ("zamba2", "full", True, "flash"), ("zamba2", "lora", False, "flash"),
    ("zamba2", "full", False, "eager"), ("zamba", "lora", True, "flash"), ("zamba", "full", True, "flash")])
def test_a_zamba_shared_block_as_each_workload_runs_it(family: str, method: str, autocast: bool,
                                                       attention: str) -> None:
    """The shared block beyond a pure-bf16 full fine-tune: under autocast a full fine-tune's fp32 norm outputs are
    cast once per linear that reads them, and peft's fp32 adapters copy every adapted layer's input; LoRA keeps
    each adapter's rank-wide output; eager attention its S x S scores. The plan counted none of these: 19-42 % under
    the hooks (a hybrid-last model less a Mamba-last one)."""
    pure = not autocast
    eager = attention == "eager"
    configs = [_zamba(family, last) for last in ("hybrid", "linear_attention")]
    for c in configs:
        c._attn_implementation = "eager" if eager else "sdpa"
    with_shared, without = (_saved_per_token_as_run(c, method, autocast, pure and method == "lora") for c in configs)
    w = Workload(seq_len=SEQ, method=method, precision="bf16", pure_16bit=pure and method == "full",
                 adapters_16bit=pure and method == "lora", attention=attention, mamba_scan="torch", grad_ckpt="none",
                 lora_rank=8)
    shapes = [shape_from_config(c.to_dict(), family) for c in configs]
    layers = shapes[0].layers
    planned = (activation_bytes(shapes[0], w, layers) - activation_bytes(shapes[1], w, layers)) / SEQ
    # the hooks see the saved tensors, not the eager scores' peak the block alive at a time adds once
    planned -= score_peak_bytes_per_token(shapes[0], w, "single") - score_peak_bytes_per_token(shapes[1], w, "single")
    assert planned == pytest.approx(with_shared - without, rel=0.01)
