"""The time model (plan/timing.py): FLOPs per token, links, overlap, and the recommendation by predicted speed."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.plan import comms, flops, timing
from shardfit.plan.cards import card_of
from shardfit.plan.comms import ADAM_BYTES_PER_PARAM
from shardfit.plan.dispatch import ENGINE_HOST_S, LAYER_OPS, dispatch_ops_per_layer, host_dispatch_s
from shardfit.plan.estimate import trainable_params
from shardfit.plan.flops import (
    attention_flops_per_token,
    linear_flops_per_token,
    lora_flops_per_token,
    step_flops_per_token,
)
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.plan import make_plan, with_candidates
from shardfit.plan.shapes import ModelShape, resolve_shape
from shardfit.plan.step_ops import step_host_s
from shardfit.plan.timing import (
    ELEMENTWISE_BYTES,
    REST_BYTES,
    elementwise_bytes_per_micro_batch,
    elementwise_bytes_per_token,
    fused_bytes_saved,
    step_time,
)
from shardfit.plan.workload import Workload

LLAMA8 = resolve_shape("meta-llama/Llama-3.1-8B")
BENCH = Path(__file__).resolve().parent.parent / "bench"
LLAMA70 = resolve_shape("meta-llama/Llama-3.1-70B")


def test_full_finetune_flops_are_six_per_parameter_plus_attention() -> None:
    """Without checkpointing a full fine-tune runs 6 FLOPs per weight and token (2 forward, 4 backward) plus
    attention: the usual 6N + 12 L s d count, halved for a causal kernel."""
    w = Workload(method="full", grad_ckpt="none", attention="eager", seq_len=4096)
    lin, params = linear_flops_per_token(LLAMA8)
    assert lin == 2 * params
    head = LLAMA8.hidden * LLAMA8.vocab
    expected = 6 * (LLAMA8.layers * params + head) + 12 * LLAMA8.layers * 4096 * LLAMA8.hidden
    assert step_flops_per_token(LLAMA8, w) == pytest.approx(expected, rel=1e-9)
    flash = dataclasses.replace(w, attention="flash")
    assert attention_flops_per_token(LLAMA8, flash) == attention_flops_per_token(LLAMA8, w) / 2


def test_windowed_blocks_attend_within_their_window_under_flash() -> None:
    """Gemma 3 1b: 22 of 26 blocks slide over 512 tokens. Under flash (which skips what lies outside the window) a
    32k-token example's windowed query runs over about 512 positions, not half the row; a dense mask still computes
    the whole square, and rows no longer than the window are causal rows."""
    gemma = resolve_shape("google/gemma-3-1b-it")
    assert (gemma.sliding_window, gemma.sliding_layers, gemma.layers) == (512, 22, 26)
    flash = Workload(method="lora", grad_ckpt="full", attention="flash", seq_len=32768)
    windowed = 512 - 512 * 512 / (2 * 32768)
    assert flops.attended_positions(flash, gemma) == pytest.approx((22 * windowed + 4 * 16384) / 26)
    assert attention_flops_per_token(gemma, flash) == pytest.approx(
        4 * (22 * windowed + 4 * 16384) / 26 * gemma.heads * gemma.hd)
    whole = dataclasses.replace(gemma, sliding_window=0, sliding_layers=0)
    assert step_flops_per_token(gemma, flash) < 0.6 * step_flops_per_token(whole, flash)
    sdpa = dataclasses.replace(flash, attention="sdpa")
    assert flops.attended_positions(sdpa, gemma) == 32768
    short = dataclasses.replace(flash, seq_len=512)
    assert flops.attended_positions(short, gemma) == flops.attended_positions(short, whole) == 256
    # A partial layout of unknown size (window 1) is counted as whole attention, never as a 1-token window.
    unknown = dataclasses.replace(gemma, sliding_window=1)
    assert flops.attended_positions(flash, unknown) == 16384


def test_chunked_blocks_never_look_back_past_their_chunk() -> None:
    """Llama 4 Scout: 36 of 48 blocks attend within 8192-token chunks that tile the example."""
    scout = resolve_shape("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    assert scout.attention_chunked and (scout.sliding_window, scout.sliding_layers) == (8192, 36)
    seq = 2 * 8192 + 1000
    flash = Workload(method="lora", grad_ckpt="full", attention="flash", seq_len=seq)
    chunked = (2 * 8192 * 8192 / 2 + 1000 * 1000 / 2) / seq
    assert flops.attended_positions(flash, scout) == pytest.approx((36 * chunked + 12 * seq / 2) / 48)
    gpt_oss = resolve_shape("openai/gpt-oss-20b")  # windows, not chunks: 128-token windows on half its blocks
    assert not gpt_oss.attention_chunked and (gpt_oss.sliding_window, gpt_oss.sliding_layers) == (128, 12)
    windows = tuple(dataclasses.replace(g, attention="window") for g in scout.attention_groups)
    sliding = dataclasses.replace(scout, attention_chunked=False, attention_groups=windows)
    assert flops.attended_positions(flash, sliding) > flops.attended_positions(flash, scout)


def test_lora_skips_weight_gradients_and_checkpointing_adds_a_forward() -> None:
    base = Workload(method="lora", grad_ckpt="none", attention="flash")
    full = dataclasses.replace(base, method="full")
    lin, _ = linear_flops_per_token(LLAMA8)
    head = 2 * LLAMA8.hidden * LLAMA8.vocab
    lora = lora_flops_per_token(LLAMA8, base)
    # The frozen base's weight gradients are what LoRA saves; its adapters cost three times their forward.
    assert step_flops_per_token(LLAMA8, full) - step_flops_per_token(LLAMA8, base) == pytest.approx(
        LLAMA8.layers * (lin - 3 * lora) + head, rel=1e-9)
    ckpt = dataclasses.replace(base, grad_ckpt="full")
    block_fwd = lin + attention_flops_per_token(LLAMA8, base) + lora
    assert step_flops_per_token(LLAMA8, ckpt) - step_flops_per_token(LLAMA8, base) == pytest.approx(
        LLAMA8.layers * block_fwd, rel=1e-9)
    selective = dataclasses.replace(base, grad_ckpt="selective")
    assert step_flops_per_token(LLAMA8, base) < step_flops_per_token(LLAMA8, selective) < \
        step_flops_per_token(LLAMA8, ckpt)
    freeze = dataclasses.replace(base, method="freeze")  # backward stops below the two trained blocks
    assert step_flops_per_token(LLAMA8, freeze) < step_flops_per_token(LLAMA8, base)


def test_more_gpus_more_tokens_and_nvlink_beats_pcie() -> None:
    w = Workload(method="full", grad_ckpt="full", seq_len=4096, micro_batch=1, attention="flash")
    four, eight = (step_time(LLAMA8, w, parse_gpus(f"{n}xH100"), "zero3") for n in (4, 8))
    assert eight.tokens_per_s > 1.8 * four.tokens_per_s  # data parallel: every GPU adds its micro-batch
    assert eight.compute_s == pytest.approx(four.compute_s, rel=0.05)  # the same work per GPU (AdamW: 1/n)
    nvlink, pcie = step_time(LLAMA8, w, parse_gpus("8xA100"), "zero3"), step_time(LLAMA8, w, parse_gpus("8x4090"),
                                                                                    "zero3")
    assert nvlink.comm_s < pcie.comm_s / 10  # 230 GB/s NVLink rings against 10 GB/s through host memory
    assert nvlink.bound == "compute" and pcie.bound == "comm"
    one_node = step_time(LLAMA8, w, parse_gpus("8xA100"), "zero3")
    two_nodes = step_time(LLAMA8, w, parse_gpus("8xA100", nodes=2), "zero3")
    # Across nodes the ring runs at the node's network bandwidth (8 x 25 GB/s HDR), below NVLink's 230 GB/s.
    assert two_nodes.comm_s > one_node.comm_s * 230 / 200 * 0.99
    assert step_time(LLAMA8, w, parse_gpus("8x4090"), "zero3").comm_s > \
        step_time(LLAMA8, w, parse_gpus("8x4090"), "zero2").comm_s  # zero3 gathers again in backward


def test_two_cards_on_an_nvlink_bridge_reduce_over_it() -> None:
    """`2x3090-nvlink` (or `2xA6000-nvlink`) names the bridged pair: P2P at ~45 GB/s instead of host memory's
    10, so DDP's all-reduce of a small model that waits on it on bare 3090s hides under backward; a bridge joins
    two cards, so any other count is refused with the notation to use instead."""
    from shardfit.errors import UserError

    small = resolve_shape("Qwen/Qwen2.5-0.5B")
    w = Workload(method="full", grad_ckpt="none", seq_len=256, micro_batch=1, attention="flash")
    bare, bridged = (step_time(small, w, parse_gpus(g), "ddp") for g in ("2x3090", "2x3090-nvlink"))
    assert card_of(parse_gpus("2x3090-nvlink")).link == pytest.approx(4.5 * card_of(parse_gpus("2x3090")).link)
    assert parse_gpus("2xA6000-NVLink").gpu_mem_gib == parse_gpus("2xA6000").gpu_mem_gib
    assert bare.bound == "comm" and bridged.bound == "compute"
    assert bridged.tokens_per_s > bare.tokens_per_s
    with pytest.raises(UserError, match="write 2x3090-nvlink, or 4x3090"):
        parse_gpus("4x3090-nvlink")


def test_offload_is_pcie_traffic_and_ddp_overlaps_its_all_reduce() -> None:
    w = Workload(method="full", grad_ckpt="full", seq_len=2048, micro_batch=1, attention="flash")
    on, off = (step_time(LLAMA70, w, parse_gpus("8xH100"), s) for s in ("zero3", "zero3_offload"))
    assert off.pcie_s > 0 == on.pcie_s and off.step_s > on.step_s and off.bound == "pcie"
    lora = dataclasses.replace(w, method="lora")
    ddp = step_time(LLAMA8, lora, parse_gpus("8xH100"), "ddp")
    assert ddp.comm_s == 0  # 21M fp32 adapter gradients all-reduce well inside the backward pass
    accum = step_time(LLAMA8, dataclasses.replace(lora, grad_accum=4), parse_gpus("8xH100"), "ddp")
    assert accum.step_s == pytest.approx(4 * ddp.step_s, rel=0.05) and accum.tokens_per_s == pytest.approx(
        ddp.tokens_per_s, rel=0.05)


def test_seed_case_recommends_the_fastest_that_fits_with_numbers(capsys) -> None:
    """Qwen2-VL-72B LoRA on 8 x 24 GB: model_parallel computes on one GPU at a time, zero3_offload on all eight;
    the plan picks the higher tokens/s and says why in numbers."""
    assert main(["plan", "--model", "Qwen/Qwen2-VL-72B-Instruct", "--gpus", "8x4090", "--method", "lora",
                 "--seq", "2048", "--batch", "1", "--grad-ckpt", "full", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    by = {c["strategy"]: c for c in plan["candidates"]}
    for c in by.values():
        assert c["step_s"] > 0 and c["tokens_per_s"] > 0 and c["bound"] in ("compute", "host", "comm", "pcie")
    assert by["model_parallel"]["fits"] and by["zero3_offload"]["fits"]
    assert by["model_parallel"]["tokens_per_s"] == pytest.approx(by["single"]["tokens_per_s"], rel=0.05)
    assert plan["recommended"] == "zero3_offload"
    assert by["zero3_offload"]["tokens_per_s"] > 1.5 * by["model_parallel"]["tokens_per_s"]
    assert "s/step" in plan["reason"] and "one GPU busy at a time" in plan["reason"]
    assert main(["plan", "--model", "Qwen/Qwen2-VL-72B-Instruct", "--gpus", "8x24GB", "--method", "lora"]) in (0, 3)
    assert "card not named: step times are those of a 4090" in capsys.readouterr().out


def test_recommendation_prefers_replicas_where_they_fit() -> None:
    """8B LoRA on 8 H100s: everything fits; DDP moves only the adapter's gradients, so it is (within the tie margin)
    the fastest, and the plan names it."""
    w = Workload(method="lora", grad_ckpt="full", seq_len=2048, micro_batch=1)
    plan = make_plan(LLAMA8, w, parse_gpus("8xH100"))
    assert plan.recommended == "ddp"
    single = plan.candidate("single")
    assert single is not None and single.tokens_per_s is not None
    assert plan.candidate("ddp").tokens_per_s > 7 * single.tokens_per_s


def test_cards_table_covers_every_known_card() -> None:
    for name in ("H100", "A100-40G", "4090", "3090", "V100", "L40S", "T4", "MI300X", "cpu"):
        card = card_of(parse_gpus(f"2x{name}") if name != "cpu" else dataclasses.replace(parse_gpus("2x24GB"),
                                                                                          name="cpu"))
        assert card.assumed is None and card.peak("bf16") > 0 and card.link > 0, name
    assert card_of(parse_gpus("8x48GB")).assumed and card_of(parse_gpus("8x48GB")).key == "l40s"


@pytest.mark.parametrize(("driver_name", "key"), [
    ("NVIDIA H100 80GB HBM3", "h100-80g"), ("NVIDIA A100-SXM4-40GB", "a100-40g"), ("NVIDIA A100 80GB PCIe", "a100-80g"),
    ("Tesla V100-SXM2-16GB", "v100-16g"), ("NVIDIA GeForce RTX 4090", "4090"), ("NVIDIA RTX A6000", "a6000"),
    ("NVIDIA RTX 6000 Ada Generation", "6000ada"), ("NVIDIA L40S", "l40s"), ("Tesla T4", "t4"), ("NVIDIA H200", "h200"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"), ("H100-PCIe", "h100-pcie"),
    ("NVIDIA H100 96GB HBM2e", "h100-96g"),
])
def test_a_detected_gpu_is_timed_as_itself(driver_name: str, key: str) -> None:
    """What torch.cuda reports as the device's name (plan/hardware.py `detect`) names the card, memory variant
    included: an H100 was timed as an A100 while its driver name carried `80GB HBM3`."""
    hw = dataclasses.replace(parse_gpus("1x80GB"), name=driver_name)
    card = card_of(hw)
    assert card.key == key and card.assumed is None


def test_simulated_estimates_keep_their_predicted_times() -> None:
    """`plan --simulate` replaces the memory estimates; the times stay, and so does the recommendation's basis."""
    plan = make_plan(LLAMA8, Workload(method="lora", grad_ckpt="full"), parse_gpus("8xH100"))
    bare = [dataclasses.replace(c, step_s=None, tokens_per_s=None, bound=None, estimator="simulated")
            for c in plan.candidates]
    again = with_candidates(plan, bare)
    for before, after in zip(plan.candidates, again.candidates, strict=True):
        assert after.estimator == "simulated" and after.tokens_per_s == before.tokens_per_s
    assert again.recommended == plan.recommended and "tokens/s" in again.reason


