"""Mechanisms found on the outsiders' batch 12 (dev since it was replaced as the blind set): a device error raised by
an inference runtime that has no ranks, c10d's set-up barrier counting more workers than the world size, and
mpirun's process count read past the program it runs. Each paste is made up in the shape of the library's message
(its source is cited in causes.yaml and parse.py), not taken from a thread.
"""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze
from shardfit.diagnose.parse import parse

# ONNX Runtime's CudaCall (core/providers/cuda/cuda_call.cc): "%s failure %d: %s ; GPU=%d ; hostname=%s ; expr=%s"
ORT_ORDINAL = ("/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_call.cc:121 bool onnxruntime::CudaCall(...) "
               "CUDA failure 101: invalid device ordinal ; GPU=0 ; hostname=box7 ; "
               "expr=cudaSetDevice(info_.device_id);")


def test_an_inference_runtimes_invalid_ordinal_is_not_a_confident_rank_count() -> None:
    assert analyze(ORT_ORDINAL).answer != "confident"
    # what still reads as a rank count: torch's message under a launcher, and the runtime's under one
    a = analyze("torchrun --nproc_per_node 8 train.py\nRuntimeError: CUDA error: invalid device ordinal")
    assert a.answer == "confident" and a.findings[0].category == "more_ranks_than_gpus"
    assert analyze("torchrun --nproc_per_node 4 serve.py\n" + ORT_ORDINAL).likely[0].category == "more_ranks_than_gpus"


@pytest.mark.parametrize("log", [
    # torch < 2.1 (distributed_c10d.py, _store_based_barrier)
    "srun -N1 -n2 --gres gpu:2 python main.py\n"
    "RuntimeError: Timed out initializing process group in store based barrier on rank: 3, for key: "
    "store_based_barrier_key:1 (world_size=2, worker_count=4, timeout=0:30:00)",
    # torch >= 2.1 words the count num_workers_joined
    "torch.distributed.DistStoreError: Timed out initializing process group in store based barrier on rank 1, for "
    "key: store_based_barrier_key:1 (world_size=4, num_workers_joined=8, timeout=0:30:00 error=timeout)",
])
def test_more_workers_than_world_size_at_the_barrier_is_a_process_count(log: str) -> None:
    a = analyze(log)
    assert a.likely[0].category == "more_ranks_than_gpus"
    assert a.answer != "confident"


def test_only_more_workers_than_world_size_reads_as_a_process_count() -> None:
    barrier = ("RuntimeError: Timed out initializing process group in store based barrier on rank: 0, for key: "
               "store_based_barrier_key:1 (world_size=4, worker_count={}, timeout=0:30:00)")
    assert analyze(barrier.format(6)).likely[0].category == "more_ranks_than_gpus"
    fewer = analyze(barrier.format(2))  # a rank that has not arrived yet: late, not extra
    assert "barrier_extra_workers" not in fewer.parsed.facts
    assert not fewer.likely or fewer.likely[0].category != "more_ranks_than_gpus"


def test_a_file_store_left_by_an_earlier_run_explains_the_extra_workers() -> None:
    a = analyze("dist.init_process_group('nccl', init_method='file:///tmp/dist_init', rank=0, world_size=2)\n"
                "RuntimeError: Timed out initializing process group in store based barrier on rank: 0, for key: "
                "store_based_barrier_key:1 (world_size=2, worker_count=4, timeout=0:02:00)")
    assert "barrier_extra_workers" in a.parsed.facts
    assert "more_ranks_than_gpus" not in [x.category for x in a.likely]


def test_mpiruns_options_end_at_a_program_run_by_path() -> None:
    assert parse("mpirun ./a.out -n 3").world_size is None  # the program's own -n
    assert parse("mpirun --oversubscribe ../bin/solver -np 6 --steps 10").world_size is None
    assert parse("mpirun -np 4 ./a.out -n 3").world_size == 4
    assert parse("mpirun --hostfile hosts -np 8 python train.py -n 3").world_size == 8
    # an option's own path value is not the program: the count after it is mpirun's
    assert parse("mpirun --hostfile ./hostfile -np 16 python train.py").world_size == 16
    assert parse("mpirun -machinefile ../hosts -np 8 ./a.out").world_size == 8
    assert parse("mpirun --prefix ./ompi -n 4 ./a.out -n 3").world_size == 4
    assert parse("mpirun --mca btl_tcp_if_include eth0 -x NCCL_DEBUG=INFO -np 2 ./train.sh").world_size == 2
    assert parse("mpirun --allow-run-as-root -N 8 ./a.out").world_size is None  # Open MPI's -N: per node


def test_a_file_address_that_names_no_store_leaves_the_extra_workers_read() -> None:
    """pip's own file:// line above the barrier's error is no file store: the extra workers still read as more
    processes than the job's world size."""
    a = analyze("Processing file:///home/u/wheels/flash_attn-2.5.0-cp310-linux_x86_64.whl\n"
                "RuntimeError: Timed out initializing process group in store based barrier on rank: 0, for key: "
                "store_based_barrier_key:1 (world_size=2, num_workers_joined=4, timeout=0:30:00)")
    assert "file_store" not in a.parsed.facts
    assert a.likely[0].category == "more_ranks_than_gpus"

