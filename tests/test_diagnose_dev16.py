"""Mechanisms found on the outsiders' batch 16 (dev data): two confident rules narrowed (an invalid device ordinal on
a job over several machines, torch's JIT build of an extension DeepSpeed does not own), and bare messages the engine
left unanswered (a dotted module missing from an installed library, pydantic 2 refusing the v1 API, DDP's forward cut
at its reducer check, the linker finding no NCCL, cuDNN's frontend with no engine for a graph, a CUDA assert typed with
full-width signs, the first GPU holding more memory than the others, a cut keyword TypeError of the old
gradient-checkpointing API). Then those rules narrowed where they read a library's real format wrongly: a compiled
part missing from its package, cuDNN's message beside a new GPU, unequal memory with no first GPU named, a graph's
nodes, generation and rollout batch sizes, a script's own call of the checkpointing hook, DDP's other forward line.
Each paste is made up in the shape of the library's message (its source is cited in causes.yaml, facts.py or
parse.py), not taken from a thread.
"""

from __future__ import annotations

from shardfit.diagnose.engine import analyze
from tests.helpers import likely_categories as _cats

ORDINAL = "RuntimeError: CUDA error: invalid device ordinal\ntorch.cuda.set_device(rank)\n"


def test_an_invalid_ordinal_over_several_machines_is_ranked_not_confident() -> None:
    a = analyze("DDP over 2 machines with 5 GPUs each fails:\n" + ORDINAL)
    assert "multi_node" in a.parsed.facts
    assert a.answer != "confident"
    assert a.likely[0].category == "more_ranks_than_gpus"  # still the check to run
    # a launch over nodes shown by its flags reads the same
    flags = analyze("torchrun --nnodes=2 --node_rank=1 --nproc_per_node=4 train.py\n" + ORDINAL)
    assert "multi_node" in flags.parsed.facts and flags.answer != "confident"
    # on one machine the ordinal keeps its confident reading
    one = analyze(ORDINAL)
    assert "multi_node" not in one.parsed.facts
    assert one.answer == "confident" and one.likely[0].category == "more_ranks_than_gpus"


def _ninja(name: str, extra: str = "") -> str:
    return (f"{extra}ninja: build stopped: subcommand failed.\n"
            "Traceback (most recent call last):\n"
            '  File "/usr/lib/python3/site-packages/torch/utils/cpp_extension.py", line 1900, in _run_ninja_build\n'
            "    subprocess.run(\n"
            f"RuntimeError: Error building extension '{name}'\n")


def test_a_project_kernel_build_is_not_a_confident_deepspeed_op() -> None:
    own = analyze(_ninja("wkv_1024_bf16"))
    assert own.answer != "confident"
    assert own.likely[0].category == "env_deepspeed_op_build"  # a JIT build all the same: its toolchain check
    assert analyze(_ninja("fused_adam")).answer == "confident"
    # DeepSpeed in sight: its own name for an op is not needed
    assert analyze(_ninja("my_op", "[INFO] DeepSpeed info: version=0.14.0\n")).answer == "confident"


def test_a_submodule_missing_from_an_installed_library_is_a_version_question() -> None:
    assert _cats("ModuleNotFoundError: No module named 'pytorch_lightning.lite'")[0] == "library_version_regression"
    assert _cats("ModuleNotFoundError: No module named 'diffusers.models.cross_attention'")[0] == \
        "library_version_regression"
    # a project's own package (its parent is the user's) says nothing of versions
    assert _cats("ModuleNotFoundError: No module named 'models.sync_batchnorm'") == []


def test_pydantic_two_refusing_a_v1_validator_is_a_version_question() -> None:
    paste = ("pydantic.errors.PydanticUserError: If you use `@root_validator` with pre=False (the default) you MUST "
             "specify `skip_on_failure=True`. Note that `@root_validator` is deprecated and should be replaced with "
             "`@model_validator`.")
    assert _cats(paste)[0] == "library_version_regression"