def test_dispatch_count_is_a_function_of_the_recipe() -> None:
    """The host's op count per layer grows with LoRA targets, dropout, checkpointing and autocast, and falls under
    torch.compile (two kernels per matmul, no views)."""
    lora = Workload(method="lora", grad_ckpt="full", precision="bf16")
    k7, v7 = dispatch_ops_per_layer(lora)
    assert (k7, v7) == LAYER_OPS[("lora7", True, True)][:2]
    k2, _ = dispatch_ops_per_layer(dataclasses.replace(lora, lora_targets=("q", "v")))
    assert k2 == LAYER_OPS[("lora2", True, True)][0] < k7
    assert dispatch_ops_per_layer(dataclasses.replace(lora, lora_dropout=0.05))[0] > k7
    none = dispatch_ops_per_layer(dataclasses.replace(lora, grad_ckpt="none"))[0]
    selective = dispatch_ops_per_layer(dataclasses.replace(lora, grad_ckpt="selective"))[0]
    assert none < selective < k7
    assert dispatch_ops_per_layer(dataclasses.replace(lora, precision="fp32"))[0] < k7  # no autocast casts
    full = dispatch_ops_per_layer(dataclasses.replace(lora, method="full"))[0]
    assert full < k7  # no adapters: fewer, larger ops
    compiled = dispatch_ops_per_layer(dataclasses.replace(lora, compile=True))
    assert compiled == (2 * LAYER_OPS[("lora7", True, True)][2], 0.0) and compiled[0] < k7


