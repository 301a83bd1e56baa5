"""Mechanisms the planner learned from issue 46 (plan/timing.py, plan/estimate.py, plan/plan.py): QLoRA's
dequantization time per backend, the memory a CPU-offloaded full fine-tune keeps on the GPU, gradient accumulation
against long-sequence activations, the allocator's reserve as its own line, and the search over settings that
change memory but not the trained result."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shardfit.plan.cards import card_of
from shardfit.plan.dequant import DEQUANT, dequant_per_use, dequant_uses
from shardfit.plan.dispatch import host_dispatch_s
from shardfit.plan.hardware import parse_gpus
from shardfit.plan.shapes import resolve_shape
from shardfit.plan.timing import step_time
from shardfit.plan.workload import Workload

ROOT = Path(__file__).resolve().parent.parent
SHAPE = resolve_shape("meta-llama/Llama-3.1-8B")
H100 = parse_gpus("1xH100")


def test_torchao_dequant_table_is_the_bench_count() -> None:
    """DEQUANT's torchao row is what bench/dequant_traffic.py counted (kernels, views, bytes per weight)."""
    got = json.loads((ROOT / "bench" / "results" / "dequant_traffic.json").read_text())
    assert DEQUANT["torchao"] == (got["kernels"], got["views"], got["bytes_per_weight"])


def test_every_4bit_weight_is_dequantized_per_use_at_the_memory_bandwidth() -> None:
    """QLoRA's step is LoRA's plus, for every use of every 4-bit weight (forward, backward, recomputation), its
    dequantization's bytes at the card's bandwidth: exactly so while the step is compute-bound."""
    lora = Workload(method="lora", seq_len=8192, attention="flash", grad_ckpt="full")
    card = card_of(H100)
    for backend in ("torchao", "bnb"):
        q = replace(lora, method="qlora", quant_backend=backend)
        t_l, t_q = step_time(SHAPE, lora, H100, "single"), step_time(SHAPE, q, H100, "single")
        assert t_q.bound == "compute" and dequant_uses(q) == 3
        extra = 3 * SHAPE.decoder_linear_params() * dequant_per_use(q)[2] / card.hbm
        assert abs((t_q.compute_s - t_l.compute_s) - extra) < 1e-3 * t_l.compute_s
    # without checkpointing two uses per weight, selective two and a half
    assert dequant_uses(replace(lora, grad_ckpt="none")) == 2
    assert dequant_uses(replace(lora, grad_ckpt="selective")) == 2.5


def test_torchao_eager_dequantization_is_slower_than_bitsandbytes_kernel() -> None:
    """torchao's eager ops move ~15x bitsandbytes' bytes and launch ~5x its kernels per use: its QLoRA runs slower
    than a bitsandbytes QLoRA of the same job, which runs slower than LoRA; short micro-batches, where the weights'
    traffic and launches are a larger share, lose the most."""
    for seq in (512, 8192):
        lora = Workload(method="lora", seq_len=seq, grad_ckpt="full")
        rate = {m: step_time(SHAPE, replace(lora, method="qlora", quant_backend=m) if m != "lora" else lora, H100,
                             "single").tokens_per_s for m in ("lora", "bnb", "torchao")}
        assert rate["torchao"] < rate["bnb"] < rate["lora"], (seq, rate)
    short = Workload(method="qlora", seq_len=512, quant_backend="torchao")
    long = replace(short, seq_len=8192)
    ratio = {w.seq_len: step_time(SHAPE, w, H100, "single").tokens_per_s
             / step_time(SHAPE, replace(w, method="lora"), H100, "single").tokens_per_s for w in (short, long)}
    assert ratio[512] < ratio[8192] < 1
    # the host launches every dequantization kernel: 7 linears x 3 uses x 15 kernels more per layer than LoRA
    more = host_dispatch_s(SHAPE, short) - host_dispatch_s(SHAPE, replace(short, method="lora"))
    assert more > SHAPE.layers * 7 * 3 * 15 * 8e-6


def test_foreign_tools_dequantize_with_bitsandbytes() -> None:
    """A QLoRA planned from an HF Trainer / TRL / LLaMA-Factory / axolotl config is bitsandbytes'; shardfit's own
    config is torchao's."""
    from shardfit.config import Config
    from shardfit.plan.workload import workload_of

    assert workload_of(Config()).quant_backend == "torchao"
    assert Workload(method="qlora", bnb_precision=True).bnb and not Workload(method="lora", quant_backend="bnb").bnb


