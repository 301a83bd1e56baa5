"""Sequence parallelism (Ulysses): the attention kernel on 2 gloo ranks against plain SDPA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests import sp_workers
from tests.helpers import free_port

CASES = [(2, True), (1, True), (4, False)]


@pytest.mark.slow
def test_ulysses_attention_matches_sdpa(tmp_path: Path) -> None:
    """Forward and backward of each rank's slice equal the whole row's SDPA (fp32): GQA with key/value heads that
    split over the ranks, a single key/value head (repeated first), packed rows (a block-causal mask)."""
    mp.start_processes(sp_workers.attention_rank, args=(2, free_port(), CASES, str(tmp_path)), nprocs=2,
                       start_method="spawn", join=True)
    for r in range(2):
        for (_, packed), got in zip(CASES, json.loads((tmp_path / f"rank-{r}.json").read_text()), strict=True):
            assert got["masked"] is packed
            assert got["out"] <= 1e-5 * got["scale"], got
            assert max(got["grads"]) <= 1e-5 * got["grad_scale"], got
