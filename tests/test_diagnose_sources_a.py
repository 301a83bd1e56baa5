"""`shardfit diagnose` on the libraries' own messages (share a): for device placement, ZeRO-3 placement and saving,
out-of-memory, FSDP flat parameters, gradient checkpointing, DDP's unused parameters and DataParallel, the
messages that torch, accelerate, transformers and DeepSpeed raise or warn (the installed releases and the wordings
of older ones), each pasted bare and at the end of a short traceback, must rank their cause among the first three.
Where a message names one cause it is answered confidently; the look-alikes at the end (warnings that are no
failure, the same words meaning another cause, a message too bare to name a setting) never are."""

from __future__ import annotations

import re

import pytest

from shardfit.diagnose.engine import analyze

# (message, where it comes from, expected cause, confident): confident True must be answered confidently, False
# must not be, None may be either (a ranked answer that context can raise).
SOURCES: list[tuple[str, str, str, bool | None]] = [
    # device_map_auto_in_distributed
    ("ValueError: You can't train a model that has been loaded with `device_map='auto'` in any distributed mode. "
     "Please rerun your script specifying `--num_processes=1` or by launching with `python {{myscript.py}}`.",
     "accelerate/accelerator.py:1820 (prepare_model)", "device_map_auto_in_distributed", True),
    ("ValueError: You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple devices in "
     "any distributed mode. In order to use 8-bit or 4-bit models that have been loaded across multiple GPUs the "
     "solution is to use Naive Pipeline Parallelism. Therefore you should not specify that you are under any "
     "distributed regime in your accelerate config.",
     "accelerate/accelerator.py:1847", "device_map_auto_in_distributed", True),
    ("ValueError: You can't train a model that has been loaded in 8-bit precision on multiple devices in any "
     "distributed mode. In order to use 8-bit models that have been loaded across multiple GPUs the solution is to "
     "use Naive Pipeline Parallelism.",
     "accelerate 0.2x (8-bit only)", "device_map_auto_in_distributed", True),
    ("RuntimeError: You can't move a model that has some modules offloaded to cpu or disk.",
     "accelerate/big_modeling.py:470", "device_map_auto_in_distributed", None),
    # device_map_auto_cross_device
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
     "cuda:1! (when checking argument for argument target in method wrapper_CUDA_nll_loss_forward)",
     "libtorch_cpu.so (torch 1.x-2.x)", "device_map_auto_cross_device", None),
    ("RuntimeError: Expected all tensors to be on the same device, but got index is on cuda:1, different from "
     "other tensors on cuda:0 (when checking argument in method wrapper_CUDA__index_select)",
     "libtorch_cpu.so (torch 2.13)", "device_map_auto_cross_device", None),
    ("RuntimeError: Expected all tensors to be on the same device, but got mat2 is on cuda:3, different from "
     "other tensors on cuda:2 (when checking argument in method wrapper_CUDA_mm)",
     "libtorch_cpu.so (torch 2.13)", "device_map_auto_cross_device", None),
    # zero3_device_map_conflict
    ("ValueError: DeepSpeed Zero-3 is not compatible with passing a `device_map`.",
     "transformers/integrations/accelerate.py:137", "zero3_device_map_conflict", True),
    ("ValueError: DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True` or with passing a `device_map`.",
     "transformers 4.x modeling_utils.py", "zero3_device_map_conflict", True),
    ("ValueError: Passing along a `device_map` requires `low_cpu_mem_usage=True`",
     "transformers 4.3x modeling_utils.py", "zero3_device_map_conflict", None),
    ("ValueError: Passing along a `device_map` or a `tp_plan` requires `low_cpu_mem_usage=True`",
     "transformers 4.5x modeling_utils.py", "zero3_device_map_conflict", None),
    # zero3_cpu_buffer_rotary
    ("RuntimeError: indices should be either on cpu or on the same device as the indexed tensor (cpu)",
     "libtorch_cpu.so (index)", "zero3_cpu_buffer_rotary", None),
    # zero3_save_empty_params
    ("RuntimeError: Error(s) in loading state_dict for PeftModelForCausalLM:\n\tsize mismatch for "
     "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight: copying a param with shape "
     "torch.Size([0]) from checkpoint, the shape in current model is torch.Size([8, 4096]).",
     "torch/nn/modules/module.py:2443", "zero3_save_empty_params", True),
    ("- lm_head.weight: found shape torch.Size([0]) in the checkpoint and torch.Size([32000, 4096]) in the model "
     "instantiated", "transformers 4.x modeling_utils.py (mismatched sizes report)", "zero3_save_empty_params", None),
    ("model.embed_tokens.weight | MISMATCH | Reinit due to size mismatch - ckpt: torch.Size([0]) vs "
     "model:torch.Size([151936, 896])",
     "transformers/utils/loading_report.py:231", "zero3_save_empty_params", None),
    ("ValueError: Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save` in DeepSpeed "
     "config is False. To save the model weights in 16bit, set `stage3_gather_16bit_weights_on_model_save` to True "
     "in DeepSpeed config file or set `zero3_save_16bit_model` to True when using `accelerate config`.",
     "accelerate/accelerator.py:4087", "zero3_save_empty_params", False),
    ("deepspeed.save_16bit_model didn't save the model, since stage3_gather_16bit_weights_on_model_save=false. "
     "Saving the full checkpoint instead, use zero_to_fp32.py to recover weights",
     "transformers/trainer.py:4115 (older wording)", "zero3_save_empty_params", False),
    ("[WARNING] [engine.py:3631:save_16bit_model] Did not save the model /out/checkpoint-500/pytorch_model.bin "
     "because stage3_gather_16bit_weights_on_model_save is False",
     "deepspeed/runtime/engine.py:5739", "zero3_save_empty_params", False),
    # shardfit_predicted_oom
    ("shardfit: error: out of memory: GPU memory ran out in step 1 (backward); a 2.00 GiB allocation failed "
     "(strategy ddp on 4 x cuda, bf16, micro_batch 8, max_seq_len 4096, grad_ckpt none).\nThe plan predicted "
     "31.2 GiB per GPU of 24.0 for ddp (largest part: activations 14.1 GiB): it predicted this and would have "
     "refused to start; force: true started it anyway.",
     "shardfit/train/oom.py:55", "shardfit_predicted_oom", True),
    # oom_activation_not_sharded / oom_full_replica_per_rank: a bare GPU OOM ranks both, confidently neither
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of "
     "79.11 GiB of which 2.53 GiB is free. Including non-PyTorch memory, this process has 76.57 GiB memory in use.",
     "c10/cuda/CUDACachingAllocator.cpp (torch 2.x)", "oom_activation_not_sharded", False),
    ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 23.69 GiB total "
     "capacity; 23.01 GiB already allocated; 19.06 MiB free; 23.02 GiB reserved in total by PyTorch)",
     "CUDACachingAllocator.cpp (torch 1.x-2.0)", "oom_full_replica_per_rank", False),
    ("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
     "aten/src/ATen/cuda/CublasHandlePool.cpp", "oom_activation_not_sharded", False),
    ("torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
     "63.98 GiB of which 1.02 GiB is free.", "torch ROCm build", "oom_activation_not_sharded", False),
    ("RuntimeError: cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
     "aten/src/ATen/cudnn/Exceptions.h", "oom_activation_not_sharded", False),
    ("node01:1234:1290 [0] include/alloc.h:103 NCCL WARN Failed to CUDA calloc 6291456 bytes",
     "NCCL src/include/alloc.h", "oom_full_replica_per_rank", False),
    # host_ram_oom
    ("RuntimeError: [enforce fail at alloc_cpu.cpp:83] err == 0. DefaultCPUAllocator: can't allocate memory: you "
     "tried to allocate 11811160064 bytes. Error code 12 (Cannot allocate memory)",
     "c10/core/impl/alloc_cpu.cpp", "host_ram_oom", None),
    ("RuntimeError: [enforce fail at C:\\actions-runner\\_work\\pytorch\\pytorch\\c10\\core\\impl\\alloc_cpu.cpp:72]"
     " data. DefaultCPUAllocator: not enough memory: you tried to allocate 1073741824 bytes.",
     "c10/core/impl/alloc_cpu.cpp (Windows)", "host_ram_oom", None),
    ("MemoryError: Unable to allocate 8.00 GiB for an array with shape (1073741824,) and data type float64",
     "numpy _core (array allocation)", "host_ram_oom", None),
    ("torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: -9) local_rank: 3 (pid: 48211) of "
     "binary: /opt/conda/bin/python", "torch/distributed/elastic/multiprocessing/api.py", "host_ram_oom", None),
    ("RuntimeError: DataLoader worker (pid 2811) is killed by signal: Killed.",
     "torch/utils/data/_utils/signal_handling.py", "host_ram_oom", None),
    ("[2024-03-01 12:00:01,234] [ERROR] [launch.py:321:sigkill_handler] ['/usr/bin/python', '-u', 'train.py', "
     "'--local_rank=1'] exits with return code = -9", "deepspeed/launcher/launch.py", "host_ram_oom", None),
    ("subprocess.CalledProcessError: Command '['/usr/bin/python3', 'train.py']' died with <Signals.SIGKILL: 9>.",
     "accelerate/commands/launch.py (simple_launcher)", "host_ram_oom", None),
    ("Out of memory: Killed process 12345 (python) total-vm:312345678kB, anon-rss:123456789kB, file-rss:0kB",
     "Linux kernel (dmesg)", "host_ram_oom", None),
    ("slurmstepd: error: Detected 1 oom_kill event in StepId=123456.0. Some of your processes may have been killed "
     "by the cgroup out-of-memory handler.", "slurm task/cgroup", "host_ram_oom", None),
    ("ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory.",
     "ray memory monitor", "host_ram_oom", None),
    ("mpirun noticed that process rank 0 with PID 0 on node gpu01 exited on signal 9 (Killed).",
     "Open MPI", "host_ram_oom", None),
    # fsdp_lora_requires_grad
    ("ValueError: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`",
     "torch/distributed/fsdp/_flat_param.py:823", "fsdp_lora_requires_grad", True),
    ("ValueError: `FlatParameter` requires uniform `requires_grad`",
     "torch 1.13 fsdp/flat_param.py", "fsdp_lora_requires_grad", True),
    ("ValueError: model.layers.0.self_attn.q_proj has both parameters with requires_grad=True and False. FSDP does "
     "not support wrapping such modules when use_orig_params=False. If possible, wrap the frozen parameters with "
     "FSDP separately.", "torch/distributed/fsdp/_wrap_utils.py:166", "fsdp_lora_requires_grad", True),
    # fsdp_mixed_dtype
    ("ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.float32",
     "torch/distributed/fsdp/_flat_param.py:814", "fsdp_mixed_dtype", True),
    ("AssertionError: FSDP expects uniform original parameter dtype but got {torch.bfloat16, torch.float32}",
     "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:284", "fsdp_mixed_dtype", None),
    ("AssertionError: FSDP expects uniform reduce dtype but got {torch.bfloat16, torch.float32}",
     "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:292", "fsdp_mixed_dtype", None),
    ("AssertionError: FSDP reduce-scatter expects uniform gradient dtype but got {torch.float32, torch.bfloat16}",
     "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:557", "fsdp_mixed_dtype", None),
    # fsdp_qlora_quant_storage
    ("ValueError: Cannot flatten integer dtype tensors",
     "torch/distributed/fsdp/_flat_param.py:811", "fsdp_qlora_quant_storage", True),
    ("ValueError: Must flatten tensors with uniform dtype but got torch.bfloat16 and torch.uint8",
     "torch/distributed/fsdp/_flat_param.py:814", "fsdp_qlora_quant_storage", True),
    ("AssertionError: FSDP expects uniform original parameter dtype but got {torch.uint8, torch.bfloat16}",
     "torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:284", "fsdp_qlora_quant_storage", None),
    # fsdp_tied_embeddings
    ("ValueError: Parameter 'lm_head.weight' is shared with a parameter already managed by another FSDP group. "
     "For shared/tied parameters, use fully_shard([module_a, module_b]) to place them in the same FSDP group.",
     "torch/distributed/fsdp/_fully_shard/_fsdp_state.py:224", "fsdp_tied_embeddings", True),
    # gc_ddp_reentrant
    ("RuntimeError: Expected to mark a variable ready only once. This error is caused by one of the following "
     "reasons: 1) Use of a module parameter outside the `forward` function. 2) Reused parameters in multiple "
     "reentrant backward passes.", "torch/csrc/distributed/c10d/reducer.cpp", "gc_ddp_reentrant", True),
    ("Parameter at index 195 with name base_model.model.model.layers.31.mlp.down_proj.lora_B.default.weight has "
     "been marked as ready twice. This means that multiple autograd engine  hooks have fired for this particular "
     "parameter during this iteration.", "torch/csrc/distributed/c10d/reducer.cpp", "gc_ddp_reentrant", True),
    ("AssertionError: The parameter 447 has already been reduced. Gradient computed twice for this partition. "
     "Multiple gradient reduction is currently not supported",
     "deepspeed/runtime/zero/stage_1_and_2.py", "gc_ddp_reentrant", True),
    ("RuntimeError: When use_reentrant=True, torch.utils.checkpoint is incompatible with .grad() or passing an "
     "`inputs` parameter to .backward(). To resolve this error, you can either set use_reentrant=False, or call "
     ".backward() without passing the `inputs` argument.",
     "torch/utils/checkpoint.py:280", "gc_ddp_reentrant", None),
    ("RuntimeError: Checkpointing is not compatible with .grad() or when an `inputs` parameter is passed to "
     ".backward(). Please use .backward() and do not pass its `inputs` argument.",
     "torch 1.x utils/checkpoint.py", "gc_ddp_reentrant", None),
    # gc_remote_code_old_api
    ("TypeError: ChatGLMPreTrainedModel._set_gradient_checkpointing() got an unexpected keyword argument 'enable'",
     "transformers modeling_utils.py:3169 calling remote code", "gc_remote_code_old_api", True),
    ("ValueError: InternLMForCausalLM does not support gradient checkpointing.",
     "transformers modeling_utils.py (gradient_checkpointing_enable)", "gc_remote_code_old_api", None),
    ("You are using an old version of the checkpointing format that is deprecated (We will also silently ignore "
     "`gradient_checkpointing_kwargs` in case you passed it).Please update to the new format on your modeling file.",
     "transformers modeling_utils.py:3177", "gc_remote_code_old_api", None),
    ("AttributeError: 'QWenModel' object has no attribute '_gradient_checkpointing_func'",
     "remote modeling code on transformers < 4.35", "gc_remote_code_old_api", None),
    # gc_inputs_no_grad
    ("RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn",
     "torch/csrc/autograd (run_backward)", "gc_inputs_no_grad", None),
    ("UserWarning: None of the inputs have requires_grad=True. Gradients will be None",
     "torch/utils/checkpoint.py:92", "gc_inputs_no_grad", None),
    ("RuntimeError: none of output has requires_grad=True, this checkpoint() is not necessary",
     "torch/utils/checkpoint.py:327", "gc_inputs_no_grad", None),
    # ddp_unused_parameters
    ("RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one. This "
     "error indicates that your module has parameters that were not used in producing loss. You can enable unused "
     "parameter detection by passing the keyword argument `find_unused_parameters=True` to "
     "`torch.nn.parallel.DistributedDataParallel`.", "torch/csrc/distributed/c10d/reducer.cpp",
     "ddp_unused_parameters", True),
    ("Parameter indices which did not receive grad for rank 1: 390 391 392 393",
     "torch/csrc/distributed/c10d/reducer.cpp", "ddp_unused_parameters", None),
    ("Parameters which did not receive grad for rank 0: visual.merger.mlp.2.bias, visual.merger.mlp.2.weight",
     "torch/csrc/distributed/c10d/reducer.cpp (DETAIL)", "ddp_unused_parameters", None),
    ("RuntimeError: Expected to have finished reduction in the prior iteration before starting a new one. This "
     "error indicates that your training graph has changed in this iteration, e.g., one parameter is used in first "
     "iteration, but then got unused in the second iteration. this is not compatible with static_graph set to True.",
     "torch/csrc/distributed/c10d/reducer.cpp (static_graph)", "ddp_unused_parameters", None),
    # dataparallel_accidental
    ("RuntimeError: Caught RuntimeError in replica 0 on device 0.",
     "torch/nn/parallel/parallel_apply.py (ExceptionWrapper)", "dataparallel_accidental", None),
    ("UserWarning: Was asked to gather along dimension 0, but all input tensors were scalars; will instead "
     "unsqueeze and return a vector.", "torch/nn/parallel/_functions.py:97", "dataparallel_accidental", None),
    ("RuntimeError: module must have its parameters and buffers on device cuda:0 (device_ids[0]) but found one of "
     "them on device: cuda:1", "torch/nn/parallel/data_parallel.py:181", "dataparallel_accidental", None),
    ("UserWarning: There is an imbalance between your GPUs. You may want to exclude GPU 1 which has less than 75% "
     "of the memory or cores of GPU 0.", "torch/nn/parallel/data_parallel.py (_check_balance)",
     "dataparallel_accidental", None),
    ("RuntimeError: Gather got an input of invalid size: got [2, 3, 32000], but expected [2, 5, 32000]",
     "torch 1.x nn/parallel/comm.py (gather)", "dataparallel_accidental", None),
    ("RuntimeError: Input tensor at index 1 has invalid shape [2, 511, 32000], but expected [2, 512, 32000]",
     "torch/csrc/cuda/comm.cpp (gather)", "dataparallel_accidental", None),
    # quantized_model_device_placement
    ("ValueError: You can't train a model that has been loaded in 8-bit or 4-bit precision on a different device "
     "than the one you're training on. Make sure you loaded the model on the correct device using for example "
     "`device_map={'':torch.cuda.current_device()}`", "accelerate/accelerator.py:1868",
     "quantized_model_device_placement", True),
    ("ValueError: You can't train a model that has been loaded in 8-bit or 4-bit precision with CPU or disk "
     "offload. If you want train the 8-bit or 4-bit model in CPU, please install bitsandbytes with multi-backend",
     "accelerate/accelerator.py:1877", "quantized_model_device_placement", True),
    ("ValueError: You can't train a model that has been loaded in 8-bit precision with CPU or disk offload.",
     "accelerate 0.2x", "quantized_model_device_placement", True),
    ("ValueError: `.to` is not supported for `4-bit` or `8-bit` bitsandbytes models. Please use the model as it "
     "is, since the model has already been set to the correct devices and casted to the correct `dtype`.",
     "transformers 4.3x modeling_utils.py", "quantized_model_device_placement", True),
    ("ValueError: Calling `cuda()` is not supported for `8-bit` quantized models.  Please use the model as it is, "
     "since the model has already been set to the correct devices.",
     "transformers/modeling_utils.py:3716", "quantized_model_device_placement", True),
    ("ValueError: Calling `to()` is not supported for `8-bit` quantized models with this version of bitsandbytes. "
     "Please use the model as it is, since the model has already been set to the correct devices.",
     "transformers 4.4x modeling_utils.py", "quantized_model_device_placement", True),
    ("ValueError: You need to install `pip install bitsandbytes>=0.48.0` if you want to move a 8-bit model across "
     "devices using to().", "transformers/modeling_utils.py (to)", "quantized_model_device_placement", None),
]

