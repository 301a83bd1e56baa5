"""`shardfit diagnose` on thin evidence (round 8): error families that got no answer at all, a bare dtype clash, a
kernel that faults in memory, the c10d store's own 30-minute wait, an hf_device_map over two GPUs, FSDP's device_id
clash, a parameter of size 0, a reduction message cut short and "fails on multiple GPUs" in the reporter's words.
Each paste is made up in the shape such threads have; each now gets a ranked list, never a confident answer, and
ordinary errors that only share a word with them stay unanswered (the controls at the end: a user's own dtype,
data, kernel or convergence bug, a split model next to an unrelated error)."""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze


def _likely(log: str) -> list[str]:
    a = analyze(log)
    assert a.answer == "likely", (log, a.answer, [(x.category, x.confidence) for x in a.likely])
    assert all(x.confidence < 0.8 for x in a.likely)
    return [x.category for x in a.likely]


MIXED = "python train.py --bf16 --lora_r 16\n"


@pytest.mark.parametrize("log", [
    "RuntimeError: expected scalar type Half but found Float",
    "RuntimeError: mat1 and mat2 must have the same dtype, but got BFloat16 and Float",
    "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: c10::BFloat16 != float",
])
def test_a_half_float_clash_in_mixed_precision_training_ranks_a_version_not_fsdp(log: str) -> None:
    assert _likely(MIXED + log) == ["library_version_regression"]  # no FSDP shown: no FSDP cause
    assert analyze(log).answer == "none"  # no setting shown: nothing a 16-bit/32-bit clash can be pinned on


def test_a_dtype_clash_under_fsdp_is_mixed_dtypes_first_and_quant_storage_with_4bit() -> None:
    cats = _likely("accelerate launch --config_file fsdp.yaml train.py\n"
                   "RuntimeError: expected scalar type BFloat16 but found Float")
    assert cats[0] == "fsdp_mixed_dtype", cats
    cats = _likely("fsdp_sharding_strategy: FULL_SHARD\nload_in_4bit: true\n"
                   "RuntimeError: mat1 and mat2 must have the same dtype, but got Float and BFloat16")
    assert cats[:2] == ["fsdp_qlora_quant_storage", "fsdp_mixed_dtype"], cats  # 4-bit storage under FSDP first