def test_short_sequences_are_host_bound_long_ones_compute_bound() -> None:
    """A micro-batch takes the slower of the GPU's work and the host's launches: 7B LoRA on an H100 at 128 tokens
    waits on the host (tokens/s then grows with length), at 8192 on compute; a CPU run has no separate host."""
    w = Workload(method="lora", grad_ckpt="full", precision="bf16", attention="flash", micro_batch=1)
    qwen = resolve_shape("Qwen/Qwen-7B")
    h100 = parse_gpus("1xH100")
    short, long = (step_time(qwen, dataclasses.replace(w, seq_len=n), h100, "single") for n in (128, 8192))
    assert short.bound == "host" and long.bound == "compute"
    # the micro-batch's launches and, once a step, the step's own (plan/step_ops.py)
    step_host = step_host_s(qwen, w, card_of(h100))
    assert short.host_s == pytest.approx(host_dispatch_s(qwen, w) + step_host) and short.step_s >= short.host_s
    assert short.tokens_per_s < long.tokens_per_s
    # torch.compile launches fewer kernels: the floor drops and the short run speeds up.
    compiled = step_time(qwen, dataclasses.replace(w, seq_len=128, compile=True), h100, "single")
    assert compiled.host_s < short.host_s / 2 and compiled.tokens_per_s > short.tokens_per_s
    cpu = dataclasses.replace(parse_gpus("1x24GB"), name="cpu")
    assert step_time(LLAMA8, dataclasses.replace(w, seq_len=128), cpu, "single").host_s == 0


