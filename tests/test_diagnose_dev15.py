"""Mechanisms found on the outsiders' batch 15 (dev data): three confident rules narrowed by the fact that tells the
settings apart (the rendezvous keep-alive thread's warning, a launch whose ranks fit its visible GPUs, rank 0's own
watchdog line beside another rank's), out of memory at a micro-batch of one, a local read before assignment in a
library's frame, and a script that spawns its own ranks. Each paste is made up in the shape of the library's message
(its source is cited in causes.yaml or facts.py), not taken from a thread.
"""

from __future__ import annotations

from shardfit.diagnose.engine import analyze
from tests.helpers import likely_categories as _cats

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


# Review of round 18: pastes in the libraries' own formats where those facts claimed too much.


def test_every_rank_of_the_world_timing_out_in_one_collective_is_not_a_rank_that_never_came() -> None:
    # both ranks of a two-rank launch time out at the same SeqNum: every rank entered it (a transport hang)
    both = ("CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 train.py\n"
            " 37%|###7      | 1120/3000 [20:11<33:52,  1.08s/it]\n"
            + "\n".join(_watchdog(r, 4481, 8) for r in (0, 1)))
    assert "nccl_rank0_in_step" not in analyze(both).parsed.facts
    # four ranks launched, two of them in the collective: the others never came
    assert "nccl_rank0_in_step" in analyze(both.replace("--nproc_per_node 2", "--nproc_per_node 4")).parsed.facts
    # two nodes of two ranks: ranks 0 and 1 are half of the world
    two_nodes = both.replace("--nproc_per_node 2", "--nnodes 2 --node_rank 0 --nproc_per_node 2")
    assert "nccl_rank0_in_step" in analyze(two_nodes).parsed.facts


UNBOUND_THEN_LAUNCHER = (
    'Traceback (most recent call last):\n'
    '  File "/home/u/proj/train.py", line 212, in <module>\n'
    '    main()\n'
    '  File "/home/u/proj/train.py", line 188, in main\n'
    '    print(best_acc)\n'
    "UnboundLocalError: cannot access local variable 'best_acc' where it is not associated with a value\n"
    "[2025-03-01 10:00:01,123] torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1) "
    "local_rank: 0 (pid: 4242) of binary: /usr/bin/python3\n"
    'Traceback (most recent call last):\n'
    '  File "/usr/local/bin/torchrun", line 8, in <module>\n'
    '    sys.exit(main())\n'
    '  File "/usr/local/lib/python3.11/dist-packages/torch/distributed/run.py", line 919, in main\n'
    '    run(args)\n'
    '  File "/usr/local/lib/python3.11/dist-packages/torch/distributed/launcher/api.py", line 270, in '
    'launch_agent\n'
    '    raise ChildFailedError(\n'
    'torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n'
    '============================================================\n'
    'train.py FAILED\n')


def test_a_users_own_unbound_local_under_torchrun_is_not_a_library_release() -> None:
    # raised in train.py; the paste's last frame is the launcher's, in its own traceback
    assert "unbound_in_library" not in analyze(UNBOUND_THEN_LAUNCHER).parsed.facts
    # raised in a library's frame, the launcher's traceback after it changes nothing
    lib = UNBOUND_THEN_LAUNCHER.replace(
        '  File "/home/u/proj/train.py", line 188, in main\n',
        '  File "/home/u/proj/train.py", line 188, in main\n    trainer.train()\n'
        '  File "/usr/local/lib/python3.11/dist-packages/transformers/trainer.py", line 2401, in train\n')
    assert "unbound_in_library" in analyze(lib).parsed.facts


def _yaml_oom(eval_batch: int) -> str:
    """LLaMA-Factory's yaml echo (train batch 8, a long cutoff), then out of memory in the training step."""
    return ("### dataset\ncutoff_len: 8192\n### train\nper_device_train_batch_size: 8\n"
            f"gradient_accumulation_steps: 2\nper_device_eval_batch_size: {eval_batch}\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 7.83 GiB. GPU 0 has a total capacity of "
            "79.15 GiB of which 3.10 GiB is free.\n")


