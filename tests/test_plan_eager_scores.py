"""Eager attention's scores in the time model (plan/timing.py `eager_score_bytes`): the heads x L x L scores
transformers' eager_attention_forward writes and reads, which SDPA and flash keep on chip."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardfit.errors import UserError
from shardfit.plan import timing
from shardfit.plan.cards import card_of
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.flops import attention_flops_per_token, step_flops_per_token
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
    a, m = timing.EAGER_SCORE_BYTES[(timing.SINKS_CHAIN, True, "bf16")]["eager"]
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
    """Full and selective checkpointing run each block's forward scores again (selective keeps no eager score op);
    fp32 takes its own count (the mask's elements twice as wide); `freeze` runs the backward only through the
    blocks it trains."""
    w = lora(8192, "eager")
    a0, m0 = timing.EAGER_SCORE_BYTES[(timing.LLAMA_CHAIN, False, "bf16")]["eager"]
    a1, m1 = timing.EAGER_SCORE_BYTES[(timing.LLAMA_CHAIN, True, "bf16")]["eager"]
    scores = LLAMA8.heads * LLAMA8.layers * w.tokens * 8192  # micro_batch rows of 8192 x 8192 each
    by = {ck: timing.eager_score_bytes(LLAMA8, dataclasses.replace(w, grad_ckpt=ck), "eager")
          for ck in ("none", "selective", "full")}
    assert by["none"] == pytest.approx(scores * (a0 + m0))
    assert by["full"] == pytest.approx(scores * (a1 + m1))
    assert by["selective"] == pytest.approx(by["full"])
    fp32 = dataclasses.replace(w, grad_ckpt="none", precision="fp32")
    a32, m32 = timing.EAGER_SCORE_BYTES[(timing.LLAMA_CHAIN, False, "fp32")]["eager"]
    assert timing.eager_score_bytes(LLAMA8, fp32, "eager") == pytest.approx(scores * (a32 + m32))
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
    """EAGER_SCORE_BYTES carries bench/results/eager_attention_bytes.json's per-head (less the score matmuls') and
    per-mask-element bytes of each chain: a recount that changes them fails here until they are carried over.
    gpt-oss's (counted in bf16 only) its eager layer less the matmuls, fp32 twice that; compiled, Llama's for every
    chain less the matmuls (12 bytes, 16 under checkpointing: eager's count of the same bmm calls), under
    checkpointing the compiled count without it plus one compiled forward, fp32 twice bf16's. Checkpointing, full
    or selective, adds one forward's bytes: what a forward without gradients moves."""
    result = json.loads((BENCH / "results" / "eager_attention_bytes.json").read_text())
    chains, eager, compiled = result["chains"], result["eager"], result["compiled"]
    counted = {}
    for key, r in chains.items():
        chain, ckpt, dtype = key.split("/")
        if ckpt == "selective":
            full = chains[f"{chain}/full/{dtype}"]
            assert (r["a_less_matmuls"], r["eager"]["coef"]["m"]) == pytest.approx(
                (full["a_less_matmuls"], full["eager"]["coef"]["m"]), abs=0.01), key
            continue
        counted[(chain, ckpt == "full", dtype)] = (r["a_less_matmuls"], r["eager"]["coef"]["m"])
    for ckpt, recipe in ((False, "full"), (True, "full+ckpt")):
        r = eager[f"gpt_oss/{recipe}/bf16"]
        a, m = r["eager"]["coef"]["a"] - r["scores_by_op"]["bmm"], r["eager"]["coef"]["m"]
        counted[(timing.SINKS_CHAIN, ckpt, "bf16")] = (a, m)
        counted[(timing.SINKS_CHAIN, ckpt, "fp32")] = (2 * a, 2 * m)
    assert set(counted) == set(timing.EAGER_SCORE_BYTES)
    # the matmuls' share of the compiled step: the same bmm calls eager makes
    bmm = {ck: chains[f"llama/{ck}/bf16"]["scores_by_op"]["bmm"] for ck in ("none", "full")}
    once = compiled["llama/full/bf16"]["eager"]["coef"]["a"]
    forward = compiled["llama/full/bf16"]["forward"]["coef"]["a"]
    compiled_bf16 = {False: once - bmm["none"], True: once + forward - bmm["full"]}
    for (chain, ckpt, dtype), sides in timing.EAGER_SCORE_BYTES.items():
        assert sides["eager"] == pytest.approx(counted[(chain, ckpt, dtype)], abs=0.01), (chain, ckpt, dtype)
        widen = 2 if dtype == "fp32" else 1
        assert sides["compiled"] == pytest.approx((widen * compiled_bf16[ckpt], 0.0), abs=0.01), (chain, ckpt, dtype)
    fwd = eager["llama/full/bf16"]["forward_less_sdpa"]["coef"]["a"]
    assert chains["llama/full/bf16"]["eager"]["coef"]["a"] - chains["llama/none/bf16"]["eager"]["coef"]["a"] == \
        pytest.approx(fwd, abs=0.01)


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
    and score without checkpointing, 138 + 4 with full, against Llama's 68 + 2 / 100 + 4; charged less the score
    matmuls' 12 and 16 (their FLOPs are in the utilization's term)."""
    assert per_score(GEMMA2, grad_ckpt="none") == pytest.approx(94.0 - 12 + 2, rel=0.02)
    assert per_score(GEMMA2, grad_ckpt="full") == pytest.approx(138.0 - 16 + 4, rel=0.02)
    assert per_score(GEMMA2, grad_ckpt="none") > per_score(LLAMA8, grad_ckpt="none")


def test_gpt2_eager_softmax_has_no_fp32_round_trip() -> None:
    """GPT-2's eager_attention_forward softmaxes in the scores' dtype (no dtype=float32, no casts): counted 34 + 2
    per head and score in bf16 without checkpointing, half of Llama's 68 + 2; charged less the score matmuls' 12.
    fp32: twice as many (68 + 4), where Llama's casts make fp32 no dearer."""
    assert per_score(GPT2, grad_ckpt="none") == pytest.approx(34.0 - 12 + 2, rel=0.02)
    assert per_score(GPT2, grad_ckpt="none", precision="fp32") == pytest.approx(68.0 - 24 + 4, rel=0.02)


