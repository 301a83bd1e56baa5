"""Load what a user points at for generation: a run directory (its adapter applied to the base model without
merging, or its full model), a Hugging Face folder or GGUF file or bundled id, optionally with an adapter folder.

Every model is built by `build_model` (the same path as training: GGUF de-quantised, Qwen-Omni's thinker kept),
in fp32, then cast to the compute dtype of the device it runs on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from shardfit import method as methods
from shardfit.config import Config, load_config
from shardfit.config.support import qlora_compute_dtype
from shardfit.data.tokenize import ensure_chat_template
from shardfit.errors import RemoteCodeRefused, UserError
from shardfit.models.build import (
    DTYPES,
    build_model,
    load_tokenizer,
    needs_remote_code,
    refuse_remote_code,
)
from shardfit.models.experts import adapter_names_as_written
from shardfit.models.quantize import as_qlora_trained
from shardfit.models.source import resolve_model
from shardfit.parallel.env import resolve_precision

log = logging.getLogger("shardfit")


@dataclass
class Target:
    """Where the weights are: `model` (what build_model loads) and `adapter` (a PEFT folder applied on top)."""

    model: str
    adapter: Path | None
    tokenizer_dir: Path | None  # the tuned run's saved tokenizer (its chat template), when there is one
    run_cfg: Config | None  # the run's config when the target is a run directory (trust_remote_code always off)
    label: str
    remote_code_config: Path | None = None  # the run's config.yaml, when it said trust_remote_code: true

    @property
    def base_model(self) -> str:
        """The model before fine-tuning: the run's base (full fine-tunes too), else the model itself."""
        return self.run_cfg.model if self.run_cfg is not None else self.model


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: Any
    target: Target
    device: torch.device
    dtype: torch.dtype

    @property
    def has_adapter(self) -> bool:
        return isinstance(self.model, PeftModel)


def resolve_target(path: str, adapter: str | None = None) -> Target:
    """What `shardfit chat|eval PATH [--adapter DIR]` points at. A run directory gives its `model/` (a full
    fine-tune, or a merged export) before its `adapter/`; an adapter folder names its base in adapter_config.json."""
    p = Path(path).expanduser()
    extra = Path(adapter).expanduser() if adapter else None
    if extra is not None and not (extra / "adapter_config.json").is_file():
        raise UserError(f"--adapter {adapter}: no adapter_config.json there; give a PEFT adapter folder "
                        "(a run's adapter/).")
    if (p / "config.yaml").is_file() and not (p / "config.json").is_file():
        run_cfg = load_config(p / "config.yaml", check_files=False)
        asked = p / "config.yaml" if run_cfg.trust_remote_code else None
        # A run directory is files anyone can hand you: only --trust-remote-code on the command line lets a
        # model folder's Python run, never the run's own config.yaml.
        run_cfg = dataclasses.replace(run_cfg, trust_remote_code=False)
        if extra is None and (p / "model" / "config.json").is_file():
            return Target(str(p / "model"), None, p / "model", run_cfg, f"{p} (model/)", asked)
        use = extra or p / "adapter"
        if (use / "adapter_config.json").is_file():
            return Target(run_cfg.model, use, use, run_cfg, f"{p} ({use.name}/ on {run_cfg.model})", asked)
        raise UserError(f"{p} has no adapter/ or model/ yet (is the run still training?); train it to the end, "
                        "or point at a checkpoint's exported folder.")
    if (p / "adapter_config.json").is_file() and not (p / "config.json").is_file():
        base = _adapter_base(p / "adapter_config.json")
        if not base:
            raise UserError(f"{p}/adapter_config.json names no base model; pass the base and --adapter {p}.")
        return Target(base, p, p, None, f"{p} (adapter on {base})")
    return Target(path, extra, extra, None, path + (f" + {extra}" if extra else ""))


