"""The 2-rank gloo traces of torch's FullyShardedDataParallel that the planner's FSDP1 terms rest on
(tests/test_plan_fsdp1_root.py, test_plan_fsdp1_orig_params.py, test_plan_fsdp1_offload.py), run under one
torchrun: each probe builds its own model and returns rank 0's findings, so one process group serves them all and
the ranks pay torch's and transformers' start-up once rather than once a probe. Each probe undoes the patches it
puts on torch before the next one runs."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (module, probe function, its arguments)
PROBES: dict[str, tuple[str, str, tuple]] = {
    "root": ("tests.test_plan_fsdp1_root", "probe_root", ()),
    "backward_full": ("tests.test_plan_fsdp1_root", "probe_backward", (False,)),
    "backward_lora": ("tests.test_plan_fsdp1_root", "probe_backward", (True,)),
    "flatgrad": ("tests.test_plan_fsdp1_root", "probe_flat_grad", ()),
    "orig_params": ("tests.test_plan_fsdp1_orig_params", "probe", ()),
    "offload": ("tests.test_plan_fsdp1_offload", "probe", ()),
}
# The probes `make test` runs, launched together the first time one is asked for; the rest (heavy cases) alone.
TOGETHER = ("root", "backward_full", "flatgrad", "orig_params", "offload")


def trace(name: str) -> dict:
    """Rank 0's findings of probe `name` (PROBES)."""
    r = _run(TOGETHER if name in TOGETHER else (name,))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])[name]


@functools.cache
def _run(names: tuple[str, ...]) -> subprocess.CompletedProcess:
    """Every probe of `names` on 2 gloo ranks, in one torchrun (rank 0 prints {name: findings}); kept, a failed run
    too, so that the tests sharing it do not launch it again."""
    from tests.helpers import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(Path(__file__)), *names], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def _main(names: list[str]) -> None:
    """On each rank: one gloo group, the probes in the order given (the same on every rank, so their collectives
    pair up), rank 0 printing one JSON line of everything found."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    found = {}
    for name in names:
        module, probe, args = PROBES[name]
        found[name] = getattr(importlib.import_module(module), probe)(*args)
        dist.barrier()
    if dist.get_rank() == 0:
        print(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
