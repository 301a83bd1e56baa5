"""`shardfit diagnose` on the messages the libraries themselves print, read from their source (share b).

Rules written from threads users posted answer the wordings those threads happened to show; a thread from general
PyTorch training code shows the same library's message in another release's wording, or a sibling message of the
same failure. Each row below is a message as the library (or NCCL, the driver, the OS) prints it, with where it comes
from: a file and line of the installed release, a release where the wording differs, or NCCL's source. Each must put
its cause among the three likely ones, bare and inside a short traceback or log around it.

The look-alikes share words with those messages but name another failure (a label out of range in the loss, a
benign warning NCCL prints on every run, a store warning of a clean shutdown): none may be answered confidently as
one of these causes."""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze
from shardfit.diagnose.likely import CONFIDENT

SITE = "/opt/conda/lib/python3.10/site-packages/"

# (message, source, cause, frame): frame is (file under site-packages, function, source line) for the traceback
# around an exception, or None for a line a library logs (then a log line precedes it instead)
ROWS: list[tuple[str, str, str, tuple[str, str, str] | None]] = [
    # meta_device_loading
    ("NotImplementedError: Cannot copy out of meta tensor; no data!",
     "torch libtorch_cpu.so (torch 2.0)", "meta_device_loading",
     ("torch/nn/modules/module.py", "convert", "return t.to(device, dtype if t.is_floating_point() else None)")),
    ("NotImplementedError: Cannot copy out of meta tensor; no data! Please use torch.nn.Module.to_empty() instead "
     "of torch.nn.Module.to() when moving module from meta to a different device.",
     "torch/nn/modules/module.py _apply (torch >= 2.1)", "meta_device_loading",
     ("torch/nn/modules/module.py", "convert", "raise NotImplementedError(")),
    ("ValueError: weight is on the meta device, we need a `value` to put in on 0.",
     "accelerate/utils/modeling.py:299", "meta_device_loading",
     ("accelerate/utils/modeling.py", "set_module_tensor_to_device", "raise ValueError(")),
    ("RuntimeError: You can't save the model since some parameters are on the meta device.",
     "accelerate/accelerator.py:3529", "meta_device_loading",
     ("accelerate/accelerator.py", "save_model", "raise RuntimeError(")),
    ("The following tensors were not saved because they were still on meta device: ['lm_head.weight']",
     "accelerate/utils/modeling.py:1776 (warning)", "meta_device_loading", None),
    ("NotImplementedError: aten::_local_scalar_dense: attempted to run this operator with Meta tensors, but there "
     "was no fake impl or Meta kernel registered.",
     "torch libtorch_cpu.so (Meta dispatch key)", "meta_device_loading",
     ("torch/_tensor.py", "item", "return self._local_scalar_dense()")),
    ("RuntimeError: Tensor.item() cannot be called on meta tensors",
     "torch (meta tensors, 2.x)", "meta_device_loading",
     ("transformers/modeling_utils.py", "_init_weights", "std = self.config.initializer_range")),
    ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, meta and cuda:0!",
     "torch TensorIterator device check", "meta_device_loading",
     ("torch/nn/functional.py", "linear", "return torch._C._nn.linear(input, weight, bias)")),
    # meta_device_offload
    ("UserWarning: Some parameters are on the meta device because they were offloaded to the cpu and disk.",
     "accelerate/big_modeling.py:451", "meta_device_offload", None),
    ("Some parameters are on the meta device device because they were offloaded to the cpu.",
     "accelerate/big_modeling.py (0.2x, doubled word)", "meta_device_offload", None),
    ("ValueError: The current `device_map` had weights offloaded to the disk. Please provide an `offload_folder` "
     "for them. Alternatively, make sure you have `safetensors` installed if the model you are using offers the "
     "weights in this format.",
     "transformers/modeling_utils.py (4.3x-4.4x)", "meta_device_offload",
     ("transformers/modeling_utils.py", "_load_pretrained_model", "raise ValueError(")),
    ("RuntimeError: You can't move a model that has some modules offloaded to cpu or disk.",
     "accelerate/big_modeling.py (dispatch_model .to)", "meta_device_offload",
     ("accelerate/big_modeling.py", "wrapper", "raise RuntimeError(")),
    ("ValueError: You are trying to offload the whole model to the disk. Please use the `disk_offload` function "
     "instead.", "accelerate/big_modeling.py dispatch_model", "meta_device_offload",
     ("accelerate/big_modeling.py", "dispatch_model", "raise ValueError(")),
    # fp16_unscale
    ("ValueError: Attempting to unscale FP16 gradients.", "torch/amp/grad_scaler.py:275", "fp16_unscale",
     ("torch/amp/grad_scaler.py", "_unscale_grads_", "raise ValueError(\"Attempting to unscale FP16 gradients.\")")),
    ("ValueError: Attempting to unscale FP16 gradients.", "torch/distributed/fsdp/sharded_grad_scaler.py:201",
     "fp16_unscale",
     ("torch/distributed/fsdp/sharded_grad_scaler.py", "_unscale_grads_", "raise ValueError(")),
    # nccl_timeout_save / nccl_timeout_preprocessing: a collective timeout alone does not say which
    ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, OpType=BROADCAST, NumelIn=1, "
     "NumelOut=1, Timeout(ms)=1800000) ran for 1800083 milliseconds before timing out.",
     "torch ProcessGroupNCCL.cpp (2.0-2.3)", "nccl_timeout_preprocessing", None),
    ("[rank1]:[E1018 10:21:07.123 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: "
     "WorkNCCL(SeqNum=4211, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800097 "
     "milliseconds before timing out.",
     "torch ProcessGroupNCCL.cpp (2.2+ prefix)", "nccl_timeout_save", None),
    ("RuntimeError: NCCL communicator was aborted on rank 1.  Original reason for failure was: [Rank 1] Watchdog "
     "caught collective operation timeout: WorkNCCL(OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1806948 "
     "milliseconds before timing out.",
     "torch ProcessGroupNCCL.cpp (1.10-1.13)", "nccl_timeout_save", None),
    ("RuntimeError: [1] is setting up NCCL communicator and retreiving ncclUniqueId from [0] via c10d key-value "
     "store by key '0', but store->get('0') got error: Socket Timeout",
     "torch ProcessGroupNCCL.cpp (2.0-2.1, 'retreiving')", "nccl_timeout_preprocessing",
     ("torch/distributed/distributed_c10d.py", "barrier", "work = default_pg.barrier(opts=opts)")),
    ("torch.distributed.DistBackendError: [3] is setting up NCCL communicator and retrieving ncclUniqueId from [0] "
     "via c10d key-value store by key '0', but store->get('0') got error: wait timeout after 600000ms, keys: "
     "/default_pg/0//cuda//0",
     "torch ProcessGroupNCCL.cpp (2.4+)", "nccl_timeout_preprocessing",
     ("torch/distributed/distributed_c10d.py", "broadcast", "work = group.broadcast([tensor], opts)")),
    ("RuntimeError: Timed out initializing process group in store based barrier on rank: 0, for key: "
     "store_based_barrier_key:1 (world_size=2, worker_count=1, timeout=0:30:00)",
     "torch/distributed/distributed_c10d.py _store_based_barrier (1.x-2.0)", "nccl_timeout_preprocessing",
     ("torch/distributed/distributed_c10d.py", "_store_based_barrier", "raise RuntimeError(")),
    ("RuntimeError: Rank 1 failed to pass monitoredBarrier in 1800000 ms",
     "torch ProcessGroupGloo.cpp monitoredBarrier", "nccl_timeout_preprocessing",
     ("torch/distributed/distributed_c10d.py", "monitored_barrier", "return group_to_use.monitored_barrier(timeout,")),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for "
     "recv operation to complete",
     "gloo tcp/unbound_buffer.cc", "nccl_timeout_preprocessing",
     ("torch/distributed/distributed_c10d.py", "all_reduce", "work.wait()")),
    ("[rank0]:[E ProcessGroupNCCL.cpp:1316] [PG 0 Rank 0] Heartbeat monitor timed out! Process will be terminated "
     "after dumping debug info. workMetaList_.size()=1",
     "torch ProcessGroupNCCL.cpp heartbeatMonitor (2.2+)", "nccl_timeout_save", None),
    ("[rank0]:[E ProcessGroupNCCL.cpp:1414] [PG 0 Rank 0] ProcessGroupNCCL's watchdog got stuck for 480 seconds "
     "without making progress in monitoring enqueued collectives. This typically indicates a NCCL/CUDA API hang "
     "blocking the watchdog, and could be triggered by another thread holding the GIL inside a CUDA api, or other "
     "deadlock-prone behaviors.",
     "torch ProcessGroupNCCL.cpp heartbeatMonitor (2.3+)", "nccl_p2p_hang", None),
    # nccl_p2p_hang
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, "
     "unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3\nncclUnhandledCudaError: "
     "Call to CUDA function failed.\nLast error:\nCuda failure 'peer access is not supported between these two "
     "devices'", "torch NCCLUtils + NCCL p2p.cc", "nccl_p2p_hang",
     ("torch/distributed/distributed_c10d.py", "barrier", "work = group.barrier(opts=opts)")),
    ("node1:1234:1290 [1] NCCL WARN Cuda failure 'peer access is not supported between these two devices'",
     "NCCL transport/p2p.cc", "nccl_p2p_hang", None),
    ("node1:1234:1290 [0] transport/p2p.cc:275 NCCL WARN Cuda failure 217 'peer access is not supported between "
     "these two devices'", "NCCL 2.1x transport/p2p.cc", "nccl_p2p_hang", None),
    ("RuntimeError: NCCL error in: /opt/pytorch/torch/lib/c10d/ProcessGroupNCCL.cpp:825, unhandled cuda error, "
     "NCCL version 2.7.8", "torch 1.8 ProcessGroupNCCL", "nccl_p2p_hang",
     ("torch/distributed/distributed_c10d.py", "all_reduce", "work = default_pg.allreduce([tensor], opts)")),
    ("RuntimeError: CUDA error: peer mapping resources exhausted",
     "CUDA runtime cudaErrorTooManyPeers (711, cudaDeviceEnablePeerAccess)", "nccl_p2p_hang",
     ("torch/nn/parallel/comm.py", "broadcast_coalesced",
      "return torch._C._broadcast_coalesced(tensors, devices, buffer_size)")),
    # env_deepspeed_op_build
    ("deepspeed.ops.op_builder.builder.MissingCUDAException: CUDA_HOME does not exist, unable to compile CUDA op(s)",
     "deepspeed/ops/op_builder/builder.py:47", "env_deepspeed_op_build",
     ("deepspeed/ops/op_builder/builder.py", "installed_cuda_version", "raise MissingCUDAException(")),
    ("Exception: >- DeepSpeed Op Builder: Installed CUDA version 12.1 does not match the version torch was compiled "
     "with 11.8, unable to compile cuda/cpp extensions without a matching cuda version.",
     "deepspeed/ops/op_builder/builder.py assert_no_cuda_mismatch", "env_deepspeed_op_build",
     ("deepspeed/ops/op_builder/builder.py", "assert_no_cuda_mismatch", "raise CUDAMismatchException(")),
    ("RuntimeError: Error building extension 'fused_adam'", "torch/utils/cpp_extension.py _run_ninja_build",
     "env_deepspeed_op_build", ("torch/utils/cpp_extension.py", "_run_ninja_build", "raise RuntimeError(message)")),
    ("RuntimeError: Ninja is required to load C++ extensions (pip install ninja to get it)",
     "torch/utils/cpp_extension.py:2562", "env_deepspeed_op_build",
     ("torch/utils/cpp_extension.py", "verify_ninja_availability", "raise RuntimeError(")),
    ("OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install root.",
     "torch/utils/cpp_extension.py:3302", "env_deepspeed_op_build",
     ("torch/utils/cpp_extension.py", "_join_cuda_home",
      "raise OSError('CUDA_HOME environment variable is not set. '")),
    ("RuntimeError: The detected CUDA version (12.1) mismatches the version that was used to compile PyTorch (11.8). "
     "Please make sure to use the same CUDA versions.",
     "torch/utils/cpp_extension.py:342", "env_deepspeed_op_build",
     ("torch/utils/cpp_extension.py", "_check_cuda_version", "raise RuntimeError(CUDA_MISMATCH_MESSAGE.format(")),
    ("AttributeError: 'DeepSpeedCPUAdam' object has no attribute 'ds_opt_adam'",
     "deepspeed/ops/adam/cpu_adam.py __del__", "env_deepspeed_op_build",
     ("deepspeed/ops/adam/cpu_adam.py", "__del__", "self.ds_opt_adam.destroy_adam(self.opt_id)")),
    ("ImportError: /root/.cache/torch_extensions/py310_cu118/fused_adam/fused_adam.so: cannot open shared object "
     "file: No such file or directory", "torch/utils/cpp_extension.py _import_module_from_library",
     "env_deepspeed_op_build",
     ("torch/utils/cpp_extension.py", "_import_module_from_library", "module = importlib.util.module_from_spec(spec)")),
    ("#error -- unsupported GNU version! gcc versions later than 12 are not supported! The nvcc flag "
     "'-allow-unsupported-compiler' can be used to override this version check",
     "CUDA host_config.h (nvcc)", "env_deepspeed_op_build", None),
    # resume_world_size_mismatch
    ("deepspeed.runtime.zero.utils.ZeRORuntimeException: The checkpoint being loaded used a DP world size of 8 but "
     "the current world size is 4. Automatic adjustment of ZeRO's optimizer state partitioning with a new world "
     "size is not currently supported.", "deepspeed/runtime/engine.py:4750", "resume_world_size_mismatch",
     ("deepspeed/runtime/engine.py", "_load_zero_checkpoint", "raise ZeRORuntimeException(")),
    ("Didn't find an RNG file for process 4, if you are resuming a training that wasn't launched in a distributed "
     "fashion, reproducibility is not guaranteed.", "transformers/trainer.py:3852 (warning)",
     "resume_world_size_mismatch", None),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'output/checkpoint-500/global_step500/"
     "zero_pp_rank_4_mp_rank_00_optim_states.pt'", "deepspeed/runtime/engine.py _get_all_zero_checkpoints",
     "resume_world_size_mismatch",
     ("deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py", "load",
      "partition = torch.load(path, map_location=map_location)")),
    # fp16_nan_loss
    ("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
     "deepspeed/runtime/fp16/loss_scaler.py:259", "fp16_nan_loss",
     ("deepspeed/runtime/fp16/loss_scaler.py", "update_scale", "raise Exception(")),
    ("[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 65536, reducing to 32768",
     "deepspeed/runtime/fp16/loss_scaler.py:263", "fp16_nan_loss", None),
    ("[deepspeed] fp16 dynamic loss scale overflow! Skipping step. Attempted loss scale: 4294967296, reducing to "
     "2147483648", "deepspeed/runtime/fp16/loss_scaler.py (0.3-0.5)", "fp16_nan_loss", None),
    ("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0",
     "apex/amp/handle.py", "fp16_nan_loss", None),
    ("RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output.",
     "torch/csrc/autograd/python_anomaly_mode.cpp", "fp16_nan_loss",
     ("torch/autograd/__init__.py", "backward", "_engine_run_backward(")),
    ("Loss is nan, stopping training", "detr engine.py (a research repo's guard)", "fp16_nan_loss", None),
    ("{'loss': nan, 'grad_norm': nan, 'learning_rate': 1.9e-05, 'epoch': 0.12}",
     "transformers/trainer.py log", "fp16_nan_loss", None),
    # extension_abi_mismatch
    ("ImportError: /opt/conda/lib/python3.10/site-packages/flash_attn_2_cuda.cpython-310-x86_64-linux-gnu.so: "
     "undefined symbol: _ZN3c104cuda9SetDeviceEi", "the dynamic loader on flash-attn's wheel",
     "extension_abi_mismatch",
     ("flash_attn/flash_attn_interface.py", "<module>", "import flash_attn_2_cuda as flash_attn_cuda")),
    ("RuntimeError: Detected that PyTorch and torchvision were compiled with different CUDA major versions. "
     "PyTorch has CUDA Version=11.8 and torchvision has CUDA Version=12.1. Please reinstall the torchvision that "
     "matches your PyTorch install.", "torchvision/extension.py _check_cuda_version", "extension_abi_mismatch",
     ("torchvision/extension.py", "_check_cuda_version", "raise RuntimeError(")),
    ("RuntimeError: operator torchvision::nms does not exist", "torch/_ops.py (torchvision built for another torch)",
     "extension_abi_mismatch", ("torch/library.py", "impl_abstract", "op = torch._ops.ops.torchvision.nms")),
    ("WARNING[XFORMERS]: xFormers can't load C++/CUDA extensions. xFormers was built for:\n    PyTorch 2.1.0+cu121 "
     "with CUDA 1201 (you have 2.2.0+cu121)", "xformers/_cpp_lib.py", "extension_abi_mismatch", None),
    ("The installed version of bitsandbytes was compiled without GPU support. 8-bit optimizers, 8-bit "
     "multiplication, and GPU quantization are unavailable.", "bitsandbytes/cextension.py", "extension_abi_mismatch",
     None),
    ("AttributeError: 'NoneType' object has no attribute 'cadam32bit_grad_fp32'", "bitsandbytes/functional.py",
     "extension_abi_mismatch",
     ("bitsandbytes/functional.py", "optimizer_update_32bit", "str2optimizer32bit[optimizer_name][0](")),
    ("RuntimeError: Not compiled with GPU support", "detectron2 / maskrcnn-benchmark / mmcv C++ ops",
     "extension_abi_mismatch",
     ("torchvision/ops/roi_align.py", "roi_align", "return torch.ops.torchvision.roi_align(")),
    ("ImportError: libcudart.so.11.0: cannot open shared object file: No such file or directory",
     "the dynamic loader", "extension_abi_mismatch",
     ("xformers/_cpp_lib.py", "_register_extensions", "torch.ops.load_library(ext_specs.origin)")),
    # tokenizer_embedding_mismatch
    ("../aten/src/ATen/native/cuda/Indexing.cu:1146: indexSelectLargeIndex: block: [234,0,0], thread: [64,0,0] "
     "Assertion `srcIndex < srcSelectDimSize` failed.", "torch aten/src/ATen/native/cuda/Indexing.cu",
     "tokenizer_embedding_mismatch", None),
    ("IndexError: index out of range in self", "torch aten embedding (CPU)", "tokenizer_embedding_mismatch",
     ("torch/nn/functional.py", "embedding",
      "return torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)")),
    ("RuntimeError: index out of range: Tried to access index 32000 out of table with 31999 rows. at "
     "/pytorch/aten/src/TH/generic/THTensorEvenMoreMath.cpp:418", "torch 1.0-1.4 TH", "tokenizer_embedding_mismatch",
     ("torch/nn/functional.py", "embedding",
      "return torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)")),
    ("RuntimeError: Error(s) in loading state_dict for PeftModelForCausalLM:\n\tsize mismatch for "
     "base_model.model.model.embed_tokens.weight: copying a param with shape torch.Size([32001, 4096]) from "
     "checkpoint, the shape in current model is torch.Size([32000, 4096]).", "torch/nn/modules/module.py "
     "load_state_dict", "tokenizer_embedding_mismatch",
     ("torch/nn/modules/module.py", "load_state_dict", "raise RuntimeError(")),
    # shm_too_small
    ("RuntimeError: DataLoader worker (pid 2671) is killed by signal: Bus error. It is possible that dataloader's "
     "workers are out of shared memory. Please try to raise your shared memory limit.",
     "torch/utils/data/_utils/signal_handling.py + libtorch_python", "shm_too_small",
     ("torch/utils/data/_utils/signal_handling.py", "handler", "_error_if_any_worker_fails()")),
    ("ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).",
     "torch/csrc/DataLoader.cpp", "shm_too_small", None),
    ("RuntimeError: unable to write to file </torch_18692_1954506624_0>: No space left on device (28)",
     "torch libshm / StorageSharing.cpp", "shm_too_small",
     ("torch/multiprocessing/reductions.py", "reduce_storage", "fd, size = storage._share_fd_cpu_()")),
    ("RuntimeError: DataLoader worker (pid(s) 2671, 2672) exited unexpectedly", "torch/utils/data/dataloader.py:1305",
     "shm_too_small", ("torch/utils/data/dataloader.py", "_try_get_data", "raise RuntimeError(")),
    ("node1:123:456 [0] include/shm.h:48 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-1a2B3c "
     "(size 9637888)", "NCCL include/shm.h (2.7-2.12)", "shm_too_small", None),
    ("node1:123:456 [0] misc/shmutils.cc:87 NCCL WARN Error: failed to extend /dev/shm/nccl-1a2B3c to 9637892 bytes, "
     "error: No space left on device (28)", "NCCL misc/shmutils.cc (2.12+)", "shm_too_small", None),
    ("node1:123:456 [0] NCCL WARN Call to posix_fallocate failed : No space left on device",
     "NCCL include/shm.h (2.8-2.11)", "shm_too_small", None),
    # more_ranks_than_gpus
    ("RuntimeError: CUDA error: invalid device ordinal", "torch c10/cuda CUDAFunctions (cudaSetDevice)",
     "more_ranks_than_gpus", ("torch/cuda/__init__.py", "set_device", "torch._C._cuda_setDevice(device)")),
    ("ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\nDuplicate GPU detected : "
     "rank 1 and rank 0 both on CUDA device 3b000", "torch NCCLUtils + NCCL init.cc", "more_ranks_than_gpus",
     ("torch/distributed/distributed_c10d.py", "barrier", "work = default_pg.barrier(opts=opts)")),
    ("RuntimeError: device >= 0 && device < num_gpus INTERNAL ASSERT FAILED at "
     "\"../aten/src/ATen/cuda/CUDAContext.cpp\":50, please report a bug to PyTorch.",
     "torch aten/src/ATen/cuda/CUDAContext.cpp", "more_ranks_than_gpus",
     ("torch/cuda/__init__.py", "get_device_properties", "return _get_device_properties(device)")),
    # nccl_env_setup
    ("Failed to initialize NVML: Driver/library version mismatch", "nvidia-smi / NVML", "nccl_env_setup", None),
    ("RuntimeError: Distributed package doesn't have NCCL built in", "torch/distributed/distributed_c10d.py",
     "nccl_env_setup", ("torch/distributed/distributed_c10d.py", "_new_process_group_helper", "raise RuntimeError(")),
    ("ImportError: /opt/conda/lib/python3.10/site-packages/torch/lib/libtorch_cuda.so: undefined symbol: "
     "ncclCommRegister", "the dynamic loader (nvidia-nccl-cu12 older than torch's)", "nccl_env_setup",
     ("torch/__init__.py", "<module>", "from torch._C import *  # noqa: F403")),
    ("RuntimeError: The NVIDIA driver on your system is too old (found version 11040). Please update your GPU driver "
     "by downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx",
     "torch c10/cuda", "nccl_env_setup", ("torch/cuda/__init__.py", "_lazy_init", "torch._C._cuda_init()")),
    ("RuntimeError: CUDA error: system not yet initialized", "CUDA runtime (fabric manager down)",
     "nccl_env_setup", ("torch/cuda/__init__.py", "_lazy_init", "torch._C._cuda_init()")),
    ("node2:789:901 [3] NCCL WARN NET/IB : Got async event : port error", "NCCL transport/net_ib.cc",
     "nccl_env_setup", None),
    # library_version_regression
    ("ImportError: tokenizers>=0.14,<0.19 is required for a normal functioning of this module, but found "
     "tokenizers==0.19.1.", "transformers/utils/versions.py require_version", "library_version_regression",
     ("transformers/utils/versions.py", "_compare_versions", "raise ImportError(")),
    ("ImportError: Using the `Trainer` with `PyTorch` requires `accelerate>=0.26.0`: Please run `pip install "
     "transformers[torch]` or `pip install 'accelerate>=0.26.0'`", "transformers/training_args.py _setup_devices",
     "library_version_regression", ("transformers/training_args.py", "_setup_devices", "raise ImportError(")),
    ("ValueError: The checkpoint you are trying to load has model type `qwen2` but Transformers does not recognize "
     "this architecture. This could be because of an issue with the checkpoint, or because your version of "
     "Transformers is out of date.", "transformers/models/auto/configuration_auto.py", "library_version_regression",
     ("transformers/models/auto/configuration_auto.py", "from_pretrained", "raise ValueError(")),
    ("AttributeError: module 'torch.library' has no attribute 'register_fake'",
     "an extension written for torch >= 2.4", "library_version_regression",
     ("torchao/ops.py", "<module>", "@torch.library.register_fake(\"torchao::quant_llm_linear\")")),
    # dist_port_in_use
    ("RuntimeError: The server socket has failed to listen on any local network address. The server socket has "
     "failed to bind to [::]:29500 (errno: 98 - Address already in use). The server socket has failed to bind to "
     "0.0.0.0:29500 (errno: 98 - Address already in use).", "torch c10d socket.cpp (2.0+)", "dist_port_in_use",
     ("torch/distributed/rendezvous.py", "_create_c10d_store", "return TCPStore(")),
    ("RuntimeError: Address already in use", "torch c10d TCPStore (1.x)", "dist_port_in_use",
     ("torch/distributed/rendezvous.py", "_env_rendezvous_handler",
      "store = TCPStore(master_addr, master_port, world_size, start_daemon, timeout)")),
    ("ConnectionError: Tried to launch distributed communication on port `29500`, but another process is utilizing "
     "it. Please specify a different port (such as using the `--main_process_port` flag or specifying a different "
     "`main_process_port` in your config file) and rerun your script.", "accelerate/utils/launch.py:245",
     "dist_port_in_use", ("accelerate/utils/launch.py", "prepare_multi_gpu_env", "raise ConnectionError(")),
    # gpu_arch_unsupported
    ("UserWarning: NVIDIA GeForce RTX 5090 with CUDA capability sm_120 is not compatible with the current PyTorch "
     "installation.\nThe current PyTorch install supports CUDA capabilities sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 "
     "sm_90.", "torch/cuda/__init__.py:427", "gpu_arch_unsupported", None),
    ("UserWarning: Found GPU0 Tesla K80 which is of cuda capability 3.7.\n    PyTorch no longer supports this GPU "
     "because it is too old.\n    The minimum cuda capability supported by this library is 5.0.",
     "torch/cuda/__init__.py _check_capability", "gpu_arch_unsupported", None),
    ("RuntimeError: Current CUDA Device does not support bfloat16. Please switch dtype to float16.",
     "torch/amp/autocast_mode.py:295", "gpu_arch_unsupported",
     ("torch/amp/autocast_mode.py", "__init__", "raise RuntimeError(")),
    ("RuntimeError: Found Tesla P100-PCIE-16GB which is too old to be supported by the triton GPU compiler, which is "
     "used as the backend. Triton only supports devices of CUDA Capability >= 7.0, but your device is of CUDA "
     "capability 6.0", "torch/_inductor/exc.py:151", "gpu_arch_unsupported",
     ("torch/_inductor/scheduler.py", "create_backend",
      "raise GPUTooOldForTriton(device_props, inspect.currentframe())")),
    ("ValueError: bf16 mixed precision requires PyTorch >= 1.10 and a supported device.",
     "accelerate/accelerator.py:595", "gpu_arch_unsupported",
     ("accelerate/accelerator.py", "__init__", "raise ValueError(")),
    ("RuntimeError: CUDA error: no kernel image is available for execution on the device",
     "CUDA runtime cudaErrorNoKernelImageForDevice", "gpu_arch_unsupported",
     ("torch/nn/modules/linear.py", "forward", "return F.linear(input, self.weight, self.bias)")),
    # rendezvous_unreachable
    ("torch.distributed.DistNetworkError: The client socket has timed out after 1800s while trying to connect to "
     "(10.0.0.1, 29500).", "torch c10d socket.cpp (2.0+)", "rendezvous_unreachable",
     ("torch/distributed/rendezvous.py", "_create_c10d_store", "return TCPStore(")),
    ("RuntimeError: connect() timed out. Original timeout was 1800000 ms.", "torch c10d TCPStore (1.x)",
     "rendezvous_unreachable",
     ("torch/distributed/rendezvous.py", "_env_rendezvous_handler",
      "store = TCPStore(master_addr, master_port, world_size, start_daemon, timeout)")),
    ("ValueError: Error initializing torch.distributed using env:// rendezvous: environment variable MASTER_ADDR "
     "expected, but not set", "torch/distributed/rendezvous.py:249", "rendezvous_unreachable",
     ("torch/distributed/rendezvous.py", "_get_env_or_raise", "raise _env_error(env_var)")),
    ("torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has "
     "failed. See inner exception for details.", "torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py",
     "rendezvous_unreachable",
     ("torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", "_create_tcp_store",
      "raise RendezvousConnectionError(")),
    ("RuntimeError: Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:144] no error",
     "torch ProcessGroupGloo.cpp + gloo pair.cc", "rendezvous_unreachable",
     ("torch/distributed/distributed_c10d.py", "_new_process_group_helper", "backend_class = ProcessGroupGloo(")),
    ("torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.",
     "torch c10d TCPStore waitForWorkers (2.1+)", "rendezvous_unreachable",
     ("torch/distributed/rendezvous.py", "_create_c10d_store", "return TCPStore(")),
    ("node1:1234:1234 [0] NCCL WARN Bootstrap : no socket interface found", "NCCL bootstrap.cc",
     "rendezvous_unreachable", None),
    # watchdog_stuck_rank: torch's own word that the ranks are not in the same collective
    ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: "
     "CollectiveFingerPrint(SequenceNumber=12, OpType=ALLREDUCE, TensorShape=[1], TensorDtypes=Float), but Rank 1 "
     "is running collective: CollectiveFingerPrint(SequenceNumber=12, OpType=BROADCAST, TensorShape=[1], "
     "TensorDtypes=Float).", "torch ProcessGroupWrapper.cpp (TORCH_DISTRIBUTED_DEBUG=DETAIL)", "watchdog_stuck_rank",
     ("torch/distributed/distributed_c10d.py", "all_reduce", "work = group.allreduce([tensor], opts)")),
    # peer_rank_failed
    ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, remote "
     "process exited or there was a network error, NCCL version 2.18.1\nncclRemoteError: A call failed possibly due "
     "to a network error or a remote process exiting prematurely.\nLast error:\nNET/IB : Got completion from peer "
     "10.0.0.2<41231> with error 12, opcode 0, len 0, vendor err 129 (Recv)", "torch NCCLUtils + NCCL net_ib.cc",
     "peer_rank_failed",
     ("torch/distributed/distributed_c10d.py", "all_reduce", "work = group.allreduce([tensor], opts)")),
    ("torch.distributed.DistStoreError: Failed to recv, got 0 bytes. Connection was likely closed. Did the remote "
     "server shutdown or crash?", "torch c10d Utils.hpp recvBytes (2.2+)", "peer_rank_failed",
     ("torch/distributed/distributed_c10d.py", "barrier", "work = group.barrier(opts=opts)")),
    ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
     "[10.0.0.2]:43210", "gloo tcp/pair.cc", "peer_rank_failed",
     ("torch/distributed/distributed_c10d.py", "all_reduce", "work.wait()")),
    ("node1:123:789 [0] misc/socket.cc:538 NCCL WARN Net : Connection closed by remote peer "
     "10.0.0.2<52344>", "NCCL misc/socket.cc (2.14+)", "peer_rank_failed", None),
    ("RuntimeError: NCCL communicator was aborted on rank 3.", "torch ProcessGroupNCCL.cpp", "peer_rank_failed",
     ("torch/distributed/distributed_c10d.py", "all_reduce", "work.wait()")),
    ("torch.distributed.elastic.multiprocessing.api: [WARNING] Sending process 41235 closing signal SIGTERM",
     "torch/distributed/elastic/multiprocessing/api.py", "peer_rank_failed", None),
]

