"""`shardfit diagnose` on thin evidence (round 8): error families that got no answer at all, a bare dtype clash, a
kernel that faults in memory, the c10d store's own 30-minute wait, an hf_device_map over two GPUs, FSDP's device_id
clash, a vocabulary of size 0, a reduction message cut short and "fails on multiple GPUs" in the reporter's words.
Each paste is made up in the shape such threads have; each now gets a ranked list, never a confident answer, and
ordinary errors that only share a word with them stay unanswered."""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze


def _likely(log: str) -> list[str]:
    a = analyze(log)
    assert a.answer == "likely", (log, a.answer, [(x.category, x.confidence) for x in a.likely])
    assert all(x.confidence < 0.8 for x in a.likely)
    return [x.category for x in a.likely]


@pytest.mark.parametrize("log", [
    "RuntimeError: expected scalar type Half but found Float",
    "RuntimeError: mat1 and mat2 must have the same dtype, but got BFloat16 and Float",
    "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float",
])
def test_a_bare_dtype_clash_ranks_a_version_and_mixed_dtypes(log: str) -> None:
    cats = _likely(log)
    assert cats[:2] == ["library_version_regression", "fsdp_mixed_dtype"], cats


def test_a_dtype_clash_under_fsdp_is_mixed_dtypes_first_and_quant_storage_with_4bit() -> None:
    cats = _likely("accelerate launch --config_file fsdp.yaml train.py\n"
                   "RuntimeError: expected scalar type BFloat16 but found Float")
    assert cats[0] == "fsdp_mixed_dtype", cats
    cats = _likely("fsdp_sharding_strategy: FULL_SHARD\nload_in_4bit: true\n"
                   "RuntimeError: mat1 and mat2 must have the same dtype")
    assert cats[:2] == ["fsdp_qlora_quant_storage", "fsdp_mixed_dtype"], cats  # 4-bit storage under FSDP first


def test_an_illegal_memory_access_ranks_extensions_then_versions_then_vocabulary() -> None:
    cats = _likely("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert cats == ["extension_abi_mismatch", "library_version_regression", "tokenizer_embedding_mismatch"], cats
    # inside NCCL, the communicator's setup is the first suspect
    cats = _likely("NCCL WARN Cuda failure 'an illegal memory access was encountered'")
    assert cats[0] == "nccl_env_setup", cats
    a = analyze("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert "CUDA_LAUNCH_BLOCKING=1" in a.likely[0].check or "wheel" in a.likely[0].check


def test_the_stores_thirty_minute_wait_is_preprocessing_first() -> None:
    line = ("[rank1]:[W516 14:34:56.854597329 socket.cpp:489] [c10d] waitForInput: socket SocketImpl(fd=79, "
            "addr=[localhost]:41170, remote=[localhost]:29500) timed out after 1800000ms")
    cats = _likely(line)
    assert cats == ["nccl_timeout_preprocessing", "nccl_timeout_save", "rendezvous_unreachable"], cats
    assert "rank 0" in analyze(line).likely[0].check


def test_an_hf_device_map_over_two_gpus_is_a_split_model() -> None:
    dm = "model.hf_device_map: {'model.embed_tokens': 0, 'model.layers.20': 1, 'lm_head': 1}"
    assert _likely(dm)[0] == "device_map_auto_cross_device"
    assert _likely("torchrun --nproc_per_node 2 train.py\n" + dm)[0] == "device_map_auto_in_distributed"


def test_fsdps_device_id_clash_ranks_the_script_and_a_device_map() -> None:
    cats = _likely("ValueError: Inconsistent compute device and `device_id` on rank 3: cuda:0 vs cuda:3")
    assert cats[:2] == ["library_version_regression", "device_map_auto_in_distributed"], cats


def test_a_vocabulary_of_size_zero_is_an_ungathered_zero3_partition() -> None:
    assert _likely("Model vocab size: 0")[0] == "zero3_save_empty_params"


def test_a_truncated_reduction_message_keeps_the_three_causes_in_view() -> None:
    cats = _likely("[1] RuntimeError: Expected to have finished reductio")
    assert cats == ["ddp_unused_parameters", "gc_ddp_reentrant", "gc_inputs_no_grad"], cats


@pytest.mark.parametrize("log", ["Train with multiple GPU - errors", "多卡训练报错",
                                 "training on multiple GPUs doesn't work, it crashes every time"])
def test_fails_on_multiple_gpus_in_words_ranks_nccl_and_the_process_count(log: str) -> None:
    assert _likely(log) == ["nccl_p2p_hang", "nccl_env_setup", "more_ranks_than_gpus"]


# Each new family next to an ordinary error that only shares a word with it: the first is answered, the second not.
@pytest.mark.parametrize(("thin", "ordinary"), [
    ("Train with multiple GPU - errors",
     "I get an error when running on multiple GPUs: KeyError: 'input_ids'"),  # the exception decides, not the words
    ("model.hf_device_map: {'model.embed_tokens': 0, 'lm_head': 1}", "model.hf_device_map: {'': 0}"),
    ("RuntimeError: expected scalar type Half but found Float",
     "RuntimeError: Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same"),
    ("Model vocab size: 0", "Model vocab size: 32000"),
])
def test_errors_that_only_share_a_word_stay_unanswered(thin: str, ordinary: str) -> None:
    assert _likely(thin)
    a = analyze(ordinary)
    assert a.answer == "none", (ordinary, [(x.category, x.confidence) for x in a.likely])
