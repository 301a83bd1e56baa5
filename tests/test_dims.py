"""The job's parallel dimensions (resolve/dims.py): which rank sits where, and what is refused before launch."""

from __future__ import annotations

import pytest

from shardfit.errors import UserError
from shardfit.resolve.dims import ParallelDims


def test_coords_put_sequence_shards_next_to_each_other_and_stages_farthest() -> None:
    d = ParallelDims(world=8, pp=2, sp=2)
    assert d.dp == 2 and d.stage_ranks == 4
    assert [d.coords(r) for r in range(8)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
                                               (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    # Every (pp, dp, sp) cell is one rank.
    assert len({d.coords(r) for r in range(8)}) == 8


def test_expert_shards_are_neighbouring_data_ranks() -> None:
    d = ParallelDims(world=8, ep=4)
    assert d.dp == 8 and [d.ep_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert d.describe() == "data over 8, experts over 4"
    assert ParallelDims(world=4).trivial and ParallelDims(world=4).describe() == ""
    assert ParallelDims(world=4, pp=2).describe() == "2 stages, data over 2"


@pytest.mark.parametrize(("dims", "says"), [
    (ParallelDims(world=6, pp=4), "pipeline_parallel: 4 does not divide the job's 6 ranks: use one of 1, 2, 3, 6"),
    (ParallelDims(world=4, sp=3), "sequence_parallel: 3 does not divide"),
    (ParallelDims(world=8, pp=4, sp=4), "pipeline_parallel: 4 x sequence_parallel: 4 = 16 does not divide"),
    (ParallelDims(world=6, ep=4), "expert_parallel: 4 must divide the 6 data-parallel ranks of each stage"),
    (ParallelDims(world=8, pp=2, ep=3), "use one of 1, 2, 4"),
])
def test_layouts_that_do_not_divide_say_what_would(dims: ParallelDims, says: str) -> None:
    with pytest.raises(UserError, match=says.replace("(", r"\(")):
        dims.check()


def test_layouts_that_divide_pass() -> None:
    for d in (ParallelDims(world=8, pp=2, sp=2, ep=2), ParallelDims(world=1), ParallelDims(world=2, ep=2)):
        d.check()
