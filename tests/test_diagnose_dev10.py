"""Mechanisms found on the outsiders' batch 10 (dev since it was replaced as the blind set): threads of general
PyTorch training code whose messages come from torch, NCCL or the reporter's own words rather than the fine-tuning
stacks. Each paste is made up in the shape of the library's message (cited in causes.yaml), not taken from a thread.
"""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze, generic_steps
from tests.diagnose_real.evaluate import CONFIDENT
from tests.helpers import likely_categories as _cats

# torch >= 2.0's launcher passes --local-rank=N; a script that only parses --local_rank stops on every rank
LOCAL_RANK = """usage: train_seg.py [-h] [--config CONFIG] [--local_rank LOCAL_RANK]
train_seg.py: error: unrecognized arguments: --local-rank=3
ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 2) local_rank: 3 (pid: 4121) of binary: python
"""


def test_torch2_launcher_local_rank_is_a_version_change() -> None:
    assert _cats(LOCAL_RANK)[0] == "library_version_regression"
    # the rename in the reporter's words, both spellings on one line
    assert _cats("Should the parser accept --local-rank as well as --local_rank with torch 2.1?")[0] == \
        "library_version_regression"


def test_ddp_refusing_a_module_on_several_gpus_is_a_split_model_under_a_launch() -> None:
    log = ("ValueError: DistributedDataParallel device_ids and output_device arguments only work with "
           "single-device/multiple-device GPU modules or CPU modules, but got device_ids [0], output_device 0, and "
           "module parameters {device(type='cuda', index=0), device(type='cuda', index=2)}.")
    a = analyze(log)
    assert a.likely[0].category == "device_map_auto_in_distributed"
    assert a.answer != "confident"  # a hand-made model parallel prints it too: ranked, not asserted


@pytest.mark.parametrize("line", [
    "gpu-b:811:902 [0] misc/socket.cc:484 NCCL WARN socketPollConnect: connect to 10.1.0.7<39211> returned "
    "Connection refused, exceeded error retry count after 35 attempts",
    "node2:77:90 [0] NCCL WARN socketProgressOpt: connect returned No route to host, exceeded error retry count (35)",
])
def test_nccl_giving_up_on_another_ranks_address_is_unreachable(line: str) -> None:
    assert _cats(line)[0] == "rendezvous_unreachable"


def test_a_socket_closed_by_its_remote_peer_is_not_gpu_peer_to_peer() -> None:
    log = """h1:500:610 [1] NCCL INFO cudaDev 1 busId 3000 - Init START (RTX 3090)
h1:500:611 [1] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer h2<51012>
h1:500:611 [1] proxy.cc:884 NCCL WARN Proxy Call to rank 1 failed (Connect)
"""
    cats = _cats(log)
    assert "rendezvous_unreachable" in cats[:3]
    # the RTX card alone is no evidence of P2P when NCCL's socket names the other process as the one that closed
    assert cats[0] != "nccl_p2p_hang", cats
    assert _cats(log.replace("Connection closed by remote peer", "Could not enable P2P between dev 1 and dev 0"))[0] \
        == "nccl_p2p_hang"
    # evidence names the rule (its regex), not the matched line: no NCCL WARN rule of P2P's may fire on these lines
    p2p = [e for x in analyze(log).likely if x.category == "nccl_p2p_hang" for e in x.evidence]
    assert not any(e.startswith("re /NCCL WARN") for e in p2p), p2p


def test_nccl_out_of_memory_ranks_memory_not_p2p() -> None:
    log = ("n1:40:40 [3] include/alloc.h:103 NCCL WARN Cuda failure 2 'out of memory'\n"
           "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1275, unhandled cuda "
           "error, NCCL version 2.18.1\nncclUnhandledCudaError: Call to CUDA function failed.\n")
    cats = _cats(log)
    assert cats[0].startswith("oom_") and "nccl_p2p_hang" not in cats


