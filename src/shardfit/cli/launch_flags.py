"""The launch flags `train` and `doctor` share, so doctor rendezvouses exactly as train would."""

from __future__ import annotations

import argparse

from shardfit.cli.args import non_negative_int, port, positive_int
from shardfit.errors import UserError


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=positive_int, default=None, help="ranks per node (default: all GPUs; 1 on CPU)")
    p.add_argument("--nnodes", type=positive_int, default=1, help="nodes in the job; run the same command on each")
    p.add_argument("--node-rank", type=non_negative_int, default=0, help="this node's index, 0..nnodes-1")
    p.add_argument("--master-addr", default=None, help="node 0's address, reachable from every node")
    p.add_argument("--master-port", type=port, default=None, help="a free port on node 0 (default 29500)")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of a c10d rendezvous (elastic multi-node)")


def check_launch_flags(args: argparse.Namespace, nproc: int) -> None:
    """Flags that cannot describe a launch: a UserError naming the flag and the fix."""
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}.")
    if args.nnodes < 1:
        raise UserError(f"--nnodes must be at least 1, got {args.nnodes}.")
    if not 0 <= args.node_rank < args.nnodes:
        raise UserError(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1} (--nnodes {args.nnodes}); "
                        "number the nodes 0, 1, ... with node 0 the one at --master-addr.")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise UserError(f"--master-port {args.master_port} is not a TCP port; use a free port such as 29500.")
    if args.rdzv_endpoint is not None and args.master_addr is not None:
        raise UserError("give either --rdzv-endpoint HOST:PORT (c10d rendezvous) or --master-addr/--master-port "
                        "(static), not both.")
