"""An absurd size in a model's config.json (num_experts: 1e15, a vocabulary of a trillion) is exit 2 naming the
key from plan, check and the model's build, never an out-of-memory error; every real model still reads."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from shardfit.cli.main import main
from shardfit.config import load_config
from shardfit.errors import UserError
from shardfit.models.build import model_config
from shardfit.models.source import resolve_model
from shardfit.plan.config_shape import require_sane_sizes
from shardfit.plan.shapes import catalog, hf_config, resolve_shape
from tests.helpers import write_config

ABSURD = [("num_experts", 10**15), ("num_experts", 1e15), ("vocab_size", 10**12), ("intermediate_size", 10**13),
          ("num_hidden_layers", 10**9)]


def _absurd_model(tmp_path: Path, tiny_llama: Path, key: str, value: object) -> Path:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config[key] = value
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize(("key", "value"), ABSURD, ids=[f"{k}={v}" for k, v in ABSURD])
def test_plan_refuses_an_absurd_size_naming_it(tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture,
                                               key: str, value: object) -> None:
    model = _absurd_model(tmp_path, tiny_llama, key, value)
    assert main(["plan", "--model", str(model), "--gpus", "1x80GB"]) == 2
    err = capsys.readouterr().err
    assert f"config.json's {key} is " in err and "Traceback" not in err, err


def test_check_and_the_build_refuse_it_too(tmp_path: Path, tiny_llama: Path, small_data: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    """The planner swallows a shape it cannot read (the job is then taken to fit), so the build's own read of
    config.json must refuse it: check (a weightless build) and train (the real one) both go through it."""
    model = _absurd_model(tmp_path, tiny_llama, "num_experts", 10**15)
    cfg = write_config(tmp_path / "c.yaml", model=str(model), data=str(small_data), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=1, output_dir=str(tmp_path / "run"))
    with pytest.raises(UserError, match="config.json's num_experts is 1,000,000,000,000,000"):
        model_config(load_config(str(cfg)), resolve_model(str(model)), weights=True)
    assert main(["check", str(cfg)]) == 2
    assert "config.json's num_experts is" in capsys.readouterr().err


def test_every_catalog_model_is_within_the_ceilings() -> None:
    """Real models keep working: Qwen3-Next's 512 experts, Gemma 3's 262k vocabulary, every catalog entry."""
    require_sane_sizes("qwen3-next", {"num_experts": 512, "num_experts_per_tok": 10, "vocab_size": 151936,
                                      "moe_intermediate_size": 512, "hidden_size": 2048, "num_hidden_layers": 48})
    require_sane_sizes("gemma-3", {"text_config": {"vocab_size": 262208, "hidden_size": 5376,
                                                   "intermediate_size": 21504, "num_hidden_layers": 62}})
    entries = catalog()
    assert any(e.get("config", {}).get("n_routed_experts") == 256 for e in entries.values())
    for name in entries:
        require_sane_sizes(name, hf_config(resolve_shape(name)).to_dict())
        if "config" in entries[name]:
            require_sane_sizes(name, entries[name]["config"])


def test_per_modality_expert_lists_and_new_expert_keys_are_refused_by_name() -> None:
    """ERNIE 4.5 VL gives its experts' sizes one per modality ([1536, 512]): refused naming the key (it ended as an
    unexpected TypeError, exit 1); ERNIE's own shared-expert key has a ceiling like the others."""
    base = {"model_type": "ernie4_5_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 128, "intermediate_size": 128}
    with pytest.raises(UserError, match="moe_intermediate_size is a list"):
        require_sane_sizes("ernie-vl", {**base, "moe_intermediate_size": [1536, 512], "moe_num_experts": 64})
    with pytest.raises(UserError, match="moe_num_shared_experts is 100,000,000"):
        require_sane_sizes("ernie", {**base, "moe_num_shared_experts": 10**8})


def _absurd_tower(tmp_path: Path, model: Path, path: tuple[str, ...], value: object) -> Path:
    """A copy of `model` whose config.json sets the tower key at `path` (e.g. vision_config, depth) to `value`."""
    out = tmp_path / "model"
    shutil.copytree(model, out)
    config = json.loads((out / "config.json").read_text())
    holder = config
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    (out / "config.json").write_text(json.dumps(config))
    return out


TOWERS = [(("vision_config", "depth"), 10**9), (("vision_config", "embed_dim"), 10**12),
          (("vision_config", "patch_size"), 10**6)]


@pytest.mark.parametrize(("path", "value"), TOWERS, ids=[".".join(p) for p, _ in TOWERS])
def test_plan_refuses_an_absurd_vision_tower_naming_its_key(tmp_path: Path, tiny_vl: Path,
                                                            capsys: pytest.CaptureFixture, path: tuple[str, ...],
                                                            value: int) -> None:
    """The ceilings covered the language model only: a vision tower a billion blocks deep was planned (and built)
    as given. It is now exit 2 naming the tower's key, as the language model's sizes are."""
    model = _absurd_tower(tmp_path, tiny_vl, path, value)
    assert main(["plan", "--model", str(model), "--gpus", "1x80GB"]) == 2
    err = capsys.readouterr().err
    assert f"config.json's {'.'.join(path)} is {value:,}, beyond any model's" in err and "Traceback" not in err, err


def test_the_build_refuses_an_absurd_audio_tower(tmp_path: Path, tiny_omni: Path, small_data: Path) -> None:
    """Qwen2.5-Omni's audio encoder (thinker_config.audio_config): the build's read of config.json, which check and
    train go through, refuses a size beyond any model's before allocating it."""
    model = _absurd_tower(tmp_path, tiny_omni, ("thinker_config", "audio_config", "encoder_layers"), 10**9)
    cfg = write_config(tmp_path / "c.yaml", model=str(model), data=str(small_data), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=1, output_dir=str(tmp_path / "run"))
    with pytest.raises(UserError, match=r"config.json's thinker_config\.audio_config\.encoder_layers is "
                                        r"1,000,000,000"):
        model_config(load_config(str(cfg)), resolve_model(str(model)), weights=True)


def test_a_towers_two_sided_size_is_checked_side_by_side() -> None:
    """A [height, width] image_size (InternVL, Molmo 2) is held to the ceiling on each side; real towers pass."""
    text = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}
    require_sane_sizes("internvl", {**text, "vision_config": {"image_size": [448, 448], "patch_size": [14, 14],
                                                              "hidden_size": 1024, "num_hidden_layers": 24}})
    with pytest.raises(UserError, match=r"vision_config\.image_size is 10,000,000"):
        require_sane_sizes("internvl", {**text, "vision_config": {"image_size": [448, 10**7]}})