def test_layer_op_table_matches_a_fresh_count() -> None:
    """LAYER_OPS is what bench/dispatch_ops.py counts with the installed torch / transformers / peft: recount two
    recipes on tiny Llama layers (a second each) and hold the table to them within 10 % (a version that changes
    the count by more wants the table refreshed)."""
    path = Path(__file__).resolve().parent.parent / "bench" / "dispatch_ops.py"
    spec = importlib.util.spec_from_file_location("dispatch_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for key, (method, ckpt, targets, bf16) in {("full", False, False): ("full", False, [], False),
                                               ("lora7", True, True): ("lora", True, mod.ALL_LINEAR, True)}.items():
        fresh = mod.per_layer("llama", method, ckpt, targets, 0.0, bf16)
        kernels, views, matmuls = LAYER_OPS[key]
        assert fresh["layer_kernel"] == pytest.approx(kernels, rel=0.1), key
        assert fresh["layer_view"] == pytest.approx(views, rel=0.1), key
        assert fresh["layer_matmul"] == pytest.approx(matmuls, rel=0.1), key


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compile_credits_the_fused_bytes_at_memory_bandwidth() -> None:
    """A compute-bound compiled step computes for the eager time less the bytes fusion saves over the card's memory
    bandwidth; the eager step keeps FLOPs at the training utilization."""
    w = Workload(method="full", grad_ckpt="selective", precision="bf16", attention="flash", seq_len=8192,
                 micro_batch=1, grad_accum=2)
    hw = parse_gpus("1xH100")
    card = card_of(hw)
    eager = step_time(LLAMA8, w, hw, "single")
    compiled = step_time(LLAMA8, dataclasses.replace(w, compile=True), hw, "single")
    assert fused_bytes_saved(LLAMA8, w) == 0.0
    flops = step_flops_per_token(LLAMA8, w) * w.seq_len
    optim = trainable_params(LLAMA8, w) * ADAM_BYTES_PER_PARAM / card.hbm
    assert eager.compute_s == pytest.approx(w.grad_accum * flops / card.peak("bf16") + optim)  # eager as before
    saved = fused_bytes_saved(LLAMA8, dataclasses.replace(w, compile=True))
    assert eager.compute_s - compiled.compute_s == pytest.approx(w.grad_accum * saved / card.hbm)
    assert eager.bound == compiled.bound == "compute" and compiled.tokens_per_s > eager.tokens_per_s
    # Per layer and token, the saving is the counted eager minus compiled bytes, for every layer and token.
    cw = dataclasses.replace(w, compile=True)
    per = elementwise_bytes_per_token(LLAMA8, cw, "eager") - elementwise_bytes_per_token(LLAMA8, cw, "compiled")
    assert fused_bytes_saved(LLAMA8, cw) == pytest.approx(LLAMA8.layers * 8192 * per) and per > 0
    # fp32 moves twice the bytes of the bf16 count; LoRA's adapters add elementwise work of their own.
    fp32 = dataclasses.replace(cw, precision="fp32")
    assert fused_bytes_saved(LLAMA8, fp32) == pytest.approx(2 * fused_bytes_saved(LLAMA8, cw))
    lora = dataclasses.replace(cw, method="lora")
    assert elementwise_bytes_per_token(LLAMA8, lora, "eager") > elementwise_bytes_per_token(LLAMA8, cw, "eager")


