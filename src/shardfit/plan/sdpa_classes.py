"""Which transformers causal-LM classes attend with SDPA, release by release: the one table the rank
(models/build.py `_attention`) and the planner (plan/config_shape.py, plan/shapes.py) read under the installed
transformers, and the readers of other tools' jobs (foreign/common.py `default_attention`, foreign/read.py) under
the job's `--transformers`. Torch-free: the installed release is read from the package's metadata.

transformers attends with torch's SDPA by default from 4.36 for a class whose modeling file sets
`_supports_sdpa = True`. A class that sets it False (or never sets it: PreTrainedModel's default is False) loads
eager attention when the job names none, and refuses `attn_implementation="sdpa"` at load with a ValueError, in
every release. Eager attention keeps each head's fp32 scores for the backward: memory that grows with the square
of the row.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any

Release = tuple[int, int]
# Before 4.36 no class attended with SDPA by default.
SDPA_DEFAULT_SINCE: Release = (4, 36)
# The releases [first, until) whose class (the one AutoModelForCausalLM maps a model_type to: a config's own, and a
# composite's text config's, whose class picks its decoder's kernel) has no SDPA: `first` None, every release of the
# class before `until`; `until` None, every release since, the newest included. Deprecated classes (mega, qdqbert, ...)
# never set `_supports_sdpa`, in models/ or models/deprecated/. Read per class (`_supports_sdpa`, through its bases) in
# the modeling files of the published wheels, the last patch of each minor release from 4.36.2 to 5.23.0 and the first
# patch of each release where one changed. Gemma 2 had SDPA from its first release (4.42) to 5.20 and says False from
# 5.21 (VaultGemma too); GOT-OCR2 from 4.49 to 4.53. gpt-oss (4.55), the Mamba and xLSTM classes, DeepSeek-V4 (5.8),
# MiMo-V2-Flash (5.13), the Granite SWA classes (5.15), HY-V4 (5.17), Flint (5.21) and Inkling2 (5.23) never had it.
NO_SDPA: dict[str, tuple[Release | None, Release | None]] = {
    # never had SDPA
    "big_bird": (None, None), "bigbird_pegasus": (None, None), "bloom": (None, None), "codegen": (None, None),
    "cpmant": (None, None), "deepseek_v4": (None, None), "falcon_mamba": (None, None), "flint": (None, None),
    "git": (None, None), "gpt_neo": (None, None), "gpt_neox_japanese": (None, None), "gpt_oss": (None, None),
    "gptj": (None, None), "granite_swa": (None, None), "granitemoe_swa": (None, None), "hy_v4": (None, None),
    "inkling2_text": (None, None), "mamba": (None, None), "mamba2": (None, None), "megatron-bert": (None, None),
    "mimo_v2_flash": (None, None), "mpt": (None, None), "mvp": (None, None), "openai-gpt": (None, None),
    "prophetnet": (None, None), "reformer": (None, None), "rembert": (None, None), "roformer": (None, None),
    "rwkv": (None, None), "trocr": (None, None), "xglm": (None, None), "xlm": (None, None), "xlnet": (None, None),
    "xlstm": (None, None),
    # moved to models/deprecated/ (4.42; open-llama and transfo-xl earlier) without ever setting _supports_sdpa
    "mega": (None, None), "open-llama": (None, None), "qdqbert": (None, None), "speech_to_text_2": (None, None),
    "transfo-xl": (None, None), "xlm-prophetnet": (None, None),
    # had SDPA, then lost it
    "gemma2": ((5, 21), None), "vaultgemma": ((5, 21), None), "got_ocr2": ((4, 54), None),
    # gained SDPA later (Mistral and Mixtral: transformers PR 28133, after 4.36.0)
    "mistral": (None, (4, 37)), "mixtral": (None, (4, 37)), "stablelm": (None, (4, 39)), "phi": (None, (4, 39)),
    "musicgen": (None, (4, 40)), "musicgen_melody": (None, (4, 40)), "bert": (None, (4, 41)),
    "gpt_neox": (None, (4, 42)), "gpt2": (None, (4, 42)), "gpt-sw3": (None, (4, 42)), "phi3": (None, (4, 45)),
    "biogpt": (None, (4, 45)), "camembert": (None, (4, 45)), "mbart": (None, (4, 45)),
    "roberta": (None, (4, 45)), "xlm-roberta": (None, (4, 45)), "xlm-roberta-xl": (None, (4, 45)),
    "opt": (None, (4, 46)), "fuyu": (None, (4, 52)), "persimmon": (None, (4, 53)), "blenderbot": (None, (4, 53)),
    "blenderbot-small": (None, (4, 53)), "marian": (None, (4, 53)), "pegasus": (None, (4, 53)),
    "plbart": (None, (4, 53)), "modernbert-decoder": (None, (4, 56)), "bert-generation": (None, (5, 0)),
    "data2vec-text": (None, (5, 0)), "electra": (None, (5, 0)), "ernie": (None, (5, 0)),
    "roberta-prelayernorm": (None, (5, 0)), "roc_bert": (None, (5, 0)), "xmod": (None, (5, 0)),
    "zamba": (None, (5, 10)), "ctrl": (None, (5, 13)), "recurrent_gemma": (None, (5, 13)),
}

# The eager setting shardfit's own config takes for such a class (and `auto`, which loads it eager).
SDPA_FIX = "attn_implementation: eager (or auto, which runs eager for it)"


def installed_transformers() -> str:
    """The installed transformers' version, read without importing it; a current release where none is installed
    (what a job would run on a machine set up today)."""
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return "5.0"


def release_of(version: str | None) -> Release:
    """(major, minor) of a transformers version; None: the installed one. An unreadable version counts as a
    current release."""
    m = re.match(r"(\d+)\.(\d+)", installed_transformers() if version is None else version)
    return (int(m.group(1)), int(m.group(2))) if m else (5, 0)


def without_sdpa(model_type: Any, version: str | None = None) -> tuple[Release | None, Release | None] | None:
    """The releases (NO_SDPA's window) around transformers `version` (None: the installed one) in which a
    `model_type` model's class has no SDPA; None where it has SDPA there. Before 4.36, `(None, (4, 36))` for a
    class the table does not hold."""
    window = class_without_sdpa(model_type, version)
    if window is not None:
        return window
    return (None, SDPA_DEFAULT_SINCE) if release_of(version) < SDPA_DEFAULT_SINCE else None


def class_without_sdpa(model_type: Any, version: str | None = None) -> tuple[Release | None, Release | None] | None:
    """NO_SDPA's window around transformers `version` (None: the installed one) for a `model_type` class, None
    where the table holds none there: the class alone, whatever a release before 4.36 defaulted every class to
    (a tool's own SDPA patch, such as axolotl's `sdp_attention` on Llama, ran there)."""
    at, window = release_of(version), NO_SDPA.get(model_type)
    if window is not None and (window[0] is None or at >= window[0]) and (window[1] is None or at < window[1]):
        return window
    return None


def runs_eager(model_type: Any, attention: str, version: str | None = None, text_type: Any = None) -> bool:
    """Whether a `model_type` model asked for `attention` (transformers' `attn_implementation`, `auto` included, or
    the planner's `sdpa`) under transformers `version` (None: the installed one) runs eager attention in its
    language model: the one rule the rank (models/build.py) and the planner follow. `text_type`: the model_type of
    a composite's text config -- each sub-model checks its own class for SDPA (transformers 5), so the decoder of a
    PaliGemma 2 (a Gemma 2 text model) runs eager and GOT-OCR2's Qwen2 SDPA. `auto` before 4.36 is eager for
    every class; `sdpa` there is a tool's own patch, eager only where the class table says so."""
    key = text_type or model_type
    if attention == "auto":
        return without_sdpa(key, version) is not None
    return attention == "sdpa" and class_without_sdpa(key, version) is not None


def sdpa_refusal(model_type: Any, key: str, fix: str, version: str | None = None,
                 text_type: Any = None) -> str | None:
    """What a job that names SDPA (`key`) for a `model_type` model (`text_type`: its text config's model_type)
    says where transformers `version` (None: the installed one) refuses it -- its class or its text model's class
    has no SDPA: a ValueError at load -- with `fix`, the eager setting; None where both have SDPA, and before 4.36,
    whose transformers took no `attn_implementation` (a tool's own SDPA patch ran there)."""
    if release_of(version) < SDPA_DEFAULT_SINCE:
        return None
    lacking = [t for t in dict.fromkeys((model_type, text_type or model_type)) if without_sdpa(t, version)]
    if not lacking:
        return None
    at = ".".join(map(str, release_of(version)))
    return (f"{key}: the {lacking[0]} model's class has no SDPA attention (transformers {at}), so loading it with "
            f"sdpa fails. Use {fix}.")