def _adapter_base(path: Path) -> str | None:
    """The base model an adapter_config.json names (None when it names none); a file that is not one is a
    UserError."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UserError(f"{path}: not a readable adapter_config.json ({type(e).__name__}: {e}).") from None
    base = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    return base if isinstance(base, str) else None


def pick_device(name: str = "auto") -> torch.device:
    """`auto`: the first GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N.") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is visible here; use --device cpu.")
    return device


def compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype weights generate in: `auto` is bf16 where the device computes it fast, else fp16 (GPU) or fp32."""
    return DTYPES[resolve_precision(precision, device.type)]


def _build(model: str, trust_remote_code: bool, run_cfg: Config | None) -> torch.nn.Module:
    base = run_cfg if run_cfg is not None else Config(model=model)
    cfg = dataclasses.replace(base, model=model, method="full", precision="fp32", freeze_modules=[],
                              trust_remote_code=trust_remote_code)  # the command line's word only
    model_ = build_model(cfg, "single", weights=True)
    if methods.get(base.method).quantized and run_cfg is not None and model == run_cfg.model:
        # The run's adapter learned against its 4-bit weights: apply it to those, dequantized (as export merges).
        as_qlora_trained(model_, DTYPES.get(qlora_compute_dtype(run_cfg), torch.float32))
    model_.requires_grad_(False)
    return model_


def _tokenizer(target: Target, trust_remote_code: bool) -> Any:
    if target.tokenizer_dir is not None and (target.tokenizer_dir / "tokenizer_config.json").is_file():
        try:
            tok = AutoTokenizer.from_pretrained(str(target.tokenizer_dir), trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - a run's saved files: any failure to read them is bad input
            if not trust_remote_code and needs_remote_code(e):
                raise refuse_remote_code(str(target.tokenizer_dir)) from None
            raise UserError(f"{target.tokenizer_dir}: cannot load its tokenizer: {type(e).__name__}: {e}") from None
        ensure_chat_template(tok)
        return tok
    return load_tokenizer(resolve_model(target.model), trust_remote_code)


def load_for_inference(target: Target, *, device: torch.device, precision: str = "auto", base: bool = False,
                       trust_remote_code: bool = False, show: bool = True) -> Loaded:
    """The target's model in eval mode on `device` with its tokenizer. `base`: the model before fine-tuning
    (the run's base model; an adapter left off)."""
    steps = ["tokenizer", "weights"] + (["adapter"] if target.adapter and not base else []) + ["to device"]
    bar = tqdm(total=len(steps), desc="load", unit="stage", file=sys.stderr, disable=not show, leave=False)
    try:
        return _load(target, bar, device, precision, base, trust_remote_code)
    except RemoteCodeRefused as e:
        raise e.for_command_line(target.remote_code_config) from None
    finally:
        bar.close()


def _load(target: Target, bar: Any, device: torch.device, precision: str, base: bool,
          trust_remote_code: bool) -> Loaded:
    """The stages of load_for_inference, each shown on `bar`."""
    bar.set_postfix_str("tokenizer")
    tok = _tokenizer(target, trust_remote_code)
    bar.update()
    bar.set_postfix_str("weights")
    model_id = target.base_model if base else target.model
    model = _build(model_id, trust_remote_code, target.run_cfg)
    bar.update()
    if target.adapter and not base:
        bar.set_postfix_str("adapter")
        try:
            with adapter_names_as_written(model):
                model = PeftModel.from_pretrained(model, str(target.adapter), is_trainable=False)
        except Exception as e:  # noqa: BLE001 - a damaged or foreign adapter folder fails in many ways: bad input
            raise UserError(f"{target.adapter}: not an adapter of {target.base_model} that loads "
                            f"({type(e).__name__}: {str(e)[:300]}); train again, or restore the run's adapter/ "
                            "(a truncated adapter_model.safetensors is the usual cause).") from None
        bar.update()
    dtype = compute_dtype(precision, device)
    bar.set_postfix_str(f"{device} {str(dtype).removeprefix('torch.')}")
    model = model.to(device=device, dtype=dtype).eval()
    model.config.use_cache = True
    bar.update()
    return Loaded(model, tok, target, device, dtype)
