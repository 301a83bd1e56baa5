"""Eager attention's scores in memory (plan/eager_scores.py): what each op chain saves for backward, the peaks above
it, held to bench/results/eager_attention_memory.json; the chain chosen by the config's softcapping; and the ops
the host launches for them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.plan import dispatch, eager_scores
from shardfit.plan.activations import (
    activation_bytes,
    checkpointed_block_bytes_per_token,
    score_peak_bytes_per_token,
)
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.reference_memory import reference_activation_bytes
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

RESULT = json.loads((Path(__file__).resolve().parent.parent / "bench" / "results" /
                     "eager_attention_memory.json").read_text())
HEADS, TOKENS = RESULT["held_out"]
# A model of each chain at the bench's held-out heads (the widths do not enter the score terms).
CHAIN_SHAPES = {
    "llama": dict(model_type="llama"), "softcap": dict(model_type="gemma2", attn_softcap=50.0),
    "plain": dict(model_type="gpt2"), "fp32_qk": dict(model_type="gptj"), "alibi": dict(model_type="bloom"),
    "sinks": dict(model_type="gpt_oss", attention_sinks=True)}
# The bench's precisions as workloads: 16-bit weights (LoRA over a bf16 base), fp32, fp32 masters under autocast.
KINDS = {"bf16": dict(method="lora", precision="bf16"), "fp32": dict(method="full", precision="fp32"),
         "amp": dict(method="full", precision="bf16")}
LLAMA8 = resolve_shape("meta-llama/Llama-3.1-8B")


def chain_shape(chain: str, dropout: float) -> ModelShape:
    return ModelShape(id=chain, layers=2, hidden=96, intermediate=160, heads=HEADS, kv_heads=2, vocab=136,
                      head_dim=16, attn_dropout=dropout, **CHAIN_SHAPES[chain])


def held_out_workload(kind: str) -> Workload:
    return Workload(seq_len=TOKENS, micro_batch=1, grad_ckpt="none", attention="eager", **KINDS[kind])


def measured(key: str, what: str) -> float:
    """The bench's count of `what` at the held-out shape, less the mask's share (m L^2: the mask is built once
    per forward, held_mask_bytes' term) and the sink column's (s H L) where a chain has one."""
    r = RESULT["chains"][key]
    coef = r[what]["coef"]
    return r["at"][f"{HEADS}x{TOKENS}"][what] - coef["m"] * TOKENS**2 - coef["s"] * HEADS * TOKENS


CONFIGS = [k for k in RESULT["chains"] if k.endswith("/none")]


@pytest.mark.parametrize("key", CONFIGS)
def test_planned_scores_are_the_measured_ones_on_the_held_out_shape(key: str) -> None:
    """Per chain, precision and dropout: the score-sized tensors the planner counts as saved, and at the block's
    peak, are what one real layer holds at a shape the bench did not solve with (planned / measured = 1.000)."""
    chain, kind, p, _ = key.split("/")
    shape, w = chain_shape(chain, float(p[1:])), held_out_workload(kind)
    saved = eager_scores.eager_saved_bytes_per_token(shape, w, "single") * TOKENS
    if shape.attention_sinks:  # the sink column, planned apart: what the bench's column coefficient holds
        column = RESULT["chains"][key]["forward_end"]["coef"]["s"] * HEADS * TOKENS
        assert eager_scores.eager_saved_bytes_per_token(shape, w, "single") * TOKENS - \
            eager_scores.EAGER_SCORE_MEMORY[(chain, kind, float(p[1:]) > 0)][0] * HEADS * TOKENS**2 == \
            pytest.approx(column)
        saved -= column
    assert saved / measured(key, "forward_end") == pytest.approx(1.0, abs=5e-4)
    peak = max(measured(key, "forward_peak"), measured(key, "backward_peak"))
    planned_peak = saved + eager_scores.eager_peak_bytes_per_token(shape, w, "single") * TOKENS
    assert planned_peak / peak == pytest.approx(1.0, abs=5e-4)
    no_grad = saved + eager_scores.eager_no_grad_bytes_per_token(shape, w, "single") * TOKENS
    assert no_grad / measured(key, "no_grad_peak") == pytest.approx(1.0, abs=5e-4)


def test_tables_are_the_bench_result() -> None:
    """EAGER_SCORE_MEMORY and EAGER_SCORE_OPS carry the json's per head and score coefficients and its op counts
    (the same at both shapes counted): a recount that changes them fails here until they are carried over."""
    memory, ops = {}, {}
    for key in CONFIGS:
        chain, kind, p, _ = key.split("/")
        r = RESULT["chains"][key]
        entry = (chain, kind, float(p[1:]) > 0)
        memory[entry] = tuple(round(r[q]["coef"]["a"], 2)
                              for q in ("saved", "forward_peak", "backward_peak", "no_grad_peak"))
        counts = list(r["ops"].values())
        assert counts[0] == counts[1], key
        ops[entry] = tuple(counts[0][q] for q in ("forward_kernels", "forward_views", "backward_kernels",
                                                  "backward_views"))
        assert r["forward_end"]["coef"]["a"] == pytest.approx(r["saved"]["coef"]["a"]), key
    assert memory == eager_scores.EAGER_SCORE_MEMORY
    assert ops == eager_scores.EAGER_SCORE_OPS


@pytest.mark.parametrize("ckpt", ["full", "selective"])
def test_checkpointed_blocks_keep_no_scores(ckpt: str) -> None:
    """A checkpointed layer, full or selective (shardfit's policy keeps mm/addmm and SDPA/flash outputs), keeps
    none of its scores when its forward returns (measured: 0 per head and score for every chain); the planner's
    checkpointed block keeps nothing that grows with the row."""
    for key, r in RESULT["chains"].items():
        if key.endswith(f"/{ckpt}"):
            assert r["forward_end"]["coef"]["a"] == pytest.approx(0.0, abs=1e-6), key
    w = Workload(method="lora", seq_len=4096, attention="eager", grad_ckpt=ckpt)
    longer = dataclasses.replace(w, seq_len=8192)
    assert checkpointed_block_bytes_per_token(LLAMA8, w, "single") == \
        checkpointed_block_bytes_per_token(LLAMA8, longer, "single")


def test_the_block_alive_at_a_time_holds_the_scores_peak() -> None:
    """Llama-3.1-8B LoRA over 8k rows, eager, checkpointed: the recomputed block holds its scores at their
    backward peak (12 bytes a score in bf16: the saved fp32 softmax and its cast, the gradient, its upcast and the
    softmax's gradient), 6 above the 6 saved, less what the block saves after its scores (its MLP's tensors: not
    made yet at the forward's peak, freed by the backward's); the checkpointed blocks hold none. SDPA holds no
    scores. Without checkpointing the last block adds the same peak once."""
    w = Workload(method="lora", seq_len=8192, attention="eager", grad_ckpt="full")
    scores = w.tokens * LLAMA8.heads * 8192
    peak = score_peak_bytes_per_token(LLAMA8, w, "single") * w.tokens
    assert 5 * scores < peak < 6 * scores  # the MLP and the rest after the scores: 0.6 bytes a score here
    sdpa = dataclasses.replace(w, attention="sdpa")
    eager_less_sdpa = activation_bytes(LLAMA8, w, LLAMA8.layers) - activation_bytes(LLAMA8, sdpa, LLAMA8.layers)
    # the saved set's other tensors differ by SDPA's per-token terms only (no row-length term)
    assert eager_less_sdpa == pytest.approx(6 * scores + peak, rel=0.01)
    none = dataclasses.replace(w, grad_ckpt="none")
    assert activation_bytes(LLAMA8, none, 2) - activation_bytes(LLAMA8, none, 1) == pytest.approx(
        activation_bytes(LLAMA8, none, 3) - activation_bytes(LLAMA8, none, 2))
    assert activation_bytes(LLAMA8, none, 1) - activation_bytes(LLAMA8, none, 0) == pytest.approx(
        activation_bytes(LLAMA8, none, 2) - activation_bytes(LLAMA8, none, 1) + peak)


def test_reference_forward_holds_the_no_grad_peak() -> None:
    """DPO's reference forward without gradients holds Llama's scores at their no-grad peak (10 bytes a score in
    bf16: the masked scores, their fp32 upcast and the softmax), not the 6 a block saves."""
    w = Workload(method="lora", seq_len=4096, attention="eager", objective="dpo")
    sdpa = dataclasses.replace(w, attention="sdpa")
    scores = w.tokens * LLAMA8.heads * 4096
    assert reference_activation_bytes(LLAMA8, w, "single") - reference_activation_bytes(LLAMA8, sdpa, "single") == \
        pytest.approx(10 * scores, rel=0.01)


def test_gpt2_dropout_keeps_its_mask_and_output() -> None:
    """GPT-2's attention dropout (attn_pdrop 0.1) keeps a 1-byte bool mask and the dropped probabilities beside the
    softmax's output: 5 bytes a score saved in bf16 where 2 were."""
    gpt2 = chain_shape("plain", 0.1)
    w = Workload(method="lora", precision="bf16", seq_len=1024, attention="eager", grad_ckpt="none")
    per_score = eager_scores.eager_saved_bytes_per_token(gpt2, w, "single") / (gpt2.heads * 1024)
    assert per_score == 5
    undropped = eager_scores.eager_saved_bytes_per_token(dataclasses.replace(gpt2, attn_dropout=0.0), w, "single")
    assert undropped / (gpt2.heads * 1024) == 2


GEMMA2 = {"model_type": "gemma2", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 2, "vocab_size": 100}


def test_softcap_chain_follows_the_config() -> None:
    """Gemma 2's softcapping is the config's attn_logit_softcapping, not its model_type: null runs Llama's chain,
    absent is its class's 50; the catalog's Gemma 2 entries carry it; a value that is no softcap is the user's
    error, naming the key."""
    assert eager_scores.score_chain(shape_from_config(GEMMA2, "g")) == eager_scores.SOFTCAP_CHAIN
    assert shape_from_config(GEMMA2, "g").attn_softcap == 50.0
    off = shape_from_config({**GEMMA2, "attn_logit_softcapping": None}, "g")
    assert off.attn_softcap == 0.0
    assert eager_scores.score_chain(off) == eager_scores.LLAMA_CHAIN
    assert eager_scores.score_chain(resolve_shape("google/gemma-2-9b")) == eager_scores.SOFTCAP_CHAIN
    with pytest.raises(UserError, match="attn_logit_softcapping"):
        shape_from_config({**GEMMA2, "attn_logit_softcapping": -1}, "g")


def test_softcap_chain_only_where_the_class_applies_it() -> None:
    """Gemma 3's attention never hands attn_logit_softcapping to its attention function (transformers'
    Gemma3Attention keeps the value but passes no softcap), so a Gemma 3 config that sets it runs Llama's chain, and
    a value there is no user error; VaultGemma's class applies it as Gemma 2's does (its class default 50)."""
    gemma3 = {**GEMMA2, "model_type": "gemma3_text", "attn_logit_softcapping": 50.0}
    shape = shape_from_config(gemma3, "g3")
    assert shape.attn_softcap == 0.0
    assert eager_scores.score_chain(shape) == eager_scores.LLAMA_CHAIN
    assert shape_from_config({**gemma3, "attn_logit_softcapping": -1.0}, "g3").attn_softcap == 0.0
    vault = shape_from_config({**GEMMA2, "model_type": "vaultgemma"}, "v")
    assert eager_scores.score_chain(vault) == eager_scores.SOFTCAP_CHAIN


def test_softcap_off_moves_and_keeps_what_llama_does() -> None:
    """A Gemma 2 without softcapping is planned as Llama's chain on both sides: its scores' bytes in the time model
    and what they keep in memory."""
    from shardfit.plan import timing

    w = Workload(method="lora", seq_len=4096, attention="eager")
    capped = resolve_shape("google/gemma-2-9b")
    off = dataclasses.replace(capped, attn_softcap=0.0)
    as_llama = dataclasses.replace(capped, attn_softcap=0.0, model_type="llama")
    assert timing.eager_score_bytes(off, w, "eager") == timing.eager_score_bytes(as_llama, w, "eager")
    assert timing.eager_score_bytes(off, w, "eager") < timing.eager_score_bytes(capped, w, "eager")
    assert activation_bytes(off, w, 4) < activation_bytes(capped, w, 4)


@pytest.mark.parametrize("chain", list(CHAIN_SHAPES))
def test_selective_launches_every_eager_score_op_again(chain: str) -> None:
    """Selective checkpointing keeps no eager score op, so under eager it launches each of them again as full
    checkpointing does (not half-way): the eager ops beyond SDPA's kernel differ from full's by SDPA's kernel alone
    (LAYER_OPS counts its recomputation half-way under selective, and eager runs none)."""
    shape = chain_shape(chain, 0.0)
    w = Workload(method="lora", seq_len=1024, attention="eager")
    ops = {ck: dispatch.eager_attention_ops(shape, dataclasses.replace(w, grad_ckpt=ck)) for ck in
           ("none", "selective", "full")}
    fk, fv, bk, bv = eager_scores.eager_score_ops(shape, w, "single")
    assert ops["none"] == (fk + bk - 2, fv + bv)
    assert ops["full"] == (2 * fk + bk - 3, 2 * fv + bv)
    assert ops["selective"] == (ops["full"][0] + 0.5, ops["full"][1])
    assert dispatch.eager_attention_ops(shape, dataclasses.replace(w, attention="sdpa")) == (0.0, 0.0)


def test_eager_host_time_counts_the_score_ops() -> None:
    """The host launches eager attention's score ops in every softmax block: a short-row eager step's host time
    exceeds SDPA's by those ops at the kernel and view costs."""
    w = Workload(method="lora", seq_len=512, attention="eager", grad_ckpt="selective")
    sdpa = dataclasses.replace(w, attention="sdpa")
    k, v = dispatch.eager_attention_ops(LLAMA8, w)
    assert dispatch.host_dispatch_s(LLAMA8, w) - dispatch.host_dispatch_s(LLAMA8, sdpa) == pytest.approx(
        LLAMA8.layers * (k * dispatch.DISPATCH_KERNEL_S + v * dispatch.DISPATCH_VIEW_S))
    assert k > 0


def test_only_softmax_blocks_launch_score_ops() -> None:
    """A hybrid launches eager's score ops in its softmax-attention blocks alone: Nemotron-H's attention parts, not
    its Mamba and MLP parts."""
    shape = ModelShape(id="hybrid", layers=10, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=100,
                       single_part=True, mamba_layers=4, attention_layers=2)
    assert eager_scores.softmax_blocks(shape) == 2
    w = Workload(method="lora", seq_len=512, attention="eager", grad_ckpt="none")
    sdpa = dataclasses.replace(w, attention="sdpa")
    k, v = dispatch.eager_attention_ops(shape, w)
    assert dispatch.host_dispatch_s(shape, w) - dispatch.host_dispatch_s(shape, sdpa) == pytest.approx(
        2 * (k * dispatch.DISPATCH_KERNEL_S + v * dispatch.DISPATCH_VIEW_S))
