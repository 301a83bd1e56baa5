"""A review of the OLDER symptom rules (before round 21), done the way round 21's review probed its own
(tests/test_diagnose_symptoms_probes.py): pastes a user of a fine-tuning stack might write that share a rule's words
but not its cause, and that got a wrong cause ranked first.

Each probe failed before the rule it names was narrowed; each control keeps a right reading of the same rule. The
pastes are made up in the shape such reports take (no corpus's text); the answers they must not get are the wrong
causes the review saw.
"""

from __future__ import annotations

import pytest

from tests.helpers import parsed_facts as _facts
from tests.helpers import ranked_causes as _ranked

_OOM = {"oom_full_replica_per_rank", "oom_activation_not_sharded", "shardfit_predicted_oom", "host_ram_oom"}


# sym_oom: 显存 alone counted as an out-of-memory, and "GPU memory is maxed out" beside a display's trouble
@pytest.mark.parametrize("log", [
    "显存满了但是程序卡住不动",
    "多卡训练时显存占满了，然后就卡死了，没有任何报错",
    "My monitor flickers, GPU memory is maxed out",
    "训练的时候显示器闪烁，显存也满了",
])
def test_a_full_gpu_memory_beside_a_hang_or_a_display_is_no_out_of_memory(log: str) -> None:
    assert "sym_oom" not in _facts(log), log
    assert not set(_ranked(log)[:1]) & _OOM, (log, _ranked(log))


@pytest.mark.parametrize("log", [
    "显存不足，程序卡住了",
    "爆显存了",
    "训练时显存满了然后报错",
    "training crashes after 10 steps, GPU memory is completely full",
])
def test_gpu_memory_running_short_is_still_out_of_memory(log: str) -> None:
    assert "sym_oom" in _facts(log), log


# host_ram_oom: a scheduler's walltime kill read as the kernel's OOM killer
@pytest.mark.parametrize("log", [
    "srun: error: gpu-node07: task 0: Killed\n"
    "slurmstepd: error: *** STEP 123456.0 ON gpu-node07 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME LIMIT ***",
    "{'loss': 0.8123, 'learning_rate': 1.2e-05, 'epoch': 2.4}\n"
    "slurmstepd: error: *** JOB 88211 ON node12 CANCELLED AT 2025-01-09T03:12:44 DUE TO TIME LIMIT ***\nKilled",
    "the job was killed with -9 after hitting the walltime limit",
])
def test_a_scheduler_s_time_limit_is_no_host_oom(log: str) -> None:
    assert "host_ram_oom" not in _ranked(log), (log, _ranked(log))


def test_the_scheduler_s_cancel_line_alone_stays_unanswered() -> None:
    assert _ranked("slurmstepd: error: *** JOB 123456 ON gpu-node07 CANCELLED AT 2024-05-01T10:00:00 DUE TO TIME "
                   "LIMIT ***") == []


@pytest.mark.parametrize("log", [
    "Killed",
    "torch.distributed.elastic.multiprocessing.api:failed (exitcode: -9) local_rank: 0 (pid: 4711) of binary: "
    "/usr/bin/python",
    "slurmstepd: error: Detected 1 oom-kill event(s) in StepId=123.0. Some of your processes may have been killed "
    "by the cgroup out-of-memory handler.\nslurmstepd: error: *** JOB 123 ON node1 CANCELLED AT 2024-05-01T10:00:00 "
    "***",
])
def test_a_kill_with_no_time_limit_or_with_an_oom_kill_named_stays_host_oom(log: str) -> None:
    assert _ranked(log)[:1] == ["host_ram_oom"], (log, _ranked(log))


# sym_one_gpu_used: one GPU by design (evaluation) or by the paste's own reason (CUDA_VISIBLE_DEVICES)
@pytest.mark.parametrize("log", [
    "only the first GPU is used during evaluation",
    "[W] only 1 GPU is being used because CUDA_VISIBLE_DEVICES is set",
    "During generation only one GPU is used, is that expected?",
])
def test_one_gpu_in_use_by_design_or_for_a_given_reason_is_not_the_launch(log: str) -> None:
    cats = _ranked(log)
    assert "dataparallel_accidental" not in cats and "more_ranks_than_gpus" not in cats, (log, cats)


@pytest.mark.parametrize("log", [
    "only the first GPU is used",
    "I have 4 GPUs but only GPU 0 is used during training",
    "只用了一张卡",
])
def test_one_gpu_in_use_while_training_still_ranks_the_launch(log: str) -> None:
    assert _ranked(log)[:1] == ["dataparallel_accidental"], (log, _ranked(log))


