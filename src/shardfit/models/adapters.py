"""What trains: LoRA adapters (peft), the whole model, or chosen modules (freeze)."""

from __future__ import annotations

import contextlib
import fnmatch
import re
import warnings

import torch

from shardfit import method as methods
from shardfit.config import Config, LoraSettings
from shardfit.dtypes import DTYPES
from shardfit.errors import UserError
from shardfit.models.anatomy import decoder_and_head, projector_name, projector_of, vision_body, vision_tower_of
from shardfit.models.experts import (
    adapter_names_as_written,
    expert_target_parameters,
    lora_targets,
    moe_parts,
    router_targets,
)

# A vision-language model's vision tower and Qwen2.5-Omni's audio tower, by module path: what LoRA leaves alone
# while the tower is frozen.
VISION_TOWER = r"(.*\.)?(visual|vision_tower)(\..*)?"
AUDIO_TOWER = r"(.*\.)?audio_tower(\..*)?"


def apply_lora(model: torch.nn.Module, lora: LoraSettings, *, exclude: str | None = None,
               modules_to_save: list[str] | None = None) -> torch.nn.Module:
    """Wrap `model` with peft LoRA adapters, kept in `lora.dtype` whatever the base dtype (fp32 by default; bf16
    adapters compute without autocast, their fp32 masters held by the optimizer, train/optim.py). `exclude`: a
    regular expression of module paths that get no adapter; `modules_to_save`: modules trained whole and saved
    in the adapter (a vision-language model's merger under train_projector), stored like the adapters."""
    # Here, not at the top: importing peft pulls in bitsandbytes and torchao (~3 s of start-up on a small CPU),
    # which a full or freeze fine-tune never uses.
    from peft import LoraConfig, get_peft_model

    targets: str | list[str] = lora.targets
    parameters = None
    parts = moe_parts(model)
    fused_out = mamba_out_projs(model)
    if targets == "all-linear" and (parts.any or fused_out):
        targets = [name for name in lora_targets(model, parts) if name not in fused_out]
    if parts.any:  # a mixture: shardfit names the linear layers and the expert weights; never a router
        routers = "|".join(re.escape(r) for r in parts.routers)
        exclude = f"({exclude})|({routers})" if exclude and routers else (exclude or routers or None)
        parameters = expert_target_parameters(parts) if lora.experts else None
        if parameters and lora.dropout > 0:
            # peft's adapters on the fused expert weights (target_parameters) have no dropout and refuse one; said
            # here, since peft's own message would read as a wrong lora.targets
            raise UserError(f"'lora.dropout': {lora.dropout} with lora.experts true: this mixture of experts keeps "
                            "its routed experts as fused weights, whose adapters (peft's target_parameters) take "
                            "no dropout. Set lora.dropout: 0, or lora.experts: false to adapt the attention and "
                            "shared experts only.")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                        task_type="CAUSAL_LM", bias="none", exclude_modules=exclude,
                        modules_to_save=modules_to_save, target_parameters=parameters)
    try:
        with warnings.catch_warnings():
            # peft reads transformers' deprecated is_gradient_checkpointing alias; the notice is not the user's.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # A weightless model (check, simulate) gets weightless adapters: peft would draw every adapter's
            # random init in CPU memory (~5 s and 0.6 GB for a 72B) and then move it to the meta device.
            weightless = all(p.is_meta for p in model.parameters())
            with adapter_names_as_written(model), torch.device("meta") if weightless else contextlib.nullcontext():
                peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except (ValueError, TypeError, re.error) as e:  # peft reads a string of targets as a regular expression
        routers = " Routers never get adapters (one changes which experts each token reaches)." \
            if parts.any and router_targets(lora.targets, parts) else ""
        raise UserError(f"'lora.targets': {targets!r} does not select the model's linear layers ({e}).{routers} "
                        "Use all-linear, or a list of module names such as [q_proj, v_proj].") from None
    dtype = DTYPES[lora.dtype]
    for p in peft_model.parameters():
        if p.requires_grad and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return peft_model


def mamba_out_projs(model: torch.nn.Module) -> set[str]:
    """The module paths of every Mamba mixer's out_proj, which all-linear LoRA leaves alone: the fused training
    kernel (mamba_ssm) reads out_proj's base weight itself, so an adapter there would never train, and peft
    refuses one for the families it knows. A Mamba mixer is told by its state size (Gated DeltaNet has none)."""
    return {f"{name}.out_proj" if name else "out_proj" for name, m in model.named_modules()
            if hasattr(m, "ssm_state_size") and isinstance(getattr(m, "out_proj", None), torch.nn.Linear)}