def test_too_many_open_files_is_the_fd_limit_not_shm() -> None:
    log = ("RuntimeError: unable to open shared memory object </torch_9120_2231984713_12> in read-write mode: "
           "Too many open files (24)")
    a = analyze(log)
    assert "shm_too_small" not in [x.category for x in a.likely]
    assert any("ulimit -n" in s for s in generic_steps(a.parsed))
    # the same object with a full /dev/shm stays shared memory
    assert _cats(log.replace("Too many open files (24)", "No space left on device (28)"))[0] == "shm_too_small"


def test_c10d_localhost_errno_99_warning_is_harmless_before_another_error() -> None:
    warn = ("[W socket.cpp:663] [c10d] The client socket has failed to connect to [localhost]:29500 "
            "(errno: 99 - Cannot assign requested address).")
    later = warn + "\nTraceback (most recent call last):\n  File \"fit.py\", line 41, in <module>\n" \
        "    batch = next(it)\nKeyError: 'mask'"
    cats = _cats(later)
    assert "rendezvous_unreachable" not in cats and "nccl_env_setup" not in cats
    # alone (a run that never gets further) it is still the likely rendezvous problem
    assert _cats(warn)[0] == "rendezvous_unreachable"


@pytest.mark.parametrize(("log", "label"), [
    ("Eval outputs turn into NaNs after 40k steps; I train with fp16 mixed precision.", "fp16_nan_loss"),
    ("With gradient checkpoint on and LoRA, all gradients are None and the adapters never change.",
     "gc_inputs_no_grad"),
    ("微调进程被系统终止 (Code -9)", "host_ram_oom"),
    ("Trained with `ds_config/stage3.json` on two L40; what I saved holds only "
     "{'base.proj.weight': tensor([], device='cuda:0', dtype=torch.float16)}", "zero3_save_empty_params"),
    ("The GPUs sit idle for more than 30 mins while rank 0 is preparing the dataset, then the job dies.",
     "nccl_timeout_preprocessing"),
])
def test_the_reporters_spelling_of_a_setting_or_symptom(log: str, label: str) -> None:
    cats = _cats(log)
    assert cats and cats[0] == label, cats
    assert analyze(log).likely[0].confidence < CONFIDENT


def test_the_dataloader_message_with_its_pids_written_as_a_placeholder() -> None:
    """torch/utils/data/dataloader.py raises "DataLoader worker (pid(s) 123, 456) exited unexpectedly"; retold in a
    title or a post the pids become a placeholder. Both memory causes of a dead worker rank."""
    cats = _cats("How to fix 'DataLoader worker (pid(s) xxx) exited unexpectedly' in long training runs")
    assert {"host_ram_oom", "shm_too_small"} <= set(cats[:3])


def test_mpiexec_counts_as_a_launch_of_several_processes() -> None:
    a = analyze("mpiexec -n 4 python scripts/train.py --batch 32\nit hangs at the first step, nothing printed")
    assert {"launcher", "multi_rank"} <= a.parsed.facts
    assert "nccl_p2p_hang" in [x.category for x in a.likely][:3]


# Review of round 13: the symptom words above must not fire on their negations or on look-alike lines.

def test_an_empty_batch_tensor_is_not_a_zero3_placeholder() -> None:
    log = ("deepspeed --num_gpus 2 train.py --deepspeed ds_z3.json\n"
           "IndexError: index 0 is out of bounds for dimension 0 with size 0\n"
           'print(batch["labels"]) -> tensor([], device="cuda:0", dtype=torch.int64)\n')
    a = analyze(log)
    assert "sym_zero_size" not in a.parsed.facts
    assert "zero3_save_empty_params" not in [x.category for x in a.likely]
    # a parameter printed by torch is the placeholder
    param = "Parameter containing:\ntensor([], device='cuda:0', dtype=torch.bfloat16, requires_grad=True)"
    assert "sym_zero_size" in analyze("ds_z3.json\n" + param).parsed.facts