def test_compile_credit_stops_at_its_kernels_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a card whose memory is slow against its saving, a compiled step is never faster than its kernels one after
    another: the matmuls at the card's GEMM efficiency, then the fused kernels' own bytes at the memory bandwidth."""
    hw = parse_gpus("1xH100")
    slow = dataclasses.replace(card_of(hw), hbm=1e9)
    monkeypatch.setattr(timing, "card_of", lambda _: slow)
    w = Workload(method="lora", grad_ckpt="none", precision="bf16", attention="flash", seq_len=8192, compile=True)
    st = step_time(LLAMA8, w, hw, "single")
    flops = step_flops_per_token(LLAMA8, w) * w.seq_len
    floor = flops / (slow.bf16_flops * slow.matmul_eff) + elementwise_bytes_per_micro_batch(LLAMA8, w, "compiled") / 1e9
    optim = trainable_params(LLAMA8, w) * ADAM_BYTES_PER_PARAM / slow.hbm
    assert st.compute_s == pytest.approx(w.grad_accum * floor + optim)
    assert flops / slow.peak("bf16") - fused_bytes_saved(LLAMA8, w) / slow.hbm < floor  # the credit overshoots


GPT2 = ModelShape(id="gpt2", layers=12, hidden=768, intermediate=2048, heads=12, kv_heads=12, vocab=50257,
                  tied=False)


def test_a_small_model_is_timed_by_its_kernels_not_the_large_model_utilization() -> None:
    """The training utilization is what large models reach; a small model's step holds more non-matmul work than
    theirs. GPT-2 124M on an A100 is timed as its matmuls at GEMM efficiency plus every other kernel's bytes (its 12
    layers and the 50k-wide logits through the loss) at the memory bandwidth, slower than the utilization says; an
    8B model keeps the utilization. The rest of the model counts: outside its layers (mostly the logits' passes
    through the loss) GPT-2 moves more than 0.3x its layers' bytes."""
    hw = parse_gpus("1xA100-40G")
    card = card_of(hw)
    w = Workload(method="full", grad_ckpt="none", precision="bf16", attention="flash", seq_len=1024, micro_batch=8,
                 pure_16bit=True)
    st = step_time(GPT2, w, hw, "single")
    flops = step_flops_per_token(GPT2, w) * 8192
    moved = elementwise_bytes_per_micro_batch(GPT2, w, "eager")
    layers = GPT2.layers * 8192 * elementwise_bytes_per_token(GPT2, w, "eager")
    assert moved - layers > 0.3 * layers  # the logits' passes through the loss
    # In fp32 the layers move twice the bytes; the loss runs in fp32 either way, so the rest stays as counted.
    fp32 = dataclasses.replace(w, precision="fp32", pure_16bit=False)
    layers32 = GPT2.layers * 8192 * elementwise_bytes_per_token(GPT2, fp32, "eager")
    assert layers32 == pytest.approx(2 * layers)
    assert elementwise_bytes_per_micro_batch(GPT2, fp32, "eager") - layers32 == pytest.approx(moved - layers)
    parts = flops / (card.bf16_flops * card.matmul_eff) + moved / card.hbm
    optim = trainable_params(GPT2, w) * ADAM_BYTES_PER_PARAM / card.hbm
    assert parts > 1.2 * flops / card.peak("bf16")
    assert st.compute_s == pytest.approx(parts + optim)
    big = Workload(method="full", grad_ckpt="none", precision="bf16", attention="flash", seq_len=8192)
    large = step_time(LLAMA8, big, hw, "single")
    flops8 = step_flops_per_token(LLAMA8, big) * 8192
    assert large.compute_s == pytest.approx(flops8 / card.peak("bf16")
                                            + trainable_params(LLAMA8, big) * ADAM_BYTES_PER_PARAM / card.hbm)


