"""One input shape per run (`static_shape`): every training micro-batch one row of micro_batch x max_seq_len
tokens, with the loss of unpacked rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shardfit.config import load_config
from shardfit.parallel.env import init_distributed
from shardfit.resolve.defaults import resolve_static_shape
from shardfit.train.diverge import DivergenceStop
from shardfit.train.metrics import MetricsLog, StepLogger
from shardfit.train.recipe import FineTune
from tests.helpers import write_config


def _recipe(tmp_path: Path, model: Path, data: Path, static: bool | str) -> FineTune:
    cfg = write_config(tmp_path / f"{static}.yaml", model=str(model), data=str(data),
                       output_dir=str(tmp_path / f"run-{static}"), method="full", precision="fp32", max_seq_len=256,
                       micro_batch=4, grad_accum=2, max_steps=2, attn_implementation="sdpa", static_shape=static)
    recipe = FineTune(load_config(cfg), init_distributed(), quiet=True)
    recipe.setup()
    recipe.stop = DivergenceStop(recipe.optimizer, recipe.env.device, on_device=True)
    recipe.logger = StepLogger(MetricsLog(recipe.run_dir, recipe.env), recipe.env, 100, recipe.total_steps, 0,
                               recipe.batches.epoch_of, 0.0, show=False)
    return recipe


def _epoch_shapes(recipe: FineTune) -> set[tuple[int, ...]]:
    """The input shapes of every training micro-batch of the first epoch, as the step collates them."""
    return {tuple(recipe._collate(micro).input_ids.shape) for k in range(recipe.batches.steps_per_epoch)
            for micro in recipe.batches.step(k).micro_batches}


def test_an_epoch_has_one_input_shape(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    static = _recipe(tmp_path, tiny_qwen2, small_data, True)
    assert static.job.static_shape and static.batches.steps_per_epoch > 1
    assert _epoch_shapes(static) == {(1, 4 * 256)}
    assert len(_epoch_shapes(_recipe(tmp_path, tiny_qwen2, small_data, False))) > 1  # what it replaces


def test_the_static_rows_train_as_the_unpacked_ones(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """The same examples per micro-batch, attention kept within each: the step's loss and gradient norm equal those
    of the default rows (the dense block mask on a CPU)."""
    got = []
    for static in (True, False):
        recipe = _recipe(tmp_path, tiny_qwen2, small_data, static)
        norm = recipe.train_step(0, recipe.batches.step(0))
        got.append((float(recipe.logger._loss), float(norm)))
    (loss_s, norm_s), (loss_d, norm_d) = got
    assert loss_s == pytest.approx(loss_d, rel=1e-5) and norm_s == pytest.approx(norm_d, rel=1e-4)


@pytest.mark.parametrize("value,device,packing,attention,preference,expect", [
    ("auto", "cuda", True, "flash_attention_2", False, True),
    ("auto", "cuda", True, "flex_attention", False, True),
    ("auto", "cuda", True, "auto", False, False),  # SDPA: the whole masked square of a long row
    ("auto", "cuda", False, "flash_attention_2", False, False),
    ("auto", "cpu", True, "flex_attention", False, False),
    ("auto", "cuda", True, "flash_attention_2", True, False),
    (True, "cpu", True, "sdpa", False, True),
    (True, "cuda", True, "sdpa", True, False),  # preference pairs keep their rows
    (False, "cuda", True, "flash_attention_2", False, False),
])
def test_when_the_shape_is_static(value: bool | str, device: str, packing: bool, attention: str, preference: bool,
                                  expect: bool) -> None:
    assert resolve_static_shape(value, device, packing, attention, preference) is expect


@pytest.mark.parametrize(("device", "packing", "attention", "static", "sp", "objective", "expect"), [
    ("cuda", True, "flex_attention", "auto", 1, "sft", True),  # packed into one static row: one shape, compiled
    ("cuda", True, "flash_attention_2", True, 1, "sft", True),
    ("cuda", True, "sdpa", "auto", 1, "sft", False),  # packed rows of every width: no static shape, no compile
    ("cuda", True, "flex_attention", False, 1, "sft", False),
    ("cuda", True, "flex_attention", "auto", 1, "dpo", False),  # pairs keep their rows
    ("cuda", True, "flex_attention", "auto", 2, "sft", False),  # sequence parallelism is not compiled
    ("cuda", False, "sdpa", "auto", 1, "sft", True),  # unpacked rows padded to one shape, as before
    ("cpu", True, "flex_attention", True, 1, "sft", False),  # a CPU never compiles under auto
])
def test_compile_auto_compiles_a_gpus_static_shape_rows(device: str, packing: bool, attention: str,
                                                        static: bool | str, sp: int, objective: str,
                                                        expect: bool) -> None:
    """`compile: auto` on a GPU: one input shape per run pays for the compile, so packed SFT rows in one static
    row (`static_shape` on, which auto does for a boundary kernel) compile as unpacked rows do."""
    from shardfit.config import Config
    from shardfit.resolve.defaults import compiled_for, resolve_speed_settings

    cfg = dataclasses.replace(Config(), packing=packing, attn_implementation=attention, static_shape=static,
                              sequence_parallel=sp, objective=objective)
    assert compiled_for(cfg, device) is expect
    assert resolve_speed_settings(cfg, device).compile is expect
    assert compiled_for(dataclasses.replace(cfg, compile=False), device) is False


def test_a_bad_value_is_refused_with_the_choices(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    from shardfit.errors import UserError

    cfg = write_config(tmp_path / "c.yaml", model=str(tiny_qwen2), data=str(small_data), static_shape="yes")
    with pytest.raises(UserError, match="static_shape"):
        load_config(cfg)


def test_flex_attention_gets_the_examples_block_mask_from_the_host(monkeypatch: pytest.MonkeyPatch,
                                                                   tiny_qwen2: Path) -> None:
    """A static row's attention from its example boundaries: flex attention's block mask, built from the positions
    without transformers' read of the device, allows exactly what the dense block-causal mask of SDPA allows (flex
    attention itself compiles for a minute on a CPU: the semantics are compared, the GPU runs it)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import masking_utils as mu

    from shardfit.models.anatomy import decoder_and_head
    from shardfit.models.build import use_attention
    from shardfit.models.masks import mask_argument

    real = mu.create_block_mask
    monkeypatch.setattr(mu, "create_block_mask", lambda *a, **k: real(*a, **{**k, "_compile": False}))

    def no_read(*_):  # noqa: ANN202
        raise AssertionError("transformers looked for the packed examples on the device")

    monkeypatch.setattr(mu, "find_packed_sequence_indices", no_read)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2)
    decoder, _ = decoder_and_head(model)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 1], list(range(16))])
    q, k = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    for restarts in (True, False):
        rows = pos if restarts else torch.arange(16).repeat(2, 1)
        use_attention(model, "sdpa")
        dense = mask_argument(decoder, rows, restarts)["attention_mask"]["full_attention"]
        if dense is None:  # SDPA's causal kernel on rows without a restart
            dense = torch.ones(16, 16, dtype=torch.bool).tril().expand(2, 1, 16, 16)
        use_attention(model, "flex_attention")
        flex = mask_argument(decoder, rows, restarts)["attention_mask"]["full_attention"]
        assert type(flex).__name__ == "BlockMask"
        for b in range(2):
            allowed = flex.mask_mod(torch.tensor(b), torch.tensor(0), q, k)
            assert torch.equal(allowed, dense[b, 0]), (restarts, b)
