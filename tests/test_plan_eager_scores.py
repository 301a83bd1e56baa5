"""Eager attention's scores in the time model (plan/timing.py `eager_score_bytes`): the heads x L x L scores
transformers' eager_attention_forward writes and reads, which SDPA and flash keep on chip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.plan import timing
from shardfit.plan.cards import card_of
from shardfit.plan.hardware import Hardware, parse_gpus
from shardfit.plan.model_shape import ModelShape
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.workload import Workload, model_workload

BENCH = Path(__file__).resolve().parent.parent / "bench"
LLAMA8 = resolve_shape("meta-llama/Llama-3.1-8B")
GPT_OSS = resolve_shape("openai/gpt-oss-20b")
H200 = parse_gpus("1xH200")


def lora(seq_len: int, attention: str) -> Workload:
    """The default LoRA job a model is planned with (full checkpointing), at `seq_len` tokens with `attention`."""
    return dataclasses.replace(model_workload(), method="lora", seq_len=seq_len, attention=attention)


def without_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """EAGER_SCORE_BYTES at zero: the time model as it was without the scores' term."""
    for key, sides in timing.EAGER_SCORE_BYTES.items():
        monkeypatch.setitem(timing.EAGER_SCORE_BYTES, key, {side: (0.0, 0.0) for side in sides})


@pytest.mark.parametrize("gpus", ["1xH100", "1xH200"])
def test_eager_attention_is_slower_than_sdpa_at_8k(gpus: str) -> None:
    """Llama-3.1-8B LoRA over 8k-token rows: eager attention writes and reads every head's 8k x 8k scores in HBM
    (about 100 bytes a score with checkpointing), which SDPA never does, so the eager plan is the slower one by
    more than a tenth, not the faster one (as its 2x backward against flash's 2.5x made it)."""
    hw = parse_gpus(gpus)
    eager, sdpa = (timing.step_time(LLAMA8, lora(8192, a), hw, "single").step_s for a in ("eager", "sdpa"))
    assert eager > 1.1 * sdpa


def test_eager_penalty_grows_with_the_square_of_the_row() -> None:
    """Per micro-batch the scores grow with L^2 (L per token, L tokens): from 4k to 8k the scores' bytes are four
    times as many, and the eager plan's lead over SDPA grows about as much (both sides' attention FLOPs grow with
    L^2 too, the rest of the step with L)."""
    at = {n: timing.eager_score_bytes(LLAMA8, lora(n, "eager"), "eager") for n in (4096, 8192)}
    assert at[8192] == pytest.approx(4 * at[4096])
    gap = {n: timing.step_time(LLAMA8, lora(n, "eager"), H200, "single").step_s
           - timing.step_time(LLAMA8, lora(n, "sdpa"), H200, "single").step_s for n in (4096, 8192)}
    assert 3.5 < gap[8192] / gap[4096] < 4.5


def test_gpt_oss_is_no_faster_for_running_eager() -> None:
    """gpt-oss-20b's class has no SDPA: a job that asks for SDPA runs (and is planned) eager. Its 8k LoRA step was
    planned faster eager than with SDPA's kernel (2.70 s against 2.81 on an H200), as only the backward's FLOPs
    changed; with the scores' traffic it is the slower, and by the scores' bytes at the memory bandwidth."""
    sdpa_kernel = dataclasses.replace(GPT_OSS, eager_only=False)
    eager = timing.step_time(GPT_OSS, lora(8192, "sdpa"), H200, "single").step_s
    assert eager > timing.step_time(sdpa_kernel, lora(8192, "sdpa"), H200, "single").step_s
    w = lora(8192, "eager")
    # every block's whole square: the windowed half of the blocks is a dense mask over the row under eager
    a, m = timing.EAGER_SCORE_BYTES[(True, True)]["eager"]
    scores = GPT_OSS.heads * GPT_OSS.layers * w.tokens * 8192
    assert timing.eager_score_bytes(GPT_OSS, w, "eager") == pytest.approx(scores * (a + m))


def test_scores_only_under_eager_attention() -> None:
    """SDPA and flash keep the scores on chip: no bytes for them."""
    for attention in ("sdpa", "flash"):
        assert timing.eager_score_bytes(LLAMA8, lora(8192, attention), "eager") == 0.0