def test_elementwise_table_is_the_bench_result() -> None:
    """ELEMENTWISE_BYTES carries bench/results/elementwise_bytes.json's coefficients: a recount that changes them
    fails here until they are carried over."""
    result = json.loads((BENCH / "results" / "elementwise_bytes.json").read_text())["recipes"]
    for (base, ckpt), sides in ELEMENTWISE_BYTES.items():
        counted = result[f"llama/{base}{'+ckpt' if ckpt else ''}"]
        for side in ("eager", "compiled"):
            assert sides[side] == pytest.approx(tuple(counted[side]["coef"].values()), abs=0.01), (base, ckpt, side)
    rest = json.loads((BENCH / "results" / "elementwise_bytes.json").read_text())["rest"]
    for kind, sides in REST_BYTES.items():
        for side in ("eager", "compiled"):
            assert sides[side] == pytest.approx(tuple(rest[f"llama/{kind}"][side]["coef"].values()), abs=0.01), \
                (kind, side)


def test_engine_host_table_is_the_bench_result() -> None:
    """ENGINE_HOST_S carries bench/results/fsdp_host_overhead.json's medians (ms there, seconds here): a new
    measurement fails here until it is carried over."""
    measured = json.loads((BENCH / "results" / "fsdp_host_overhead.json").read_text())["ms_per_block"]
    for engine, table in ENGINE_HOST_S.items():
        for (kind, ckpt), seconds in table.items():
            ms = measured[f"{kind}/{'ckpt' if ckpt else 'no_ckpt'}"][engine]
            assert seconds == pytest.approx(ms / 1e3, abs=0.006e-3), (engine, kind, ckpt)


def test_data_parallel_engines_add_their_hooks_to_the_host() -> None:
    """Each block's hooks run on the host between launches: FSDP2's and FSDP1's per block are added to the
    host's time of a micro-batch, DDP's reducer far less, one GPU none. With short rows, where the host sets the
    pace, two GPUs under FSDP1 train fewer tokens/s than one (as litgpt's LoRA tables on 2 A100 show), DDP
    nearly twice as many."""
    small = resolve_shape("Qwen/Qwen2.5-0.5B")
    w = Workload(method="lora", grad_ckpt="none", precision="bf16", attention="flash", micro_batch=1, seq_len=128)
    two = parse_gpus("2xH100")
    one, ddp, fsdp2 = (step_time(small, w, two, s) for s in ("single", "ddp", "zero3"))
    fsdp1 = step_time(small, dataclasses.replace(w, fsdp1=True), two, "zero3")
    blocks = small.layers * w.grad_accum
    assert one.host_s == pytest.approx(host_dispatch_s(small, w) + step_host_s(small, w, card_of(two)))
    assert fsdp2.host_s - one.host_s == pytest.approx(blocks * ENGINE_HOST_S["fsdp2"][("lora", False)])
    assert fsdp1.host_s - one.host_s == pytest.approx(blocks * ENGINE_HOST_S["fsdp1"][("lora", False)])
    assert 0 < ddp.host_s - one.host_s < (fsdp2.host_s - one.host_s) / 5
    assert one.bound == fsdp1.bound == "host"
    assert fsdp1.tokens_per_s < one.tokens_per_s < fsdp2.tokens_per_s < ddp.tokens_per_s
    # An 8B model's long rows hide the hooks under the GPU's work: FSDP1 on two GPUs is again the faster.
    long = dataclasses.replace(w, seq_len=8192, fsdp1=True)
    sharded, alone = (step_time(LLAMA8, long, two, s).tokens_per_s for s in ("zero3", "single"))
    assert sharded > 1.5 * alone


