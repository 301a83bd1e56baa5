"""The parallel dimensions of a job: how its ranks divide between pipeline stages, data-parallel replicas, expert
shards and sequence shards. Torch-free, so plan and check can read it before anything loads; parallel/layout.py builds
the device mesh from it. The one place that says which rank sits where.

The ranks are laid out on a mesh ("pp", "dp", "sp"), the last dimension the fastest-varying: the ranks of one
sequence-parallel group are neighbours (they talk at every layer), the stages of a pipeline the farthest apart (they
pass one activation per micro-batch). Expert parallelism does not add ranks: it splits the data-parallel ranks into
`dp // ep` replicas of `ep` ranks, each of which holds 1/ep of every mixture-of-experts block's experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardfit.errors import UserError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """`world` ranks as `pp` stages x `dp` data-parallel ranks x `sp` sequence shards; `ep` of the dp ranks share
    the experts of each block."""

    world: int
    pp: int = 1
    sp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Ranks per stage that read different rows (the data is split this many ways)."""
        return self.world // (self.pp * self.sp)

    @property
    def stage_ranks(self) -> int:
        """Ranks that hold the same stage of the model: the group the strategy replicates or shards over."""
        return self.dp * self.sp

    @property
    def trivial(self) -> bool:
        """Every rank holds the whole model and its own rows: no mesh beyond the world's."""
        return self.pp == self.sp == self.ep == 1

    def check(self) -> None:
        """UserError naming what would divide, when the dimensions do not fit the world."""
        fits = [d for d in _divisors(self.world)]
        for name, n in (("pipeline_parallel", self.pp), ("sequence_parallel", self.sp)):
            if self.world % n:
                raise UserError(f"{name}: {n} does not divide the job's {self.world} ranks: use one of "
                                f"{', '.join(map(str, fits))}, or launch a multiple of {n} ranks (--nproc).")
        if self.world % (self.pp * self.sp):
            raise UserError(f"pipeline_parallel: {self.pp} x sequence_parallel: {self.sp} = {self.pp * self.sp} "
                            f"does not divide the job's {self.world} ranks: launch a multiple of "
                            f"{self.pp * self.sp} (--nproc), or lower one of them.")
        if self.dp % self.ep:
            raise UserError(f"expert_parallel: {self.ep} must divide the {self.dp} data-parallel ranks of each stage "
                            f"(world {self.world} / pipeline {self.pp} / sequence {self.sp}): use one of "
                            f"{', '.join(map(str, _divisors(self.dp)))}.")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, sp_rank) of a global rank on the ("pp", "dp", "sp") mesh."""
        return rank // (self.dp * self.sp), rank // self.sp % self.dp, rank % self.sp

    def ep_rank(self, rank: int) -> int:
        """Which share of the experts a rank holds: its place among the ep neighbouring dp ranks."""
        return self.coords(rank)[1] % self.ep

    def describe(self) -> str:
        """The layout in words, for the job line and the plan: empty when every rank holds the whole model."""
        parts = [f"{self.pp} stages"] if self.pp > 1 else []
        parts.append(f"data over {self.dp}")
        if self.ep > 1:
            parts.append(f"experts over {self.ep}")
        if self.sp > 1:
            parts.append(f"rows split over {self.sp}")
        return "" if self.trivial else ", ".join(parts)
