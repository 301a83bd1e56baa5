"""A step's inputs on the GPU path, checked on a CPU: pinned host batches, copied without blocking, the next
micro-batch collated and issued before the current one computes; and the same numbers as a plain loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardfit.data.loader import Batch, collate
from shardfit.train.inputs import InputFeed
from shardfit.train.recipe import FineTune
from tests.test_host_syncs import _recipe


def _log_order(recipe: FineTune, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Forces the GPU path's pinning (a CPU cannot pin: a stand-in records it) and records, in order, each
    collation, pinning, copy and forward."""
    order: list[str] = []
    collate_rows = recipe._collate

    def prepare(rows):  # noqa: ANN001, ANN202
        order.append("collate")
        return collate_rows(rows)

    def pinned(self: Batch) -> Batch:
        order.append("pin")
        return self

    real_to = Batch.to

    def to(self: Batch, device):  # noqa: ANN001, ANN202
        order.append("copy")
        return real_to(self, device)

    monkeypatch.setattr(Batch, "pinned", pinned)
    monkeypatch.setattr(Batch, "to", to)
    recipe.feed = InputFeed(recipe.in_device, prepare, pin=True)
    recipe.loss_module.register_forward_pre_hook(lambda *_: order.append("forward"))
    return order


def test_the_next_micro_batch_is_pinned_and_copied_before_the_current_one_computes(
        tmp_path: Path, tiny_qwen2: Path, small_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = _recipe(tmp_path, tiny_qwen2, small_data, "lora")
    order = _log_order(recipe, monkeypatch)
    recipe.train_step(0, recipe.batches.step(0))  # 2 micro-batches
    assert order == ["collate", "pin", "copy", "collate", "pin", "copy", "forward", "forward"]


def test_a_cpu_pins_nothing_and_the_copy_never_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    feed = InputFeed(torch.device("cpu"), lambda rows: rows)
    assert not feed.pin and feed.stream is None
    calls = []
    real = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: calls.append(k.get("non_blocking")) or real(t, *a, **k))
    batch = collate([], 0)
    batch.to("cpu")
    assert calls and all(calls)


def test_the_feed_changes_no_number(tmp_path: Path, tiny_qwen2: Path, small_data: Path) -> None:
    """The step's gradient norm and logged loss are bit-equal to a plain collate-forward-backward loop's."""
    recipe = _recipe(tmp_path, tiny_qwen2, small_data, "full")
    rows = recipe.batches.step(0)
    scale = 1 / rows.global_targets
    loss = torch.zeros((), dtype=torch.float64)
    for micro in rows.micro_batches:  # the loop as it was, before the feed
        batch = collate(micro, recipe.pad_id, recipe.job.rows)
        loss_sum, _ = recipe.loss_module(batch.input_ids, batch.position_ids, batch.targets, **batch.host_facts)
        (loss_sum * scale).backward()
        loss += loss_sum.detach().double() / rows.global_targets
    norm = torch.nn.utils.get_total_norm([p.grad for p in recipe.params])
    recipe.optimizer.zero_grad(set_to_none=True)
    got = recipe.train_step(0, rows)
    assert torch.equal(got, norm) and torch.equal(recipe.logger._loss, loss)


class _CountedList(list):
    """A list that counts how often it is read through."""

    reads = 0

    def __iter__(self):  # noqa: ANN204
        type(self).reads += 1
        return super().__iter__()


def test_each_examples_label_count_is_counted_once_not_every_step() -> None:
    from shardfit.data.loader import BatchSchedule
    from shardfit.data.tokenize import IGNORE, Encoded

    examples = [Encoded(list(range(6)), _CountedList([IGNORE, IGNORE, 3, 4, 5, IGNORE])) for _ in range(8)]
    # Rows formed elsewhere: only the step's own counting reads the targets here.
    schedule = BatchSchedule(examples, micro_batch=2, grad_accum=2, world=1, rank=0, seed=0, form=lambda ex: [])
    _CountedList.reads = 0
    counts = [schedule.step(k).global_targets for k in range(6)]
    assert counts == [12] * 6 and _CountedList.reads == len(examples)