_EXC_LINE = re.compile(r"^[\w.]+(Error|Exception|Warning): ")


def _in_traceback(message: str) -> str:
    """The message as the end of a short traceback from the user's training script."""
    return ("Traceback (most recent call last):\n"
            '  File "/home/user/project/train.py", line 142, in <module>\n'
            "    main()\n"
            '  File "/home/user/project/train.py", line 121, in main\n'
            "    trainer.train()\n" + message + "\n")


def _check(log: str, cause: str, confident: bool | None) -> None:
    a = analyze(log)
    ranked = [(x.category, round(x.confidence, 2)) for x in a.likely]
    assert cause in [c for c, _ in ranked[:3]], (log, a.answer, ranked)
    if confident is True:
        assert a.answer == "confident" and ranked[0][0] == cause, (log, a.answer, ranked)
    elif confident is False:
        assert a.answer != "confident", (log, a.answer, ranked)


@pytest.mark.parametrize("message,source,cause,confident", SOURCES, ids=[f"{c}-{i}" for i, (_, _, c, _)
                                                                          in enumerate(SOURCES)])
def test_a_library_message_ranks_its_cause(message: str, source: str, cause: str, confident: bool | None) -> None:
    assert source  # each row names where the message comes from
    _check(message, cause, confident)
    if _EXC_LINE.match(message):
        _check(_in_traceback(message), cause, confident)


