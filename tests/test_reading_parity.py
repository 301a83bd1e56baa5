"""The blind benches and the in-sample bench read a plan alike: a row's predicted reading (nvidia-smi's device,
max_memory_reserved() or max_memory_allocated()) comes from the same function, on the row's card, so an error in
one set means what it means in the other."""

from __future__ import annotations

import pytest

from shardfit.plan.estimate import ALLOCATOR_RESERVE, Breakdown
from tests.helpers import load_bench

BLIND = load_bench("plan_vs_blind")
PUBLISHED = load_bench("plan_vs_published")
CARD = 79.2  # an 80 GB card, GiB


def _breakdown(tensors: float) -> Breakdown:
    """A plan of `tensors` GiB of tensors with the verdict's reserve and one GPU's runtime."""
    b = Breakdown(weights=tensors / 2, activations=tensors / 2, allocator_reserve=tensors * ALLOCATOR_RESERVE,
                  runtime_overhead=1.0)
    b.total = tensors + b.allocator_reserve + b.runtime_overhead
    return b


@pytest.mark.parametrize("tensors", [20.0, 70.0])
@pytest.mark.parametrize("reading", ["allocated", "reserved", "total"])
def test_blind_and_published_predict_the_same_reading(tensors: float, reading: str) -> None:
    """For a plan with room (20 GiB of tensors) and one near its card (70 GiB, where the cache is capped), every
    reading the blind bench predicts is the in-sample bench's."""
    b = _breakdown(tensors)
    assert BLIND.predicted_reading(b, reading, CARD) == pytest.approx(PUBLISHED.read_as(b, reading, CARD))


def test_the_device_reads_at_least_what_the_allocator_reserved() -> None:
    """nvidia-smi shows the allocator's reserve and the runtime beside it: never less than max_memory_reserved(),
    and near the card no more than the card."""
    for tensors in (20.0, 70.0):
        b = _breakdown(tensors)
        reserved = BLIND.predicted_reading(b, "reserved", CARD)
        total = BLIND.predicted_reading(b, "total", CARD)
        assert total >= reserved + b.runtime_overhead - 1e-9
        assert total <= max(CARD, b.total) + 1e-9


@pytest.mark.parametrize("seq", [2048, 140000])
@pytest.mark.parametrize("reading", ["allocated", "reserved", "total"])
def test_a_blind_row_is_scored_on_the_in_sample_benchs_reading(seq: int, reading: str) -> None:
    """plan_vs_blind.predict on a planned case (with room at 2048 tokens; at 140000 it fits, but its cache
    would not: the reading is capped by the card) carries the reading
    plan_vs_published predicts for the same case; the default reading is the device's."""
    case = {"model": "Qwen/Qwen2.5-0.5B", "gpu": "1xH100", "strategy": "single", "seq": seq, "reading": reading}
    p = BLIND.predict(case)
    assert p["reading"] == reading
    assert p["predicted_read_gib"] == pytest.approx(PUBLISHED.predicted_total(case, seq), abs=0.006)
    del case["reading"]
    device = BLIND.predict(case)
    assert device["predicted_read_gib"] == pytest.approx(PUBLISHED.predicted_total(case, seq), abs=0.006)
    assert device["predicted_read_gib"] >= p["predicted_read_gib"]
    if seq == 140000:
        assert device["predicted_total_gib"] <= device["card_gib"] == pytest.approx(device["predicted_read_gib"])