def test_offload_keeps_staging_and_gradient_shards_on_the_gpu() -> None:
    """zero3_offload of a full fine-tune holds no weights, gradients or AdamW states on the GPU, but each in-flight
    unit's shard copied in as stored (fp32) with its bf16 cast, twice (computing and prefetched), and the fp32
    gradient shard before its copy out; the end of backward never holds less than nothing."""
    from shardfit.plan.estimate import estimate, offload_staging_bytes, per_rank
    from shardfit.strategy import get

    hw = parse_gpus("8xA100-80G")
    w = Workload(method="full", seq_len=2048)
    staging, grad = offload_staging_bytes(SHAPE, w, 8)
    layer = SHAPE.layer_params()
    assert staging == 2 * layer * (4 + 2) / 8 and grad == layer * 4 / 8
    off, on = per_rank(SHAPE, w, hw, get("zero3_offload")), per_rank(SHAPE, w, hw, get("zero3"))
    assert off.weights == off.grads == off.optimizer == 0
    assert off.fwd_temp - on.fwd_temp == staging and off.bwd_temp - on.bwd_temp == staging + grad
    c = estimate(SHAPE, w, hw, "zero3_offload")
    assert min(c.per_gpu_gib.grads, c.per_gpu_gib.temporaries) >= 0


def test_gradient_accumulation_never_multiplies_activations_or_the_loss() -> None:
    """Accumulation runs the micro-batches one after another: a long-sequence LoRA's activations and logits are one
    micro-batch's whatever grad_accum is; only the accumulated gradients (LoRA's: megabytes) stay through the
    forward."""
    from shardfit.plan.estimate import estimate

    hw = parse_gpus("1xA100-80G")
    w = Workload(method="lora", seq_len=8192, loss="full", grad_ckpt="full")
    one, many = estimate(SHAPE, w, hw, "single"), estimate(SHAPE, replace(w, grad_accum=16), hw, "single")
    assert one.per_gpu_gib.activations == many.per_gpu_gib.activations
    assert one.per_gpu_gib.logits == many.per_gpu_gib.logits
    assert 0 <= many.per_gpu_gib.total - one.per_gpu_gib.total < 0.2


def test_the_allocator_reserve_is_its_own_line() -> None:
    """The tensor columns are what max_memory_allocated() reports, the reserve (ALLOCATOR_RESERVE of them) brings
    them to the max_memory_reserved() of a full card, and runtime_overhead (CUDA context, NCCL) is outside the
    allocator."""
    from shardfit.plan.estimate import ALLOCATOR_RESERVE, CUDA_CONTEXT_GIB, NCCL_GIB, estimate

    for hw, strategy, runtime in ((H100, "single", CUDA_CONTEXT_GIB),
                                  (parse_gpus("8xH100"), "zero3", CUDA_CONTEXT_GIB + NCCL_GIB)):
        b = estimate(SHAPE, Workload(method="lora"), hw, strategy).per_gpu_gib
        tensors = b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries
        assert b.allocator_reserve == tensors * ALLOCATOR_RESERVE and b.runtime_overhead == runtime
        assert abs(b.total - (tensors + b.allocator_reserve + b.runtime_overhead)) < 1e-9


def test_nothing_fits_recommends_the_fastest_setting_with_the_same_result() -> None:
    """A job that fits no strategy as configured is planned again with checkpointing and micro-batch 1 at the same
    global batch; the fastest of those that fits is recommended with what it turned on, and it is the fastest of
    every combination the search may take."""
    from shardfit.plan.plan import estimate_all, make_plan, recommend

    hw = parse_gpus("1x24GB")
    w = Workload(method="lora", seq_len=4096, micro_batch=4, grad_ckpt="none")
    plan = make_plan(SHAPE, w, hw)
    assert plan.recommended is None and plan.adjusted is not None
    a = plan.adjusted
    changed = replace(w, **dict(a.changes))
    assert changed.micro_batch * changed.grad_accum == w.micro_batch * w.grad_accum  # the same global batch
    assert a.total_gib <= hw.gpu_mem_gib and a.tokens_per_s
    rates = []
    for ckpt in ("none", "selective", "full"):
        for mb, acc in ((4, 1), (1, 4)):
            cands = estimate_all(SHAPE, replace(w, grad_ckpt=ckpt, micro_batch=mb, grad_accum=acc), hw)
            best, _ = recommend(cands, hw)
            rates += [c.tokens_per_s for c in cands if c.strategy == best]
    assert a.tokens_per_s >= max(rates) * 0.95
    assert plan.to_json()["adjusted"]["changes"] == dict(a.changes)
    # a job that fits as configured is not searched
    assert make_plan(SHAPE, replace(w, seq_len=512, micro_batch=1), hw).adjusted is None