def test_eager_elementwise_bytes_match_a_fresh_count() -> None:
    """The eager coefficients predict a fresh count with the installed torch / transformers (a tiny Llama, 1 and 2
    layers, well under a second) within 2 %."""
    mod = _bench_module("elementwise_bytes")
    shape = mod.HELD_OUT
    fresh = mod.per_layer_token(mod.eager_bytes, "llama", shape, "full", False)
    assert mod.predict(list(ELEMENTWISE_BYTES[("full", False)]["eager"]), shape) == pytest.approx(fresh, rel=0.02)


def test_eager_rest_bytes_match_a_fresh_count() -> None:
    """REST_BYTES's eager coefficients predict a fresh count of the model outside its layers (the held-out vocabulary,
    width, head_dim and tokens) within 5 %: the rotary tables grow with head_dim, which the fit holds fixed."""
    mod = _bench_module("elementwise_bytes")
    for kind in ("full", "lora"):
        fresh = mod.rest_bytes(mod.eager_bytes, "llama", *mod.REST_HELD_OUT, kind)
        terms = mod.rest_terms(*mod.REST_HELD_OUT)
        predicted = sum(c * x for c, x in zip(REST_BYTES[kind]["eager"], terms, strict=True))
        assert predicted == pytest.approx(fresh, rel=0.05), kind


LLAMA2_7 = resolve_shape("meta-llama/Llama-2-7b-hf")


def test_fsdp1_adapter_units_expose_both_all_gathers() -> None:
    """FSDP1 with LoRA under use_orig_params=False (`flat_params`): each adapter is an FSDP unit inside its block, so
    the rate limiter and BACKWARD_PRE's order leave the block's all-gathers unhidden (comms.exposed_collectives).
    FULL_SHARD waits for both gathers of a micro-batch; SHARD_GRAD_OP, NO_SHARD and a full fine-tune are as
    before."""
    w = Workload(method="lora", grad_ckpt="full", seq_len=2048, micro_batch=4, attention="flash",
                 lora_targets=("q", "k", "v", "gate", "up", "down"))
    flat = dataclasses.replace(w, flat_params=True)
    hw = parse_gpus("2x3090")
    fsdp2, fsdp1 = step_time(LLAMA2_7, w, hw, "zero3"), step_time(LLAMA2_7, flat, hw, "zero3")
    assert fsdp2.step_s == pytest.approx(fsdp2.compute_s, rel=0.02)  # FSDP2: the gathers hide under compute
    # both gathers (13.5 GB of bf16 weights, half of it received, at 10 GB/s) come after the compute
    assert fsdp1.step_s - fsdp2.step_s == pytest.approx(fsdp1.comm_s, rel=0.02)
    assert fsdp1.comm_s == pytest.approx(2 * LLAMA2_7.params() * 2 / 2 / 10e9, rel=0.05)
    for strategy in ("zero2", "ddp"):
        assert step_time(LLAMA2_7, flat, hw, strategy).step_s == pytest.approx(
            step_time(LLAMA2_7, w, hw, strategy).step_s, rel=0.01)
    full = dataclasses.replace(w, method="full", lora_targets=None)
    assert step_time(LLAMA2_7, dataclasses.replace(full, flat_params=True), hw, "zero3").step_s == \
        step_time(LLAMA2_7, full, hw, "zero3").step_s


def test_fsdp1_without_backward_prefetch_waits_in_backward() -> None:
    """FSDP1 with backward_prefetch=None: the backward all-gather and the reduce-scatter are waited for; the
    forward's gather still overlaps, and SHARD_GRAD_OP (no backward gather) is unchanged."""
    gpt2 = ModelShape(id="gpt2-large", layers=36, hidden=1280, intermediate=3413, heads=20, kv_heads=20,
                             vocab=50257, tied=True)
    w = Workload(method="full", precision="fp32", grad_ckpt="none", seq_len=128, micro_batch=15, attention="eager")
    none = dataclasses.replace(w, fsdp1_no_backward_prefetch=True)
    hw = parse_gpus("2xTitanRTX")
    pre, post = step_time(gpt2, w, hw, "zero3"), step_time(gpt2, none, hw, "zero3")
    card = card_of(hw)
    gather = gpt2.params() * 4 / 2 / card.link
    scatter = trainable_params(gpt2, w) * 4 / 2 / card.link
    assert post.step_s - pre.step_s == pytest.approx(gather + scatter, rel=0.05)
    assert step_time(gpt2, none, hw, "zero2").step_s == step_time(gpt2, w, hw, "zero2").step_s