# messages that share words with the ones above but name another failure: never a confident answer of these causes
LOOK_ALIKES: list[tuple[str, str]] = [
    # a class label past the classifier's outputs in the loss: the labels, not the tokenizer
    ("../aten/src/ATen/native/cuda/Loss.cu:240: nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], thread: "
     "[5,0,0] Assertion `t >= 0 && t < n_classes` failed.", "tokenizer_embedding_mismatch"),
    # printed on every run without the optional plugin: not a broken install
    ("node1:123:123 [0] NCCL INFO NET/Plugin : Plugin load (libnccl-net.so) returned 2 : libnccl-net.so: cannot open "
     "shared object file: No such file or directory", "nccl_env_setup"),
    # torch's store warning on localhost where IPv6 is off: the connection is retried on IPv4 and works
    ("[W socket.cpp:436] [c10d] The server socket cannot be initialized on [::]:29500 (errno: 97 - Address family "
     "not supported by protocol).", "dist_port_in_use"),
    # DeepSpeed's note that an optional op is missing; training goes on without it
    ("[WARNING]  async_io requires the dev libaio .so object and headers but these were not found.",
     "env_deepspeed_op_build"),
    # a list index in the user's own code
    ("IndexError: list index out of range", "tokenizer_embedding_mismatch"),
    # too many open file descriptors under the file_descriptor sharing strategy: ulimit, not /dev/shm
    ("RuntimeError: received 0 items of ancdata", "shm_too_small"),
    # sampling from a model's logits at inference
    ("RuntimeError: probability tensor contains either `inf`, `nan` or element < 0", "fp16_nan_loss"),
    # a model with some keys newly initialised: an ordinary load report
    ("Some weights of LlamaForSequenceClassification were not initialized from the model checkpoint at "
     "meta-llama/Llama-2-7b-hf and are newly initialized: ['score.weight']", "meta_device_loading"),
]