def test_gptj_scores_are_fp32_from_qk() -> None:
    """GPT-J's and CodeGen's `_attn` upcasts q and k, so QK^T writes fp32 scores and a div follows: counted
    74 + 2 in bf16 (18 of them the matmuls'), more than Llama's."""
    gptj = dataclasses.replace(GPT2, id="gptj", model_type="gptj")
    assert per_score(gptj, grad_ckpt="none") == pytest.approx(74.0 - 18 + 2, rel=0.02)
    assert timing.score_chain(dataclasses.replace(gptj, model_type="codegen")) == timing.FP32_QK_CHAIN


def test_attention_dropout_adds_its_kernels_in_training() -> None:
    """GPT-2's configs drop the attention probabilities (attn_pdrop 0.1): on CUDA native_dropout reads them and
    writes them and a 1-byte mask, its backward reads the gradient and the mask and writes the gradient (5 bytes a
    score each way in bf16, 9 in fp32), checkpointing runs the forward's again; none at p 0, nor under SDPA."""
    dropped = dataclasses.replace(GPT2, attn_dropout=0.1)
    assert per_score(dropped, grad_ckpt="none") - per_score(GPT2, grad_ckpt="none") == pytest.approx(10.0)
    assert per_score(dropped, grad_ckpt="full") - per_score(GPT2, grad_ckpt="full") == pytest.approx(15.0)
    assert per_score(dropped, grad_ckpt="none", precision="fp32") - \
        per_score(GPT2, grad_ckpt="none", precision="fp32") == pytest.approx(18.0)
    sdpa = dataclasses.replace(model_workload(), method="lora", seq_len=4096, attention="sdpa")
    assert timing.eager_score_bytes(dropped, sdpa, "eager") == 0.0


def test_selective_checkpointing_recomputes_eager_attention_matmuls() -> None:
    """Selective checkpointing keeps every other mm/addmm and SDPA's or flash's output: under eager the two
    attention matmuls (bmm) are recomputed too, once more their forward FLOPs; under SDPA not."""
    def flops(attention: str, ckpt: str) -> float:
        w = dataclasses.replace(model_workload(), method="lora", seq_len=4096, attention=attention, grad_ckpt=ckpt)
        return step_flops_per_token(LLAMA8, w)

    attn = attention_flops_per_token(LLAMA8, dataclasses.replace(model_workload(), seq_len=4096, attention="eager"))
    eager_extra = flops("eager", "selective") - flops("eager", "none")
    sdpa_extra = flops("sdpa", "selective") - flops("sdpa", "none")
    assert eager_extra == pytest.approx(sdpa_extra + LLAMA8.layers * attn)


def test_config_carries_the_attention_dropout() -> None:
    """config.json's attention dropout reaches the shape: GPT-2's attn_pdrop (its class's 0.1 where the file has
    none), attention_dropout elsewhere; a value that is no probability is the user's error, naming the key."""
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "vocab_size": 50257}
    assert shape_from_config(gpt2, "gpt2").attn_dropout == pytest.approx(0.1)
    assert shape_from_config({**gpt2, "attn_pdrop": 0.0}, "gpt2").attn_dropout == 0.0
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_hidden_layers": 2, "vocab_size": 100}
    assert shape_from_config(llama, "tiny").attn_dropout == 0.0
    assert shape_from_config({**llama, "attention_dropout": 0.05}, "tiny").attn_dropout == pytest.approx(0.05)
    with pytest.raises(UserError, match="attention_dropout"):
        shape_from_config({**llama, "attention_dropout": 1.5}, "tiny")