# ZeRO-3 shown in the paste: a CPU tensor in a rotary cache is the buffer cause, in an omni talker the submodule.
def test_a_cpu_gpu_clash_in_the_newer_torch_wording_under_zero3() -> None:
    rotary = ("deepspeed --num_gpus 8 train.py --deepspeed ds_z3_config.json\n"
              '  File "/work/modeling_chatglm.py", line 210, in apply_rotary_pos_emb\n'
              "    x_out2 = torch.stack([xshaped[..., 0] * rope_cache[..., 0]], -1)\n"
              "RuntimeError: Expected all tensors to be on the same device, but got other is on cpu, different from "
              "other tensors on cuda:0 (when checking argument in method wrapper_CUDA_mul_Tensor)")
    _check(rotary, "zero3_cpu_buffer_rotary", None)
    talker = ("zero_optimization stage: 3\n"
              '[rank0]: File "/x/transformers/models/qwen2_5_omni/modeling_qwen2_5_omni.py", line 1200, in forward\n'
              "[rank0]: RuntimeError: Expected all tensors to be on the same device, but got weight is on cpu, "
              "different from other tensors on cuda:0 (when checking argument in method "
              "wrapper_CUDA__native_layer_norm)\ntalker")
    _check(talker, "zero3_cpu_submodule", None)


