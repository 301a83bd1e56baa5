"""`shardfit plan --simulate`: one real training step of the actual transformers model on fake tensors.

The model is built by `models.build.build_model` on the meta device (no memory), given fake storage inside
`FakeTensorMode`, made ready by `parallel.parallelize` exactly as `train` does (LoRA, checkpointing, FSDP2
`fully_shard` per block over a fake process group of the planned world size), and run for two steps (the second
with optimizer states) under torch's memory trackers. The tracker's peak, by category, is what one rank's tensors
need; the runtime overhead of a real GPU is added as in the analytic estimate. No weights are read and nothing
real is allocated, so a 72B config runs on a laptop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AttentionInterface, AutoConfig
from transformers.integrations import moe as hf_moe
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from shardfit.config import Config, LoraSettings
from shardfit.errors import UserError
from shardfit.models.adapters import skip_adapter_input_casts
from shardfit.models.anatomy import base_model, decoder_and_head, vision_body
from shardfit.models.build import build_model
from shardfit.models.nf4 import is_nf4
from shardfit.models.quantize import nf4_to_empty
from shardfit.parallel.parallelize import parallelize
from shardfit.plan.estimate import Candidate, estimate, planned_workload, with_loss_chunk
from shardfit.plan.hardware import Hardware
from shardfit.plan.plan import Plan, with_candidates
from shardfit.plan.shapes import ModelShape, hf_config
from shardfit.plan.workload import FULL_LOSSES, LORA_TARGETS, Workload
from shardfit.simulate.gpu_kernels import dropout_as_on_a_gpu, sdpa_as_on_a_gpu
from shardfit.simulate.tracker import (
    StepFSDPMemTracker,
    StepMemTracker,
    measure_step,
    skip_frozen_grad_hooks,
    to_breakdown,
    train_step,
)
from shardfit.strategy import get as get_strategy
from shardfit.train.loss import CausalLMLoss
from shardfit.train.optim import build_optimizer

log = logging.getLogger(__name__)


def hf_config_for(shape: ModelShape, source: str | None) -> Any:
    """The transformers config to build: the model's own config.json when we have it (a vision-language model's
    whole config: its vision tower's weights are loaded in training too), else one from the shape."""
    if source is not None:
        p = Path(source)
        folder = p.parent if p.is_file() else p
        if (folder / "config.json").is_file():
            try:
                return AutoConfig.from_pretrained(folder)
            except ValueError:  # remote code the simulation will not run: its shape stands in (same sizes)
                return hf_config(shape)
    return hf_config(shape)


UNMASKED_SDPA = "shardfit_unmasked_sdpa"


def _unmasked_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
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
    AttentionInterface.register(UNMASKED_SDPA, _unmasked_sdpa)
    return UNMASKED_SDPA