def test_an_illegal_memory_access_ranks_extensions_then_versions_then_vocabulary() -> None:
    cats = _likely("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert cats == ["extension_abi_mismatch", "library_version_regression", "tokenizer_embedding_mismatch"], cats
    # inside NCCL, the communicator's setup is the first suspect
    cats = _likely("NCCL WARN Cuda failure 'an illegal memory access was encountered'")
    assert cats[0] == "nccl_env_setup", cats
    a = analyze("RuntimeError: CUDA error: an illegal memory access was encountered")
    assert "wheel name" in a.likely[0].check  # the extension's own check
    assert "library kernel" in a.likely[1].check and "resize_token_embeddings" in a.likely[2].check  # the hints'


@pytest.mark.parametrize("frame", [
    '  File "/opt/conda/lib/python3.10/site-packages/flash_attn/flash_attn_interface.py", line 51, in _fwd',
    '  File "/opt/conda/lib/python3.10/site-packages/torch/nn/functional.py", line 2264, in embedding',
])
def test_a_memory_fault_in_an_extension_or_torch_frame_keeps_its_ranking_under_deepspeed(frame: str) -> None:
    cats = _likely("deepspeed train.py --deepspeed zero3.json\n" + frame +
                   "\nRuntimeError: CUDA error: an illegal memory access was encountered")
    assert set(cats) == {"extension_abi_mismatch", "library_version_regression", "tokenizer_embedding_mismatch"}


def test_the_stores_thirty_minute_wait_is_preprocessing_first() -> None:
    line = ("[rank3]:[W1102 08:12:40.118204511 socket.cpp:489] [c10d] waitForInput: socket SocketImpl(fd=61, "
            "addr=[localhost]:50812, remote=[localhost]:29511) timed out after 1800000ms")
    cats = _likely(line)
    assert cats == ["nccl_timeout_preprocessing", "nccl_timeout_save", "rendezvous_unreachable"], cats
    assert "rank 0" in analyze(line).likely[0].check


def test_an_hf_device_map_over_two_gpus_is_a_split_model() -> None:
    dm = "model.hf_device_map: {'model.embed_tokens': 0, 'model.layers.20': 1, 'lm_head': 1}"
    assert _likely(dm)[0] == "device_map_auto_cross_device"
    assert _likely("torchrun --nproc_per_node 2 train.py\n" + dm)[0] == "device_map_auto_in_distributed"
    # the HF Trainer's argument echo of a one-process run is no launcher
    assert _likely("TrainingArguments(\n_n_gpu=2,\nlocal_rank=-1,\n)\n" + dm)[0] == "device_map_auto_cross_device"


def test_fsdps_device_id_clash_ranks_the_script_and_a_device_map() -> None:
    cats = _likely("ValueError: Inconsistent compute device and `device_id` on rank 3: cuda:0 vs cuda:3")
    assert cats[:2] == ["library_version_regression", "device_map_auto_in_distributed"], cats


@pytest.mark.parametrize("log", [
    "ValueError: the embedding weight has shape torch.Size([0]), expected a 2-D matrix",
    "deepspeed train.py --deepspeed ds_z3.json\n"
    "RuntimeError: The size of tensor a (4096) must match the size of tensor b (0) at non-singleton dimension 1",
])
def test_a_parameter_of_size_zero_in_an_error_is_an_ungathered_zero3_partition(log: str) -> None:
    assert _likely(log)[0] == "zero3_save_empty_params"


def test_a_truncated_reduction_message_keeps_the_three_causes_in_view() -> None:
    cats = _likely("[1] RuntimeError: Expected to have finished reductio")
    assert cats == ["ddp_unused_parameters", "gc_ddp_reentrant", "gc_inputs_no_grad"], cats


@pytest.mark.parametrize("log", ["Train with multiple GPU - errors: rank 1 never joins",
                                 "多卡训练报错，NCCL 初始化失败",
                                 "training on multiple GPUs doesn't work, rank 3 crashes every time"])
def test_fails_on_multiple_gpus_with_a_sign_of_the_ranks_ranks_nccl(log: str) -> None:
    cats = _likely(log)
    assert cats[0] == "nccl_p2p_hang" and "nccl_env_setup" in cats, cats
    assert "more_ranks_than_gpus" not in _likely(log)  # no launcher shown: no process count to compare


@pytest.mark.parametrize("log", [
    "accelerate launch --num_processes 8 train.py\nTraining fails on multiple GPUs (the node has 4 A100s)",
    "torchrun --nproc_per_node 8 train.py  # fails on multiple GPUs, I only have 4",
])
def test_fails_on_multiple_gpus_under_a_launcher_asks_for_the_process_count(log: str) -> None:
    assert _likely(log)[0] == "more_ranks_than_gpus"


# Each new family next to an ordinary error that only shares a word with it: the first is answered, the second not.
@pytest.mark.parametrize(("thin", "ordinary"), [
    ("Train with multiple GPU - errors: NCCL timeout",
     "I get an error when running on multiple GPUs: KeyError: 'input_ids'"),  # the exception decides, not the words
    ("model.hf_device_map: {'model.embed_tokens': 0, 'lm_head': 1}", "model.hf_device_map: {'': 0}"),
    (MIXED + "RuntimeError: expected scalar type Half but found Float",
     "RuntimeError: Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same"),
    ("ValueError: the embedding weight has shape torch.Size([0]), expected a 2-D matrix",
     "Model vocab size: 0"),  # a debug print of a size is the user's data
    ("deepspeed train.py\nRuntimeError: The size of tensor a (96) must match the size of tensor b (0) at dimension 2",
     "RuntimeError: The size of tensor a (96) must match the size of tensor b (0) at dimension 2"),  # no DeepSpeed
])
def test_errors_that_only_share_a_word_stay_unanswered(thin: str, ordinary: str) -> None:
    assert _likely(thin)
    a = analyze(ordinary)
    assert a.answer == "none", (ordinary, [(x.category, x.confidence) for x in a.likely])


TRAIN_PY = '  File "/home/amy/proj/train_regressor.py", line 88, in <module>\n    out = model(x)\n'
# Ordinary errors of the user's own code, data or question that only look like a thin-evidence family.
CONTROLS = {
    "numpy_double_features": TRAIN_PY + "RuntimeError: mat1 and mat2 must have the same dtype, but got Double and "
                                        "Float",
    "float_labels_for_cross_entropy": "  File \"/home/u/cls/train.py\", line 54, in train_epoch\n"
                                      "    loss = criterion(logits, labels)\n"
                                      "RuntimeError: expected scalar type Long but found Float",
    "int_targets_for_mse": "  File \"fit.py\", line 31, in <module>\n    loss = F.mse_loss(pred, y)\n"
                           "RuntimeError: Found dtype Long but expected Float",
    "fp16_generate": "$ python generate.py --model ./llama-7b --fp16\n  File \"generate.py\", line 40, in <module>\n"
                     "    out = model.generate(**inputs, max_new_tokens=64)\n"
                     "RuntimeError: expected scalar type Half but found Float",
    "sdpa_query_dtype": "RuntimeError: Expected query, key, and value to have the same dtype, but got query.dtype: "
                        "c10::Half key.dtype: float and value.dtype: float instead.",
    "onnx_dtype_mismatch": "torch.onnx.errors.SymbolicValueError: ONNX export failed: dtype mismatch between input 'x'",
    "own_cuda_op": "  File \"/work/myproj/ops/roi_pool.py\", line 41, in forward\n"
                   "    out = _C.roi_pool_forward(feat, rois, self.output_size)\n"
                   "RuntimeError: CUDA error: an illegal memory access was encountered\n"
                   "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "own_triton_kernel": "  File \"/home/x/kern/fused_softmax.py\", line 88, in softmax\n"
                         "    softmax_kernel[(n_rows,)](y, x, n_cols, BLOCK_SIZE=BLOCK_SIZE)\n"
                         "  File \"/opt/conda/lib/python3.11/site-packages/triton/runtime/jit.py\", line 345, in run\n"
                         "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered",
    "own_kernel_with_a_pip_list": "bitsandbytes==0.43.1\ntorch==2.3.0\n"
                                  "  File \"/work/myproj/ops/scan.py\", line 12, in forward\n"
                                  "    y = selective_scan_cuda.fwd(u, delta, A, B, C)\n"
                                  "RuntimeError: CUDA error: an illegal memory access was encountered",
    "illegal_access_in_a_librarys_python": "  File \"/opt/conda/lib/python3.10/site-packages/megatron/core/"
                                           "tensor_parallel/layers.py\", line 930, in forward\n"
                                           "RuntimeError: CUDA error: an illegal memory access was encountered",
    "split_model_then_collator_keyerror": "model.hf_device_map: {'model.embed_tokens': 0, 'model.layers.16': 1, "
                                          "'lm_head': 1}\n"
                                          "  File \"eval.py\", line 21, in collate\nKeyError: 'label'",
    "split_model_then_adapter_shapes": "hf_device_map = {'transformer.wte': 0, 'transformer.h.20': 1, 'lm_head': 1}\n"
                                       "RuntimeError: The size of tensor a (4096) must match the size of tensor b "
                                       "(5120) at non-singleton dimension 2",
    "convergence_question": "Loss fails to decrease when training on multiple GPUs",
    "metrics_question": "Evaluation metrics are wrong with multi-GPU, it's not working like single card",
    "hub_403": "Multi-GPU inference: download of the checkpoint fails, 403 error from the hub",
    "one_process_multi_gpu": "python train.py\nmulti-GPU training doesn't work",
    "words_only": "Train with multiple GPU - errors",
    "words_only_zh": "多卡训练报错",
    "empty_batch": "tensor shape: torch.Size([0])\nIndexError: index 0 is out of bounds for dimension 0 with size 0",
    "empty_split": "Loaded 0 examples from data/train.jsonl\ntensor size: 0",
    "model_size_print": "Model size: 0",
    "frozen_everything": "trainable params: 0 || all params: 6738415616 || trainable%: 0.0\nparam size = 0",
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_ordinary_errors_near_a_thin_family_get_no_answer(name: str) -> None:
    a = analyze(CONTROLS[name])
    assert a.answer == "none", (name, [(x.category, x.confidence) for x in a.likely])
