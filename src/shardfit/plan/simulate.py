"""`shardfit plan --simulate`: one real training step of the actual transformers model on fake tensors.

The model is built on the meta device (no memory), given fake storage inside `FakeTensorMode`, wrapped exactly as
`train` wraps it (LoRA, checkpointing, FSDP2 `fully_shard` per block over a fake process group of the planned world
size), and run for two steps (the second with optimizer states) under torch's `MemTracker` / `FSDPMemTracker`.
The tracker's peak, by category, is what one rank's tensors need; the runtime overhead of a real GPU is added as
in the analytic estimate. No weights are read and nothing real is allocated, so a 72B config runs on a laptop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardfit.plan.estimate import ALLOCATOR_RESERVE, CUDA_CONTEXT_GIB, GIB, NCCL_GIB, Breakdown, Candidate, Workload
from shardfit.plan.hardware import Hardware
from shardfit.plan.shapes import ModelShape

SIMULATED = ("single", "ddp", "zero2", "zero3")
# How the trackers' categories map onto the plan's columns.
COLUMNS = {
    "Parameter": "weights", "Sharded Param": "weights", "Buffer": "weights",
    "Gradient": "grads", "Sharded Grad": "grads",
    "Optstate": "optimizer", "OptState": "optimizer",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "Unsharded Param": "temporaries", "Unsharded Grad": "temporaries",
    "All Gather": "temporaries", "Reduce Scatter": "temporaries", "Other": "temporaries",
}


def hf_config_for(shape: ModelShape, source: str | None) -> Any:
    """The transformers config to build: the model's own config.json when we have it, else one from the shape."""
    from transformers import AutoConfig, LlamaConfig, Qwen2Config

    if source is not None:
        p = Path(source)
        folder = p.parent if p.is_file() else p
        if (folder / "config.json").is_file():
            cfg = AutoConfig.from_pretrained(folder)
            return getattr(cfg, "text_config", None) if "vl" in cfg.model_type else cfg
    cls = Qwen2Config if "qwen" in shape.id.lower() else LlamaConfig
    kwargs = dict(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                  num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                  tie_word_embeddings=shape.tied, max_position_embeddings=131072)
    if shape.head_dim:
        kwargs["head_dim"] = shape.head_dim
    return cls(**kwargs)


def _build(config: Any, w: Workload) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from shardfit.config.schema import LoraSettings
    from shardfit.models.adapters import apply_lora
    from shardfit.models.checkpointing import enable_hf_checkpointing

    dtype = torch.float32 if w.method == "full" or w.precision == "fp32" else torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                 attn_implementation="eager" if w.attention == "eager" else "sdpa")
        if w.method in ("lora", "qlora"):
            model = apply_lora(model, LoraSettings(rank=w.lora_rank, alpha=2 * w.lora_rank))
    if w.grad_ckpt == "full":
        enable_hf_checkpointing(model)
    return model


class _NoHook:
    def remove(self) -> None:
        pass


def skip_frozen_grad_hooks(tracker: Any, module: torch.nn.Module) -> None:
    """MemTracker hooks every parameter for its gradient, which torch refuses on frozen ones (LoRA's base
    weights); marking those as already hooked makes it skip them (they never get a gradient anyway)."""
    for p in module.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


def measure_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, tracker: Any,
                 steps: int = 2) -> dict[str, float]:
    """Peak bytes per tracker category over `steps` training steps (GiB)."""
    with tracker:
        for _ in range(steps):
            loss, _ = module(*batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tracker.reset_mod_stats()
    peak = tracker.get_tracker_snapshot("peak")
    out: dict[str, float] = {}
    for per_dev in peak.values():
        for k, v in per_dev.items():
            name = getattr(k, "value", k)
            out[name] = out.get(name, 0.0) + v / GIB
    return out


def to_breakdown(cats: dict[str, float], hw: Hardware, strategy: str) -> Breakdown:
    b = Breakdown()
    for name, gib in cats.items():
        col = COLUMNS.get(name)
        if col is not None:
            setattr(b, col, getattr(b, col) + gib)
    tensors = b.weights + b.grads + b.optimizer + b.activations + b.logits + b.temporaries
    comm = NCCL_GIB if hw.world > 1 and strategy != "single" else 0.0
    b.runtime_overhead = tensors * ALLOCATOR_RESERVE + CUDA_CONTEXT_GIB + comm
    b.total = tensors + b.runtime_overhead
    return b


class ModelOwnLoss(torch.nn.Module):
    """`loss: full`: the step as the HF Trainer runs it, through the model's own loss over full logits."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: Any, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        out = self.model(input_ids=input_ids, labels=targets, use_cache=False)
        return out.loss, targets.numel()


def simulate(shape: ModelShape, w: Workload, hw: Hardware, strategy: str, source: str | None = None) -> Candidate:
    """Measure `strategy` with fake tensors; logits are inside activations/temporaries (one chunk at a time)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    from shardfit.train.loss import CausalLMLoss

    if strategy not in SIMULATED:
        raise ValueError(f"--simulate covers {', '.join(SIMULATED)}; {strategy} stays analytic")
    world = hw.world if strategy in ("zero2", "zero3") else 1
    own_group = False
    if world > 1 and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        own_group = True
    try:
        mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (world,))  # outside fake mode, as the mesh holds real process groups
        model = _build(hf_config_for(shape, source), w)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.tie_weights()  # to_empty gives each parameter its own storage; tied weights must share one again
            module = ModelOwnLoss(model) if w.loss == "full" else CausalLMLoss(model, all_labelled=True)
            if mesh is not None:
                from shardfit.parallel.wrap import mp_policy, shard

                shard(module, model, mesh=mesh, mp_policy=mp_policy(w.precision),
                      reshard_after_forward=strategy == "zero3")
            params = [p for p in module.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            ids = torch.zeros(w.micro_batch, w.seq_len, dtype=torch.long)
            batch = (ids, None, ids)
            if mesh is not None:
                from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

                tracker = FSDPMemTracker(module, optimizer)
                tracker.track_inputs(batch[:1])
            else:
                tracker = MemTracker()
                tracker.track_external(module, optimizer)
                skip_frozen_grad_hooks(tracker, module)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=w.precision != "fp32" and mesh is None)
            with autocast:
                cats = measure_step(module, optimizer, batch, tracker)
    finally:
        if own_group:
            dist.destroy_process_group()
    b = to_breakdown(cats, hw, strategy)
    return Candidate(strategy, b.total <= hw.gpu_mem_gib, b, 0.0, "simulated",
                     "fake-tensor step: logits are counted in activations/temporaries")


def simulate_plan(plan: dict, shape: ModelShape, w: Workload, hw: Hardware, source: str | None) -> dict:
    """Replace the analytic candidates that can be simulated with measured ones; re-derive the recommendation."""
    from shardfit.plan.build import recommend

    cands = []
    from shardfit.plan.estimate import estimate

    for c in plan["candidates"]:
        if c["strategy"] in SIMULATED:
            cands.append(simulate(shape, w, hw, c["strategy"], source))
        else:
            cands.append(estimate(shape, w, hw, c["strategy"]))
    best, reason = recommend(cands, hw)
    return {**plan, "candidates": [c.to_json() for c in cands], "recommended": best, "reason": reason}