def test_two_gpus_in_the_newer_torch_wording_are_no_cpu_clash() -> None:
    a = analyze("RuntimeError: Expected all tensors to be on the same device, but got index is on cuda:1, "
                "different from other tensors on cuda:0 (when checking argument in method wrapper_CUDA__index_select)")
    assert a.likely[0].category == "device_map_auto_cross_device", a.likely
    assert not {"zero3_cpu_submodule", "zero3_cpu_buffer_rotary"} & {x.category for x in a.likely[:2]}


LOOK_ALIKES: list[tuple[str, str]] = [
    # a warning that find_unused_parameters costs time: nothing failed
    ("[W reducer.cpp:1346] Warning: find_unused_parameters=True was specified in DDP constructor, but did not find "
     "any unused parameters in the forward pass. This flag results in an extra traversal of the autograd graph "
     "every iteration,  which can adversely affect performance.", "ddp_unused_parameters"),
    # use_orig_params=True: FSDP wraps the mixed module and only warns about the gradient memory
    ("UserWarning: model.layers.0 has both parameters with requires_grad=True and False. We do not recommend "
     "wrapping such modules since the gradient memory usage will be higher than expected (1234 numel instead of 12 "
     "numel before sharding via reduce-scatter). If possible, wrap the frozen parameters with FSDP separately.",
     "fsdp_lora_requires_grad"),
    # the checkpoint API asking for use_reentrant explicitly: a deprecation, not a failure
    ("UserWarning: torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly. In version 2.5 "
     "we will raise an exception if use_reentrant is not passed. use_reentrant=False is recommended",
     "gc_ddp_reentrant"),
    # shared memory of a DataLoader worker, not the host's RAM
    ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
     "host_ram_oom"),
    # FSDP wrapping a module twice, and parameters on two devices: flat-parameter errors of other causes
    ("ValueError: Cannot flatten a `FlatParameter`", "fsdp_lora_requires_grad"),
    ("ValueError: Must flatten tensors on the same device but got both cpu and cuda:0", "fsdp_mixed_dtype"),
    # a size-0 tensor with no ZeRO-3 shown: as likely the user's empty batch
    ("RuntimeError: The size of tensor a (0) must match the size of tensor b (4096) at non-singleton dimension 1",
     "zero3_save_empty_params"),
    # a CPU/GPU clash in the newer wording, bare: no setting shown that could name the cause
    ("RuntimeError: Expected all tensors to be on the same device, but got index is on cpu, different from other "
     "tensors on cuda:0 (when checking argument in method wrapper_CUDA__index_select)", "device_map_auto_cross_device"),
    # accelerate's warning about tied parameters placed apart by a device_map: a load-time notice
    ("UserWarning: Tied parameters are on different devices: {'lm_head.weight': 'cuda:1', "
     "'model.embed_tokens.weight': 'cuda:0'}. Please modify your custom device map or set `device_map='auto'`.",
     "fsdp_tied_embeddings"),
]


@pytest.mark.parametrize("message,cause", LOOK_ALIKES, ids=[c for _, c in LOOK_ALIKES])
def test_a_look_alike_is_not_answered_confidently(message: str, cause: str) -> None:
    a = analyze(message)
    assert a.answer != "confident", (message, [(x.category, x.confidence) for x in a.likely])
    assert not (a.likely and a.likely[0].category == cause and a.likely[0].confidence >= 0.8), a.likely