def packed_positions(batch: int, seq: int) -> torch.Tensor:
    """Position ids of rows holding two examples each, as the loader packs them: with SDPA or eager attention
    transformers builds a [batch, seq, seq] block-diagonal mask from them, as it does in training."""
    return (torch.arange(seq) % max(1, (seq + 1) // 2)).expand(batch, seq).contiguous()


def upcast_frozen_outside_blocks(model: torch.nn.Module) -> None:
    """What peft's prepare_model_for_kbit_training does to a 4-bit model: every frozen 16-bit weight that is not
    quantized (embeddings, norms, head; the blocks' linear layers are) becomes fp32."""
    quantized = {id(m.weight) for m in decoder_and_head(model)[0].modules() if isinstance(m, torch.nn.Linear)}
    for p in model.parameters():
        # (a mixture's expert stacks are parameters of no Linear, quantized to NF4 all the same)
        if not p.requires_grad and id(p) not in quantized and not is_nf4(p.data) and \
                p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.float()


def workload_config(w: Workload, model: str, mixture: bool = False) -> Config:
    """The training config whose model `build_model` builds for workload `w` (kernel names as the simulation
    stands them in: see `attention_kernel`)."""
    # a mixture's fused experts refuse a list of names: every projection named is all-linear's choice there (on
    # other models all-linear would also adapt the linear_*, Mamba and per-layer projections a list leaves out)
    named = w.lora_targets and not (mixture and set(w.lora_targets) == set(LORA_TARGETS))
    targets = [f"{t}_proj" for t in w.lora_targets] if named else "all-linear"
    return Config(model=model, method=w.method, precision=w.precision, grad_ckpt=w.grad_ckpt,
                  lora=LoraSettings(rank=w.lora_rank, alpha=2 * w.lora_rank, dropout=w.lora_dropout, targets=targets,
                                    experts=w.lora_experts),
                  attn_implementation=attention_kernel(w),
                  freeze_vision_tower=not w.vision_trainable, freeze_audio_tower=not w.audio_trainable)


def tools_recipe(model: torch.nn.Module, w: Workload, autocast: bool) -> None:
    """What the recipe changes on the built model: shardfit's own stops peft casting the adapters' inputs to
    fp32 under autocast (train/recipe.py, `adapter_input_casts` off); other tools' recipes keep that cast and may
    make the adapters 16-bit (peft < 0.12, LLaMA-Factory's pure_bf16) or the frozen embeddings, norms and head
    fp32 (peft's k-bit training), or every frozen weight (a model loaded in fp32, `loaded_fp32`)."""
    if autocast and w.trains_adapters and not w.adapter_input_casts:
        skip_adapter_input_casts(model)
    low = torch.float16 if w.precision == "fp16" else torch.bfloat16
    if w.pure_16bit:  # every weight, its gradient and its AdamW states in the compute dtype (no fp32 masters)
        # one tensor at a time: Module.to would turn a QLoRA's NF4 weights, still on the meta device here, into
        # plain 16-bit ones (NF4Tensor's own `to` keeps its 4 bits only on a real device)
        for p in model.parameters():
            if p.is_floating_point() and not is_nf4(p):
                p.data = p.data.to(low)
        for b in model.buffers():
            if b.is_floating_point():
                b.data = b.data.to(low)
    if w.adapters_16bit and w.trains_adapters:  # 16-bit in an fp32 run too
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(low)
    if w.loaded_fp32:  # the model loaded in fp32: every frozen weight, the blocks' linears too (not 4-bit ones)
        for p in model.parameters():
            if not p.requires_grad and not is_nf4(p.data) and p.dtype in (torch.float16, torch.bfloat16):
                p.data = p.data.float()
    elif w.frozen_fp32:
        upcast_frozen_outside_blocks(model)


@contextlib.contextmanager
def grouped_mm_as_on_a_gpu() -> Iterator[None]:
    """The experts' `grouped_mm` of a run whose expert weights are not bf16 (a full fine-tune's fp32 master weights
    under autocast, which does not cover grouped_mm): PyTorch's CUDA kernel then runs its own loop of one matmul
    per expert into the same output, but its fake-tensor rule accepts bf16 only and refuses the step. Within this
    scope transformers takes its own per-expert loop for those weights, whose fake rule gives the same output and
    saves the same input and weight for backward; bf16 weights keep torch's kernel."""
    can_use = hf_moe._can_use_grouped_mm

    def bf16_only(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and can_use(input, weight, offs)

    hf_moe._can_use_grouped_mm = bf16_only
    try:
        yield
    finally:
        hf_moe._can_use_grouped_mm = can_use


class RealIndices(TorchDispatchMode):
    """Inside fake mode, an op whose tensor inputs are all real runs for real: the vision tower's index arithmetic
    on its real patch grid (`cu_seqlens[1:] - cu_seqlens[:-1]`, then `.tolist()`) stays computable. Parameters,
    activations and the batch are fake, so nothing the step allocates becomes real."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def with_vision_indices(model: torch.nn.Module, grid: torch.Tensor) -> None:
    """The vision tower's forward given the index tensors of patch grid `grid` (rotary positions, attention and
    window boundaries), computed here as real tensors outside fake mode: they are data-dependent (their sizes come
    from the grid's values), which fake tensors cannot compute."""
    from transformers import vision_utils  # the tower's own index helpers, the same the forward would call

    visual = vision_body(model).visual
    vc = visual.config
    with unset_fake_temporarily():
        pre: dict[str, Any] = {"position_ids": vision_utils.get_vision_position_ids(grid, vc.spatial_merge_size)}
        pre["cu_seqlens"], pre["max_seqlen"] = vision_utils.get_vision_attention_seqlens(grid, vc)
        if getattr(vc, "window_size", None):
            pre["window_index"], pre["cu_window_seqlens"] = vision_utils.get_vision_window_index(
                grid, spatial_merge_size=vc.spatial_merge_size, window_size=vc.window_size, patch_size=vc.patch_size)
    forward = visual.forward

    def with_indices(hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs: Any) -> Any:
        return forward(hidden_states, grid_thw, **pre, **kwargs)

    visual.forward = with_indices


def image_batch(model: torch.nn.Module, config: Any, w: Workload) -> tuple:
    """A vision-language batch as the loader makes it: each row's image tokens, (4, rows, width) positions, every
    image's pixel patches (fp32, as the image processor gives them) and its (1, rows, columns) patch grid.

    The grid and the vision tower's index tensors derived from it (rotary positions, attention and window
    boundaries) are real tensors computed here, outside fake mode, and passed to the tower's forward: they are
    data-dependent (their sizes come from the grid's values), which fake tensors cannot compute."""
    vc = config.vision_config
    rows, cols = w.image_rows, w.image_cols
    n_images = w.micro_batch * w.images
    with unset_fake_temporarily():
        grid = torch.tensor([[1, rows, cols]] * n_images)
    with_vision_indices(model, grid)
    patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    pixels = torch.zeros(n_images * rows * cols, patch)
    per_row = w.images * rows * cols // vc.spatial_merge_size ** 2
    ids = torch.zeros(w.micro_batch, w.seq_len, dtype=torch.long)
    ids[:, 1:1 + per_row] = config.image_token_id
    positions = packed_positions(w.micro_batch, w.seq_len).unsqueeze(0).expand(4, -1, -1).contiguous()
    return ids, positions, ids, pixels, grid


def audio_batch(model: torch.nn.Module, w: Workload, batch: tuple) -> tuple:
    """`batch` with audio clips as the loader adds them (Qwen2.5-Omni's thinker): each row's audio tokens after
    its image tokens, every clip's fp32 log-mel features side by side in time (mel bins, frames) and each clip's
    frame count, with (4, rows, width) positions.

    The tower's index tensors (chunk lengths, the valid and pooled positions, attention boundaries) are real
    tensors computed here by transformers' own helpers, outside fake mode, and passed to the tower's forward: they
    are data-dependent (their sizes come from the clips' lengths), which fake tensors cannot compute. The padded
    chunks are made from the fake features with the same ops the tower runs."""
    from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as omni  # the tower's own index helpers

    body = vision_body(model)
    tower = body.audio_tower
    if not isinstance(tower, omni.Qwen2_5OmniAudioEncoder):
        # Qwen3-Omni's tower chunks clips with index helpers of its own, and the planner counts Qwen2.5-Omni's
        # tokens: a simulation of it would measure another model's step.
        raise UserError(f"plan --simulate: the audio tower of this model ({type(tower).__name__}) is not simulated "
                        "yet (only Qwen2.5-Omni's); plan without --simulate (the estimate), or simulate the step "
                        "without audio: shardfit plan --model FOLDER --gpus ... --simulate, no --audio-* flags.")
    clips = w.micro_batch * w.audio_clips
    with unset_fake_temporarily():
        lens = torch.tensor([w.audio_frames] * clips)
        _, chunk_lengths = omni.chunk_and_pad_features(torch.zeros(1, clips * w.audio_frames), lens, tower.n_window)
        pre = {"chunk_lengths": chunk_lengths, "valid_indices": omni.get_valid_indices(chunk_lengths),
               "pool_indices": omni.get_pool_indices(lens), "cu_seqlens": omni.get_audio_cu_seqlens(chunk_lengths)}
    split = chunk_lengths.tolist()
    forward = tower.forward

    def with_indices(input_features: torch.Tensor, feature_lens: torch.Tensor | None = None, **kwargs: Any) -> Any:
        padded = torch.nn.utils.rnn.pad_sequence(input_features.T.split(split, dim=0), batch_first=True)
        return forward(input_features, feature_lens=feature_lens, padded_feature=padded.transpose(1, 2), **pre,
                       **kwargs)

    tower.forward = with_indices
    if len(batch) == 3:  # no images: the vision tower runs on one blank merge x merge image (media_forward.idle_vision)
        merge = body.visual.spatial_merge_size
        with unset_fake_temporarily():
            with_vision_indices(model, torch.tensor([[1, merge, merge]]))
    ids = batch[0]
    first = 1 + (w.images * w.image_rows * w.image_cols // body.visual.spatial_merge_size ** 2 if len(batch) > 3
                 else 0)  # after the row's image tokens
    after_conv = (w.audio_frames - 1) // 2 + 1
    per_row = w.audio_clips * ((after_conv - 2) // 2 + 1)
    ids[:, first:first + per_row] = body.config.audio_token_id
    positions = batch[1] if batch[1].dim() == 3 else batch[1].unsqueeze(0).expand(4, -1, -1).contiguous()
    features = torch.zeros(tower.num_mel_bins, clips * w.audio_frames)
    pixels, grid = (batch[3], batch[4]) if len(batch) > 3 else (None, None)
    return ids, positions, ids, pixels, grid, features, lens


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


def unsimulated(w: Workload, shape: ModelShape | None = None) -> str | None:
    """The first setting of `w` that changes memory and that the simulated step does not build, or None. The step
    builds torch's AdamW over FSDP2 (or one device) with SFT's loss, eager modules and 16-bit matmuls, every row
    whole on its rank; a job that differs in one of these would be measured as another job and called simulated."""
    # (bitsandbytes' or torchao's 32-bit AdamW keeps the states torch's does: only the optimizer's name matters)
    if w.optimizer != "adamw":
        kernels = "bitsandbytes' " if w.bnb_optimizer else "torchao's " if w.torchao_optimizer else ""
        return f"{kernels}{w.optimizer} (the simulated step builds torch's AdamW)"
    for name, on in (("sequence_parallel", w.sequence_parallel > 1), ("expert_parallel", w.expert_parallel > 1),
                     ("torch.compile", w.compile), ("float8", w.float8), ("FSDP1", w.fsdp1)):
        if on:
            return f"{name} (the simulated step runs without it)"
    if w.objective != "sft":
        return f"the {w.objective} objective (the simulated step runs SFT's loss)"
    if w.method == "qlora" and w.quant_backend == "bnb" and w.frozen_fp32:
        # bitsandbytes' Linear4bit returns its input's dtype, fp32 over peft's fp32 stream (tests/test_plan_qlora_
        # stream.py); the step's NF4 layers return 16 bits under autocast
        return "bitsandbytes' 4-bit layers over an fp32 stream (the simulated step's NF4 layers return 16 bits)"
    if w.trains_adapters and w.lora_experts and w.lora_dropout > 0 and shape and shape.moe_layers:
        # transformers 5's fused expert stacks take adapters only through peft's target_parameters, which refuses
        # dropout; the runs that had it (transformers 4's expert Linears) cannot be built from this transformers
        return "LoRA dropout on the routed experts (peft's adapters on fused expert weights take none)"
    if w.method == "qlora" and w.quant_backend == "bnb" and (w.bnb_compute_fp32 or (shape and shape.moe_layers)):
        # bitsandbytes leaves a mixture's expert stacks in 16 bits and dequantizes to fp32 under bnb_compute_fp32;
        # the step stores every stack in torchao's NF4 and dequantizes to the compute dtype
        return "bitsandbytes' QLoRA of this job (its experts or fp32 dequantization; the step builds torchao's NF4)"
    return None


def simulate(shape: ModelShape, w: Workload, hw: Hardware, strategy: str, source: str | None = None) -> Candidate:
    """Measure `strategy` with fake tensors: the breakdown at the step's peak moment. ValueError where the strategy
    or a setting of `w` (`unsimulated`) is not one the step builds."""
    s = get_strategy(strategy)
    if not s.simulable:
        raise ValueError(f"--simulate cannot run {strategy}; it stays analytic")
    if why := unsimulated(w, shape):
        raise ValueError(f"--simulate cannot build {why}; {strategy} stays analytic")
    world = hw.world if s.sharded else 1
    own_group = False
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        own_group = True
    try:
        # The mesh is made outside fake mode: it holds real process groups.
        mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
        cfg = workload_config(w, source or shape.id, mixture=bool(shape.moe_layers))
        config = hf_config_for(shape, source)
        model = build_model(cfg, s, weights=False, config=config)
        vl = vision_body(model)  # its config holds the towers' (Qwen2.5-Omni's: the thinker's, not the top one)
        images = w.images > 0 and vl is not None
        audio = w.audio_clips > 0 and hasattr(vl, "audio_tower")
        autocast = w.precision != "fp32" and mesh is None  # FSDP's mixed precision casts the parameters instead
        tools_recipe(model, w, autocast)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            nf4_to_empty(model, "cpu")
            base_model(model).tie_weights()  # to_empty gives each parameter its own storage; ties must share one
            module = (ModelOwnLoss(model, w.loss) if w.loss in FULL_LOSSES
                      else CausalLMLoss(model, with_loss_chunk(shape, w, hw).loss_chunk, all_labelled=True))
            module = parallelize(module, s, device=torch.device("cpu"), world=world, precision=w.precision,
                                 grad_ckpt=w.grad_ckpt, mesh=mesh)
            # The 16-bit stacks the planner models (adapters_16bit, pure_16bit) kept 16-bit AdamW states.
            optimizer = build_optimizer([p for p in module.parameters() if p.requires_grad], 1e-4, 0.0,
                                        fused_shards=w.fused_adamw, masters=False, fused_plain=w.fused_adamw)
            ids = torch.zeros(w.micro_batch, w.seq_len, dtype=torch.long)
            batch = (ids, packed_positions(w.micro_batch, w.seq_len), ids)
            if images:
                batch = image_batch(model, vl.config, w)
            if audio:
                batch = audio_batch(model, w, batch)
            # the run's own 16-bit dtype: bf16 autocast over fp16 weights would promote every residual add to fp32
            low = torch.float16 if w.precision == "fp16" else torch.bfloat16
            amp = functools.partial(torch.autocast, "cpu", dtype=low, enabled=autocast)
            real_indices = RealIndices() if images or audio else contextlib.nullcontext()
            with warnings.catch_warnings(), real_indices, grouped_mm_as_on_a_gpu(), sdpa_as_on_a_gpu(), \
                    dropout_as_on_a_gpu():
                # torchao's NF4 all-gather asserts that its output aliases FSDP's buffer by data pointer, which
                # fake tensors answer with a deprecation warning (the check itself holds in a real run).
                warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
                # The first step, untracked: it makes the optimizer's states (which the tracker made below finds)
                # and fills fake mode's caches; the step measured is the second, as a run's peak is.
                train_step(module, optimizer, batch, amp)
                tracker = _tracker(model, module, optimizer, batch, mesh is not None, images, audio)
                with tracker.ignoring_sharding_propagation():
                    cats = measure_step(module, optimizer, batch, tracker, steps=1, amp=amp)
    finally:
        if own_group:
            dist.destroy_process_group()
    b = to_breakdown(cats, hw, strategy)
    phase = tracker.peak_phase()
    return Candidate(strategy, b.total <= hw.gpu_mem_gib, b, 0.0, "simulated",
                     f"fake-tensor step, peak in the {phase} pass", peak_phase=phase)


def _tracker(model: torch.nn.Module, module: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: tuple,
             sharded: bool, images: bool, audio: bool) -> Any:
    """The memory tracker of the step: FSDP's for a sharded strategy, else the plain one, with the loss's tensors
    filed as logits and a batch's pixels and audio features as activations."""
    body = decoder_and_head(model)[0]
    if sharded:
        tracker = StepFSDPMemTracker(body, module, optimizer)
        tracker.track_inputs(batch[:1])
    else:
        tracker = StepMemTracker(body)
        tracker.track_external(module, optimizer)
        skip_frozen_grad_hooks(tracker, module)
    if images:
        tracker.track_as_activation(batch[3])
    if audio:
        tracker.track_as_activation(batch[5])
    return tracker


def simulate_plan(plan: Plan, shape: ModelShape, w: Workload, hw: Hardware, source: str | None) -> Plan:
    """Replace the analytic candidates that can be simulated with measured ones; re-derive the recommendation.
    A strategy the hardware cannot run (a multi-rank one on one device) keeps its analytic row: measuring it would
    only repeat `single`'s step. The workload as the rank runs it, as the analytic rows had it (`sdpa` is eager for
    a class without SDPA)."""
    w = planned_workload(shape, w)
    if why := unsimulated(w, shape):  # every row stays analytic, and the plan says why
        log.warning("--simulate cannot build %s: the plan stays analytic", why)
        return dataclasses.replace(plan, notes=[*plan.notes, f"--simulate cannot build {why}: every row stays "
                                                             "analytic"])
    cands = []
    for c in plan.candidates:
        if get_strategy(c.strategy).simulable and c.applies:
            t0 = time.perf_counter()
            log.info("simulating %s: one training step of %s on fake tensors ...", c.strategy, shape.id)
            cands.append(simulate(shape, w, hw, c.strategy, source))
            log.info("simulated %s in %.0f s", c.strategy, time.perf_counter() - t0)
        else:
            cands.append(estimate(shape, w, hw, c.strategy))
    return with_candidates(plan, cands)
