"""The plan of a preference run (issue 44): both answers of a pair forwarded, the reference's forward inside each
micro-batch (dpo with LoRA), the reference's one-off pass (precomputed), and no second copy of the weights."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.plan.cards import card_of
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import Plan, make_plan
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload

LLAMA8 = resolve_shape("meta-llama/Llama-3.1-8B")
A100 = parse_gpus("1xA100-80G")
EIGHT = parse_gpus("8xA100-80G")
SEQ = 2048
GIB = 2**30


def plan_of(objective: str, method: str = "lora", hw=A100, **kw) -> Plan:
    return make_plan(LLAMA8, Workload(method=method, seq_len=SEQ, objective=objective, **kw), hw)


def forward_flops_per_token(seq: int) -> float:
    """A forward pass of Llama-3.1-8B per token, from its widths alone: 2 FLOPs per weight of every block's seven
    projections and of the head, and QK^T and PV over the whole row (SDPA with a dense mask)."""
    s = LLAMA8
    q, kv = s.heads * s.hd, s.kv_heads * s.hd
    block = s.hidden * q + 2 * s.hidden * kv + q * s.hidden + 3 * s.hidden * s.intermediate
    return s.layers * (2 * block + 2 * 2 * seq * q) + 2 * s.hidden * s.vocab


def test_a_pair_doubles_the_rows_and_the_activations() -> None:
    """orpo (pairs, no reference) against sft: twice the sequences per example, so twice the saved activations
    and twice the compute; the model states are the same."""
    sft_plan = plan_of("sft")
    sft, orpo = sft_plan.candidate("single"), plan_of("orpo").candidate("single")
    assert sft.peak_phase == orpo.peak_phase == "backward"
    a, b = sft.per_gpu_gib, orpo.per_gpu_gib
    assert (b.weights, b.grads, b.optimizer) == (a.weights, a.grads, a.optimizer)
    assert b.activations == pytest.approx(2 * a.activations, rel=1e-9)
    # The added rows' tokens each keep at least every checkpointed block's 16-bit input.
    assert (b.activations - a.activations) * GIB >= SEQ * LLAMA8.layers * LLAMA8.hidden * 2
    # compute_s is the micro-batch's and the optimizer step's (AdamW over the fp32 adapters: read weight, gradient
    # and both moments, write three, 28 bytes a parameter), which does not grow with the rows.
    adam_s = sft_plan.model.trainable_params * 28 / card_of(A100).hbm
    micro_batch_s = sft.time_parts["compute_s"] - adam_s
    assert orpo.time_parts["compute_s"] == pytest.approx(2 * micro_batch_s + adam_s, rel=1e-9)
    assert orpo.reference_pass_s is None
    assert orpo.tokens_per_s == pytest.approx(2 * SEQ / orpo.step_s, rel=1e-6)  # both answers' tokens


def test_dpo_with_lora_adds_the_reference_forward_to_each_step_but_no_memory() -> None:
    """dpo with LoRA: the policy with its adapters off runs a forward without gradients in every micro-batch:
    its FLOPs (the frozen base, both rows) at the card's training rate, about a third of the step; the peak and the
    weights stay those of the same pairs without a reference."""
    dpo_plan, orpo_plan = plan_of("dpo"), plan_of("orpo")
    dpo, orpo = dpo_plan.candidate("single"), orpo_plan.candidate("single")
    assert dpo_plan.to_json()["objective"] == {"name": "dpo", "rows": 2, "tokens": 2 * SEQ,
                                               "reference": "adapters_off"}
    reference_s = 2 * SEQ * forward_flops_per_token(SEQ) / card_of(A100).peak("bf16")
    assert dpo.time_parts["compute_s"] - orpo.time_parts["compute_s"] == pytest.approx(reference_s, rel=1e-3)
    assert 0.25 < reference_s / orpo.time_parts["compute_s"] < 0.4
    assert dpo.per_gpu_gib.total == orpo.per_gpu_gib.total
    assert dpo.per_gpu_gib.weights == orpo.per_gpu_gib.weights
    assert any("adapters switched off" in n and "no second copy of the weights" in n and "+" in n
               for n in dpo_plan.notes)


def test_orpo_and_a_precomputed_reference_have_no_reference_term() -> None:
    """orpo has no reference; dpo with precompute_reference true pays it once before step 1, not in the step."""
    orpo, pre = plan_of("orpo"), plan_of("dpo", precompute_reference=True)
    assert orpo.to_json()["objective"]["reference"] is None
    assert any("no reference model" in n for n in orpo.notes)
    assert pre.candidate("single").step_s == orpo.candidate("single").step_s
    per_example = 2 * SEQ * forward_flops_per_token(SEQ) / card_of(A100).peak("bf16")
    assert pre.candidate("single").reference_pass_s == pytest.approx(per_example, rel=1e-3)


def test_full_finetune_dpo_precomputes_and_keeps_one_copy_of_the_weights() -> None:
    """A full fine-tune has no adapters to switch off: auto precomputes the reference, whose pass is shared by the
    ranks; weights, gradients and optimizer states are those of SFT on the same model."""
    sft, dpo = plan_of("sft", "full", EIGHT), plan_of("dpo", "full", EIGHT)
    assert dpo.workload.reference == "precomputed"
    for name in ("single", "zero3"):
        a, b = sft.candidate(name).per_gpu_gib, dpo.candidate(name).per_gpu_gib
        assert (b.weights, b.grads, b.optimizer) == (a.weights, a.grads, a.optimizer)
    one, eight = dpo.candidate("single").reference_pass_s, dpo.candidate("zero3").reference_pass_s
    assert one and eight and eight < one / 4  # eight ranks take every eighth micro-batch each
    assert any("computed once before step 1" in n and "no second copy of the weights" in n for n in dpo.notes)


def test_zero3_gathers_the_weights_once_more_for_the_reference() -> None:
    comm = {o: plan_of(o, hw=EIGHT).candidate("zero3").time_parts["comm_s"] for o in ("sft", "orpo", "dpo")}
    assert comm["sft"] == pytest.approx(comm["orpo"], rel=1e-9)  # collectives move weights, not tokens
    assert comm["dpo"] > comm["orpo"]
    assert plan_of("dpo", hw=EIGHT).candidate("zero2").time_parts["comm_s"] == pytest.approx(
        plan_of("orpo", hw=EIGHT).candidate("zero2").time_parts["comm_s"], rel=1e-9)


def test_plan_command_takes_the_objective(capsys, tmp_path: Path) -> None:
    """--objective and --precompute-reference with --model; a config's objective and dpo section."""
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1xA100-80G", "--objective", "dpo",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"]["reference"] == "adapters_off" and out["workload"]["objective"] == "dpo"
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1xA100-80G", "--objective", "kto",
                 "--precompute-reference", "true"]) == 0
    text = capsys.readouterr().out
    assert "objective kto (reference: precomputed)" in text and "per 1,000 examples" in text
    assert main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--gpus", "1xA100-80G", "--objective", "dpo",
                 "--method", "full", "--precompute-reference", "false"]) == 2
    assert "no adapters to switch off" in capsys.readouterr().err
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text("model: meta-llama/Llama-3.1-8B\nobjective: simpo\nmethod: qlora\nmax_seq_len: 1024\n"
                   "micro_batch: 2\n")
    assert main(["plan", str(cfg), "--gpus", "1xA100-80G", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["objective"] == {"name": "simpo", "rows": 4, "tokens": 4096, "reference": None}
    assert dataclasses.asdict(Workload())["objective"] == "sft"