def skip_adapter_input_casts(model: torch.nn.Module) -> int:
    """Stop peft casting each adapter's input to the adapter's fp32 dtype; returns how many layers it touched.

    Only for a forward that runs under autocast: there every linear casts its input to the autocast dtype, so
    peft's bf16 -> fp32 copy of the input is cast straight back to bf16 (a lossless round trip), which made those
    copies the largest kernel outside the matmuls of a bf16 LoRA step on a CPU (bench/profile_step.py). Without
    autocast the fp32 adapters need the cast, so callers outside an autocast region must not use this."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    n = 0
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False
            n += 1
    return n


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatch(name, pattern) or re.search(rf"(^|\.){re.escape(pattern)}(\.|$)", name) is not None


def apply_freeze(model: torch.nn.Module, trainable: list[str]) -> torch.nn.Module:
    """Train only parameters whose name matches a pattern (glob, or a dotted module path such as `layers.11`)."""
    hit = 0
    for name, p in model.named_parameters():
        on = any(_matches(name, pat) for pat in trainable)
        p.requires_grad_(on)
        if on:
            hit += 1
            if p.dtype != torch.float32:
                p.data = p.data.float()
    if hit == 0:
        names = [n for n, _ in model.named_parameters()][:6]
        raise UserError(f"'freeze_trainable': no parameter matches {trainable}. Parameter names look like: "
                        f"{', '.join(names)} ...")
    return model


def freeze_modules(model: torch.nn.Module, patterns: list[str]) -> int:
    """Freeze parameters under the named modules (e.g. a vision tower); returns how many were frozen."""
    n = 0
    for name, p in model.named_parameters():
        if any(_matches(name, pat) for pat in patterns):
            p.requires_grad_(False)
            n += 1
    return n


def drop_modules(model: torch.nn.Module, names: list[str]) -> list[str]:
    """Remove submodules the text training forward never uses (e.g. an audio talker); returns what was removed.
    A name that matches nothing is fine (Qwen-Omni's talker is not even built for text training); a module that
    holds the decoder or the head is refused."""
    needed = _needed_modules(model)
    removed = []
    for name in names:
        for full, module in list(model.named_modules()):
            if full == name or full.endswith("." + name):
                if any(id(m) in needed for m in module.modules()):
                    raise UserError(f"'drop_modules': {name} ({full}) holds the decoder or the output head the "
                                    "training runs; drop only modules outside them (e.g. talker, token2wav).")
                parent_name, _, child = full.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                if child in parent._modules:
                    del parent._modules[child]
                    setattr(parent, child, None)
                    removed.append(full)
    return removed


def _needed_modules(model: torch.nn.Module) -> set[int]:
    """Every module of the decoder and the head (a module that is, holds or lies inside them cannot be dropped)."""
    try:
        decoder, head = decoder_and_head(model)
    except TypeError:
        return set()
    return {id(m) for part in (decoder, head) for m in part.modules()}


def setup_trainable(model: torch.nn.Module, cfg: Config) -> torch.nn.Module:
    """Apply the config's method; returns the model whose trainable parameters the optimizer updates."""
    if cfg.drop_modules:
        drop_modules(model, cfg.drop_modules)
    body = vision_body(model)
    if methods.get(cfg.method).adapters:
        if body is None:
            model = apply_lora(model, cfg.lora)
        else:
            frozen = [t for t, on in ((VISION_TOWER, cfg.freeze_vision_tower), (AUDIO_TOWER, cfg.freeze_audio_tower))
                      if on]
            model = apply_lora(model, cfg.lora, exclude="|".join(f"({t})" for t in frozen) or None,
                               modules_to_save=[projector_name(model)] if cfg.train_projector else None)
    elif cfg.method == "freeze":
        model = apply_freeze(model, cfg.freeze_trainable)
    else:
        for p in model.parameters():
            p.requires_grad_(True)
    if body is not None and not methods.get(cfg.method).adapters:
        _vision_trainable(body, cfg.freeze_vision_tower, cfg.train_projector)
    tower = getattr(body, "audio_tower", None) if body is not None else None
    if tower is not None:
        _audio_trainable(tower, cfg.freeze_audio_tower and not methods.get(cfg.method).adapters)
    if cfg.freeze_modules:
        freeze_modules(model, cfg.freeze_modules)
    return model


def _vision_trainable(body: torch.nn.Module, freeze_tower: bool, train_projector: bool) -> None:
    """Full and freeze fine-tunes of a vision-language model: the tower frozen (freeze_vision_tower) and the merger
    (projector) trained (train_projector), each as a whole, so no FSDP unit mixes trainable and frozen weights."""
    merger = projector_of(body)
    merger_params = {id(p) for p in merger.parameters()} if merger is not None else set()
    params = {id(p): p for m in (vision_tower_of(body), merger) if m is not None for p in m.parameters()}
    for p in params.values():
        if id(p) in merger_params and train_projector:
            p.requires_grad_(True)
            if p.dtype != torch.float32:
                p.data = p.data.float()
        elif freeze_tower:
            p.requires_grad_(False)


def _audio_trainable(tower: torch.nn.Module, freeze: bool) -> None:
    """Qwen2.5-Omni's audio tower: frozen whole under freeze_audio_tower (full and freeze fine-tunes; LoRA already
    left it without adapters). Its begin/end-of-audio embedding serves only the talker's speech path, never the
    thinker's forward, so it never trains (DDP would wait for its gradient)."""
    for p in tower.parameters():
        if freeze:
            p.requires_grad_(False)
    unused = getattr(tower, "audio_bos_eos_token", None)
    if unused is not None:
        for p in unused.parameters():
            p.requires_grad_(False)