TEXT = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 128}
ELSEWHERE = [({"visual": {"depth": 10**9}}, "visual.depth is 1,000,000,000"),
             ({"speech_config": {"encoder_layers": 10**9}}, "speech_config.encoder_layers is 1,000,000,000"),
             ({"vit_config": {"hidden_size": 10**12}}, "vit_config.hidden_size is 1,000,000,000,000"),
             ({"thinker_config": {"visual": {"patch_size": 10**6}}}, "thinker_config.visual.patch_size is 1,000,000"),
             ({"vision_config": {"image_size": {"height": 448, "width": 10**7}}},
              "vision_config.image_size.width is 10,000,000"),
             ({"vision_config": {"image_size": {"shortest_edge": 10**7}}},
              "vision_config.image_size.shortest_edge is 10,000,000")]


@pytest.mark.parametrize(("towers", "said"), ELSEWHERE, ids=["visual", "speech_config", "vit_config",
                                                             "thinker-visual", "image-size-height-width",
                                                             "image-size-shortest-edge"])
def test_a_tower_under_another_key_or_a_mapped_image_size_has_its_ceiling(towers: dict, said: str) -> None:
    """The ceilings read vision_config and audio_config (and Qwen-Omni's under thinker_config) only: a tower under
    another key (Qwen-VL's visual, speech_config, vit_config) and an image_size given as a mapping ({"height",
    "width"} or {"shortest_edge"}, image processors' form) went unchecked. Each is now held to the tower ceilings,
    naming the key; the same towers at real sizes pass."""
    with pytest.raises(UserError, match=re.escape(f"config.json's {said}, beyond any model's")):
        require_sane_sizes("m", {**TEXT, **towers})
    real = {"visual": {"depth": 32, "image_size": {"height": 448, "width": 448}, "patch_size": 14},
            "speech_config": {"encoder_layers": 32, "d_model": 1280},
            "thinker_config": {"visual": {"image_size": {"shortest_edge": 336}}}}
    require_sane_sizes("m", {**TEXT, **real})


def test_check_refuses_a_mapped_image_size_beyond_any_model(tmp_path: Path, tiny_vl: Path, small_data: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """End to end: a vision tower's image_size of {"height": 448, "width": 10**7} is exit 2 from check (the build's
    read of config.json, which train goes through too), naming the key."""
    model = _absurd_tower(tmp_path, tiny_vl, ("vision_config", "image_size"), {"height": 448, "width": 10**7})
    cfg = write_config(tmp_path / "c.yaml", model=str(model), data=str(small_data), precision="fp32",
                       max_seq_len=128, micro_batch=2, max_steps=1, output_dir=str(tmp_path / "run"))
    assert main(["check", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "config.json's vision_config.image_size.width is 10,000,000, beyond any model's" in err, err
