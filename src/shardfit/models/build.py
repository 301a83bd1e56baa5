"""THE construction path of a model: `build_model` is what `train` (real weights), `check` and `plan --simulate`
(weightless, on the meta device) call, so all three see the same modules, dtypes and trainable parameters.

Order: resolve where the weights are -> the transformers config (Qwen-Omni's speech output switched off) -> the
weights' dtype -> load (or build on meta) -> keep the text model (Omni's thinker) -> drop, adapt and freeze what the
config says. Never a device map under a distributed launch: every rank loads the whole model on the CPU and the
parallel stage moves or shards it. Only `model_parallel` (one process) places modules with a device map.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

import torch
import transformers
import transformers.modeling_gguf_pytorch_utils as gguf_loading
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError

from shardfit import method as methods
from shardfit.config import Config
from shardfit.config.support import qlora_compute_dtype, require_method_support
from shardfit.data.tokenize import ensure_chat_template
from shardfit.dtypes import DTYPES
from shardfit.errors import RemoteCodeRefused, UserError
from shardfit.models import prequantized
from shardfit.models.adapters import setup_trainable
from shardfit.models.anatomy import FLAGGED_MEDIA_TYPES, MEDIA_FLAG, text_model
from shardfit.models.experts import use_experts
from shardfit.models.gguf_cache import cached_part, lookup, weights_part
from shardfit.models.gguf_cache import enabled as cache_enabled
from shardfit.models.placement import balanced_device_map
from shardfit.models.processor import vision_model_type
from shardfit.models.quantize import quantize_blocks
from shardfit.models.quantize_experts import quantize_experts_under_lora
from shardfit.models.source import ModelSource, resolve_model
from shardfit.plan.attention_layout import text_of
from shardfit.plan.config_shape import require_sane_sizes
from shardfit.plan.sdpa_classes import SDPA_FIX, runs_eager, sdpa_refusal
from shardfit.plan.shapes import catalog, hf_config, resolve_shape
from shardfit.strategy import Strategy
from shardfit.strategy import get as get_strategy

log = logging.getLogger(__name__)



def weight_dtype(cfg: Config) -> torch.dtype:
    """The dtype weights are loaded in: a full fine-tune keeps fp32 master weights (autocast or FSDP's mixed
    precision computes in low precision); LoRA and freeze keep the frozen weights in the compute dtype."""
    return torch.float32 if methods.get(cfg.method).trains_base or cfg.precision == "fp32" else DTYPES[cfg.precision]


def _through_cache(source: ModelSource, part: str, convert: Any) -> ModelSource:
    """`source` as a plain HF folder from the model cache when its weights are GGUF (converted on first use), else
    `source` itself. The name stays the source's, so messages and records name the GGUF model."""
    try:
        folder = cached_part(source, part, convert)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - a user's GGUF file: any failure to convert it is bad input
        raise UserError(f"'model': cannot read {source.name} ({source.gguf_file}): {type(e).__name__}: {e}. Check "
                        "that the file is a complete GGUF model (re-download it).") from None
    return source if folder is None else ModelSource(str(folder), None, source.name)


def gguf_meta(source: ModelSource, trust_remote_code: bool = False) -> ModelSource:
    """A GGUF source's config and tokenizer as a folder from the model cache: parsing them from the GGUF file takes
    seconds on every load, reading the saved files a fraction of one."""
    def convert(out: Any) -> None:
        kwargs = {"gguf_file": source.gguf_file, "trust_remote_code": trust_remote_code}
        AutoConfig.from_pretrained(source.folder, **kwargs).save_pretrained(out)
        AutoTokenizer.from_pretrained(source.folder, **kwargs).save_pretrained(out)

    return _through_cache(source, "meta", convert) if source.gguf_file else source


