"""A vision-language model in a pipeline (`pipeline_parallel: N`, Qwen2-VL): the first stage runs the vision tower
and writes the images' features into their tokens, every stage reads the M-RoPE positions (rows first inside the
schedule), and two gloo ranks train image rows to one process's losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

from shardfit.data.vision import mrope_positions
from shardfit.parallel.pipeline import cut
from shardfit.train.media_forward import embed_images, vision_language_forward
from tests.helpers import read_jsonl, run_cli, train_here, write_config, write_images

IMAGE = 60


def _tiny_vl(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rope_parameters=rope)
    ids = dict(image_token_id=IMAGE, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
    if arch == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2)
        return Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids)).eval()
    # Qwen2.5-VL: windowed attention in the tower (a window of 56 pixels, the last block attending fully)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)).eval()


def _rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two rows of 20 tokens, the first with a 4x4-patch image (4 tokens after merging) from token 3: input ids,
    (4, rows, width) positions (text, then M-RoPE), pixel values and the image's grid."""
    ids = torch.randint(0, 59, (2, 20))
    ids[0, 3:7] = IMAGE
    axes = [mrope_positions(20, [(3, [1, 4, 4], 1.0)], 2), mrope_positions(20, [], 2)]
    pos = torch.tensor([[list(range(20)), list(range(20))]] + [[a[k] for a in axes] for k in range(3)])
    pixels = torch.randn(16, 3 * 2 * 14 * 14)
    return ids, pos, pixels, torch.tensor([[1, 4, 4]])


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_stages_in_turn_give_the_whole_vl_models_hidden_states(arch: str) -> None:
    """Stage 0 (embedding, vision tower, block 0) and stage 1 (blocks 1-2, norm) as the plan might cut them, run
    one after the other with the positions rows first, equal the one-process forward (fp32, 1e-5); the tower is on
    the first stage only, and each parameter on one stage."""
    ids, pos, pixels, grid = _rows()
    whole = _tiny_vl(arch)
    with torch.no_grad():
        want = vision_language_forward(whole.model, ids, pos, pixels, grid).last_hidden_state
    stages = [cut(_tiny_vl(arch), s, 2, (1, 2)) for s in range(2)]
    stages[0].embed_images = embed_images
    stages[0].media = [{"pixel_values": pixels, "image_grid_thw": grid}]
    rows_first = pos.transpose(0, 1)
    with torch.no_grad():
        h = stages[0](ids, rows_first, micro=torch.zeros(2, dtype=torch.long))
        h = stages[1](h, rows_first)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
    assert list(stages[0].model.model.language_model.layers) == ["0"]
    assert list(stages[1].model.model.language_model.layers) == ["1", "2"]
    assert stages[1].model.model.visual is None and stages[0].model.model.visual is not None
    names = [set(dict(s.model.named_parameters())) for s in stages]
    whole_names = set(dict(whole.named_parameters()))
    assert set.union(*names) == whole_names and sum(map(len, names)) == len(whole_names)


COLOURS = {"red": (255, 0, 0), "green": (0, 200, 0), "blue": (0, 0, 255)}


@pytest.fixture
def image_rows(tmp_path: Path) -> Path:
    """Rows with one image each (and a text-only row), generated PNGs beside them."""
    write_images(tmp_path / "img", COLOURS)
    rows = [{"messages": [{"role": "user", "content": "<image>What colour is this?"},
                          {"role": "assistant", "content": name}], "images": [f"img/{name}.png"]}
            for name in COLOURS for _ in range(3)]
    rows.append({"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "hi there"}]})
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(tmp: Path, model: Path, data: Path, name: str, *flags: str, **over) -> list[float]:
    keys = dict(model=str(model), data=str(data), output_dir=str(tmp / name), precision="fp32", max_seq_len=128,
                micro_batch=2, grad_accum=2, lr=1e-2, log_steps=1, save_steps=100, max_steps=3, warmup_ratio=0.0,
                eval_split=0.2, eval_steps=3, lora={"rank": 4, "alpha": 8}, method="lora", report_to=["none"])
    keys.update(over)
    cfg = write_config(tmp / f"{name}.yaml", **keys)
    if flags:
        r = run_cli("train", str(cfg), *flags, env={"OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
    else:
        train_here(cfg)
    return [m.get("loss", m.get("eval_loss")) for m in read_jsonl(tmp / name / "metrics.jsonl")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_vl", pytest.param("tiny_vl25", marks=pytest.mark.heavy)])
def test_qwen2_vl_lora_over_two_stages(tmp_path: Path, model: str, image_rows: Path,
                                       request: pytest.FixtureRequest) -> None:
    """Two gloo ranks, two stages, two micro-batches of image rows a step: one process's train and held-out losses
    (fp32, 1e-5), for Qwen2-VL and (heavy: the same path, a tower with windowed attention) Qwen2.5-VL."""
    folder = request.getfixturevalue(model)
    single = _run(tmp_path, folder, image_rows, "single")
    pp = _run(tmp_path, folder, image_rows, "pp", "--nproc", "2", pipeline_parallel=2)
    assert len(pp) == len(single) >= 4 and None not in single  # 3 steps, then the held-out rows
    assert pp == pytest.approx(single, rel=1e-5)
