"""A model id that names a release of a catalog model (its -Instruct, -Thinking or -Base twin, with or without a
date stamp such as -2507, as most of 2026's example configs name Qwen3) plans with that model's shape; an id that
names no catalog model is still refused with a hint."""

from __future__ import annotations

import pytest

from shardfit.errors import UserError
from shardfit.plan.shapes import resolve_shape


@pytest.mark.parametrize("model,twin", [
    ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B"),
    ("Qwen/Qwen3-30B-A3B-Instruct-2507", "Qwen/Qwen3-30B-A3B"),
    ("Qwen/Qwen3-235B-A22B-Thinking-2507", "Qwen/Qwen3-235B-A22B"),
    ("Qwen/Qwen3-8B-Base", "Qwen/Qwen3-8B"),
])
def test_a_dated_or_base_release_plans_as_its_catalog_twin(model: str, twin: str) -> None:
    shape, ref = resolve_shape(model), resolve_shape(twin)
    assert shape.id == model
    assert (shape.layers, shape.hidden, shape.experts, shape.params()) == \
        (ref.layers, ref.hidden, ref.experts, ref.params())


def test_an_unknown_release_is_still_refused() -> None:
    with pytest.raises(UserError, match="not in the bundled catalog"):
        resolve_shape("Qwen/Qwen3-5B-Instruct-2507")