def test_ddp_forward_cut_at_its_reducer_check_is_unused_parameters() -> None:
    paste = ('  File "/opt/conda/lib/python3.8/site-packages/mmengine/model/wrappers/distributed.py", line 161, in '
             "_run_forward\n    results = self(**data, mode=mode)\n"
             '  File "/opt/conda/lib/python3.8/site-packages/torch/nn/parallel/distributed.py", line 947, in forward\n'
             "    if torch.is_grad_enabled() and self.reducer._rebuild_buckets():\n[...]\n")
    assert _cats(paste)[0] == "ddp_unused_parameters"


def test_the_linker_finding_no_nccl_is_the_nccl_install() -> None:
    paste = ("/usr/bin/ld: cannot find -lnccl: No such file or directory\n"
             "collect2: error: ld returned 1 exit status\nmake: *** [Makefile:277: train_gpt2cu] Error 1")
    assert _cats(paste)[0] == "nccl_env_setup"


def test_cudnn_frontend_without_an_engine_ranks_the_gpu_architecture() -> None:
    assert _cats("[cudnn_frontend] Error: No execution plans support the graph.")[0] == "gpu_arch_unsupported"


def test_a_cuda_assert_typed_with_full_width_signs_reads_as_the_ascii_one() -> None:
    a = analyze("训练一会就出现 `Assertion srcIndex ＜ srcSelectDimSize failed.`")
    assert a.likely and a.likely[0].category == "tokenizer_embedding_mismatch"


def test_the_first_gpu_holding_more_memory_ranks_ranks_on_one_gpu() -> None:
    paste = "The GPU load is unbalanced: the first GPU occupies much more memory than the others during training."
    assert "more_ranks_than_gpus" in _cats(paste)[:3]


def test_a_cut_set_gradient_checkpointing_type_error_is_the_old_api() -> None:
    a = analyze("TypeError: QwenPreTrainedModel._set_gradient_checkpointing() got an unexpect")
    assert a.answer == "confident" and a.likely[0].category == "gc_remote_code_old_api"


# Narrowings of the rules above, each against a paste in a library's real format that they read wrongly.

def test_a_compiled_extension_missing_from_its_package_is_not_a_version_question() -> None:
    # mmcv/utils/ext_loader.py imports 'mmcv._ext': absent from mmcv-lite and from a build with MMCV_WITH_OPS=0;
    # an xformers built without its kernels lacks xformers._C; torch imported from its source tree lacks torch._C
    for module in ("mmcv._ext", "xformers._C", "torch._C", "xformers._C_flashattention", "triton._C.libtriton"):
        paste = f"ModuleNotFoundError: No module named '{module}'"
        assert _cats(paste)[:1] != ["library_version_regression"], paste
    # a pure-Python module a release dropped still reads as the release
    assert _cats("ModuleNotFoundError: No module named 'torch._six'")[0] == "library_version_regression"


_NO_PLAN = "RuntimeError: cuDNN Frontend error: [cudnn_frontend] Error: No execution plans support the graph."


def test_cudnn_frontend_without_a_plan_on_hopper_is_not_the_architecture() -> None:
    # torch 2.5.0 put cuDNN SDPA first on sm90: the same message on an H100 is a shape / release limit, not an old GPU
    paste = "GPU: NVIDIA H100 80GB HBM3, torch 2.5.0+cu124\n" + _NO_PLAN
    assert "new_gpu" in analyze(paste).parsed.facts
    assert _cats(paste)[:1] == ["library_version_regression"]  # 2.5.1 made that backend opt-in
    assert "gpu_arch_unsupported" not in _cats("GPU: NVIDIA H100 80GB HBM3, torch 2.6.0\n" + _NO_PLAN)
    # another torch named: no release reading
    assert "library_version_regression" not in _cats("pip install torch==2.5.1\n" + _NO_PLAN)


