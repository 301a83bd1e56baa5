"""The config the rank builds (plan/loaded_config.py) against the model the rank really builds: models/build.py's
class choice, on the meta device, for every composite config this transformers loads as a causal LM."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, MllamaConfig

from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.models.build import meta_model
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.loaded_config import TEXT_ONLY_CAUSAL_TYPES, loads_text_only, rank_config
from shardfit.plan.media import has_tower
from shardfit.plan.shapes import resolve_shape
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve import sequence

RUN = SimpleNamespace(model="m", trust_remote_code=False, attn_implementation="auto")


def _causal_composites() -> list[str]:
    """The model_types whose default config holds a tower and whose class AutoModelForCausalLM maps."""
    types = []
    for model_type, cls in CONFIG_MAPPING.items():
        try:
            cfg = cls()
        except Exception:  # noqa: BLE001 - a class without defaults for every key is not a candidate
            continue
        if type(cfg) in AutoModelForCausalLM._model_mapping and has_tower(cfg):
            types.append(model_type)
    return types


def test_the_text_only_table_is_the_causal_mappings_text_classes() -> None:
    """A composite is loaded text-only exactly where AutoModelForCausalLM maps its config to a class of another
    config (its text config's): a family transformers adds either way fails here until the table says so."""
    text_only = {t for t in _causal_composites()
                 if AutoModelForCausalLM._model_mapping[type(CONFIG_MAPPING[t]())].config_class
                 is not CONFIG_MAPPING[t]}
    assert text_only == set(TEXT_ONLY_CAUSAL_TYPES)
    assert {"gemma3", "phi4_multimodal"} <= set(_causal_composites()) - text_only  # towers the rank loads


def _tied_in_text_config_only(model_type: str) -> tuple[dict[str, Any], Any]:
    """The family's default config.json, its head tied in text_config only, and its config class built from it."""
    d = json.loads(CONFIG_MAPPING[model_type]().to_json_string())
    d.pop("tie_word_embeddings", None)
    d["text_config"]["tie_word_embeddings"] = True
    return d, CONFIG_MAPPING[model_type](**{k: v for k, v in d.items() if k != "model_type"})


# The table's families whose default config builds (Qwen4-Exp's leaves its indexer's sizes unset).
BUILDABLE = [t for t in TEXT_ONLY_CAUSAL_TYPES if t != "qwen4_exp"]


@pytest.mark.parametrize("model_type", BUILDABLE)
def test_a_text_only_load_has_no_tower_and_ties_by_text_config(model_type: str) -> None:
    """The rank's model (models/build.py `meta_model`) holds no tower and ties its head as text_config says (Llama
    3.2 Vision's class: never). Before,
    the planner read the file's top level: a tower (SP and PP refused for it, mllama's allowed by the rank) and an
    untied head (Qwen3.5 and Llama 4 about 1B parameters too many)."""
    d, built = _tied_in_text_config_only(model_type)
    model = meta_model(built, torch.bfloat16, RUN)
    assert not has_tower(model.config) and not has_tower(rank_config(built)) and loads_text_only(model_type)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    shape = shape_from_config(d, model_type)
    assert tied is (model_type != "mllama")  # MllamaForCausalLM never ties
    assert shape.tied is tied and pipelines.facts_of_config(model.config).tied is tied
    assert not shape.multimodal and shape.extra_params == 0
    for planner, rank in ((sequence.facts_of_shape(shape), sequence.facts_of_config(model.config)),
                          (pipelines.facts_of_shape(shape), pipelines.facts_of_config(model.config))):
        assert planner.multimodal is rank.multimodal is False


def _mllama_folder(tmp_path: Path) -> Path:
    """A tiny Llama 3.2 Vision config.json as its checkpoints write it (MllamaForConditionalGeneration)."""
    cfg = MllamaConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, pad_token_id=0, cross_attention_layers=[1]),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1,
                           attention_heads=2, image_size=56, patch_size=14, vision_output_dim=64, max_num_tiles=4))
    cfg.architectures = ["MllamaForConditionalGeneration"]
    cfg.save_pretrained(tmp_path)
    return tmp_path


def _verdict(check: Any) -> str:
    try:
        check()
        return ""
    except UserError as e:
        return str(e)


@pytest.mark.parametrize("flag", ["--sequence-parallel", "--pipeline-parallel"])
def test_llama_3_2_vision_splits_as_the_rank_trains_it(flag: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """The rank loads Llama 3.2 Vision as MllamaForCausalLM (text only) and splits its rows or cuts it into stages;
    the planner refused both for the tower the rank never loads (exit 2). Now the two agree, and the planner counts
    no tower the rank does not build."""
    folder = _mllama_folder(tmp_path)
    shape = resolve_shape(str(folder))
    from transformers import AutoConfig

    model = meta_model(AutoConfig.from_pretrained(folder), torch.float32, RUN)
    assert type(model).__name__ == "MllamaForCausalLM"
    checks = {"--sequence-parallel": (lambda f: sequence.check_model(2, f, "m"), sequence),
              "--pipeline-parallel": (lambda f: pipelines.check_model(2, f, "m", "lora"), pipelines)}
    check, rules = checks[flag]
    assert _verdict(lambda: check(rules.facts_of_shape(shape))) == \
        _verdict(lambda: check(rules.facts_of_config(model.config))) == ""
    # The tower (40k of these 221k parameters) is not counted; left: the cross-attention blocks' gates and norms
    # and the image tokens' 8 embedding rows the planner does not model (546 parameters).
    built = sum(p.numel() for p in model.parameters())
    assert shape.extra_params == 0 and abs(shape.params() - built) < 0.005 * built
    capsys.readouterr()
    try:
        code = main(["plan", "--model", str(folder), "--gpus", "2x80GB", "--seq", "1024", flag, "2"])
    except SystemExit as e:
        code = e.code
    assert code == 0, capsys.readouterr().err