def test_an_evaluation_batch_of_one_is_not_the_training_micro_batch() -> None:
    assert "batch_of_one" not in analyze(_yaml_oom(1)).parsed.facts
    assert _cats(_yaml_oom(1))[0] == _cats(_yaml_oom(8))[0] == "oom_activation_not_sharded"
    for other in ("--eval_batch_size 1", "test_batch_size=1", "inference batch size: 1", "val_batch_size: 1"):
        assert "batch_of_one" not in analyze(f"{other}\nCUDA out of memory.").parsed.facts, other
    # the training batch of one still reads, after an evaluation batch on the same line
    assert "batch_of_one" in analyze("--per_device_eval_batch_size=4 --per_device_train_batch_size=1\n"
                                     "CUDA out of memory.").parsed.facts
    # a command line's flag and its value apart (argparse takes both forms), not a bound in prose
    for flag in ("--per_device_train_batch_size 1", "--micro_batch_size  1", "--train_batch_size\t1 --lr 2e-5"):
        assert "batch_of_one" in analyze(f"{flag}\nCUDA out of memory.").parsed.facts, flag
    for other in ("--per_device_eval_batch_size 1", "--per_device_train_batch_size 16", "batch size greater than 1",
                  "--per_device_train_batch_size 1.5"):
        assert "batch_of_one" not in analyze(f"{other}\nCUDA out of memory.").parsed.facts, other


def test_a_launchers_machine_count_or_a_dist_url_alone_spawns_no_ranks() -> None:
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "79.15 GiB of which 1.10 GiB is free.\n")
    accel = "accelerate launch --num_machines 1 --num_processes 1 --mixed_precision bf16 train.py\nn_gpu: 4\n" + oom
    a = analyze(accel)
    assert "spawns_ranks" not in a.parsed.facts and "one_process_many_gpus" in a.parsed.facts
    # a DeiT / MAE style script takes --dist_url under torchrun; started with python it is one process
    plain = ("CUDA_VISIBLE_DEVICES=0,1,2,3 python main.py --model vit_base --batch_size 64 --dist_url env://\n"
             "ValueError: Error initializing torch.distributed using env:// rendezvous: environment variable RANK "
             "expected, but not set\n")
    assert "spawns_ranks" not in analyze(plain).parsed.facts
    assert "one_process_many_gpus" in analyze(plain).parsed.facts
    # with mp.spawn in the paste the same flag is a script that starts its own ranks
    spawned = plain + '  File "/usr/lib/python3/dist-packages/torch/multiprocessing/spawn.py", line 69, in _wrap\n'
    assert "spawns_ranks" in analyze(spawned).parsed.facts


def test_a_second_node_fits_its_gpus_but_not_the_global_rank() -> None:
    # nproc_per_node 4 of 4 visible on node 1 of 2: a script choosing the device by RANK reaches ordinals 4 to 7
    log = ("CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nnodes=2 --node_rank=1 --nproc_per_node=4 "
           "--master_addr=10.0.0.1 --master_port=29500 train.py\n"
           '  File "/home/u/train.py", line 30, in main\n    torch.cuda.set_device(int(os.environ["RANK"]))\n'
           "RuntimeError: CUDA error: invalid device ordinal\n")
    assert "ranks_fit_gpus" not in analyze(log).parsed.facts
    assert "ranks_fit_gpus" not in analyze(log.replace("--nnodes=2 --node_rank=1 ", "--nnodes=2 ")).parsed.facts
    assert "ranks_fit_gpus" not in analyze(log.replace("--nnodes=2 ", "")).parsed.facts
    assert "ranks_fit_gpus" in analyze(log.replace("--nnodes=2 --node_rank=1 ", "--nnodes=1 ")).parsed.facts
    # a single node spelled out (torch.distributed.launch's --nnodes=1 --node_rank=0) is the whole world
    one = log.replace("--nnodes=2 --node_rank=1 ", "--nnodes=1 --node_rank=0 ")
    assert "ranks_fit_gpus" in analyze(one).parsed.facts
