"""Final outputs: `adapter/` (PEFT format) or `model/` (a Hugging Face folder), and `shardfit export --merge`."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from tqdm.auto import tqdm

from shardfit import method as methods
from shardfit.config import Config
from shardfit.config.support import qlora_compute_dtype
from shardfit.errors import UserError
from shardfit.models.build import DTYPES, build_model, load_tokenizer
from shardfit.models.experts import adapter_names_as_written
from shardfit.models.quantize import as_qlora_trained
from shardfit.models.source import resolve_model
from shardfit.parallel.env import DistEnv

# The weights file of a peft adapter folder.
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if hasattr(module, "module") and hasattr(module, "no_sync") else module


def gather_full_state(wrapped: nn.Module, trainable_only: bool) -> dict[str, torch.Tensor]:
    """The full (unsharded) state of the inner model on CPU; a collective, so every rank must call it."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    sd = get_model_state_dict(_unwrap(wrapped), options=opts)
    # The loss module holds the model as `.model`; the model's own names are what save_pretrained expects.
    return {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}


def save_final(wrapped: nn.Module, model: nn.Module, tokenizer: Any, run_dir: Path, env: DistEnv,
               is_lora: bool, base_name: str | None = None, stages: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `adapter/` (LoRA) or `model/` (full, freeze) on rank 0 after gathering shards on all ranks.

    An adapter names its base as the config did (`base_name`: a hub id or a local folder), not the folder the
    weights were read from: for a model bundled as GGUF that folder is not a model `from_pretrained` can load.
    `stages`: a pipeline's stages' state, gathered on rank 0 (train/pipeline.py `gather_stages`): the adapter
    file's entries (LoRA; peft writes only what rank 0's stage holds, so its file is replaced) or the model's."""
    if is_lora and base_name:
        for peft_config in getattr(model, "peft_config", {}).values():
            peft_config.base_model_name_or_path = base_name
    sd = gather_full_state(wrapped, trainable_only=is_lora) if stages is None else {} if is_lora else stages
    if not is_lora:
        sd = _drop_tied_copies(model, sd)
    out = Path(run_dir) / ("adapter" if is_lora else "model")
    if env.is_main:
        out.mkdir(parents=True, exist_ok=True)
        config = getattr(model, "config", None)
        if config is not None:
            config.use_cache = True  # training turns the KV cache off; the saved model is for generation
        with warnings.catch_warnings():
            # GGUF-loaded bases have no config.json beside them; peft's notice about it is noise here.
            warnings.filterwarnings("ignore", message="Could not find a config file")
            # Nor is its attempt to look the hub id up online, which fails offline and changes nothing saved.
            warnings.filterwarnings("ignore", message="Unable to fetch remote file")
            # A pipeline's adapter: the stages' gathered entries, never the rank's own parameters (sharded under
            # zero2/zero3); peft writes adapter_config.json, the weights file is the stages' (below).
            given = stages if is_lora and stages is not None else sd
            model.save_pretrained(str(out), state_dict=given or None, safe_serialization=True)
            if is_lora and stages is not None:
                save_file(stages, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})  # peft's format
        if config is not None:
            config.use_cache = False
        tokenizer.save_pretrained(str(out))
    return out


def _drop_tied_copies(model: nn.Module, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gathered FSDP state dict names a tied weight twice; keep the source, as save_pretrained expects."""
    tied = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None)
    if not isinstance(tied, dict):
        return sd
    for target, source in tied.items():
        if target in sd and source in sd and torch.equal(sd[target], sd[source]):
            del sd[target]
    return sd


def merge_adapter(run_cfg: Config, adapter_dir: Path, out_dir: Path, dtype: torch.dtype, show: bool = False) -> Path:
    """Build the run's base model (as training built it, in fp32), apply the adapter, merge it into the weights,
    and save a plain HF folder with the tokenizer. `show`: a progress bar over those stages.

    A QLoRA adapter learned its update against the 4-bit weights, so it is merged into those, dequantized (the
    weights the run computed with), as the HF QLoRA recipe merges; the result is a plain dense model."""
    bar = tqdm(total=4, desc="export", unit="stage", file=sys.stderr, disable=not show, leave=False)
    try:
        bar.set_postfix_str("base weights")
        base_cfg = dataclasses.replace(run_cfg, method="full", precision="fp32")
        model = build_model(base_cfg, "single", weights=True)
        if methods.get(run_cfg.method).quantized:
            as_qlora_trained(model, DTYPES.get(qlora_compute_dtype(run_cfg), torch.float32))
        bar.update()
        bar.set_postfix_str("adapter")
        from peft import PeftModel  # only a merge reads an adapter back; see models/adapters.py on the import

        try:
            with adapter_names_as_written(model):
                model = PeftModel.from_pretrained(model, str(adapter_dir))
        except Exception as e:  # noqa: BLE001 - a damaged or foreign adapter folder fails in many ways: bad input
            raise UserError(f"{adapter_dir}: not an adapter of this run's model that loads ({type(e).__name__}: "
                            f"{str(e)[:300]}); train again, or restore the run's adapter/.") from None
        bar.update()
        bar.set_postfix_str("merge")
        merged = model.merge_and_unload().to(dtype)
        merged.config.use_cache = True
        bar.update()
        bar.set_postfix_str(f"save to {out_dir}")
        out_dir.mkdir(parents=True, exist_ok=True)
        merged.save_pretrained(str(out_dir), safe_serialization=True)
        load_tokenizer(resolve_model(run_cfg.model), run_cfg.trust_remote_code).save_pretrained(str(out_dir))
        processor = adapter_dir / "preprocessor_config.json"
        if processor.is_file():  # a vision-language run: the image processor goes with the merged model
            shutil.copy(processor, out_dir / processor.name)
        bar.update()
    finally:
        bar.close()
    return out_dir


def export_base(model: str, out_dir: Path, dtype: torch.dtype, trust_remote_code: bool = False,
                precision: str = "fp32") -> Path:
    """Write a model that loads only through shardfit (a GGUF file, a model bundled as GGUF) as a plain Hugging Face
    folder, once: configs can then name that folder, and adapters trained on it name a base anyone can load.
    `precision`: the dtype it is built in (fp32 by default; a run exporting its own base builds it in its compute
    precision, so the end of training never holds an fp32 copy of a large model)."""
    cfg = Config(model=model, method="full", precision=precision, trust_remote_code=trust_remote_code)
    base = build_model(cfg, "single", weights=True).to(dtype)
    base.config.use_cache = True
    out_dir.mkdir(parents=True, exist_ok=True)
    base.save_pretrained(str(out_dir), safe_serialization=True)
    load_tokenizer(resolve_model(model), trust_remote_code).save_pretrained(str(out_dir))
    return out_dir
