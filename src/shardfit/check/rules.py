"""Preflight rules. Each takes what it needs, returns findings, and fixes in place only where `fix=True`
and the fix cannot change what the user meant (moving a buffer, freezing a module the forward never runs)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from shardfit.check.findings import Finding
from shardfit.config import Config
from shardfit.models.adapters import drop_modules
from shardfit.models.anatomy import (
    audio_units,
    base_model,
    decoder_and_head,
    trains_images,
    transformer_blocks,
    vision_body,
    vision_units,
)
from shardfit.models.checkpointing import enable_hf_checkpointing, old_gc_api
from shardfit.models.quantize import is_bnb_quantized, is_nf4
from shardfit.parallel.parallelize import fsdp_units
from shardfit.plan.plan import Plan
from shardfit.plan.quant import shard_problem
from shardfit.resolve.fits import oom_refusal
from shardfit.strategy import Strategy

# Submodules that only serve generation outputs other than text; text fine-tuning never runs them.
GENERATION_ONLY = ("talker", "token2wav")


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    try:
        return decoder_and_head(model)
    except (TypeError, AttributeError):
        return None


def unused_module_rules(model: nn.Module, s: Strategy, fix: bool) -> list[Finding]:
    """Top-level modules outside the text forward (decoder + head): talkers, vocoders, vision/audio towers.

    shardfit's training forward runs exactly the decoder and the head, so everything else is unused by
    construction. Generation-only modules are dropped; others are frozen (a DDP rank would otherwise wait for
    gradients that never come, and ZeRO-3 would leave them unplaced on the CPU)."""
    pair = _decoder_and_head(model)
    if pair is None:
        return []
    body = vision_body(model) if trains_images(model) else None
    # A VL model's forward runs its vision tower, a media-trained Omni thinker's its audio tower too.
    towers = [t for t in (getattr(body, "visual", None), getattr(body, "vision_tower", None),
                          getattr(body, "multi_modal_projector", None), getattr(body, "audio_tower", None))
              if t is not None]
    parts = [*pair, *towers]
    used = {id(m) for part in parts for m in part.modules()}
    used_params = {id(p) for m in parts for p in m.parameters()}
    out = []
    for name, module in list(_outer_modules(model, used)):
        params = [p for p in module.parameters() if id(p) not in used_params]
        if not params:
            continue
        n = sum(p.numel() for p in params)
        trainable = any(p.requires_grad for p in params)
        leaf = name.rpartition(".")[2]
        if leaf in GENERATION_ONLY:
            msg = (f"{name} ({n / 1e6:.1f}M params) only produces speech; the text forward never runs it, and under "
                   f"{s.name} it would stay unplaced (the 'cuda:0 and cpu' error of ZeRO-3 runs)")
            if fix:
                drop_modules(model, [name])
            out.append(Finding("unused_module", "warning", name, msg, f"drop_modules: [{leaf}]", fix))
            continue
        severity = "error" if trainable and s.engine == "ddp" else "warning" if trainable else "info"
        msg = f"{name} ({n / 1e6:.1f}M params) is not used by the text training forward"
        if trainable:
            msg += "; as trainable parameters they get no gradient (DDP: 'Expected to have finished reduction')"
            if fix:
                for p in params:
                    p.requires_grad_(False)
        out.append(Finding("unused_module", severity, name, msg, f"freeze_modules: [{leaf}] or drop_modules: [{leaf}]",
                           fix and trainable))
    return out


def _outer_modules(model: nn.Module, used: set[int]) -> Iterable[tuple[str, nn.Module]]:
    """Maximal submodules that neither are nor contain a used module."""
    def walk(prefix: str, module: nn.Module) -> Iterable[tuple[str, nn.Module]]:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if id(child) in used:
                continue
            if any(id(m) in used for m in child.modules()):
                yield from walk(full, child)
            else:
                yield full, child
    return walk("", model)


def placement_rules(model: nn.Module, device: torch.device, fix: bool) -> list[Finding]:
    """Parameters on the meta device (never loaded), and parameters/buffers on another device than the rank's."""
    out = []
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        out.append(Finding("meta_parameters", "error", meta[0],
                           f"{len(meta)} parameters are on the meta device (never loaded), e.g. {meta[0]}",
                           "load without low_cpu_mem_usage/device_map offload; check missing keys in the checkpoint"))
    for kind, items in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        stray = [(n, t) for n, t in items if not t.is_meta and t.device != device]
        if not stray:
            continue
        devs = sorted({str(t.device) for _, t in stray})
        if fix:
            for _, t in stray:
                t.data = t.data.to(device)
        rule = "buffer_on_wrong_device" if kind == "buffer" else "parameter_on_wrong_device"
        out.append(Finding(rule, "error", stray[0][0],
                           f"{len(stray)} {kind}s on {', '.join(devs)} instead of {device}, e.g. {stray[0][0]} "
                           f"(rotary caches and position ids created on the CPU cause 'cuda:0 and cpu' errors)",
                           f"move them to {device} after loading", fix))
    return out