def test_pipeline_stages_holding_unequal_memory_are_not_ranks_on_cuda0() -> None:
    # pipeline parallelism's first stage holds the embeddings and the most in-flight activations by design
    paste = ("Megatron pipeline parallel size 4 on 4 GPUs. The GPU memory usage is unbalanced: stage 0 uses 70GB "
             "while the last stage uses 40GB.")
    assert _cats(paste)[:1] != ["more_ranks_than_gpus"]
    # unequal memory with no first GPU named says nothing of cuda:0, under a launcher too
    launch = "torchrun --nproc_per_node 4 train.py\n"
    assert "more_ranks_than_gpus" not in _cats(launch + "The GPU memory usage is unbalanced: rank 0 evaluates alone.")
    assert "more_ranks_than_gpus" in _cats(launch + "The GPU memory usage is unbalanced: cuda:0 uses 70GB.")
    # a device_map split holds unequal layers by design
    split = "model = AutoModelForCausalLM.from_pretrained(path, device_map='auto')\n"
    assert "more_ranks_than_gpus" not in _cats(split + "GPU 0 uses much more memory than the others.")


def test_a_graph_of_many_nodes_is_not_a_job_over_several_machines() -> None:
    a = analyze("dataset: Graph(num_nodes=2708, num_edges=10556), a graph with 2708 nodes\n" + ORDINAL)
    assert "multi_node" not in a.parsed.facts
    assert a.answer == "confident"
    assert "multi_node" not in analyze("our cluster has 3 nodes but this job runs on one\n" + ORDINAL).parsed.facts
    for said in ("DDP on 2 nodes with 8 GPUs each", "2 nodes x 8", "16 GPUs across two nodes", "2-node training"):
        assert "multi_node" in analyze(f"{said}\n{ORDINAL}").parsed.facts, said


def test_generation_rollout_and_engine_batch_sizes_are_not_the_micro_batch() -> None:
    oom = "\ntorch.OutOfMemoryError: CUDA out of memory."
    for flag in ("--gen_batch_size 1", "--rollout_batch_size 1", "--max_batch_size 1"):
        assert "batch_of_one" not in analyze(f"python train.py {flag}{oom}").parsed.facts, flag
    assert "batch_of_one" in analyze(f"python train.py --max_batch_size 1 --micro_batch_size 1{oom}").parsed.facts


def test_a_script_calling_the_checkpointing_hook_itself_is_not_the_model_code() -> None:
    error = ("TypeError: LlamaPreTrainedModel._set_gradient_checkpointing() got an unexpected keyword argument "
             "'value'")
    call = "    model._set_gradient_checkpointing(model.model, value=True)\n"
    own = analyze('  File "/home/u/train.py", line 88, in <module>\n' + call + error)
    assert "own_gc_call" in own.parsed.facts and own.answer != "confident"
    assert own.likely[0].category == "library_version_regression"
    assert "own_gc_call" in analyze(call.strip() + "\n" + error).parsed.facts  # the code line shown without a frame
    # transformers' own call into a remote model's old hook keeps the confident reading
    lib = analyze('  File "/usr/lib/python3/site-packages/transformers/modeling_utils.py", line 1872, in '
                  "gradient_checkpointing_enable\n    self._set_gradient_checkpointing(enable=True, "
                  "gradient_checkpointing_func=gradient_checkpointing_func)\n"
                  "TypeError: ChatGLMPreTrainedModel._set_gradient_checkpointing() got an unexpected keyword argument "
                  "'enable'")
    assert "own_gc_call" not in lib.parsed.facts
    assert lib.answer == "confident" and lib.likely[0].category == "gc_remote_code_old_api"


def test_ddp_forward_cut_after_the_forward_is_not_the_reducer_check() -> None:
    # the line after the forward (prepare_for_backward) starts with the same `if torch.is_grad_enabled()`
    paste = ('  File "/opt/conda/lib/python3.8/site-packages/torch/nn/parallel/distributed.py", line 960, in forward\n'
             "    if torch.is_grad_enabled() and self.require_backward_grad_sync:\n[...]\n")
    assert "ddp_unused_parameters" not in _cats(paste)
    # the reducer check's line cut after its first words (a paste of torch 1.11's forward) still reads
    assert _cats(paste.replace(" and self.require_backward_grad_sync:", ""))[:1] == ["ddp_unused_parameters"]