def test_scores_time_is_their_bytes_at_the_memory_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The micro-batch computes for the scores' bytes over the card's bandwidth longer, on both sides of the floor
    (the training utilization comes from SDPA and flash runs, which never moved them); on a CPU, whose measured
    rate holds every op, nothing changes."""
    w = lora(8192, "eager")
    cpu = Hardware(1, 1, 64.0, 64.0, "cpu")
    with_term = {hw: timing.step_time(LLAMA8, dataclasses.replace(w, seq_len=n), hw, "single").step_s
                 for hw, n in ((H200, 8192), (cpu, 1024))}
    scores = timing.eager_score_bytes(LLAMA8, w, "eager") / card_of(H200).hbm
    without_scores(monkeypatch)
    assert with_term[H200] - timing.step_time(LLAMA8, w, H200, "single").step_s == pytest.approx(scores)
    assert with_term[cpu] == timing.step_time(LLAMA8, dataclasses.replace(w, seq_len=1024), cpu, "single").step_s


def test_checkpointing_recomputes_the_forward_scores() -> None:
    """Full checkpointing runs each block's forward again (its scores' bytes again); selective half-way; a
    precision's mask is in its dtype (fp32: twice bf16's bytes per element); `freeze` runs the backward only
    through the blocks it trains."""
    w = lora(8192, "eager")
    a0, m0 = timing.EAGER_SCORE_BYTES[(False, False)]["eager"]
    a1, m1 = timing.EAGER_SCORE_BYTES[(False, True)]["eager"]
    scores = LLAMA8.heads * LLAMA8.layers * w.tokens * 8192  # micro_batch rows of 8192 x 8192 each
    by = {ck: timing.eager_score_bytes(LLAMA8, dataclasses.replace(w, grad_ckpt=ck), "eager")
          for ck in ("none", "selective", "full")}
    assert by["none"] == pytest.approx(scores * (a0 + m0))
    assert by["full"] == pytest.approx(scores * (a1 + m1))
    assert by["selective"] == pytest.approx((by["none"] + by["full"]) / 2)
    fp32 = dataclasses.replace(w, grad_ckpt="none", precision="fp32")
    assert timing.eager_score_bytes(LLAMA8, fp32, "eager") == pytest.approx(scores * (a0 + 2 * m0))
    forward = timing.eager_score_bytes(LLAMA8, w, "eager", forward_only=True)
    assert forward == pytest.approx(scores * (a1 + m1 - a0 - m0))
    top_two = dataclasses.replace(w, method="freeze", grad_ckpt="none")
    assert timing.eager_score_bytes(LLAMA8, top_two, "eager") == pytest.approx(
        scores * (a1 + m1 - a0 - m0) + scores * 2 / LLAMA8.layers * (2 * (a0 + m0) - (a1 + m1)))


def test_reference_forward_moves_the_forward_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """DPO's reference forward (adapters off, inside every micro-batch) moves one forward's scores, no more."""
    w = dataclasses.replace(lora(4096, "eager"), objective="dpo")
    card = card_of(H200)
    forward = timing.eager_score_bytes(LLAMA8, w, "eager", forward_only=True) / card.hbm
    strategy = timing.strategies.get("single")
    with_term = timing.reference_work(LLAMA8, w, card, strategy).compute
    without_scores(monkeypatch)
    assert with_term - timing.reference_work(LLAMA8, w, card, strategy).compute == pytest.approx(forward)


def test_compiled_scores_are_fewer_than_eager() -> None:
    """Under torch.compile inductor keeps the two matmuls as extern kernels and fuses the scaling, mask, upcast,
    softmax and cast (and their backward) into one kernel each way: fewer bytes per score, not none."""
    w = lora(8192, "eager")
    compiled = timing.eager_score_bytes(LLAMA8, dataclasses.replace(w, compile=True), "compiled")
    assert 0 < compiled < 0.6 * timing.eager_score_bytes(LLAMA8, w, "eager")


def test_score_table_is_the_bench_result() -> None:
    """EAGER_SCORE_BYTES carries bench/results/eager_attention_bytes.json's per-head and per-mask-element bytes:
    a recount that changes them fails here until they are carried over. Llama's are eager attention less SDPA;
    gpt-oss's its eager layer alone; compiled, Llama's for both, and under checkpointing the compiled count without
    it plus one compiled forward (the direct count does not hold on a held-out shape), the rule the eager counts
    follow exactly."""
    result = json.loads((BENCH / "results" / "eager_attention_bytes.json").read_text())
    eager, compiled = result["eager"], result["compiled"]

    def coef(fit: dict) -> tuple[float, float]:
        return fit["coef"]["a"], fit["coef"]["m"]

    counted = {(False, False): coef(eager["llama/full/bf16"]["eager_less_sdpa"]),
               (False, True): coef(eager["llama/full+ckpt/bf16"]["eager_less_sdpa"]),
               (True, False): coef(eager["gpt_oss/full/bf16"]["eager"]),
               (True, True): coef(eager["gpt_oss/full+ckpt/bf16"]["eager"])}
    once, forward = coef(compiled["llama/full/bf16"]["eager"]), coef(compiled["llama/full/bf16"]["forward"])
    for (sinks, ckpt), sides in timing.EAGER_SCORE_BYTES.items():
        assert sides["eager"] == pytest.approx(counted[(sinks, ckpt)], abs=0.01), (sinks, ckpt)
        again = tuple(x + y for x, y in zip(once, forward, strict=True)) if ckpt else once
        assert sides["compiled"] == pytest.approx(again, abs=0.01), (sinks, ckpt)
    # checkpointing adds one forward's bytes, eager: what a forward without gradients moves
    for arch, key in (("llama", "forward_less_sdpa"), ("gpt_oss", "forward")):
        with_ckpt, without = (counted[(arch == "gpt_oss", ck)] for ck in (True, False))
        fwd = coef(eager[f"{arch}/full/bf16"][key])
        assert fwd == pytest.approx(tuple(x - y for x, y in zip(with_ckpt, without, strict=True)), abs=0.01), arch
    # fp32 moves as many bytes per score as bf16, its mask's elements twice as wide; LoRA as many as full
    fp32 = coef(eager["llama/full/fp32"]["eager_less_sdpa"])
    assert (fp32[0], fp32[1] / 2) == pytest.approx(counted[(False, False)], abs=0.01)
    assert coef(eager["llama/lora7+ckpt/bf16"]["eager_less_sdpa"]) == pytest.approx(counted[(False, True)], abs=0.01)


GEMMA2 = resolve_shape("google/gemma-2-9b")
GPT2 = ModelShape(id="gpt2", layers=12, hidden=768, intermediate=3072, heads=12, kv_heads=12, vocab=50257,
                  model_type="gpt2")


def per_score(shape: ModelShape, **kw) -> float:
    """Planned bytes per head and score of one 4096-token row, every block's whole square under eager."""
    w = dataclasses.replace(model_workload(), method="lora", seq_len=4096, attention="eager", **kw)
    return timing.eager_score_bytes(shape, w, "eager") / (shape.heads * shape.layers * w.tokens * w.row_len)


