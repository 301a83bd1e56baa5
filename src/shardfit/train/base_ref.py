"""The base model an adapter names (adapter_config.json's `base_model_name_or_path`), chosen so that peft's
`AutoPeftModelForCausalLM.from_pretrained(adapter)` can load it, and where that name came from.

A hub id or a local Hugging Face folder is named as the config gave it. A `.gguf` file is not something
`from_pretrained` loads as a base, so an adapter trained on one names instead
- the Hugging Face repository the GGUF's own metadata says it was converted from (`general.source.repo_url`,
  `general.source.url` on huggingface.co, or the older `general.source.huggingface.repository`); the adapter was
  trained against the GGUF's de-quantized weights, which a quantized GGUF only approximates, and the summary says so;
- else the run's `base/` folder, the GGUF's weights as the run computed with them, written as a Hugging Face folder.
The name/parts llama.cpp also writes (`general.organization`, `basename`, `size_label`, `finetune`) do not spell
a repository reliably (SmolLM2's bundled file reads `smollm2-135M-8k-lc100k-mix1-ep2`) and are not used.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from shardfit.models.source import resolve_model

SOURCE_KEYS = ("general.source.repo_url", "general.source.url", "general.source.huggingface.repository")
_HF_URL = re.compile(r"^https?://(?:www\.)?(?:huggingface\.co|hf\.co)/(?!datasets/|spaces/)([\w.-]+/[\w.-]+)")
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
BASE_DIR = "base"  # the run's folder that holds a GGUF base as a Hugging Face folder


@dataclass(frozen=True)
class BaseRef:
    """What an adapter names as its base, and where that came from (summary.json's `base_model`)."""

    name: str
    source: str  # "config" | "gguf metadata <key>" | "exported"
    export_to: Path | None = None  # where the run must write the base (the GGUF's weights) for `name` to load

    def describe(self) -> str:
        if self.source == "config":
            return f"{self.name} (as the config names it)"
        if self.export_to is not None:
            return f"{self.name} (the GGUF's weights written as a Hugging Face folder: the GGUF names no repository)"
        return (f"{self.name} (the repository the GGUF's {self.source.removeprefix('gguf metadata ')} names; the "
                "adapter was trained on the GGUF's de-quantized weights of it)")

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "source": self.source}


def hub_id_in_gguf(path: Path) -> tuple[str, str] | None:
    """(repository id, metadata key) of the Hugging Face repository a GGUF file says it was made from, or None."""
    import gguf  # transformers' GGUF loading needs it too; only read here, for a run trained on a .gguf

    try:
        fields = gguf.GGUFReader(str(path)).fields
    except (OSError, ValueError):
        return None
    for key in SOURCE_KEYS:
        field = fields.get(key)
        if field is None:
            continue
        try:
            value = str(field.contents()).strip()
        except (ValueError, TypeError, IndexError):
            continue
        m = _HF_URL.match(value)
        repo = m.group(1) if m else value if _REPO_ID.match(value) and "://" not in value else None
        if repo:
            return repo.removesuffix(".git"), key
    return None


def base_for_adapter(model: str, run_dir: Path) -> BaseRef:
    """The base an adapter of a run on `model` (the config's value) names; `run_dir` holds `base/` when the GGUF
    names no repository."""
    p = Path(model).expanduser()
    source = resolve_model(model)
    if source.gguf_file is None or not p.exists():  # a hub id (bundled GGUF ones too) or an HF folder
        return BaseRef(str(p.resolve()) if p.exists() else model, "config")
    found = hub_id_in_gguf(Path(source.folder) / source.gguf_file)
    if found is not None:
        return BaseRef(found[0], f"gguf metadata {found[1]}")
    out = (Path(run_dir) / BASE_DIR).resolve()
    return BaseRef(str(out), "exported", export_to=out)
