"""The pixels really reach the loss: a tiny Qwen2-VL built from its config (random weights) learns the colour of
generated images through the recipe `shardfit train` runs, and answers held-out images far better than chance;
the same run on blanked images stays at chance (the prompt alone cannot tell the colours apart).

Why it learns in a few seconds: every image is one solid colour, so the (frozen, random) vision tower's patch
embedding already separates the colours; the merger trains (`train_projector`) with the language model (full
fine-tune), at a learning rate high enough for 100 steps. The answer token depends on the image only."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from shardfit.cli.main import main
from shardfit.config import Config, load_config
from shardfit.data.dataset import encode_split, read_split
from shardfit.data.loader import collate
from shardfit.data.packing import no_pack
from shardfit.data.tokenize import IGNORE
from shardfit.models.anatomy import vision_body
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.parallel.env import init_distributed
from shardfit.train.media_forward import vision_language_forward
from shardfit.train.recipe import train
from tests.helpers import write_config

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 30, 220), "yellow": (230, 220, 30)}
CHANCE = math.log(len(COLOURS))  # the answer token's loss of a model that cannot see: ln 4 = 1.386


def _colour_rows(root: Path, blank: bool) -> tuple[Path, Path]:
    """64 training and 32 held-out rows asking the colour of a 56x56 image, shades jittered per image (held-out
    images are new shades); `blank` makes every image the same grey while the answers stay."""
    rng = random.Random(0)
    (root / "img").mkdir(parents=True)
    files = []
    for tag, n in (("train", 64), ("heldout", 32)):
        rows = []
        for i in range(n):
            name = list(COLOURS)[i % len(COLOURS)]
            rgb = (128, 128, 128) if blank else tuple(min(255, max(0, v + rng.randint(-25, 25)))
                                                      for v in COLOURS[name])
            Image.new("RGB", (56, 56), rgb).save(root / "img" / f"{tag}{i}.png")
            rows.append({"messages": [{"role": "user", "content": "<image>What colour is this?"},
                                      {"role": "assistant", "content": name}], "images": [f"img/{tag}{i}.png"]})
        files.append(root / f"{tag}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files[0], files[1]


@torch.no_grad()
def _answer_scores(model_dir: Path, heldout: Path) -> tuple[float, float]:
    """Mean loss of the answer token (the colour, the first assistant token) and greedy accuracy on it, over the
    held-out rows, through shardfit's own encoding (chat template, image tokens, M-RoPE positions)."""
    cfg = Config(model=str(model_dir), data=str(heldout), precision="fp32", max_seq_len=64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    vision = load_vision_processor(resolve_model(cfg.model), cfg, tok)
    examples = encode_split(cfg, tok, read_split(cfg), vision)[0]
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    losses, hits = [], []
    for row in no_pack(examples):
        b = collate([row], pad_id=tok.pad_token_id)
        hidden = vision_language_forward(vision_body(model), b.input_ids, b.position_ids, **b.media)[0]
        at = int((b.targets[0] != IGNORE).nonzero()[0])
        logits = model.lm_head(hidden[0, at])
        want = int(b.targets[0, at])
        losses.append(float(torch.nn.functional.cross_entropy(logits[None], torch.tensor([want]))))
        hits.append(int(logits.argmax()) == want)
    return sum(losses) / len(losses), sum(hits) / len(hits)


def _train(tmp: Path, tiny_vl: Path, blank: bool) -> tuple[float, float]:
    """Train on the colour rows (or their blanked twins); the held-out answer loss and accuracy of the saved
    model."""
    rows, heldout = _colour_rows(tmp / "data", blank)
    cfg = write_config(tmp / "vl.yaml", model=str(tiny_vl), data=str(rows), eval_data=str(heldout),
                       method="full", train_projector=True, freeze_vision_tower=True, precision="fp32",
                       strategy="single", max_seq_len=64, packing=False, micro_batch=8, lr=1e-2,
                       warmup_ratio=0.0, max_steps=100, log_steps=25, eval_steps=1000, save_steps=1000, seed=0,
                       output_dir=str(tmp / "run"), report_to=["none"])
    train(load_config(cfg), init_distributed(), quiet=True)  # the recipe `shardfit train` runs, in-process
    return _answer_scores(tmp / "run" / "model", heldout)


@pytest.mark.heavy
def test_colour_of_held_out_images_is_learned_and_blank_images_stay_at_chance(
        tmp_path: Path, tiny_vl: Path, capsys: pytest.CaptureFixture) -> None:
    loss, accuracy = _train(tmp_path / "seen", tiny_vl, blank=False)
    # `shardfit chat RUN --image`: the trained model names the colour of held-out images.
    for i in (0, 1, 2, 3):
        image = tmp_path / "seen" / "data" / "img" / f"heldout{i}.png"
        assert main(["chat", str(tmp_path / "seen" / "run"), "--image", str(image), "--prompt",
                     "What colour is this?", "--max-new-tokens", "4", "--device", "cpu"]) == 0
        assert capsys.readouterr().out.strip() == list(COLOURS)[i]
    # `shardfit eval` reads text rows only: image rows stop it (exit 2) naming the row, before the model loads.
    assert main(["eval", str(tmp_path / "seen" / "run"), "--data", str(tmp_path / "seen" / "data" / "heldout.jsonl")]) \
        == 2
    assert "heldout.jsonl:1: eval reads text rows only" in capsys.readouterr().err
    blank_loss, blank_accuracy = _train(tmp_path / "blank", tiny_vl, blank=True)
    print(f"held-out answer loss {loss:.4f} (accuracy {accuracy:.2f}); blanked images {blank_loss:.4f} "
          f"(accuracy {blank_accuracy:.2f}); chance {CHANCE:.4f}")
    assert loss < 0.1 * CHANCE and accuracy == 1.0
    # Without the pixels the best a model can do is the colours' prior: ln 4, a quarter right.
    assert blank_loss == pytest.approx(CHANCE, abs=0.1) and blank_accuracy <= 0.5