def test_selective_checkpointing_recomputes_every_score_op_under_eager() -> None:
    """shardfit's selective policy (models/checkpointing.py) saves mm/addmm and SDPA/flash outputs only: eager's
    bmm, scaling, mask add, casts and softmax are all recomputed, so the scores move as much as under full
    checkpointing (counted: selective = full), not half-way."""
    assert per_score(LLAMA8, grad_ckpt="selective") == pytest.approx(per_score(LLAMA8, grad_ckpt="full"))


def test_gemma2_softcapping_moves_more_than_llama() -> None:
    """Gemma 2's eager attention softcaps the scores (div, tanh, mul and their gradients): counted 94 + 2 per head
    and score without checkpointing, 138 + 4 with full, against Llama's 68 + 2 / 100 + 4."""
    assert per_score(GEMMA2, grad_ckpt="none") == pytest.approx(96.0, rel=0.02)
    assert per_score(GEMMA2, grad_ckpt="full") == pytest.approx(142.0, rel=0.02)


def test_gpt2_eager_softmax_has_no_fp32_round_trip() -> None:
    """GPT-2's eager_attention_forward softmaxes in the scores' dtype (no dtype=float32, no casts): counted 34 + 2
    per head and score in bf16 without checkpointing, half of Llama's 68 + 2."""
    assert per_score(GPT2, grad_ckpt="none") == pytest.approx(36.0, rel=0.02)