def quantized_placement_rules(model: nn.Module, device: torch.device, world: int) -> list[Finding]:
    """A 4/8-bit model placed over several devices, or (bitsandbytes) on another device than this rank's.
    bitsandbytes weights are placed at load time and cannot move afterwards, so nothing can fix it here; accelerate
    makes the same check from the same `hf_device_map` ("You can't train a model that has been loaded in 8-bit or
    4-bit precision on a different device"). QLoRA's NF4 weights move with the model, but a layer's codes, scales
    and LoRA adapter must sit on the device that computes it: they are never split over devices either."""
    fix = "load each rank's copy on its own GPU: device_map={'': int(os.environ['LOCAL_RANK'])}, and never call .to()"
    nf4_devices = {str(p.device) for p in model.parameters() if is_nf4(p)}
    if len(nf4_devices) > 1:
        return [Finding("quantized_model_device", "error", "model",
                        f"the 4-bit (NF4) weights are spread over {', '.join(sorted(nf4_devices))}; QLoRA trains them "
                        "on one device per rank", "strategy: zero3 with --nproc N (each rank holds 1/N of them)")]
    base = base_model(model)
    if not (getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)):
        return []
    placed = {str(torch.device(d) if not isinstance(d, int) else torch.device("cuda", d))
              for d in (getattr(base, "hf_device_map", None) or {}).values()}
    if not placed:
        placed = {str(p.device) for p in base.parameters()}
    if len(placed) > 1:
        return [Finding("quantized_model_device", "error", "model",
                        f"the 4/8-bit model is spread over {', '.join(sorted(placed))}; quantized weights cannot be "
                        f"trained split over devices{' under a launcher' if world > 1 else ''}", fix)]
    if placed != {str(device)}:
        return [Finding("quantized_model_device", "error", "model",
                        f"the 4/8-bit model was loaded on {placed.pop()}, but this rank computes on {device}", fix)]
    return []


def qlora_shard_rules(model: nn.Module, s: Strategy, world: int) -> list[Finding]:
    """Under a sharded strategy every NF4 weight is split into `world` row shards, which torchao supports only along
    whole groups of 4-bit blocks and their scales (otherwise its split asserts halfway through sharding)."""
    if not s.sharded or world <= 1:
        return []
    bad = []
    for name, p in model.named_parameters():
        if is_nf4(p):
            problem = shard_problem(p.shape[0], p.shape[1], world)
            if problem:
                bad.append((name, problem))
    if not bad:
        return []
    name, problem = bad[0]
    return [Finding("qlora_shard_layout", "error", name,
                    f"{len(bad)} 4-bit weights cannot be sharded over {world} ranks, e.g. {name}: {problem}",
                    "a world size that divides the weights' rows (e.g. --nproc 2, 4 or 8), or strategy: ddp")]