def test_plan_model_defaults_to_checkpointing_and_says_so(capsys) -> None:
    """`plan --model` plans gradient checkpointing on (the default of LLaMA-Factory, TRL and ms-swift) and notes it;
    --grad-ckpt none still plans without; nothing-fits-as-configured with a same-result fix exits 0."""
    from shardfit.cli.main import main

    def plan(*args: str) -> tuple[int, dict]:
        code = main(["plan", "--model", "meta-llama/Llama-3.1-8B", "--json", *args])
        return code, json.loads(capsys.readouterr().out)

    _, on = plan("--gpus", "1x80GB")
    assert on["workload"]["grad_ckpt"] == "full" and any("LLaMA-Factory" in n for n in on["notes"])
    _, off = plan("--gpus", "1x80GB", "--grad-ckpt", "none")
    assert off["workload"]["grad_ckpt"] == "none" and not any("LLaMA-Factory" in n for n in off.get("notes", []))
    code, tight = plan("--gpus", "1x24GB", "--seq", "4096", "--batch", "4", "--grad-ckpt", "none")
    assert code == 0 and tight["recommended"] is None and tight["adjusted"]["strategy"] == "single"


def test_fsdp1_root_keeps_the_untied_input_embedding_gathered() -> None:
    """FSDP1 runs wrap the decoder blocks only, so an untied input embedding is in the root unit, which FSDP1 does
    not free after forward (`_post_forward_reshard`): a full fine-tune's forward holds its 16-bit copy once more
    than shardfit's FSDP2 layout (the embedding a unit of its own, freed right after it runs). Backward holds it
    once under both: FSDP2 gathers the embedding's unit again for its gradient, FSDP1 still has the root gathered;
    FSDP1's root is one buffer, so its head and final norm are not counted a second time
    (`fsdp1_backward_weight_bytes`); a tied embedding is the head, counted in the root either way."""
    from shardfit.plan.estimate import offload_staging_bytes, per_rank
    from shardfit.strategy import get

    hw = parse_gpus("8xA100-80G")
    for strategy in ("zero3", "zero3_offload"):
        w = Workload(method="full", seq_len=4096, grad_ckpt="full")
        own, fsdp1 = (per_rank(SHAPE, replace(w, fsdp1=f), hw, get(strategy)) for f in (False, True))
        embedding = SHAPE.vocab * SHAPE.hidden * 2
        # (under offload FSDP2's staged shards and its fp32 gradient shard in flight go too: FSDP1 drops its
        # staged copy before a unit computes and holds the gradient shards, `held_grad_shards`)
        staging, in_flight = offload_staging_bytes(SHAPE, w, hw.world) if strategy == "zero3_offload" else (0, 0)
        head_and_norm = embedding + SHAPE.hidden * 2
        flat_grad = SHAPE.layer_params() * 2  # FSDP1's flat copy of a block's gradient (plan/fsdp1_grads.py)
        assert fsdp1.fwd_temp - own.fwd_temp == pytest.approx(embedding - staging)
        assert own.bwd_temp - fsdp1.bwd_temp == pytest.approx(head_and_norm + staging + in_flight - flat_grad)
    tied = resolve_shape("Qwen/Qwen2.5-0.5B")
    assert tied.tied
    w = Workload(method="full", seq_len=4096, grad_ckpt="full")
    assert per_rank(tied, replace(w, fsdp1=True), hw, get("zero3")).fwd_temp == \
        per_rank(tied, w, hw, get("zero3")).fwd_temp