def gguf_weights(source: ModelSource, config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> ModelSource:
    """A GGUF source's weights de-quantized to `dtype` as a safetensors folder from the model cache, one folder per
    dtype, so a load from it gives bitwise what loading the GGUF file in that dtype gives."""
    def convert(out: Any) -> None:
        model = model_class(config).from_pretrained(source.folder, gguf_file=source.gguf_file, config=config,
                                                    dtype=dtype, trust_remote_code=trust_remote_code)
        _drop_gguf_marks(model)
        model.save_pretrained(out, safe_serialization=True)

    return _through_cache(source, weights_part(dtype), convert) if source.gguf_file else source


def weights_cached(cfg: Config) -> bool | None:
    """Whether `build_model(cfg, weights=True)` will read the config's GGUF model from the model cache (True) or
    convert it first (False); None when the weights are not GGUF or the cache is off. For the run's record."""
    source = resolve_model(cfg.model)
    if not source.gguf_file or not cache_enabled():
        return None
    return lookup(source, weights_part(weight_dtype(cfg))) is not None


def _drop_gguf_marks(model: nn.Module) -> None:
    """GGUF weights are de-quantized on load; drop the quantizer marks so saving and merging write plain weights."""
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def refuse_remote_code(name: str) -> RemoteCodeRefused:
    """The error for the model `name` that needs its own code, worded for a config (train and check read one)."""
    err = RemoteCodeRefused(f"'model': {name} ships its own model code; set trust_remote_code: true if you "
                            "trust it.")
    err.source_name = name
    return err


def needs_remote_code(error: Exception) -> bool:
    """Whether transformers refused to load because the files need trust_remote_code."""
    return "trust_remote_code" in str(error)


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model source, with a chat template and a pad token guaranteed."""
    source = gguf_meta(source, trust_remote_code)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        tok = AutoTokenizer.from_pretrained(source.folder, **kwargs)
    except Exception as e:  # noqa: BLE001 - a user's files: any failure to read them is bad input
        if not trust_remote_code and needs_remote_code(e):
            raise refuse_remote_code(source.name) from None
        raise UserError(f"'model': cannot load a tokenizer from {source.name}: {type(e).__name__}: {e}") from None
    if len(tok) == 0:
        raise UserError(f"'model': {source.name} has no tokenizer files (tokenizer.json, or vocab and merges); "
                        "copy the base model's tokenizer files into the folder.")
    ensure_chat_template(tok)
    return tok


def model_config(cfg: Config, source: ModelSource, *, weights: bool) -> Any:
    """The transformers config of the config's model. Without weights, a hub id that is not a local folder comes
    from the Hugging Face cache or, failing that, from the bundled catalog's shape (no network either way)."""
    source = gguf_meta(source, cfg.trust_remote_code)
    kwargs: dict[str, Any] = {"trust_remote_code": cfg.trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if weights or source.is_local:
        config = _auto_config(source, kwargs)
    else:
        try:
            config = AutoConfig.from_pretrained(cfg.model, local_files_only=True, **kwargs)
        except ValueError as e:
            if needs_remote_code(e):
                raise refuse_remote_code(source.name) from None
            raise UserError(f"'model': cannot read the config of {source.name}: {e}") from None
        except OSError:
            if cfg.model not in catalog():
                raise UserError(f"'model': {cfg.model} is neither a local folder, in the Hugging Face cache, nor in "
                                "shardfit's catalog (`shardfit plan --list-models`); download it first "
                                "(huggingface-cli download) or point at its folder.") from None
            config = hf_config(resolve_shape(cfg.model))
    require_sane_sizes(f"'model': {source.name}", config.to_dict())  # as the planner reads it: exit 2, not an OOM
    return without_speech(config, source.name)


def without_speech(config: Any, name: str) -> Any:
    """Qwen-Omni's config with speech output off: the talker and token2wav only produce speech. Training never runs
    them, and left in a ZeRO-3/FSDP model they stay unplaced on the CPU ("cuda:0 and cpu"); so they are not built,
    whether the config comes from a folder, the cache or the catalog (a simulation builds from the catalog's)."""
    if getattr(config, "enable_audio_output", False):
        config.enable_audio_output = False
        log.info("%s: talker and token2wav not loaded (they only produce speech)", name)
    return config


def _auto_config(source: ModelSource, kwargs: dict[str, Any]) -> Any:
    try:
        return AutoConfig.from_pretrained(source.folder, **kwargs)
    except ValueError as e:
        if needs_remote_code(e):
            raise refuse_remote_code(source.name) from None
        raise UserError(f"'model': cannot read the config of {source.name}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a user's files: any failure to read them is bad input
        raise UserError(f"'model': cannot read the config of {source.name}: {type(e).__name__}: {e}") from None


def model_class(config: Any) -> Any:
    """The class that loads a config: a causal LM, or a composite whose text model shardfit trains (Qwen-Omni)."""
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM  # its error message names the unsupported config


def use_attention(model: nn.Module, name: str) -> None:
    """Switch a built model's attention kernel to `name` (`auto`: leave it as loaded); the weights are untouched,
    transformers reads the choice at every forward."""
    if name != "auto" and getattr(model.config, "_attn_implementation", name) != name:
        model.set_attn_implementation(name)


def attention_kernels(allow_cudnn: bool) -> contextlib.AbstractContextManager:
    """The scope of a run's forwards and backwards: PyTorch's own SDPA kernel choice, or (`allow_cudnn` false)
    every SDPA kernel but cuDNN's (resolve/defaults.py `cudnn_attention_allowed` says why). The flags are
    process-wide; the scope puts them back when the run ends."""
    if allow_cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _attention(cfg: Config, config: Any) -> dict[str, Any]:
    """transformers' `attn_implementation` for `config`'s model: the config's, none for `auto` (transformers'
    default), eager where the language model's class has no SDPA (plan/sdpa_classes.py `runs_eager`, the planner's
    rule too); `sdpa` refused where the model's class or its text model's has none (transformers' load would)."""
    model_type = getattr(config, "model_type", None)  # the key AutoModelForCausalLM maps to the class it loads
    text = text_of(config)
    text_type = getattr(text, "model_type", None) if text is not config else None
    if cfg.attn_implementation == "sdpa" and (refusal := sdpa_refusal(
            model_type, "'attn_implementation: sdpa'", SDPA_FIX, text_type=text_type)) is not None:
        raise UserError(refusal)
    if runs_eager(model_type, cfg.attn_implementation, text_type=text_type) and text_type is None:
        return {"attn_implementation": "eager"}
    # a composite's sub-models each check their own class under `auto` (transformers 5): an eager text model loads
    # eager by itself, while its vision tower keeps SDPA
    return {} if cfg.attn_implementation == "auto" else {"attn_implementation": cfg.attn_implementation}


def meta_model(config: Any, dtype: torch.dtype, cfg: Config) -> nn.Module:
    """A weightless model of the config's class on the meta device: structure and dtypes, no memory."""
    cls, attention = model_class(config), _attention(cfg, config)
    try:
        with torch.device("meta"):
            if cls is AutoModelForCausalLM:
                return cls.from_config(config, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **attention)
            return cls._from_config(config, dtype=dtype, **attention)
    except Exception as e:  # noqa: BLE001 - a config that cannot build a model (zero heads, ...) is bad input
        if isinstance(e, ImportError) and attention.get("attn_implementation") == "flash_attention_2":
            # the key asked for a package this Python lacks: the config itself is good
            raise UserError("'attn_implementation': flash_attention_2 needs the flash-attn package, which this "
                            "Python cannot import (a CUDA build: pip install flash-attn on the machine that trains); "
                            "or set attn_implementation: auto (SDPA).") from None
        raise UserError(f"'model': {cfg.model}: its config.json does not build a model: {type(e).__name__}: {e}") \
            from None


@contextlib.contextmanager
def _no_gguf_bar() -> Iterator[None]:
    """transformers' GGUF loader draws its per-tensor bar with tqdm directly, past the switch above: silence that
    one bar while loading (our own bars are untouched)."""
    bar = getattr(gguf_loading, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_loading.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_loading.tqdm = bar


def _load_weights(config: Any, source: ModelSource, dtype: torch.dtype, cfg: Config, s: Strategy) -> nn.Module:
    source = gguf_weights(source, config, dtype, cfg.trust_remote_code)
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": cfg.trust_remote_code, **_attention(cfg, config)}
    kwargs.update(prequantized.load_kwargs(config, source.name))
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if s.engine == "device_map":
        # A dict is the user's own placement; anything else gets shardfit's balanced split (head, norm and
        # embeddings together on the first GPU), which accelerate's "auto" does not guarantee.
        kwargs["device_map"] = cfg.device_map if isinstance(cfg.device_map, dict) else \
            balanced_device_map(meta_model(config, dtype, cfg))
    try:
        return model_class(config).from_pretrained(source.folder, config=config, **kwargs)
    except Exception as e:  # noqa: BLE001 - truncated or foreign weight files fail in many ways: all bad input
        msg = str(e).lower()
        if cfg.attn_implementation != "auto" and ("attention" in msg or "attn" in msg):
            raise UserError(f"'attn_implementation: {cfg.attn_implementation}': cannot load {source.name}: {e} "
                            "Use attn_implementation: auto (transformers' default, SDPA) or sdpa.") from None
        raise UserError(f"'model': cannot load {source.name}: {type(e).__name__}: {e}. Check that the weight files "
                        "are complete (re-download them) and match config.json.") from None


def require_per_layer_support(config: Any, dtype: torch.dtype, cfg: Config) -> None:
    """A UserError naming `per_layer_config` where the config sets a per-layer value its model's class reads only
    globally (a Mistral with one block's own `sliding_window`): transformers builds such a model, and its first
    forward raises. Probed with a two-token forward on the meta device, only for a config with per-layer values;
    any other failure of the probe is left to the run (the meta device runs no data-dependent op)."""
    text = text_of(config)
    if not getattr(text, "per_layer_attributes", None):
        return
    try:
        model = text_model(meta_model(config, dtype, cfg))
    except UserError:  # a config that builds no model: the build itself says so, as it does without per-layer values
        return
    try:
        with torch.device("meta"), torch.no_grad():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long))
    except AmbiguousGlobalPerLayerAttributeError as e:
        key = str(e).split("'")[1] if str(e).count("'") >= 2 else "a per-layer attribute"
        overrides = text.to_dict().get("per_layer_config") or {}
        blocks = [i for i, block in overrides.items() if isinstance(block, dict) and key in block]
        where = f"per_layer_config.{blocks[0]}.{key}" if blocks else f"per_layer_config (its {key})"
        raise UserError(f"'model': {cfg.model}: config.json sets {where} for one block, but transformers' "
                        f"{type(model).__name__} reads {key} for the whole model and cannot run it. Remove the "
                        f"per-layer value (set {key} at the top level) or use a family whose class reads it per "
                        "block.") from None
    except Exception:  # noqa: BLE001, S110 - the probe looks for one error only; the run meets any other itself
        pass


def build_model(cfg: Config, strategy: Strategy | str, *, weights: bool, config: Any = None,
                experts: str | None = None) -> nn.Module:
    """The config's model with its trainable setup (LoRA, freeze, dropped and frozen modules; QLoRA's decoder
    weights stored in 4 bits before the adapters wrap them).

    `weights`: load the real weights (training), or build on the meta device (check, simulate). `config`: a
    transformers config to build from instead of the one the config's model names (a simulation of a catalog
    shape). `experts`: how a mixture's routed experts compute, as the run resolved it for its device
    (resolve/defaults.py `resolve_experts`); None keeps transformers' default."""
    require_method_support(cfg)
    s = get_strategy(strategy) if isinstance(strategy, str) else strategy
    dtype = weight_dtype(cfg)
    source: ModelSource | None = None
    transformers.logging.set_verbosity_error()
    if config is None or weights:
        source = resolve_model(cfg.model)
        config = config if config is not None else model_config(cfg, source, weights=weights)
    config = without_speech(config, cfg.model)
    # Read before loading: transformers drops the quantization settings from a config it dequantized.
    published = prequantized.of(config)
    if published is not None and not published.dequantizable:
        raise UserError(prequantized.refusal(cfg.model, published))
    require_per_layer_support(config, dtype, cfg)
    if weights:
        log.info("loading %s (%s weights)", source.name, str(dtype).removeprefix("torch."))
        if published is not None:
            log.info("%s: %s dequantized to %s as they load", source.name, published.stores,
                     next(n for n, d in DTYPES.items() if d == dtype))
        # transformers' per-tensor bars (GGUF de-quantizing, "Loading weights") are noise in a training log.
        transformers.utils.logging.disable_progress_bar()
        try:
            with _no_gguf_bar():
                model = _load_weights(config, source, dtype, cfg, s)
        finally:
            transformers.utils.logging.enable_progress_bar()
        if source.gguf_file:
            _drop_gguf_marks(model)  # read from the GGUF file itself (cache off or unwritable) it carries them
    else:
        model = meta_model(config, dtype, cfg)
    # Qwen-Omni: the thinker (its own PreTrainedModel, with embeddings and head) is what trains; the adapter and
    # any merged model are the thinker's, loadable by Qwen2_5OmniThinkerForConditionalGeneration.
    model = text_model(model)
    model.config.use_cache = False
    if published is not None:
        setattr(model, prequantized.FLAG, published)
    use_experts(model, experts)  # before LoRA: peft's wrappers leave the experts' forward to the implementation
    if source is not None and vision_model_type(source, cfg.trust_remote_code) in FLAGGED_MEDIA_TYPES:
        # Its folder has the processor files: the thinker trains on images and audio, running both towers (Gemma 3:
        # the model on images, running its vision tower).
        setattr(model, MEDIA_FLAG, True)
    quantized = methods.get(cfg.method).quantized
    if quantized:
        quantize_blocks(model, DTYPES[qlora_compute_dtype(cfg)], experts=False)
    torch.manual_seed(cfg.seed)  # adapters start the same whatever ran before
    model = setup_trainable(model, cfg)
    if quantized:  # a mixture's expert stacks: after the adapters wrap them (models/quantize_experts.py)
        quantize_experts_under_lora(model, DTYPES[qlora_compute_dtype(cfg)])
    return model
