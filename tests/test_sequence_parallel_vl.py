"""Sequence parallelism on vision-language rows (Qwen2-VL): each rank builds the whole row's embeddings (the image
features in their tokens), then keeps its slice of them and of the whole row's M-RoPE positions; 2-rank CLI runs
against one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoTokenizer

from shardfit.config import Config, LoraSettings
from shardfit.data.dataset import encode_split, read_split
from shardfit.data.loader import Batch, collate
from shardfit.data.packing import no_pack, pack
from shardfit.data.tokenize import IGNORE
from shardfit.models.anatomy import vision_body
from shardfit.models.processor import load_vision_processor
from shardfit.models.source import resolve_model
from shardfit.parallel import ulysses
from shardfit.parallel.layout import Layout
from shardfit.parallel.sequence import shard_batch
from shardfit.parallel.ulysses import SHARD_KWARG, block_causal
from shardfit.train.media_forward import vision_language_forward
from tests.test_sequence_parallel import _same_as_one_process
from tests.vl_families import make_tiny_qwen3_vl

PROMPTS = [("Please look at the picture and tell me briefly <image> what it shows.", "noise, mostly grey", ["a"]),
           ("<image> and <image>: which is taller?", "the second one", ["b", "c"]),
           ("Say hi", "hi there", []),
           ("Describe <image> in one word.", "static", ["c"])]


@pytest.fixture(scope="module")
def sp_vl_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Noise images (every patch differs) of 4 and 8 image tokens, and rows whose image tokens sit before, on and
    after the middle of a micro-batch's rows: with micro_batch 4 and no packing, rows 62 tokens wide, the image
    tokens of the two-image row span positions 25-44 and those of the last row 27-34, across the split at 31."""
    root = tmp_path_factory.mktemp("sp-vl-data")
    rng = np.random.default_rng(0)
    for name, (w, h) in {"a": (56, 56), "b": (112, 56), "c": (56, 112)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{name}.png")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
             **({"images": [f"{i}.png" for i in imgs]} if imgs else {})} for q, a, imgs in PROMPTS]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    return root / "train.jsonl"


def _image_examples(model: Path, data: Path) -> list:
    """The encoded examples of the first three rows with images, in the file's order."""
    cfg = Config(model=str(model), data=str(data), precision="fp32", max_seq_len=192, lora=LoraSettings(rank=4))
    tok = AutoTokenizer.from_pretrained(model)
    vision = load_vision_processor(resolve_model(cfg.model), cfg, tok)
    return [e for e in encode_split(cfg, tok, read_split(cfg), vision)[0][:4] if e.image_grid_thw is not None]


