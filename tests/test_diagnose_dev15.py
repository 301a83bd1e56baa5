"""Mechanisms found on the outsiders' batch 15 (dev data): three confident rules narrowed by the fact that tells the
settings apart (the rendezvous keep-alive thread's warning, a launch whose ranks fit its visible GPUs, rank 0's own
watchdog line beside another rank's), out of memory at a micro-batch of one, a local read before assignment in a
library's frame, and a script that spawns its own ranks. Each paste is made up in the shape of the library's message
(its source is cited in causes.yaml or facts.py), not taken from a thread.
"""

from __future__ import annotations

from shardfit.diagnose.engine import analyze


def _cats(log: str) -> list[str]:
    return [x.category for x in analyze(log).likely]


# torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, _keep_alive_weak: a warning, after the node joined
HEARTBEAT = (
    " 8120/9000 [3:10:02<20:31,  1.40s/it, loss=0.41]WARNING:torch.distributed.elastic.rendezvous.dynamic_rendezvous:"
    "The node 'gpu01_2211_0' has failed to send a keep-alive heartbeat to the rendezvous 'a1b2' due to an error of "
    "type RendezvousTimeoutError.\n"
    "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 2212 closing signal SIGTERM\n"
    "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 1 (pid: 2213) of binary: "
    "/opt/conda/bin/python")


def test_a_failed_keep_alive_heartbeat_is_not_an_unreachable_rendezvous() -> None:
    a = analyze(HEARTBEAT)
    assert a.answer != "confident"
    assert a.likely[0].category == "host_ram_oom"
    # the rendezvous raising the error itself (the agent's join) still reads as one not reached
    raised = ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError\n"
              "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 0 (pid: 7) of "
              "binary: /usr/bin/python3")
    assert _cats(raised)[0] == "rendezvous_unreachable"


def _ordinal(visible: str, nproc: int) -> str:
    return ("RuntimeError: CUDA error: invalid device ordinal\n"
            f"CUDA_VISIBLE_DEVICES={visible} torchrun --standalone --nproc_per_node={nproc} train.py --gpu 3")


def test_an_invalid_ordinal_when_the_ranks_fit_the_gpus_is_not_a_confident_rank_count() -> None:
    fit = analyze(_ordinal("0,1,2,3", 4))
    assert "ranks_fit_gpus" in fit.parsed.facts
    assert fit.answer != "confident"
    assert fit.likely[0].category == "more_ranks_than_gpus"  # still the check to run, ranked
    more = analyze(_ordinal("0,1", 4))
    assert "ranks_fit_gpus" not in more.parsed.facts
    assert more.answer == "confident" and more.likely[0].category == "more_ranks_than_gpus"


def _watchdog(rank: int, seq: int, numel: int) -> str:
    return (f"[rank{rank}]:[E ProcessGroupNCCL.cpp:523] [Rank {rank}] Watchdog caught collective operation timeout: "
            f"WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, NumelIn={numel}, NumelOut={numel}, Timeout(ms)=600000) ran "
            f"for 600100 milliseconds before timing out.")


def test_rank_zero_timing_out_beside_another_rank_is_a_stalled_rank_not_a_save() -> None:
    a = analyze("\n".join(_watchdog(r, 250_000, 300_000) for r in (1, 0, 3)))
    assert "nccl_rank0_in_step" in a.parsed.facts
    assert a.answer != "confident"
    assert a.likely[0].category == "watchdog_stuck_rank"
    # rank 0 alone, in a collective of data size (gradients) is rank 0 waiting too
    assert "nccl_rank0_in_step" in analyze(_watchdog(0, 250_000, 300_000)).parsed.facts
    # rank 0 alone in a one-element barrier, or absent from the waiters, still reads as rank 0 saving
    assert "nccl_rank0_in_step" not in analyze(_watchdog(0, 250_000, 1)).parsed.facts
    others = analyze("\n".join(_watchdog(r, 250_000, 300_000) for r in (1, 3)))
    assert others.likely[0].category == "nccl_timeout_save"


def test_out_of_memory_at_a_micro_batch_of_one_is_the_replica() -> None:
    log = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 3 has a total capacity of "
           "23.64 GiB of which 900.00 MiB is free.\n"
           "I already set per_device_train_batch_size to 1 and it still runs out of memory.")
    assert _cats(log)[0] == "oom_full_replica_per_rank"
    # a larger micro-batch leaves the activations first
    assert _cats(log.replace("to 1 and", "to 16 and"))[0] == "oom_activation_not_sharded"


def test_gpu_memory_said_to_be_insufficient_is_an_out_of_memory() -> None:
    cats = _cats("Training on eight GPUs, but the GPU memory is insufficient. How can I reduce memory usage?")
    assert "oom_full_replica_per_rank" in cats and "oom_activation_not_sharded" in cats


def test_a_local_read_before_assignment_in_a_librarys_frame_is_a_version_break() -> None:
    frames = ('Traceback (most recent call last):\n'
              '  File "/work/train.py", line 40, in main\n'
              '    model.backward(loss)\n'
              '  File "/opt/conda/lib/python3.10/site-packages/deepspeed/runtime/zero/linear.py", line 90, in '
              'backward\n'
              '    grad_weight = grad_output.t().matmul(input)\n')
    for msg in ("UnboundLocalError: local variable 'dim' referenced before assignment",
                "UnboundLocalError: cannot access local variable 'dim' where it is not associated with a value"):
        assert _cats(frames + msg)[0] == "library_version_regression"
    # raised in the user's own code: no library release to blame
    own = frames.replace("/opt/conda/lib/python3.10/site-packages/deepspeed/runtime/zero/linear.py", "/work/model.py")
    assert "library_version_regression" not in _cats(own + "UnboundLocalError: local variable 'dim' referenced before "
                                                           "assignment")


def test_a_script_that_spawns_its_own_ranks_is_not_dataparallel() -> None:
    log = ("CUDA_VISIBLE_DEVICES=0,1 python tools/train_net.py --config-file cfg.yaml --num-gpus 2 --num-machines 2 "
           "--machine-rank 0 --dist-url tcp://10.0.0.5:3456\n"
           "RuntimeError: training failed")
    a = analyze(log)
    assert "spawns_ranks" in a.parsed.facts and "one_process_many_gpus" not in a.parsed.facts
    assert "dataparallel_accidental" not in _cats(log)
    # the same GPUs with a plain script that spawns nothing is one process driving both
    plain = "CUDA_VISIBLE_DEVICES=0,1 python train.py --config-file cfg.yaml\nRuntimeError: training failed"
    assert "one_process_many_gpus" in analyze(plain).parsed.facts