def fsdp_unit_rules(model: nn.Module, s: Strategy, precision: str, fix: bool) -> list[Finding]:
    """Per FSDP unit (each decoder block, then the rest): dtypes, integer storage, tied weights across units."""
    if not s.sharded:
        return []
    n_blocks = len(transformer_blocks(model))
    unit_modules = fsdp_units(model)
    in_unit = {id(p): _unit_name(i, n_blocks, model) for i, u in enumerate(unit_modules) for p in u.parameters()}
    units: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        units.setdefault(in_unit.get(id(p), "root"), []).append((name, p))
    out = []
    for unit, params in units.items():
        # NF4 weights all-gather their packed codes and scales through torchao's FSDP2 hooks, whatever the dtype
        # they dequantize to: they are not part of the unit's one float dtype (and casting one would dequantize it).
        dense = [(n, p) for n, p in params if not is_nf4(p)]
        dtypes = {p.dtype for _, p in dense if p.is_floating_point() and not is_bnb_quantized(p)}
        bnb = [(n, p) for n, p in dense if is_bnb_quantized(p)]
        ints = [n for n, p in dense if not p.is_floating_point() and not is_bnb_quantized(p)]
        if bnb:
            storage = sorted({str(p.dtype) for _, p in bnb})
            mixed = set(storage) - {str(d) for d in dtypes}
            why = (f"their storage {', '.join(storage)} is mixed with {', '.join(sorted(map(str, dtypes)))} in one "
                   "unit (FSDP1: 'Must flatten tensors with uniform dtype')") if mixed and dtypes else \
                f"their storage is {', '.join(storage)}"
            out.append(Finding("fsdp_quantized_storage", "error", f"{unit}: {bnb[0][0]}",
                               f"{len(bnb)} bitsandbytes 4/8-bit weights in {unit}: {why}; FSDP2 shards their packed "
                               "data but not the quant_state that decodes it, so ranks compute with wrong scales",
                               "method: qlora on the unquantized base model: shardfit stores it in NF4 (torchao), "
                               "which FSDP2 shards with its scales; other FSDP1/DeepSpeed stacks need "
                               "bnb_4bit_quant_storage set to the dtype of the rest of the model"))
        if ints:
            out.append(Finding("fsdp_quantized_storage", "error", f"{unit}: {ints[0]}",
                               f"{len(ints)} parameters in {unit} have integer storage (quantized weights as uint8); "
                               f"FSDP shards float tensors of one dtype",
                               "method: qlora on the unquantized base model (NF4 weights that FSDP2 shards)"))
        if len(dtypes) > 1 and precision == "fp32":
            if fix:
                for _, p in dense:
                    if p.is_floating_point() and not is_bnb_quantized(p):
                        p.data = p.data.float()
            out.append(Finding("fsdp_mixed_dtype", "error", unit, f"{unit} mixes {sorted(map(str, dtypes))}",
                               "one dtype per unit: fp32 everywhere with precision fp32", fix))
    mixed = [u for u, params in units.items() if len({p.requires_grad for _, p in params}) > 1]
    if mixed:
        out.append(Finding("fsdp_mixed_requires_grad", "info", f"{len(mixed)} units ({mixed[0]}, ...)",
                           "FSDP units mix frozen and trainable parameters (LoRA); FSDP1 flat parameters reject "
                           "this ('Must flatten tensors with uniform requires_grad')",
                           "nothing to do: FSDP2 fully_shard shards per parameter"))
    # Tied weights: one tensor reachable from two modules must sit in one unit.
    owners: dict[int, set[str]] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), set()).add(f"{mname}.{pname}")
    for names in owners.values():
        if len(names) > 1:
            units_of = {_unit_of(n, unit_modules, n_blocks, model) for n in names}
            if len(units_of) > 1:
                out.append(Finding("fsdp_tied_weights_split", "error", ", ".join(sorted(names)),
                                   f"tied weights {sorted(names)} fall into different FSDP units {sorted(units_of)}",
                                   "keep embeddings and head in the root unit (shardfit's wrapping does)"))
    return out


def _unit_name(i: int, n_blocks: int, model: nn.Module) -> str:
    n_vision = len(vision_units(model))  # a VL model's vision blocks and merger come first (fsdp_units)
    if i < n_vision:
        return f"vision unit {i}"
    i -= n_vision
    n_audio = len(audio_units(model))  # then an audio tower's layers (Qwen2.5-Omni)
    if i < n_audio:
        return f"audio unit {i}"
    i -= n_audio
    return f"block {i}" if i < n_blocks else "input embedding"


