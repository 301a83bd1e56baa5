"""A review's probes of the symptom families in words (round 21, tests/test_diagnose_symptoms.py): pastes a user might
write that share a family's words but not its symptom, and that got a ranked answer naming the wrong cause.

Each probe is one that fooled the first version of the families: a GPU's temperature or a loss that "keeps rising"
read as GPU memory growth, a download or a tokenizer that is slow as NCCL without peer-to-peer, torch that runs on the
CPU as a launch that uses one GPU, a hang whose GPU memory "is full" as an out-of-memory, and a negated "works on one
GPU" as one GPU working. The pastes are made up in the shape such reports take; the answers they must not get are the
wrong causes the review saw.
"""

from __future__ import annotations

import pytest

from tests.helpers import parsed_facts as _facts
from tests.helpers import ranked_causes as _ranked


@pytest.mark.parametrize("log", [
    "GPU temperature keeps rising to 90C during training",
    "When training on the GPU, the loss keeps increasing after a few epochs",
    "GPU utilization keeps going up and down between 0% and 100%",
    "The GPU memory doesn't keep growing, but the loss is nan after 100 steps",
    "GPU memory stays flat but system memory keeps growing until the process is killed",
])
def test_words_beside_gpu_that_are_not_its_memory_growing_are_no_growth(log: str) -> None:
    assert "sym_gpu_mem_growth" not in _facts(log), log
    assert "oom_activation_not_sharded" not in _ranked(log)[:1], (log, _ranked(log))


@pytest.mark.parametrize("log", [
    "GPU memory keeps growing every step until it runs out",
    "VRAM usage grows steadily each epoch, looks like a memory leak on the GPU",
    "the GPU memory usage keeps increasing during training",
    "CUDA memory is slowly increasing over time",
])
def test_gpu_memory_growth_in_words_is_still_read(log: str) -> None:
    assert "sym_gpu_mem_growth" in _facts(log), log


@pytest.mark.parametrize("log", [
    "Tokenization of the dataset is very slow on 2x RTX 3090",
    "Saving the checkpoint is very slow on my 2 RTX 4090 GPUs",
    "torchrun --nproc_per_node 2 train.py on 2x RTX 4090\nDownloading model is slow",
    "I trained on RTX 3090 x2 with torchrun, slowly the loss went down to 0.5, is this normal?",
    "The first step is slow with 2x RTX 4090, then it speeds up",
])
def test_slowness_that_is_not_the_training_steps_is_not_peer_to_peer(log: str) -> None:
    assert "nccl_p2p_hang" not in _ranked(log), (log, _ranked(log))


@pytest.mark.parametrize("log", [
    "torchrun --nproc_per_node 2 train.py\ntraining on 2x RTX 4090 is much slower than on one GPU",
    "torchrun --nproc_per_node 2 train.py\n2x RTX 3090: the training steps are very slow, no speedup over 1 GPU",
    "torchrun --nproc_per_node 2 train.py\n两张4090多卡训练很慢",
])
def test_a_slow_multi_gpu_training_on_consumer_cards_still_ranks_peer_to_peer(log: str) -> None:
    assert "nccl_p2p_hang" in _ranked(log), (log, _ranked(log))


@pytest.mark.parametrize("log", [
    "pytorch doesn't use my GPUs, everything runs on the CPU",
    "torch.cuda.is_available() returns False, training does not use my gpus",
    "torch.cuda.device_count() returns 1 but I have 2 GPUs, only one GPU is used",
    "vLLM only uses one GPU even though I have 4 GPUs",
    "only 1 GPU is being used because I set CUDA_VISIBLE_DEVICES=0",
])
def test_one_gpu_in_use_for_a_reason_the_paste_gives_is_not_the_launch(log: str) -> None:
    cats = _ranked(log)
    assert "dataparallel_accidental" not in cats and "more_ranks_than_gpus" not in cats, (log, cats)


@pytest.mark.parametrize("log", [
    "The training is stuck at step 0 with 4 GPUs, GPU memory is full and utilization shows 100%",
    "torchrun --nproc_per_node 4 train.py\ntraining hangs at the first step, GPU memory is full and GPU util stays at "
    "100%",
])
def test_a_hang_whose_gpu_memory_is_full_stays_a_hang(log: str) -> None:
    cats = _ranked(log)
    assert cats and cats[0] == "nccl_p2p_hang", (log, cats)


def test_gpu_memory_that_is_full_with_no_hang_is_still_out_of_memory() -> None:
    assert "sym_oom" in _facts("training crashes after 10 steps, GPU memory is completely full")


@pytest.mark.parametrize("log", [
    "multi-GPU training fails, and it does not work for one GPU either",
    "单卡也跑不通，多卡报错",
    "单卡多卡都跑不通",
])
def test_one_gpu_failing_too_is_not_one_gpu_working(log: str) -> None:
    assert "sym_single_gpu_ok" not in _facts(log), log


@pytest.mark.parametrize("log", [
    "multi-GPU training fails but it works fine for a single GPU",
    "多卡报错，单卡能跑通",
])
def test_one_gpu_working_in_words_is_still_read(log: str) -> None:
    assert "sym_single_gpu_ok" in _facts(log), log


@pytest.mark.parametrize("log", [
    "torchrun --nproc_per_node 2 train.py\nGPU 0: NVIDIA GeForce RTX 4090\nGPU 1: NVIDIA GeForce RTX 4090\n"
    "[WARNING] gradient checkpointing makes each training step slower but saves memory\n"
    "  5%|▌         | 50/1000 [00:50<15:50,  1.00s/it]\n{'loss': 1.23, 'learning_rate': 1e-4, 'epoch': 0.1}",
    "deepspeed --num_gpus 2 train.py\n2x RTX 3090\n[INFO] throughput is low on first iteration due to warmup",
])
def test_a_library_s_log_line_about_speed_is_not_the_reporter_s_slowness(log: str) -> None:
    """A warning or an info line of a healthy run that says "slower" is the library's remark, not a symptom."""
    assert "sym_slow" not in _facts(log), log
    assert "nccl_p2p_hang" not in _ranked(log), (log, _ranked(log))


def test_a_model_on_the_cpu_while_loading_leaves_the_one_gpu_ranking() -> None:
    """Only torch itself on the CPU explains one GPU in use; a model that sits there while loading does not."""
    cats = _ranked("The model stays on cpu during loading, then only one GPU is used out of 4")
    assert cats[:1] == ["dataparallel_accidental"], cats