def test_deepspeed_zero3_sync_fetch_serialises_everything() -> None:
    """DeepSpeed ZeRO-3 before v0.6.0 synchronizes the device on every fetch and gathers tensor by tensor: compute,
    the host's launches, both all-gathers and the reduce-scatter add up, one collective per parameter tensor;
    ZeRO-2 is unchanged."""
    gpt2 = ModelShape(id="gpt2-xl", layers=48, hidden=1600, intermediate=4267, heads=25, kv_heads=25,
                             vocab=50257, tied=True)
    w = Workload(method="full", precision="fp16", grad_ckpt="none", seq_len=1024, micro_batch=1, attention="eager")
    sync = dataclasses.replace(w, zero3_sync_fetch=True)
    hw = parse_gpus("16xV100")
    old, new = step_time(gpt2, sync, hw, "zero3"), step_time(gpt2, w, hw, "zero3")
    assert new.step_s == pytest.approx(new.compute_s, rel=0.02)  # FSDP2's prefetch hides all of it
    # the step's own launches (in host_s) hide behind the optimizer's kernels (in compute_s)
    step_host = step_host_s(gpt2, sync, card_of(hw))
    assert old.step_s == pytest.approx(old.compute_s + old.host_s - step_host + old.comm_s, rel=1e-6)
    assert old.comm_s > 2 * new.comm_s  # ~440 collectives per gather instead of 49
    assert comms.param_tensors(gpt2) == 48 * 9 + 2
    assert step_time(gpt2, sync, hw, "zero2").step_s == step_time(gpt2, w, hw, "zero2").step_s


def test_sharded_strategies_reduce_scatter_every_micro_batch_unless_no_sync() -> None:
    """FSDP2 (shardfit's zero2/zero3) reduce-scatters the gradients in every micro-batch's backward, so the
    collectives of a step grow with grad_accum; FSDP1 under no_sync() reduce-scatters once per optimizer step."""
    shape = resolve_shape("meta-llama/Llama-2-7b-hf")
    w = Workload(method="full", precision="bf16", grad_ckpt="none", seq_len=512, micro_batch=1, grad_accum=4,
                 attention="flash")
    hw = parse_gpus("8x4090")
    card = card_of(hw)
    gather = shape.params() * 2 * 7 / 8 / card.link
    scatter = trainable_params(shape, w) * 4 * 7 / 8 / card.link
    every = step_time(shape, w, hw, "zero3")
    once = step_time(shape, dataclasses.replace(w, fsdp1_no_sync=True), hw, "zero3")
    assert every.comm_s == pytest.approx(4 * (2 * gather + scatter), rel=0.02)
    assert once.comm_s == pytest.approx(4 * 2 * gather + scatter, rel=0.02)
    assert every.bound == "comm" and every.step_s > once.step_s
    assert step_time(shape, w, hw, "zero2").comm_s == pytest.approx(4 * (gather + scatter), rel=0.02)


def test_auto_loss_chunk_by_vocabulary_and_card() -> None:
    """`loss_chunk: auto` keeps a chunk's fp32 logits within 32 MiB, never below the rows that keep the head's
    matmul compute-bound on the card; the plan times and sizes the chunks a run on that card takes."""
    from shardfit.config.support import loss_chunk_rows
    from shardfit.plan.activations import logits_bytes
    from shardfit.plan.estimate import with_loss_chunk
    from shardfit.plan.hardware import Hardware

    h100 = card_of(Hardware(1, 1, 80, 512, "h100"))
    assert h100.compute_bound_rows("bf16") == 296  # 989 TFLOP/s over 3.35 TB/s, one FLOP per byte and row
    assert h100.compute_bound_rows("fp32") == 40  # fp32: 67 TFLOP/s, two bytes per FLOP and row
    assert loss_chunk_rows("auto", 151936, 296) == 512
    assert loss_chunk_rows("auto", 49152, 87) == 128  # this bench's CPU: 865 GFLOP/s bf16 over 10 GB/s
    assert loss_chunk_rows("auto", 151936) == 64  # never fewer than 64 rows
    assert loss_chunk_rows("auto", 2048, 296) == 1024  # at most 1024
    assert loss_chunk_rows(300, 151936, 296) == 300  # as set
    qwen = resolve_shape("Qwen/Qwen2.5-7B-Instruct")
    w = Workload(method="lora", seq_len=4096, micro_batch=1)
    assert with_loss_chunk(qwen, w, parse_gpus("1xH100")).loss_chunk == 512
    assert with_loss_chunk(qwen, dataclasses.replace(w, loss_chunk=100), parse_gpus("1xH100")).loss_chunk == 100
    # Each chunk after the first is launched from the host: smaller chunks, more host time per micro-batch.
    fewer, more = (host_dispatch_s(qwen, dataclasses.replace(w, loss_chunk=c)) for c in (1024, 64))
    assert more - fewer == pytest.approx((4096 // 64 - 4096 // 1024) * (19 * 8e-6 + 7.3 * 1e-6), rel=1e-6)
    # At the loss: a chunk's fp32 logits and their 16-bit gradient, per row.
    small, large = (logits_bytes(qwen, dataclasses.replace(w, loss_chunk=c)) for c in (512, 1024))
    assert large - small == 512 * qwen.vocab * (4 + 2)