def _unit_of(param_name: str, units: list[nn.Module], n_blocks: int, model: nn.Module) -> str:
    module_name = param_name.rpartition(".")[0]
    module = model.get_submodule(module_name) if module_name else model
    for i, u in enumerate(units):
        if any(m is module for m in u.modules()):
            return _unit_name(i, n_blocks, model)
    return "root"


def grad_ckpt_rules(model: nn.Module, cfg: Config) -> list[Finding]:
    if cfg.grad_ckpt == "none" or not old_gc_api(model):
        return []
    return [Finding("gc_remote_code_old_api", "warning", type(model).__name__,
                    "the model's remote code overrides the old _set_gradient_checkpointing(module, value) API; "
                    "transformers' gradient_checkpointing_enable() fails on it ('got an unexpected keyword argument "
                    "enable')", "shardfit wraps the decoder blocks with torch checkpointing itself", True)]


def _reentrant_blocks(model: nn.Module) -> list[str]:
    """Modules whose transformers checkpointing is on and reentrant (its default when no kwargs are given)."""
    out = []
    for name, m in model.named_modules():
        fn = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) and fn is not None:
            if getattr(fn, "keywords", {}).get("use_reentrant", True):
                out.append(name or type(m).__name__)
    return out


def reentrant_ckpt_rules(model: nn.Module, s: Strategy, fix: bool) -> list[Finding]:
    """Reentrant checkpointing breaks DDP (a parameter is marked ready twice) and, with frozen embeddings (LoRA),
    gets inputs that do not require grad, so the adapters inside get no gradient at all."""
    where = _reentrant_blocks(model)
    if not where:
        return []
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    frozen_inputs = emb is not None and not any(p.requires_grad for p in emb.parameters()) \
        and getattr(model, "_require_grads_hook", None) is None
    if fix:
        enable_hf_checkpointing(model)
    out = []
    remedy = "non-reentrant checkpointing: activation_checkpointing_enable(activation_checkpointing_kwargs=" \
              "{'use_reentrant': False}) (gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) before " \
              "transformers 5)"
    if s.engine == "ddp":
        out.append(Finding("gc_ddp_reentrant", "error", where[0],
                           "reentrant gradient checkpointing under DDP: backward re-runs each block and DDP sees "
                           "its parameters marked ready twice ('Expected to mark a variable ready only once')",
                           remedy, fix))
    if frozen_inputs:
        out.append(Finding("gc_inputs_no_grad", "error", where[0],
                           "reentrant gradient checkpointing with frozen input embeddings: the blocks' inputs do not "
                           "require grad, so nothing inside them (LoRA adapters) gets a gradient ('None of the inputs "
                           "have requires_grad=True')", remedy + ", or model.enable_input_require_grads()", fix))
    return out


def precision_rules(model: nn.Module, cfg: Config, fix: bool) -> list[Finding]:
    """fp16 trainable weights with fp16 mixed precision: the gradient scaler cannot unscale fp16 gradients."""
    bad = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
    if cfg.precision != "fp16" or not bad:
        return []
    if fix:
        for _, p in bad:
            p.data = p.data.float()
    return [Finding("fp16_trainable_weights", "error", bad[0][0],
                    f"{len(bad)} trainable parameters are fp16; fp16 mixed precision would fail with 'Attempting to "
                    f"unscale FP16 gradients'", "keep trainable parameters in fp32 (or use bf16)", fix)]


def visible_gpu_rules(s: Strategy, world: int) -> list[Finding]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n > 1 and world == 1 and s.engine != "device_map":
        return [Finding("several_gpus_one_process", "info", "launch",
                        f"{n} GPUs are visible to one process; shardfit uses one of them (never nn.DataParallel)",
                        "shardfit train --nproc N to use them all, or strategy: model_parallel")]
    return []


def plan_rules(plan: Plan | None, s: Strategy, force: bool) -> list[Finding]:
    """The plan's verdict on the strategy: resolve/fits.py `oom_refusal`, the refusal the rank raises before
    loading in the same words. Predicted out-of-memory is an error (a warning with `force`)."""
    refusal = oom_refusal(plan, s.name)
    if refusal is None:
        return []
    return [Finding("predicted_oom", "warning" if force else "error", refusal.where, refusal.message, refusal.fix)]