def _language_inputs(body: torch.nn.Module, batch: Batch) -> dict:
    """The keyword arguments the body's forward hands its language model for `batch` (sliced where the batch
    carries a sequence shard); the language model itself does not run."""
    seen: list[dict] = []

    def catch(_: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append(kwargs)
        raise StopIteration

    handle = body.language_model.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with pytest.raises(StopIteration):
            vision_language_forward(body, batch.input_ids, batch.position_ids, batch.media["pixel_values"],
                                    batch.media["image_grid_thw"],
                                    routed={SHARD_KWARG: batch.shard} if batch.shard is not None else None)
    finally:
        handle.remove()
    return seen[0]


@torch.no_grad()
def test_each_rank_gets_its_slice_of_the_whole_rows_embeddings_and_positions(tiny_vl: Path,
                                                                              sp_vl_data: Path) -> None:
    """Rank r's language model gets the r-th half of the whole rows' embeddings (image features in place) and of
    the M-RoPE positions the model's own get_rope_index gives the whole rows; positions computed on a slice alone
    (restarting at its first token, or from its own image tokens) would differ from them on rank 1."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    body = vision_body(model)
    batch = collate(no_pack(_image_examples(tiny_vl, sp_vl_data)), pad_id=2)
    ids, image = batch.input_ids, model.config.image_token_id
    assert batch.position_ids.shape == (4, 3, 62)
    own, _ = body.get_rope_index(ids, mm_token_type_ids=(ids == image).int(),
                                 image_grid_thw=batch.media["image_grid_thw"])
    real = batch.targets != IGNORE  # where the rows carry targets, the data layer's positions are the model's
    assert torch.equal(batch.position_ids[1:][:, real], own[:, real])
    whole = _language_inputs(body, batch)
    for r in range(2):
        part = shard_batch(batch, Layout(dp=1, dp_rank=0, sp=2, sp_rank=r))
        got, piece = _language_inputs(body, part), slice(31 * r, 31 * (r + 1))
        assert torch.equal(got["inputs_embeds"], whole["inputs_embeds"][:, piece])
        assert torch.equal(got["position_ids"], batch.position_ids[..., piece])
        assert (ids[1:, piece] == image).any(dim=1).all()  # rows 2 and 3: image tokens on both ranks
        assert torch.equal(part.targets, batch.targets[:, piece])
        assert torch.equal(part.shard.position_ids, batch.position_ids[0])  # the mask's: text positions
    # Rank 1's slice starts inside the second row's images: positions of its own would not be the whole row's.
    assert not torch.equal(batch.position_ids[1:, :, 31:], batch.position_ids[1:, :, :31])
    assert (batch.position_ids[1:, :, 31] > 0).all()


@torch.no_grad()
def test_qwen3_vl_deepstack_features_follow_their_tokens_to_each_rank(tmp_path: Path, tokenizer_dir: Path,
                                                                     sp_vl_data: Path) -> None:
    """Qwen3-VL adds deepstack features to the hidden states at the image tokens of its first blocks: each rank gets
    the token mask of its slice and the features of the image tokens in it, which land where the whole rows' would
    (and no rank gets them all while another has image tokens)."""
    model_dir = make_tiny_qwen3_vl(tmp_path / "qwen3-vl", tokenizer_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    body = vision_body(model)
    batch = collate(no_pack(_image_examples(model_dir, sp_vl_data)), pad_id=2)
    whole = _language_inputs(body, batch)
    mask, feats = whole["visual_pos_masks"], whole["deepstack_visual_embeds"]
    assert feats and all(f.shape[0] == int(mask.sum()) for f in feats)
    half = -(-batch.input_ids.shape[-1] // 2)
    counts = []
    for r in range(2):
        part = shard_batch(batch, Layout(dp=1, dp_rank=0, sp=2, sp_rank=r))
        got = _language_inputs(body, part)
        piece = slice(half * r, half * (r + 1))
        mine = got["visual_pos_masks"]
        assert torch.equal(mine, torch.nn.functional.pad(mask, (0, 2 * half - mask.shape[-1]))[:, piece])
        for f_whole, f_mine in zip(feats, got["deepstack_visual_embeds"], strict=True):
            placed = torch.zeros(*mask.shape, f_whole.shape[-1])
            placed[mask] = f_whole
            here = torch.zeros(*mine.shape, f_mine.shape[-1])
            here[mine] = f_mine
            assert torch.equal(here, torch.nn.functional.pad(placed, (0, 0, 0, 2 * half - mask.shape[-1]))[:, piece])
        counts.append(int(mine.sum()))
    assert sum(counts) == int(mask.sum()) and min(counts) > 0


def test_packed_image_rows_mask_by_their_text_positions(tiny_vl: Path, sp_vl_data: Path) -> None:
    """A packed row of image examples: the text positions (row 0) restart exactly at each example, so the
    kernel's block-causal mask keeps each example's causal boundary; the M-RoPE rows repeat positions inside an
    image and jump after it, so a mask read from them would cut examples inside their images."""
    examples = _image_examples(tiny_vl, sp_vl_data)
    ex_lens = [len(e.input_ids) for e in examples]
    packed = pack(examples, sum(ex_lens))
    assert len(packed) == 1
    batch = collate(packed, pad_id=2)
    text, mrope = batch.position_ids[0], batch.position_ids[1]
    starts = torch.tensor([0, *np.cumsum(ex_lens)[:-1]])
    want = torch.zeros_like(text, dtype=torch.bool)
    want[0, starts] = True
    assert torch.equal(text == 0, want) and batch.restarts is True
    doc = want.cumsum(-1)
    w = text.shape[-1]
    expected = (doc[:, :, None] == doc[:, None, :]) & torch.ones(w, w, dtype=torch.bool).tril()
    assert torch.equal(block_causal(text)[:, 0], expected)
    assert not torch.equal(block_causal(mrope)[:, 0], expected)


def _vl_keys(**over) -> dict:
    return {**dict(micro_batch=4, max_seq_len=192, train_projector=True, strategy="ddp"), **over}


@pytest.mark.slow
@pytest.mark.heavy  # test_sequence_parallel holds packed rows over two ranks
def test_qwen2_vl_lora_image_rows_split_over_two_ranks(tmp_path: Path, tiny_vl: Path, sp_vl_data: Path) -> None:
    """Qwen2-VL with LoRA and a trained merger under DDP, unpacked image rows whose image tokens straddle the split:
    two ranks splitting every row train and evaluate to one process's losses (fp32, 1e-5)."""
    summary = _same_as_one_process(tmp_path, tiny_vl, sp_vl_data, **_vl_keys(packing=False))
    assert summary["packing"] is False


@pytest.mark.slow
@pytest.mark.heavy  # the unpacked case holds the split of image rows; this adds packed rows and zero3
def test_qwen2_vl_packed_image_rows_split_over_two_ranks(tmp_path: Path, tiny_vl: Path, sp_vl_data: Path) -> None:
    """Packed image rows (a block-causal mask from the text positions) under zero3."""
    summary = _same_as_one_process(tmp_path, tiny_vl, sp_vl_data, **_vl_keys(strategy="zero3"))
    assert summary["packing"] is True


@pytest.mark.slow
@pytest.mark.heavy  # Qwen2-VL holds the split of image rows; this adds Qwen3-VL's deepstack features
def test_qwen3_vl_image_rows_split_over_two_ranks(tmp_path: Path, tokenizer_dir: Path, sp_vl_data: Path) -> None:
    """Qwen3-VL (deepstack features added in its first blocks at the image tokens of each rank's slice)."""
    model = make_tiny_qwen3_vl(tmp_path / "qwen3-vl", tokenizer_dir)
    _same_as_one_process(tmp_path, model, sp_vl_data, **_vl_keys(packing=False))


@torch.no_grad()
@pytest.mark.parametrize("fixture", ["tiny_vl", "tiny_vl25"])
def test_the_tower_under_the_split_kernel_gives_the_features_of_sdpa(fixture: str, sp_vl_data: Path,
                                                                      request: pytest.FixtureRequest) -> None:
    """Training sets the whole model to the Ulysses kernel (train/recipe.py); the vision tower calls it without a
    shard, so it is SDPA: Qwen2-VL's tower and Qwen2.5-VL's windowed one give the features they give under SDPA."""
    model_dir = request.getfixturevalue(fixture)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                        attn_implementation="sdpa").eval()
    body = vision_body(model)
    batch = collate(no_pack(_image_examples(model_dir, sp_vl_data)), pad_id=2)
    want = _language_inputs(body, batch)["inputs_embeds"]
    ulysses.register()
    model.set_attn_implementation(ulysses.NAME)
    assert body.visual.config._attn_implementation == ulysses.NAME
    got = _language_inputs(body, batch)["inputs_embeds"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
