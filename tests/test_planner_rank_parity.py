"""The planner's facts of a config.json against the rank's facts of the same config built by transformers: the
sequence-parallel and pipeline rules refuse the same models for the same reasons on both sides (per-layer heads,
vision-language towers of every family, not only Qwen-VL's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from shardfit.cli.main import main
from shardfit.errors import UserError
from shardfit.plan.config_shape import shape_from_config
from shardfit.plan.shapes import resolve_shape
from shardfit.resolve import pipeline as pipelines
from shardfit.resolve import sequence

# dots.3's text model (Dots3NoteForCausalLM), cut small: its sliding-window blocks keep 4 of the 8 heads, stated
# by the published swa_* keys that its class folds into per_layer_config; its attention reads each block's own.
SLIDING = dict(num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, head_dim=32,
               qk_nope_head_dim=16, v_head_dim=16)
DOTS3_TEXT = dict(model_type="dots3_note_text", num_hidden_layers=4, hidden_size=256, intermediate_size=128,
                  moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2, num_attention_heads=8,
                  num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                  v_head_dim=16, head_dim=32, index_n_heads=2, index_head_dim=16, index_topk=8, vocab_size=1000,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2, **{f"swa_{k}": v for k, v in SLIDING.items()})
QWEN3 = dict(model_type="qwen3", num_hidden_layers=8, hidden_size=1024, intermediate_size=3072,
             num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)

# Mistral Small 3.1's config.json as published (mistral3: a Pixtral tower beside a Mistral decoder), its
# decoder cut to 4 blocks.
MISTRAL3 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {"head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "intermediate_size": 32768,
                    "max_position_embeddings": 131072, "model_type": "mistral", "num_attention_heads": 32,
                    "num_hidden_layers": 4, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                    "rope_theta": 1000000000.0, "sliding_window": None, "vocab_size": 131072},
    "vision_config": {"head_dim": 64, "hidden_act": "gelu", "hidden_size": 1024, "image_size": 1540,
                      "intermediate_size": 4096, "model_type": "pixtral", "num_attention_heads": 16,
                      "num_channels": 3, "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
    "vision_feature_layer": -1,
}


def _written(cfg: dict[str, Any], tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture, *flags: str) -> tuple[int, str]:
    """`shardfit plan` of the folder on 16 GPUs: its exit code and what it wrote to stderr."""
    capsys.readouterr()
    try:
        code = main(["plan", "--model", str(tmp_path), "--gpus", "16x80GB", "--seq", "1024", *flags])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def _verdicts(facts_sp: sequence.DecoderFacts, facts_pp: pipelines.StageFacts) -> tuple[str, str]:
    """The sequence-parallel (2 ranks) and pipeline (2 stages) refusals of the facts ('' where allowed)."""
    out = []
    for check in (lambda: sequence.check_model(2, facts_sp, "m"),
                  lambda: pipelines.check_model(2, facts_pp, "m", "lora")):
        try:
            check()
            out.append("")
        except UserError as e:
            out.append(str(e))
    return out[0], out[1]


def test_per_layer_heads_are_read_as_the_rank_reads_them(tmp_path: Path) -> None:
    """A family whose class builds each block's heads from per_layer_config (built here on the meta device: 8, 8,
    4, 4 heads): the planner reads the blocks' 16 and 8 as the rank reads its built model's config, and both name
    the heads every block divides by. (The earlier fixture, a Qwen3 with one block's heads pruned, cannot be built:
    Qwen3's attention reads the global count, which transformers refuses to give for a per-layer attribute.)"""
    folder = _written(DOTS3_TEXT, tmp_path)
    built = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(built)
    assert [block.self_attn.num_heads for block in model.model.layers] == [8, 8, 4, 4]
    shape = resolve_shape(str(folder))
    planner, rank = sequence.facts_of_shape(shape), sequence.facts_of_config(model.config)
    assert shape.block_heads == (8, 4) and shape.heads == 8
    assert (planner.heads, planner.block_heads) == (rank.heads, rank.block_heads) == (4, (8, 4))
    assert _verdicts(planner, pipelines.facts_of_shape(shape)) == \
        _verdicts(rank, pipelines.facts_of_config(model.config))


def test_the_heads_message_names_every_blocks_count() -> None:
    """Blocks of different head counts: the refusal names them all and the count they share."""
    facts = sequence.DecoderFacts(heads=8, kv_heads=2, experts=False, multimodal=False, block_heads=(16, 8))
    with pytest.raises(UserError, match=r"blocks' attention heads \(16 and 8\) share only 8, which 16 ranks"):
        sequence.check_model(16, facts, "m")
    sequence.check_model(8, facts, "m")


def test_blocks_of_one_head_count_keep_the_plain_message() -> None:
    """A config whose blocks agree names one count."""
    shape = shape_from_config(QWEN3, "m")
    assert shape.block_heads == ()
    with pytest.raises(UserError, match=r"m has 16 attention heads, which 32 ranks"):
        sequence.check_model(32, sequence.facts_of_shape(shape), "m")


@pytest.mark.parametrize("flag", ["--sequence-parallel", "--pipeline-parallel"])
def test_a_published_mistral3_config_is_refused_before_loading(flag: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    """Mistral 3's Pixtral tower has no `depth` key (Qwen-VL's), so the planner saw a text model and planned a split
    or a pipeline that the rank refused after loading. Now the planner refuses it for the tower, as the rank does."""
    folder = _written(MISTRAL3, tmp_path)
    shape = resolve_shape(str(folder))
    assert shape.multimodal and shape.other_tower and shape.vision is None
    built = AutoConfig.from_pretrained(folder)
    planner = _verdicts(sequence.facts_of_shape(shape), pipelines.facts_of_shape(shape))
    rank = _verdicts(sequence.facts_of_config(built), pipelines.facts_of_config(built))
    assert planner == rank and all("vision or audio tower" in v for v in planner)
    if flag == "--sequence-parallel":  # a pipeline the plan names as not run; a split is refused outright
        code, err = _plan(folder, capsys, flag, "2")
        assert code == 2 and "vision or audio tower" in err, err


# Vision-language families this transformers builds from their class defaults: LLaVA-style (a CLIP or SigLIP
# tower and a projector), Mistral 3, InternVL and Molmo 2 (image sizes as [height, width]), Idefics 3, PaliGemma,
# GLM-4V (a `depth` tower that is not Qwen's), Gemma 3 (soft tokens), and the Qwen-VL towers the rules split.
# (Qwen3.5's tower is not loaded by the rank: tests/test_loaded_config.py.)
VL_TYPES = ["mistral3", "llava", "llava_next", "llava_onevision", "internvl", "molmo2", "idefics3", "paligemma",
            "glm4v", "gemma3", "aya_vision", "qwen2_vl", "qwen2_5_vl"]


@pytest.mark.parametrize("model_type", VL_TYPES)
def test_vision_language_defaults_read_alike_on_both_sides(model_type: str) -> None:
    """Each family's default config: the planner's refusals (from its config.json's dict) are the rank's (from the
    built class). Before, the planner missed every tower but Qwen-VL's and Gemma 3's, planned GLM-4V's rows split
    and cut Gemma 3 into stages, and crashed on InternVL's and Molmo 2's [height, width] image sizes."""
    built = CONFIG_MAPPING[model_type]()
    shape = shape_from_config(built.to_dict(), model_type)
    planner = _verdicts(sequence.facts_of_shape(shape), pipelines.facts_of_shape(shape))
    rank = _verdicts(sequence.facts_of_config(built), pipelines.facts_of_config(built))
    assert planner == rank
    assert shape.multimodal == sequence.facts_of_config(built).multimodal is True


def test_a_vision_language_head_is_tied_as_its_top_level_config_says(tmp_path: Path) -> None:
    """transformers ties a multimodal model's head by its top-level tie_word_embeddings, whatever its text_config
    says. Mistral 3's file leaves the key out (its class ties by default) and its text_config says untied: the
    planner read it untied (671M parameters too many); Qwen3-VL-MoE's class is untied at the top and tied in its
    text_config: the rank read it tied. Now both read the top level, and the decoder counts the built one's."""
    folder = _written(MISTRAL3, tmp_path)
    built = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(built)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    shape = resolve_shape(str(folder))
    assert shape.tied == pipelines.facts_of_config(built).tied == tied is True
    decoder = sum(p.numel() for n, p in model.named_parameters() if "language_model" in n or "lm_head" in n)
    assert shape.params() - shape.extra_params == decoder
    untied_top = CONFIG_MAPPING["qwen3_vl_moe"]()
    assert not pipelines.facts_of_config(untied_top).tied
    assert not shape_from_config(untied_top.to_dict(), "qwen3_vl_moe").tied


def test_a_block_of_zero_heads_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A per_layer_config block of 0 heads: the block-head reading dropped it and `plan` exited 0; now exit 2
    names the block's key."""
    folder = _written({**QWEN3, "per_layer_config": {"3": {"num_attention_heads": 0}}}, tmp_path)
    code, err = _plan(folder, capsys)
    assert code == 2 and "per_layer_config[3].num_attention_heads is 0" in err and "Traceback" not in err
