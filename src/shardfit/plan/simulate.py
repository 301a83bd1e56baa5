"""`shardfit plan --simulate`: one real training step of the actual transformers model on fake tensors.

The model is built on the meta device (no memory), given fake storage inside `FakeTensorMode`, wrapped exactly as
`train` wraps it (LoRA, checkpointing, FSDP2 `fully_shard` per block over a fake process group of the planned world
size), and run for two steps (the second with optimizer states) under torch's `MemTracker` / `FSDPMemTracker`.
The tracker's peak, by category, is what one rank's tensors need; the runtime overhead of a real GPU is added as
in the analytic estimate. No weights are read and nothing real is allocated, so a 72B config runs on a laptop.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _RefType

from shardfit.plan.estimate import (
    FULL_LOSSES,
    GIB,
    Breakdown,
    Candidate,
    Workload,
    add_runtime_overhead,
    estimate,
)
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
    "Logits": "logits",
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
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention_kernel(w))
        if w.trains_adapters:
            model = apply_lora(model, LoraSettings(rank=w.lora_rank, alpha=2 * w.lora_rank))
            if w.adapters_16bit:
                for p in model.parameters():
                    if p.requires_grad:
                        p.data = p.data.to(dtype)
        if w.frozen_fp32:
            upcast_frozen_outside_blocks(model)
    if w.grad_ckpt != "none":
        enable_hf_checkpointing(model, selective=w.grad_ckpt == "selective")
    return model


UNMASKED_SDPA = "shardfit_unmasked_sdpa"


def _unmasked_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, None, **kwargs)


def attention_kernel(w: Workload) -> str:
    """The transformers attention implementation whose memory the simulation measures for `w.attention`.

    `flash` (flash-attention 2's variable-length kernel: q, k, v, output and log-sum-exp saved, no dense mask) is
    stood in for by causal SDPA without a mask, which saves the same on CPU. It is registered under a name of its
    own with no mask function, so transformers builds no mask for it: fake tensors cannot show transformers that a
    row holds one example, so it would otherwise build one."""
    if w.attention == "eager":
        return "eager"
    if w.attention == "sdpa":
        return "sdpa"
    from transformers import AttentionInterface

    AttentionInterface.register(UNMASKED_SDPA, _unmasked_sdpa)
    return UNMASKED_SDPA


def packed_positions(batch: int, seq: int) -> torch.Tensor:
    """Position ids of rows holding two examples each, as the loader packs them: with SDPA or eager attention
    transformers builds a [batch, seq, seq] block-diagonal mask from them, as it does in training."""
    return (torch.arange(seq) % max(1, (seq + 1) // 2)).expand(batch, seq).contiguous()


def upcast_frozen_outside_blocks(model: torch.nn.Module) -> None:
    """What peft's prepare_model_for_kbit_training does to a 4-bit model: every frozen 16-bit weight that is not
    quantized (embeddings, norms, head; the blocks' linear layers are) becomes fp32."""
    from shardfit.train.loss import decoder_and_head

    quantized = {id(m.weight) for m in decoder_and_head(model)[0].modules() if isinstance(m, torch.nn.Linear)}
    for p in model.parameters():
        if not p.requires_grad and id(p) not in quantized and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()


class _NoHook:
    def remove(self) -> None:
        pass


def skip_frozen_grad_hooks(tracker: Any, module: torch.nn.Module) -> None:
    """MemTracker hooks every parameter for its gradient, which torch refuses on frozen ones (LoRA's base
    weights); marking those as already hooked makes it skip them (they never get a gradient anyway)."""
    for p in module.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())


class _LossRef(_RefType):
    LOGITS = "Logits"


class LossAttribution:
    """Mixin for torch's MemTracker / FSDPMemTracker that files what the loss creates under its own category.

    The trackers file every tensor by when it was made (forward: Activation, backward: Temp). Tensors made after
    the decoder body's forward and before its backward starts belong to the loss (logits, their softmax and
    gradients, the gradient handed back to the body): they become "Logits", the plan's logits column. The
    snapshot at each phase's own peak (forward, backward, optimizer) is kept as well (`phase_peaks`)."""

    def __init__(self, body: torch.nn.Module, *args: Any) -> None:
        super().__init__(*args)
        self._body = body
        self._after_body = self._body_bw = False
        self._propagating = 0
        self.phase_peaks: dict[str, dict[str, int]] = {}

        def before(*_: Any) -> None:
            self._after_body = self._body_bw = False

        def after(*_: Any) -> None:
            self._after_body = True

        body.register_forward_pre_hook(before)
        body.register_forward_hook(after)

    def _in_loss(self) -> bool:
        if not self._after_body:
            return False
        if self._mod_tracker.is_bw and self._mod_tracker.get_known_fqn(self._body) in self._mod_tracker.parents:
            self._body_bw = True
        return not self._body_bw

    @contextlib.contextmanager
    def ignoring_sharding_propagation(self) -> Iterator[None]:
        """DTensor derives output shapes by running each new op on global-shape fake tensors in the active fake
        mode, which under a fake-tensor simulation is the tracker's own: those tensors would be counted. Real runs
        make them in a throw-away fake mode (no memory), so they are ignored here (a foreach optimizer step over
        a whole model would otherwise count every parameter at full size)."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate(prop: Any, op_schema: Any) -> Any:
            self._propagating += 1
            try:
                return original(prop, op_schema)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
        try:
            yield
        finally:
            ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]

    def _track(self, reftype: Any, t: torch.Tensor) -> None:
        if self._propagating:
            return
        if reftype.value in ("Activation", "Temp") and self._in_loss():
            reftype = _LossRef.LOGITS
        super()._track(reftype, t)  # type: ignore[misc]

    def phase(self) -> str:
        """Where the step is: forward (the loss included), backward, or optimizer (gradient clipping, the update)."""
        if self._in_opt:
            return "optimizer"
        if self._mod_tracker.is_bw:
            return "backward"
        return "forward" if len(self._mod_tracker.parents) > 1 else "optimizer"

    def peak_phase(self) -> str:
        """The phase of the step's overall peak."""
        return max(self.phase_peaks, key=lambda k: self.phase_peaks[k]["Total"])

    def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
        snap = self._curr_mem_snap.setdefault(winfo.device, dict.fromkeys(self._ref_class, 0))
        snap.setdefault(_LossRef.LOGITS, 0)
        super()._update_snap(u_type, winfo, *args, **kwargs)  # type: ignore[misc]
        snap = self._curr_mem_snap.get(winfo.device)
        if snap:
            best = self.phase_peaks.setdefault(self.phase(), {})
            if snap["Total"] > best.get("Total", -1):
                best.clear()
                best.update((getattr(k, "value", k), v) for k, v in snap.items())


class StepMemTracker(LossAttribution, MemTracker):
    """MemTracker with the loss's tensors filed as Logits."""


class StepFSDPMemTracker(LossAttribution, FSDPMemTracker):
    """FSDPMemTracker with the loss's tensors filed as Logits."""


def measure_step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, tracker: Any,
                 steps: int = 2, amp: Any = contextlib.nullcontext) -> dict[str, float]:
    """Peak bytes per tracker category over `steps` training steps (GiB), each step as the training loop runs
    it: forward under `amp()`, backward, gradient clipping, optimizer step."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    with tracker:
        for _ in range(steps):
            with amp():
                loss, _ = module(*batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
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
    add_runtime_overhead(b, hw, strategy)
    return b


class ModelOwnLoss(torch.nn.Module):
    """`loss: full*`: the step as the HF Trainer runs it, through the model's own loss over full logits.

    `loss` full is transformers' current loss; full_shift is transformers 4.46-4.48's (fp32 upcast, then a
    contiguous copy of the shifted logits); full_shift16 is the GPT-2-style loss of older remote code (a contiguous
    copy of the shifted 16-bit logits, upcast by autocast inside cross-entropy)."""

    def __init__(self, model: torch.nn.Module, loss: str = "full"):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, input_ids: torch.Tensor, position_ids: Any, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self.loss == "full":
            return self.model(input_ids=input_ids, position_ids=position_ids, labels=targets,
                              use_cache=False).loss, targets.numel()
        # The model's forward still holds its 16-bit logits while its loss function upcasts them.
        logits = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        upcast = logits.float() if self.loss == "full_shift" else logits
        shifted = upcast[..., :-1, :].contiguous()
        loss = torch.nn.functional.cross_entropy(shifted.view(-1, shifted.shape[-1]), targets[..., 1:].reshape(-1),
                                                 reduction="mean")
        return loss, targets.numel()


def simulate(shape: ModelShape, w: Workload, hw: Hardware, strategy: str, source: str | None = None) -> Candidate:
    """Measure `strategy` with fake tensors: the breakdown at the step's peak moment."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardfit.train.loss import CausalLMLoss, decoder_and_head
    from shardfit.train.optim import build_optimizer

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
            module = (ModelOwnLoss(model, w.loss) if w.loss in FULL_LOSSES
                      else CausalLMLoss(model, all_labelled=True))
            if mesh is not None:
                from shardfit.parallel.wrap import mp_policy, shard

                shard(module, model, mesh=mesh, mp_policy=mp_policy(w.precision),
                      reshard_after_forward=strategy == "zero3")
            optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], 1e-4, 0.0)
            ids = torch.zeros(w.micro_batch, w.seq_len, dtype=torch.long)
            batch = (ids, packed_positions(w.micro_batch, w.seq_len), ids)
            body = decoder_and_head(model)[0]
            if mesh is not None:
                tracker = StepFSDPMemTracker(body, module, optimizer)
                tracker.track_inputs(batch[:1])
            else:
                tracker = StepMemTracker(body)
                tracker.track_external(module, optimizer)
                skip_frozen_grad_hooks(tracker, module)
            amp = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16,
                                    enabled=w.precision != "fp32" and mesh is None)
            with tracker.ignoring_sharding_propagation():
                cats = measure_step(module, optimizer, batch, tracker, amp=amp)
    finally:
        if own_group:
            dist.destroy_process_group()
    b = to_breakdown(cats, hw, strategy)
    phase = tracker.peak_phase()
    return Candidate(strategy, b.total <= hw.gpu_mem_gib, b, 0.0, "simulated",
                     f"fake-tensor step, peak in the {phase} pass", peak_phase=phase)


def simulate_plan(plan: dict, shape: ModelShape, w: Workload, hw: Hardware, source: str | None) -> dict:
    """Replace the analytic candidates that can be simulated with measured ones; re-derive the recommendation."""
    from shardfit.plan.build import recommend

    cands = []
    for c in plan["candidates"]:
        if c["strategy"] in SIMULATED:
            cands.append(simulate(shape, w, hw, c["strategy"], source))
        else:
            cands.append(estimate(shape, w, hw, c["strategy"]))
    best, reason = recommend(cands, hw)
    return {**plan, "candidates": [c.to_json() for c in cands], "recommended": best, "reason": reason}


