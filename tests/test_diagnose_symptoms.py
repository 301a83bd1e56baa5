"""`shardfit diagnose` on pastes that only describe the failure in words: no exception, no traceback, a symptom.

Issue 46 asks for "a ranked list of the likely causes in this setting ... each with the one thing to check that tells
them apart". A described symptom (GPU memory that keeps growing, one GPU doing all the work, a run killed with only
the launcher's exit code, several GPUs failing where one works) is shared by several causes, so the answer is a
ranked list, never a confident one, and the setting the paste shows (launcher, device_map, several nodes, consumer
cards) decides the order. Each paste is made up in the shape such reports take; the controls at the end are prose
that names no failure of a run and stays unanswered.
"""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze
from shardfit.diagnose.likely import CONFIDENT


def _likely(log: str) -> list[str]:
    """The ranked causes of a symptom-only paste, checking it is answered as a ranking, never with confidence, and
    that every cause carries a check."""
    a = analyze(log)
    assert a.answer == "likely", (log, a.answer, [(x.category, x.confidence) for x in a.likely])
    assert all(x.confidence < CONFIDENT for x in a.likely)
    assert all(x.check for x in a.likely)
    return [x.category for x in a.likely]


@pytest.mark.parametrize("log", [
    "GPU memory keeps growing every step until it runs out",
    "The GPU memory usage keeps increasing during training and finally goes OOM",
    "训练过程中显存一直增长，最后爆显存",
    "torchrun --nproc_per_node 4 train.py\nVRAM usage grows steadily each epoch, looks like a memory leak on the GPU",
])
def test_gpu_memory_that_keeps_growing_ranks_activations_first(log: str) -> None:
    cats = _likely(log)
    assert cats[0] == "oom_activation_not_sharded", cats
    assert "host_ram_oom" not in cats[:1]  # the GPU's memory, not the host's


def test_gpu_memory_growth_names_the_longest_batch_in_its_check() -> None:
    a = analyze("GPU memory keeps growing every step until it runs out")
    assert "longest" in a.likely[0].check, a.likely[0].check


def test_host_memory_that_keeps_growing_is_host_ram_not_activations() -> None:
    cats = _likely("CPU memory keeps growing during training until the machine runs out of RAM")
    assert cats[0] == "host_ram_oom", cats
    assert "oom_activation_not_sharded" not in cats


@pytest.mark.parametrize("log", [
    "only one GPU is used although I have 4 GPUs",
    "python train.py\nI have 8 GPUs but only GPU 0 is being used, the rest stay at 0%",
    "我有4张卡，但是只用了一张卡",
])
def test_one_gpu_used_without_a_launcher_asks_for_the_launch(log: str) -> None:
    cats = _likely(log)
    assert cats[0] == "dataparallel_accidental", cats
    assert "launcher" in analyze(log).likely[0].check or "torchrun" in analyze(log).likely[0].check


@pytest.mark.parametrize("log", [
    "torchrun --nproc_per_node 4 train.py\nonly one GPU is used, all the processes sit on GPU 0",
    "accelerate launch --num_processes 2 train.py\nBut only the first GPU is utilized, GPU 1 stays idle",
])
def test_one_gpu_used_under_a_launcher_is_every_rank_on_cuda0(log: str) -> None:
    cats = _likely(log)
    assert cats[0] == "more_ranks_than_gpus", cats
    assert "set_device" in analyze(log).likely[0].check


def test_one_gpu_busy_at_a_time_with_device_map_is_the_split_model() -> None:
    cats = _likely('model = AutoModelForCausalLM.from_pretrained(name, device_map="auto")\n'
                   "only one GPU is used at a time, the others wait at 0% utilization")
    assert cats[0] == "device_map_auto_cross_device", cats


@pytest.mark.parametrize("log", [
    "exits with return code -9",
    "torchrun --nproc_per_node 8 train.py\nthe job just dies with exit code -9, no traceback",
    "The process exited with code 137 while loading the model",
])
def test_a_bare_kill_code_ranks_host_memory(log: str) -> None:
    assert _likely(log)[0] == "host_ram_oom"


@pytest.mark.parametrize("log", [
    "multi-GPU training fails but single GPU works fine",
    "多卡运行后报错，单卡是可以的",
])
def test_several_gpus_failing_where_one_works_gets_a_ranking(log: str) -> None:
    cats = _likely(log)
    assert len(cats) >= 2, cats
    assert set(cats) <= {"more_ranks_than_gpus", "nccl_env_setup", "nccl_p2p_hang", "device_map_auto_in_distributed",
                         "dataparallel_accidental"}, cats


def test_several_gpus_failing_with_an_llm_loaded_by_device_map_ranks_the_device_map() -> None:
    cats = _likely("LoRA fine-tuning ChatGLM with device_map='auto': multi-GPU training fails, single GPU works")
    assert cats[0] == "device_map_auto_in_distributed", cats


def test_several_gpus_failing_on_consumer_cards_ranks_peer_to_peer() -> None:
    cats = _likely("two RTX 4090: training on multiple GPUs does not work, one GPU works fine")
    assert cats[0] == "nccl_p2p_hang", cats


def test_a_slow_multi_gpu_run_on_consumer_cards_ranks_peer_to_peer_after_dataparallel() -> None:
    cats = _likely("torchrun --nproc_per_node 2 train.py\ntraining on 2x RTX 4090 is much slower than on one GPU")
    assert "nccl_p2p_hang" in cats, cats


@pytest.mark.parametrize("log", [
    "How do I change the learning rate schedule?",
    "The model's answers are worse after fine-tuning, is this normal?",
    "Thanks for the great work! Which GPU did you use for the experiments?",
    "Training takes 3 hours per epoch on one GPU, is that expected?",
    "Memory usage of the dataset is 20 GB on disk",
])
def test_prose_that_names_no_failure_stays_unanswered(log: str) -> None:
    a = analyze(log)
    assert a.answer == "none", (log, [(x.category, x.confidence) for x in a.likely])
