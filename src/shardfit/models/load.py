"""Load model and tokenizer for training, the way the strategy needs them.

Never with a device map under a distributed launch: each rank loads the whole model on the CPU (or meta) and the
parallel wrapper moves or shards it. `device_map` is honoured only for `model_parallel`.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from shardfit.errors import UserError
from shardfit.models.source import ModelSource, resolve_model

log = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def load_tokenizer(source: ModelSource, trust_remote_code: bool = False) -> Any:
    """The tokenizer of a model source, with a chat template and a pad token guaranteed."""
    from transformers import AutoTokenizer

    from shardfit.data.tokenize import ensure_chat_template

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    try:
        tok = AutoTokenizer.from_pretrained(source.folder, **kwargs)
    except OSError as e:
        raise UserError(f"'model': cannot load a tokenizer from {source.name}: {e}") from None
    ensure_chat_template(tok)
    return tok


def load_model(source: ModelSource, dtype: torch.dtype, trust_remote_code: bool = False,
               device_map: Any = None, attn_implementation: str = "auto") -> torch.nn.Module:
    """A causal LM on the CPU in `dtype` (or placed by `device_map`, model_parallel only), with transformers'
    default attention kernel or the one `attn_implementation` names."""
    import transformers
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    if device_map is not None:
        kwargs["device_map"] = device_map
    transformers.logging.set_verbosity_error()
    try:
        config = AutoConfig.from_pretrained(source.folder, **{k: v for k, v in kwargs.items() if k != "dtype"
                                                               and k != "device_map"})
        if getattr(config, "enable_audio_output", False):
            # Qwen-Omni: the talker and token2wav only produce speech. Text training never runs them, and left
            # in a ZeRO-3/FSDP model they stay unplaced on the CPU ("cuda:0 and cpu"); so they are not built.
            config.enable_audio_output = False
            log.info("%s: talker and token2wav not loaded (text training)", source.name)
        if attn_implementation != "auto":
            kwargs["attn_implementation"] = attn_implementation
        model = model_class(config).from_pretrained(source.folder, config=config, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        msg = str(e).lower()
        if attn_implementation != "auto" and ("attention" in msg or "attn" in msg):
            raise UserError(f"'attn_implementation: {attn_implementation}': cannot load {source.name}: {e} "
                            "Use attn_implementation: auto (transformers' default, SDPA) or sdpa.") from None
        raise UserError(f"'model': cannot load {source.name}: {e}") from None
    if getattr(model, "thinker", None) is not None:
        # Qwen-Omni: text training trains the thinker (its own PreTrainedModel, with embeddings and head); the
        # adapter and any merged model are the thinker's, loadable by Qwen2_5OmniThinkerForConditionalGeneration.
        model = model.thinker
    if source.gguf_file:
        # GGUF weights are de-quantized on load; drop the quantizer marks so saving and merging write plain weights.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
    model.config.use_cache = False
    return model


def model_class(config: Any) -> Any:
    """The class that loads a config: a causal LM, or a composite whose text model shardfit trains (Qwen-Omni)."""
    from transformers import AutoModelForCausalLM

    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return AutoModelForCausalLM  # its error message names the unsupported config


def build_from_config(config: Any, dtype: torch.dtype, trust_remote_code: bool = False) -> torch.nn.Module:
    """A randomly initialised (or, under `torch.device("meta")`, weightless) model of the config's class."""
    from transformers import AutoModelForCausalLM

    cls = model_class(config)
    if cls is AutoModelForCausalLM:
        return cls.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    return cls._from_config(config, dtype=dtype)


def require_method_support(cfg: Any) -> None:
    """Refuse what this build cannot train instead of silently training something else: QLoRA's 4-bit weights
    need bitsandbytes' CUDA kernels, and shardfit's QLoRA loader is not written yet (the planner does model it)."""
    if cfg.method == "qlora":
        from shardfit.errors import UserError

        raise UserError("'method: qlora' cannot be trained by this version of shardfit: 4-bit (NF4) weights need "
                        "bitsandbytes on a CUDA GPU, and the QLoRA loader is not implemented yet. Use 'method: lora' "
                        "(frozen weights in bf16), or plan a QLoRA run with `shardfit plan --method qlora`.")


def load_for_training(cfg: Any, strategy: str = "single") -> tuple[torch.nn.Module, Any]:
    """Model and tokenizer for a config. LoRA/freeze keep frozen weights in the compute dtype to save memory;
    full fine-tuning keeps fp32 master weights (autocast does the low-precision compute)."""
    require_method_support(cfg)
    source = resolve_model(cfg.model)
    tok = load_tokenizer(source, cfg.trust_remote_code)
    dtype = torch.float32 if cfg.method == "full" or cfg.precision == "fp32" else DTYPES[cfg.precision]
    device_map = None
    if strategy == "model_parallel":
        from shardfit.errors import UserError
        from shardfit.models.placement import model_parallel_map

        try:
            device_map = model_parallel_map(source, dtype, cfg.trust_remote_code)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"'strategy: model_parallel': {e}.") from None
    model = load_model(source, dtype, cfg.trust_remote_code, device_map=device_map,
                       attn_implementation=cfg.attn_implementation)
    return model, tok