@pytest.mark.parametrize("text", [
    "I fine-tune with LoRA without gradient checkpointing (it is off).",
    "args = TrainingArguments(output_dir='out', gradient_checkpointing=False, bf16=True)",
    "torchrun train.py --lora_r 8 --gradient_checkpointing False",
    "fsdp_activation_checkpointing: false",
    "LoRA run; gradient checkpointing is disabled.",
])
def test_checkpointing_named_as_off_is_not_checkpointing(text: str) -> None:
    assert "grad_ckpt" not in analyze(text).parsed.facts
    log = text + " The adapter weights are not updated and the loss stays flat."
    assert "gc_inputs_no_grad" not in _cats(log)[:1]


@pytest.mark.parametrize("text", ["model.gradient_checkpointing_enable()", "--gradient_checkpointing True",
                                  "gradient checkpointing on", "gradient_checkpointing: true"])
def test_checkpointing_named_as_on_is_checkpointing(text: str) -> None:
    assert "grad_ckpt" in analyze(text).parsed.facts


def test_gradients_that_are_not_none_are_not_the_none_gradients_hint() -> None:
    log = ("gradient_checkpointing: true\n"
           "I checked after backward: the lora grads are not None, yet the eval loss stays at 2.31.\n")
    assert "gc_inputs_no_grad" not in _cats(log)
    assert _cats(log.replace("are not None", "are all None"))[0] == "gc_inputs_no_grad"


def test_a_library_error_code_minus_9_is_not_the_oom_killer() -> None:
    a = analyze("ERROR: failed to load model, error code -9 (invalid file header)")
    assert "sym_host_mem" not in a.parsed.facts
    assert "host_ram_oom" not in [x.category for x in a.likely]


def test_open_mpi_processes_per_node_is_not_the_world_size() -> None:
    a = analyze("mpirun -N 1 --hostfile hosts.txt python train.py\n"
                "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, OpType=ALLREDUCE)\n")
    assert a.parsed.world_size is None
    assert not {"one_rank", "multi_rank"} & a.parsed.facts
    # the process count after other options; the program's own -n is not mpirun's
    a = analyze("mpirun --allow-run-as-root --hostfile hosts -np 8 python train.py -n 3\nit hangs")
    assert a.parsed.world_size == 8 and "multi_rank" in a.parsed.facts


def test_thirty_minutes_preparing_the_model_is_not_data_preparation() -> None:
    log = ("The job fails after 30 minutes preparing the model with deepspeed.initialize: "
           "Watchdog caught collective operation timeout")
    ev = [e for x in analyze(log).likely if x.category == "nccl_timeout_preprocessing" for e in x.evidence]
    assert ev and not any("30 ?(minutes" in e for e in ev), ev
    ev = [e for x in analyze(log.replace("the model", "the data")).likely
          if x.category == "nccl_timeout_preprocessing" for e in x.evidence]
    assert any("30 ?(minutes" in e for e in ev), ev


def test_c10d_errno_99_warning_before_a_watchdog_timeout_is_harmless() -> None:
    """A watchdog timing a collective out means the ranks met at the rendezvous: the connect warning before it was
    one address of localhost failing before another connected."""
    log = ("[W socket.cpp:663] [c10d] The client socket has failed to connect to [localhost]:29500 "
           "(errno: 99 - Cannot assign requested address).\n"
           "[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1, OpType=ALLREDUCE, "
           "Timeout(ms)=1800000) ran for 1800102 milliseconds before timing out.\n")
    assert "rendezvous_unreachable" not in _cats(log)


@pytest.mark.parametrize("log", [
    "I fine-tune with LoRA and save a checkpoint every epoch under DDP; the loss does not change.",
    "After tokenizing the dataset the eval loss does not change across 4 GPUs.",
])
def test_hang_words_are_whole_words(log: str) -> None:
    """"change" holds "hang": the save, preprocessing and rendezvous hints read hang/hung/stuck as words only."""
    cats = _cats(log)
    assert "nccl_timeout_save" not in cats and "nccl_timeout_preprocessing" not in cats, cats
