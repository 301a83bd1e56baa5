"""This rank's place in the job's parallel dimensions (resolve/dims.py), with the process groups it talks over: the
device mesh ("pp", "dp", "sp") and, for expert parallelism, the dp dimension split into ("dp_rep", "ep").

Who uses which group: the strategy (DDP, FSDP2) replicates or shards a stage's parameters over `stage_mesh` (the dp x
sp ranks of the stage: the sequence shards of a row average their gradients like data replicas); the pipeline
passes activations between `pp` ranks over `pp_group`; the Ulysses attention exchanges heads over `group` (the sp
ranks); an expert-parallel block sends tokens to the experts' ranks over `ep_group`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardfit.parallel.env import DistEnv
from shardfit.resolve.dims import ParallelDims


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: `dp_rank` of the `dp` ranks of its stage that read different rows, `sp_rank` of the
    `sp` ranks that share each row (`group`: their process group; None when sp is 1), `pp_rank` of `pp` stages,
    `ep_rank` of the `ep` ranks that share each block's experts. `stage_mesh`: the 1-D mesh of the ranks holding
    this rank's stage, over which the strategy works (None: the world's)."""

    dp: int
    dp_rank: int
    sp: int = 1
    sp_rank: int = 0
    group: Any = None
    pp: int = 1
    pp_rank: int = 0
    pp_group: Any = None
    ep: int = 1
    ep_rank: int = 0
    ep_group: Any = None
    ep_mesh: Any = None  # the 1-D mesh of the ep ranks (the experts' shards in checkpoints)
    ep_rep_group: Any = None  # the ranks holding this rank's share of the experts (None: only this one)
    stage_mesh: Any = None


def layout_of(env: DistEnv, dims: ParallelDims) -> Layout:
    """This rank's layout; a device mesh only when some dimension is not the world's data parallelism."""
    if dims.trivial:
        return Layout(dp=env.world, dp_rank=env.rank)
    from torch.distributed.device_mesh import init_device_mesh

    dims.check()
    pp_rank, dp_rank, sp_rank = dims.coords(env.rank)
    mesh = init_device_mesh(env.device.type, (dims.pp, dims.dp // dims.ep, dims.ep, dims.sp),
                            mesh_dim_names=("pp", "dp_rep", "ep", "sp"))
    # The stage's ranks as one dimension; a 1-D mesh of the world when there is a single stage and nothing to split.
    stage = mesh["dp_rep", "ep", "sp"]._flatten("stage")  # noqa: SLF001 - torch's only way to join mesh dims
    return Layout(dp=dims.dp, dp_rank=dp_rank, sp=dims.sp, sp_rank=sp_rank,
                  group=mesh.get_group("sp") if dims.sp > 1 else None,
                  pp=dims.pp, pp_rank=pp_rank, pp_group=mesh.get_group("pp") if dims.pp > 1 else None,
                  ep=dims.ep, ep_rank=dims.ep_rank(env.rank), ep_group=mesh.get_group("ep") if dims.ep > 1 else None,
                  ep_mesh=mesh["ep"] if dims.ep > 1 else None,
                  ep_rep_group=mesh.get_group("dp_rep") if dims.ep > 1 and dims.dp > dims.ep else None,
                  stage_mesh=stage)