def _traceback(message: str, frame: tuple[str, str, str] | None) -> str:
    """The message as it reaches a user: under a short traceback through the library's frame, or logged after a
    line of the training script."""
    if frame is None:
        return f"[2025-03-02 10:14:07] INFO train.py:88: starting epoch 0\n{message}\n"
    path, func, line = frame
    return ("Traceback (most recent call last):\n"
            '  File "/home/me/project/train.py", line 142, in <module>\n    main()\n'
            '  File "/home/me/project/train.py", line 131, in main\n    run(cfg)\n'
            f'  File "{SITE}{path}", line 512, in {func}\n    {line}\n{message}\n')


def _ids() -> list[str]:
    return [f"{i}-{cause}" for i, (_, _, cause, _) in enumerate(ROWS)]


@pytest.mark.parametrize("row", ROWS, ids=_ids())
def test_a_library_message_ranks_its_cause_bare(row: tuple) -> None:
    message, source, cause, _ = row
    cats = [x.category for x in analyze(message).likely]
    assert cause in cats[:3], (source, cats)


@pytest.mark.parametrize("row", ROWS, ids=_ids())
def test_a_library_message_ranks_its_cause_in_a_traceback(row: tuple) -> None:
    message, source, cause, frame = row
    cats = [x.category for x in analyze(_traceback(message, frame)).likely]
    assert cause in cats[:3], (source, cats)


@pytest.mark.parametrize("row", LOOK_ALIKES, ids=[c for _, c in LOOK_ALIKES])
def test_a_look_alike_is_not_answered_confidently(row: tuple[str, str]) -> None:
    message, cause = row
    for log in (message, _traceback(message, None)):
        a = analyze(log)
        assert not (a.answer == "confident" and a.likely and a.likely[0].category == cause
                    and a.likely[0].confidence >= CONFIDENT), [(x.category, x.confidence) for x in a.likely]
