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
    ("deepspeed train.py --deepspeed ds_z3.json\n"
     "RuntimeError: The size of tensor a (96) must match the size of tensor b (0) at dimension 2",
     "deepspeed train.py --deepspeed ds_z2.json\n"  # ZeRO-2 never partitions a parameter
     "RuntimeError: The size of tensor a (96) must match the size of tensor b (0) at dimension 2"),
    ("deepspeed train.py --deepspeed ds_z3.json\n"
     "RuntimeError: The size of tensor a (96) must match the size of tensor b (0) at dimension 2",
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


# Review of round 8: full tracebacks (the user's script above library frames), the setting each hint needs, and the
# logs of inference. Each paste is written here in the shape such logs have.
SITE = "/opt/conda/lib/python3.11/site-packages"
EMBED_FAULT = (
    "Added 2 special tokens: ['<tool_call>', '</tool_call>']\n"
    "Traceback (most recent call last):\n"
    '  File "/home/kim/agent-ft/run_sft.py", line 203, in <module>\n'
    "    outputs = model(**batch)\n"
    f'  File "{SITE}/torch/nn/modules/module.py", line 1736, in _wrapped_call_impl\n'
    "    return self._call_impl(*args, **kwargs)\n"
    f'  File "{SITE}/transformers/models/qwen2/modeling_qwen2.py", line 816, in forward\n'
    "    outputs = self.model(\n"
    f'  File "{SITE}/transformers/models/qwen2/modeling_qwen2.py", line 521, in forward\n'
    "    inputs_embeds = self.embed_tokens(input_ids)\n"
    f'  File "{SITE}/torch/nn/modules/sparse.py", line 190, in forward\n'
    "    return F.embedding(\n"
    f'  File "{SITE}/torch/nn/functional.py", line 2551, in embedding\n'
    "    return torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)\n"
    "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\n")
ZERO3_BACKWARD_FAULT = (
    "[2026-11-02 17:40:12,118] [INFO] [config.py:1003:print]   zero_optimization ............ {'stage': 3}\n"
    "[rank1]: Traceback (most recent call last):\n"
    '[rank1]:   File "/mnt/exp/pretrain.py", line 188, in <module>\n'
    "[rank1]:     model_engine.backward(loss)\n"
    f'[rank1]:   File "{SITE}/deepspeed/runtime/engine.py", line 2126, in backward\n'
    "[rank1]:     self.optimizer.backward(loss, retain_graph=retain_graph)\n"
    f'[rank1]:   File "{SITE}/deepspeed/runtime/zero/stage3.py", line 2281, in backward\n'
    "[rank1]:     self.loss_scaler.backward(loss.float(), retain_graph=retain_graph)\n"
    f'[rank1]:   File "{SITE}/torch/_tensor.py", line 626, in backward\n'
    "[rank1]:     torch.autograd.backward(\n"
    "[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered\n")


def test_a_memory_fault_below_the_users_script_in_a_library_op_keeps_its_ranking() -> None:
    # the user's script sits above every traceback: the op at fault is torch's embedding, not a kernel of the user's
    assert _likely(EMBED_FAULT)[0] == "tokenizer_embedding_mismatch"
    # DeepSpeed's engine between the script and autograd: the bare line's ranking (CUDA reports a fault late)
    assert _likely(ZERO3_BACKWARD_FAULT) == _likely("RuntimeError: CUDA error: an illegal memory access was "
                                                    "encountered")


USER_OP_VIA_DISPATCH = (
    "Traceback (most recent call last):\n"
    '  File "/home/ro/pointops/bench.py", line 22, in <module>\n'
    "    idx = knn(xyz, new_xyz, 16)\n"
    '  File "/home/ro/pointops/pointops/functions.py", line 58, in knn\n'
    "    return torch.ops.pointops.knn_query(xyz, new_xyz, k)\n"
    f'  File "{SITE}/torch/_ops.py", line 1116, in __call__\n'
    "    return self._op(*args, **(kwargs or {}))\n"
    "RuntimeError: CUDA error: an illegal memory access was encountered\n")
EMPTY_SLICE_ZERO2 = (
    "[2026-11-05 09:14:51,007] [INFO] [launch.py:256:main] process 40113 spawned with command: ['/usr/bin/python3', "
    "'-u', 'train_rm.py', '--local_rank=0', '--deepspeed', 'configs/zero2_bf16.json']\n"
    "[rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "/data/rm/train_rm.py", line 131, in pairwise_loss\n'
    "[rank0]:     margin = r_chosen - r_rejected[:, valid]\n"
    "[rank0]: RuntimeError: The size of tensor a (16) must match the size of tensor b (0) at non-singleton "
    "dimension 1\n")
DOUBLE_TARGET_FSDP = (
    "accelerate launch --config_file configs/fsdp_8gpu.yaml train_value_head.py\n"
    "[rank2]:   File \"/srv/vh/train_value_head.py\", line 77, in <module>\n"
    "[rank2]:     loss = F.smooth_l1_loss(values, returns)\n"
    "[rank2]: RuntimeError: Found dtype Double but expected BFloat16\n")
DOUBLE_FEATURES_TRAINING = (
    "python train_probe.py --bf16 --lr 1e-4\n"
    '  File "/home/e/probe/train_probe.py", line 64, in <module>\n'
    "    logits = probe(feats)\n"
    "RuntimeError: mat1 and mat2 must have the same dtype, but got Double and BFloat16\n")
REPL_INFERENCE_CLASH = (
    '>>> model = AutoModelForCausalLM.from_pretrained("mistralai/Mistral-7B-v0.3", torch_dtype=torch.bfloat16, '
    'device_map="cuda")\n'
    ">>> embeds = model.get_input_embeddings()(ids).float() + soft_prompt\n"
    ">>> out = model(inputs_embeds=embeds)\n"
    "Traceback (most recent call last):\n"
    '  File "<stdin>", line 1, in <module>\n'
    f'  File "{SITE}/transformers/models/mistral/modeling_mistral.py", line 262, in forward\n'
    "    query_states = self.q_proj(hidden_states)\n"
    f'  File "{SITE}/torch/nn/modules/linear.py", line 125, in forward\n'
    "    return F.linear(input, self.weight, self.bias)\n"
    "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16\n")
FOUR_BIT_HEAD = (
    "bnb_config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)\n"
    "Traceback (most recent call last):\n"
    '  File "/home/j/zero_shot/score_reviews.py", line 48, in <module>\n'
    "    probs = head(last_hidden[:, -1]).softmax(-1)\n"
    f'  File "{SITE}/torch/nn/modules/linear.py", line 125, in forward\n'
    "    return F.linear(input, self.weight, self.bias)\n"
    "RuntimeError: mat1 and mat2 must have the same dtype, but got BFloat16 and Float\n")
FP16_EVAL_SCRIPT = (
    "$ python eval_retrieval.py --fp16 --ckpt runs/e5-ft/checkpoint-3000 --split test\n"
    '  File "/home/q/ir/eval_retrieval.py", line 93, in encode\n'
    "    scores = sim_proj(query_vecs) @ doc_vecs.T\n"
    "RuntimeError: expected scalar type Half but found Float\n")
DS_DATASET_TYPEERROR = (
    "[2026-11-07 11:20:03,441] [INFO] [runner.py:607:main] cmd = /usr/bin/python3 -u -m deepspeed.launcher.launch "
    "--world_info=eyJsb2NhbGhvc3QiOiBbMCwgMV19 --master_port=29511 sft.py --deepspeed ds_z2.json\n"
    "Map (num_proc=8):  37%|███▋      | 14800/40000 [00:06<00:10, 2411.09 examples/s]\n"
    "Traceback (most recent call last):\n"
    '  File "/home/v/sft/sft.py", line 71, in build_prompt\n'
    '    return tmpl.format(**ex) + ex["output"].strip()\n'
    "AttributeError: 'NoneType' object has no attribute 'strip'\n"
    "[2026-11-07 11:20:12,902] [INFO] [launch.py:319:sigkill_handler] Killing subprocess 51707\n"
    "[2026-11-07 11:20:12,903] [ERROR] [launch.py:325:sigkill_handler] ['/usr/bin/python3', '-u', 'sft.py', "
    "'--local_rank=1', '--deepspeed', 'ds_z2.json'] exits with return code = 1\n")
REVIEW_CONTROLS = {"user_op_via_torch_ops": USER_OP_VIA_DISPATCH, "empty_slice_under_zero2": EMPTY_SLICE_ZERO2,
                   "numpy_double_target_under_fsdp": DOUBLE_TARGET_FSDP,
                   "double_features_in_training": DOUBLE_FEATURES_TRAINING,
                   "repl_inference_float_embeds": REPL_INFERENCE_CLASH, "four_bit_model_fp32_head": FOUR_BIT_HEAD,
                   "fp16_eval_script": FP16_EVAL_SCRIPT, "deepspeed_dataset_typeerror": DS_DATASET_TYPEERROR}


@pytest.mark.parametrize("name", list(REVIEW_CONTROLS))
def test_user_code_errors_in_a_training_or_inference_setting_get_no_answer(name: str) -> None:
    a = analyze(REVIEW_CONTROLS[name])
    assert a.answer == "none", (name, [(x.category, x.confidence) for x in a.likely])


def test_the_same_clash_and_kill_still_rank_where_their_setting_is_shown() -> None:
    # a 4-bit model's dtype clash inside a Trainer's step: a training setting, so a release that broke it
    training = (f"{FOUR_BIT_HEAD.splitlines()[0]}\n"
                f'  File "{SITE}/transformers/trainer.py", line 3612, in training_step\n'
                f"{FOUR_BIT_HEAD.split(chr(10), 1)[1]}")
    assert _likely(training)[0] == "library_version_regression"
    # a rank the OOM killer took: its exit code, not the handler's name
    killed = DS_DATASET_TYPEERROR.split("Traceback")[0] + (
        "[2026-11-07 11:20:12,903] [ERROR] [launch.py:325:sigkill_handler] ['/usr/bin/python3', '-u', 'sft.py', "
        "'--local_rank=1'] exits with return code = -9\n")
    assert "host_ram_oom" in _likely(killed)
    # the launcher stopping the ranks with nothing else shown: DeepSpeed prints this after any rank's failure, so
    # another rank failing stays first; a scheduler's time-limit cancel is not the OOM killer either
    assert _likely("[2026-11-07 11:20:12,902] [INFO] [launch.py:319:sigkill_handler] Killing subprocess 51707")[0] \
        == "peer_rank_failed"
    cancelled = ("slurmstepd: error: *** JOB 88121 ON gpu07 CANCELLED AT 2026-03-02T04:00:11 DUE TO TIME LIMIT ***\n"
                 "torchrun --nproc_per_node 4 pretrain.py\n"
                 "W0302 04:00:11.52 api.py:891] Sending process 3301 closing signal SIGTERM\n"
                 "W0302 04:00:11.52 api.py:891] Sending process 3302 closing signal SIGTERM")
    assert _likely(cancelled)[0] == "peer_rank_failed"


VLLM_OOM = (
    "INFO 11-12 08:31:55 config.py:905] Defaulting to use mp for distributed inference\n"
    "INFO 11-12 08:31:57 llm_engine.py:237] Initializing an LLM engine (v0.6.4) with config: "
    "model='/models/Qwen2.5-72B-Instruct', dtype=torch.bfloat16, max_seq_len=32768, tensor_parallel_size=1, "
    "gpu_memory_utilization=0.95\n"
    "INFO 11-12 08:34:40 model_runner.py:1072] Loading model weights took 135.4 GiB\n"
    "Traceback (most recent call last):\n"
    '  File "/home/s/batch_infer.py", line 14, in <module>\n'
    '    llm = LLM(model="/models/Qwen2.5-72B-Instruct", max_model_len=32768)\n'
    f'  File "{SITE}/vllm/worker/worker.py", line 195, in determine_num_available_blocks\n'
    "    self.model_runner.profile_run()\n"
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.50 GiB. GPU 0 has a total capacity of "
    "139.81 GiB of which 2.06 GiB is free. Of the allocated memory 136.10 GiB is allocated by PyTorch.\n")


def test_an_inference_engines_oom_gets_no_training_memory_answer() -> None:
    a = analyze(VLLM_OOM)  # the engine's own config shows its launch: no training cause, nor a bare line's
    assert a.answer == "none", [(x.category, x.confidence) for x in a.likely]
    # the same engine generating rollouts inside a training run: its OOM is a training run's again
    grpo = ("trl==0.12.1\n" + VLLM_OOM.replace("batch_infer.py", "grpo_train.py").replace(
        "Traceback", f'  File "{SITE}/trl/trainer/grpo_trainer.py", line 402, in __init__\nTraceback'))
    assert {x.category for x in analyze(grpo).likely} & {"oom_full_replica_per_rank", "oom_activation_not_sharded"}