# sym_host_mem: a line number 137, an environment dump's RAM size, the user's own Ctrl+C, a walltime in words
@pytest.mark.parametrize("log", [
    'Traceback (most recent call last):\n  File "train.py", line 137, in <module>\n    main()\n'
    '  File "train.py", line 98, in main\n    text = example["text"]\nKeyError: \'text\'',
    "System info: Ubuntu 22.04, RAM: 128 GB, 2x RTX 4090, torch 2.3.0\nTraceback (most recent call last):\n"
    '  File "finetune.py", line 20, in <module>\n    from peft import LoraConfig\nModuleNotFoundError: No module '
    "named 'peft'",
    "I pressed Ctrl+C and the process got killed, how do I resume from the last checkpoint?",
    "The process was killed after 10 hours, I think because of the time limit on our cluster",
    "Training is killed at epoch 3 without any error, our scheduler has a 48h wall time",
])
def test_words_of_a_kill_or_of_ram_that_are_not_the_oom_killer_are_no_host_oom(log: str) -> None:
    assert "host_ram_oom" not in _ranked(log)[:1], (log, _ranked(log))


@pytest.mark.parametrize("log", [
    "Process finished with exit code 137 (interrupted by signal 9: SIGKILL)",
    "The container exited with code 137 while loading checkpoint shards",
    "I have 32 GB VRAM and 16 GB RAM, and the process is killed at loading shards 3/9",
    "Training is killed at epoch 3 without any error",
])
def test_an_exit_137_or_a_kill_beside_little_ram_stays_host_oom(log: str) -> None:
    assert _ranked(log)[:1] == ["host_ram_oom"], (log, _ranked(log))


# fp16_nan_loss: scikit-learn's refusal of NaN in its input is the data's
def test_nan_in_a_library_s_input_check_is_not_a_half_precision_loss() -> None:
    log = "ValueError: Input contains NaN, infinity or a value too large for dtype('float64')."
    assert "fp16_nan_loss" not in _ranked(log), _ranked(log)


def test_a_nan_loss_under_fp16_still_ranks_half_precision() -> None:
    log = "--fp16 True\n{'loss': nan, 'learning_rate': 2e-05, 'epoch': 0.3}"
    assert _ranked(log)[:1] == ["fp16_nan_loss"], _ranked(log)


# warnings a healthy run prints, above a plain error that is the paste's own
@pytest.mark.parametrize(("log", "wrong"), [
    ("torchrun --nproc_per_node 2 train.py\n[W reducer.cpp:1300] Warning: find_unused_parameters=True was specified "
     "in DDP constructor, but did not find any unused parameters in the forward pass. This flag results in an extra "
     "traversal of the autograd graph every iteration, which can adversely affect performance.\n"
     "ValueError: Expected input batch_size (16) to match target batch_size (8).", "ddp_unused_parameters"),
    ("torchrun --nproc_per_node 4 train.py\n`use_cache=True` is incompatible with gradient checkpointing. Setting "
     "`use_cache=False`.\ntorch/utils/checkpoint.py:460: UserWarning: torch.utils.checkpoint: the use_reentrant "
     "parameter should be passed explicitly.\nTypeError: forward() got an unexpected keyword argument 'labels'",
     "gc_ddp_reentrant"),
    ("deepspeed --num_gpus 2 train.py --deepspeed ds_z2.json\n[WARNING] cpu_adam cuda is missing or is incompatible "
     "with installed torch, only cpu ops can be compiled!\nModuleNotFoundError: No module named 'wandb'",
     "library_version_regression"),
    ("llamafactory-cli train qwen_lora.yaml\n[WARNING|logging.py:314] None of the inputs have requires_grad=True. "
     "Gradients will be None\nValueError: Template qwen2 does not exist.", "gc_inputs_no_grad"),
    ("export NCCL_P2P_DISABLE=1\nexport NCCL_IB_DISABLE=1\npython train.py\nIndexError: list index out of range",
     "nccl_p2p_hang"),
])
def test_a_healthy_run_s_warning_or_setting_above_a_plain_error_is_not_its_cause(log: str, wrong: str) -> None:
    assert wrong not in _ranked(log), (log, _ranked(log))


@pytest.mark.parametrize(("log", "right"), [
    ("torchrun --nproc_per_node 2 train.py\nRuntimeError: Expected to have finished reduction in the prior iteration "
     "before starting a new one. This error indicates that your module has parameters that were not used in "
     "producing loss. You can enable unused parameter detection by passing the keyword argument "
     "`find_unused_parameters=True`", "ddp_unused_parameters"),
    ("llamafactory-cli train qwen_lora.yaml\n[WARNING|logging.py:314] None of the inputs have requires_grad=True. "
     "Gradients will be None\nRuntimeError: element 0 of tensors does not require grad and does not have a "
     "grad_fn", "gc_inputs_no_grad"),
    ("2x RTX 4090, NCCL_P2P_DISABLE=1 makes it work\ntorchrun --nproc_per_node 2 train.py hangs at the first "
     "all_reduce", "nccl_p2p_hang"),
])
def test_the_same_words_beside_their_own_failure_keep_their_cause(log: str, right: str) -> None:
    assert right in _ranked(log)[:1], (log, _ranked(log))
