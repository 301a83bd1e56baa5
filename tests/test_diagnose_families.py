"""`shardfit diagnose` by error family (round 9): families that got no answer at all, each now answered with the
likely causes of the setting the paste shows, never confidently:

- a distributed call with no process group ("Default process group has not been initialized", "DeepSpeed backend
  not set"): a script started without a launcher, or a library that no longer creates the group;
- ZeRO-3's size-0 placeholders met by an op ("'weight' must be 2-D", "tensor b (0)", "shape '[0]'", "0x1"): a module
  used outside the engine, a parameter read ungathered;
- a traceback cut before its exception line: the last frames alone (torch.distributed, DeepSpeed's ZeRO, accelerate,
  bitsandbytes, the DataLoader) rank the causes;
- prose: a hang in words under a multi-process launch.

Each paste is made up here in the shape such threads have (none is taken from a corpus). The controls beside them
share a word with a family and must stay unanswered: a single-GPU run or a test session that calls dist itself, a
size 0 in the user's data or with no DeepSpeed, a traceback cut in the user's own code or the tokenizer, NaN in a
dataset or in generate()."""

from __future__ import annotations

import pytest

from shardfit.diagnose.engine import analyze, load_knowledge
from shardfit.diagnose.parse import parse

NO_PG = "ValueError: Default process group has not been initialized, please make sure to call init_process_group."


# a deliberate single process (or no setting shown: as often a one-process script calling dist unguarded)
NO_PG_CONTROLS = (
    NO_PG,
    "I fine-tune on one GPU: python train.py --lr 1e-4\n" + NO_PG,
    "CUDA_VISIBLE_DEVICES=0 python train.py\n" + NO_PG,
    "python -m pytest tests/test_metrics.py\n" + NO_PG,
)
# a size 0 with no DeepSpeed shown, or in the user's data
SIZE0_CONTROLS = (
    "RuntimeError: shape '[0]' is invalid for input of size 8192",
    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x2048 and 0x1)",
    "deepspeed --deepspeed ds_z3.json train.py\nValueError: the dataset has size 0 after filtering",
    "deepspeed --deepspeed ds_z3.json train.py\nKeyError: 'size 0'",
    # a debug print of the user's batch under ZeRO-3, and an empty feature map of the user's own head
    "deepspeed --deepspeed ds_z3.json dpo.py\nchosen_ids: torch.Size([0]) rejected_ids: torch.Size([0])\n"
    "IndexError: index 0 is out of bounds for dimension 0 with size 0",
    "deepspeed train.py --deepspeed ds.json\nRuntimeError: mat1 and mat2 shapes cannot be multiplied (4x0 and 0x512)",
)
# NaN in the user's data or in generation, a question about several GPUs
PROSE_CONTROLS = (
    "My dataset has NaN values in the label column",
    "fp16 inference: the logits are nan in model.generate()",
    "How do I train on several GPUs with a cosine schedule?",
    # a hang long after the first collective: a rank that diverged, not peer-to-peer failing
    "torchrun --nproc_per_node 4 sft.py\n{'loss': 0.812, 'learning_rate': 1.9e-05, 'epoch': 0.97}\n"
    "It hangs after 3000 steps with no error, then the job times out.",
    "torchrun --nproc_per_node 4 sft.py\nThe run gets stuck after 1500 iterations and times out, no error printed.",
)


def _likely(log: str) -> list[str]:
    a = analyze(log)
    assert a.answer == "likely", (log, a.answer, [(x.category, x.confidence) for x in a.likely])
    assert all(x.confidence < 0.8 for x in a.likely)
    return [x.category for x in a.likely]


def _none(log: str) -> None:
    a = analyze(log)
    assert a.answer == "none" and not a.likely, (log, [(x.category, x.confidence) for x in a.likely])


def _frames(*frames: tuple[str, str, str]) -> str:
    """A traceback cut after its last frame's source line, as pasted from a terminal."""
    out = ["Traceback (most recent call last):"]
    for path, func, src in frames:
        out += [f'  File "{path}", line 412, in {func}', f"    {src}"]
    return "\n".join(out)


SITE = "/home/me/miniconda3/envs/ft/lib/python3.11/site-packages/"


# -- no process group ------------------------------------------------------------------------------------------------

def test_no_process_group_after_a_plain_python_start_is_the_launch_first() -> None:
    cats = _likely("CUDA_VISIBLE_DEVICES=0,1,2,3 python sft.py --model_name_or_path meta-llama/Llama-3.1-8B\n" + NO_PG)
    assert cats[0] == "dataparallel_accidental" and "library_version_regression" in cats, cats
    assert "torchrun" in analyze("python sft.py --epochs 1\n" + NO_PG).likely[0].check
    for log in NO_PG_CONTROLS:
        _none(log)


@pytest.mark.parametrize("launch", [
    "torchrun --nproc_per_node 2 train_lora.py --bf16",
    "accelerate launch --num_processes 4 finetune.py",
])
def test_no_process_group_under_a_launcher_is_a_library_that_stopped_creating_it(launch: str) -> None:
    assert _likely(f"{launch}\n{NO_PG}")[0] == "library_version_regression"
    for log in NO_PG_CONTROLS:
        _none(log)


def test_deepspeed_backend_not_set_ranks_the_deepspeed_release() -> None:
    cats = _likely("AssertionError: DeepSpeed backend not set, please initialize it using init_process_group()")
    assert cats == ["library_version_regression"]




# -- ZeRO-3 size-0 placeholders --------------------------------------------------------------------------------------

@pytest.mark.parametrize("error", [
    "RuntimeError: 'weight' must be 2-D",
    "RuntimeError: The size of tensor a (4096) must match the size of tensor b (0) at non-singleton dimension 1",
    "RuntimeError: shape '[0]' is invalid for input of size 8192",
    "RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x2048 and 0x1)",
])
@pytest.mark.parametrize("setting", [
    "deepspeed --num_gpus 4 distill.py --deepspeed configs/ds_zero3.json",
    "accelerate launch --config_file zero3.yaml dpo.py  # ZeRO-3, reference model loaded apart",
])
def test_a_size_0_parameter_under_zero3_is_a_placeholder_used_outside_the_engine(setting: str, error: str) -> None:
    cats = _likely(f"{setting}\n{error}")
    assert cats[:2] == ["zero3_save_empty_params", "zero3_cpu_submodule"], cats
    assert "outside the DeepSpeed engine" in analyze(f"{setting}\n{error}").likely[0].check
    for log in SIZE0_CONTROLS:
        _none(log)


# -- tracebacks cut before the exception line ------------------------------------------------------------------------

# cut in the user's own code, or in a library no cause names (the tokenizer)
CUT_CONTROLS = (
    _frames(("/work/proj/train.py", "main", "loss = model(batch)")),
    _frames((SITE + "transformers/tokenization_utils_base.py", "__call__", "return self._call_one(text)")),
    # the DataLoader re-raising whatever the user's dataset raised in a worker
    _frames((SITE + "torch/utils/data/dataloader.py", "_next_data", "return self._process_data(data)")),
    # DDP's forward above a model's own code: every error raised in the model passes through it
    _frames((SITE + "torch/nn/parallel/distributed.py", "forward", "output = self._run_ddp_forward(*inputs)"),
            (SITE + "transformers/models/llama/modeling_llama.py", "forward", "hidden = self.norm(hidden)")),
    _frames((SITE + "torch/distributed/distributed_c10d.py", "barrier", "work = default_pg.barrier()"),
            ("/work/proj/train.py", "collate", "batch = pad(items)")),
)


TORCHRUN = "torchrun --nproc_per_node 2 train.py"


# each cut frame with the setting its cause needs shown in the paste (a launch of several processes, ZeRO-3, a
# device_map, LoRA)
CUT_IN_LIBRARY = [
    (TORCHRUN + " --deepspeed ds_z2.json",
     [(SITE + "deepspeed/runtime/zero/stage_1_and_2.py", "reduce_ready_partitions_and_remove_grads",
       "self.reduce_independent_p_g_buckets_and_remove_grads(param, i)")], "gc_ddp_reentrant"),
    ('deepspeed --deepspeed ds_z3.json train.py  # from_pretrained(name, device_map={"": 0})',
     [(SITE + "deepspeed/runtime/zero/partition_parameters.py", "_post_init_method",
       "self._convert_to_deepspeed_param(param)")], "zero3_device_map_conflict"),
    (TORCHRUN, [(SITE + "torch/distributed/distributed_c10d.py", "barrier", "work = default_pg.barrier(opts=opts)")],
     "nccl_timeout_preprocessing"),
    (TORCHRUN, [(SITE + "torch/distributed/distributed_c10d.py", "all_reduce",
                 "work = group.allreduce([tensor], opts)")], "nccl_p2p_hang"),
    ("", [(SITE + "torch/distributed/distributed_c10d.py", "init_process_group",
           "store, rank, world_size = next(rendezvous_iterator)")], "rendezvous_unreachable"),
    ("accelerate launch --num_processes 2 train.py --device_map auto",
     [(SITE + "accelerate/accelerator.py", "prepare_model", "raise ValueError(")], "device_map_auto_in_distributed"),
    ("", [(SITE + "bitsandbytes/cextension.py", "<module>", "lib = get_native_library()")], "extension_abi_mismatch"),
    ("docker run --gpus all trainer", [
        (SITE + "torch/utils/data/dataloader.py", "_next_data", "idx, data = self._get_data()"),
        (SITE + "torch/utils/data/_utils/signal_handling.py", "handler", "_error_if_any_worker_fails()")],
     "shm_too_small"),
    (TORCHRUN, [(SITE + "torch/nn/parallel/distributed.py", "_pre_forward",
                 "if torch.is_grad_enabled() and self.reducer._rebuild_buckets():")], "ddp_unused_parameters"),
]


@pytest.mark.parametrize(("setting", "frames", "first"), CUT_IN_LIBRARY)
def test_a_traceback_cut_in_a_library_ranks_the_causes_of_its_last_frames(setting: str, frames: list,
                                                                           first: str) -> None:
    log = setting + "\n" + _frames(("/work/proj/train.py", "main", "trainer.train()"), *frames)
    assert _likely(log)[0] == first
    assert parse(log).cut_frames and "tb_cut" in parse(log).facts
    for control in CUT_CONTROLS:
        _none(control)


# a cut in a frame every error of that call passes through, or in a cause's frame with its setting absent (one GPU,
# no ZeRO-3, no device_map, no LoRA, a collective late in training): no answer
CUT_NO_SETTING = (
    ("python train.py", [(SITE + "accelerate/accelerator.py", "prepare", "result = self._prepare_one(obj)"),
                         (SITE + "accelerate/accelerator.py", "prepare_model", "model = model.to(self.device)")]),
    ("python eval.py  # one GPU", [(SITE + "transformers/generation/utils.py", "generate", "out = self._sample()"),
                                    (SITE + "accelerate/hooks.py", "new_forward",
                                     "output = module._old_forward(*args, **kwargs)")]),
    ("python train.py", [(SITE + "peft/peft_model.py", "save_pretrained", "os.makedirs(save_directory)")]),
    ("deepspeed --deepspeed ds_z3.json train.py", [
        ("/work/proj/model.py", "build", "model = MyModel(cfg)"),
        (SITE + "deepspeed/runtime/zero/partition_parameters.py", "wrapper", "f(module, *args, **kwargs)")]),
    ("python infer.py", [(SITE + "bitsandbytes/nn/modules.py", "to", "return self._quantize(device)")]),
    ("python train.py --gradient_checkpointing", [(SITE + "torch/utils/checkpoint.py", "backward",
                                                   "torch.autograd.backward(outputs, args)")]),
    (TORCHRUN, [(SITE + "torch/nn/parallel/distributed.py", "_run_ddp_forward",
                 "return self.module(*inputs, **kwargs)")]),
    (TORCHRUN + "\n{'loss': 1.21, 'epoch': 0.9}\nstep 1200", [
        (SITE + "torch/distributed/distributed_c10d.py", "all_reduce", "work = group.allreduce([tensor], opts)")]),
    ("python train.py", [(SITE + "torch/utils/data/dataloader.py", "_try_get_data",
                          "data = self._data_queue.get(timeout=timeout)")]),
)


@pytest.mark.parametrize(("setting", "frames"), CUT_NO_SETTING)
def test_a_cut_without_its_causes_setting_or_in_a_pass_through_frame_is_unanswered(setting: str,
                                                                                     frames: list) -> None:
    _none(setting + "\n" + _frames(("/work/proj/train.py", "main", "trainer.train()"), *frames))


@pytest.mark.parametrize("end", [
    "Segmentation fault (core dumped)",
    "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised: RuntimeError: foo",
    "triton.runtime.autotuner.OutOfResources: out of resource: shared memory",
    "Killed",
])
def test_a_traceback_ending_in_a_death_or_an_unusual_exception_is_not_cut(end: str) -> None:
    log = "accelerate launch --num_processes 2 train.py --device_map auto\n" + _frames(
        ("/work/proj/train.py", "main", "model = accelerator.prepare(model)"),
        (SITE + "accelerate/accelerator.py", "prepare_model", "model = model.to(self.device)"))
    assert parse(log).cut_frames
    p = parse(log + "\n" + end)
    assert not p.cut_frames and "tb_cut" not in p.facts


def test_a_complete_traceback_is_not_cut() -> None:
    log = _frames((SITE + "torch/distributed/distributed_c10d.py", "barrier", "work = default_pg.barrier()"))
    p = parse(log + "\nKeyError: 'input_ids'")
    assert not p.cut_frames and "tb_cut" not in p.facts


# -- the same tracebacks as IPython / Jupyter print them ---------------------------------------------------------------

def _ipython(*frames: tuple[str, str, str], old: bool = False, exc: str = "ValueError") -> str:
    """A notebook's traceback cut after its last frame's source excerpt: IPython 8 ("File path:N, in Class.f(...)",
    the home folder as ~) or IPython 7 ("path in f(...)"), five context lines around the arrowed line."""
    out = ["-" * 75, f"{exc}{' ' * 32}Traceback (most recent call last)"]
    out += ["<ipython-input-3-9f2c1e> in <module>", "----> 1 trainer.train()"] if old else \
        ["Cell In[3], line 1", "----> 1 trainer.train()"]
    for path, func, src in frames:
        out.append("")
        if old:
            out.append(f"{path} in {func}(self, *args, **kwargs)")
        else:
            out.append(f"File {path.replace('/home/me', '~')}:412, in Owner.{func}(self, *args, **kwargs)")
        out += ["    410     if self.debug:", "    411         log(args)", f"--> 412     {src}", "    413 ",
                "    414     return out"]
    return "\n".join(out)


@pytest.mark.parametrize("old", [False, True])
@pytest.mark.parametrize(("setting", "frames", "first"), CUT_IN_LIBRARY)
def test_a_notebooks_traceback_cut_in_a_library_ranks_as_a_terminals(setting: str, frames: list, first: str,
                                                                      old: bool) -> None:
    log = setting + "\n" + _ipython(*frames, old=old)
    assert _likely(log)[0] == first
    p = parse(log)
    # the frame's arrowed line is its source; the header's type stands for the message the paste cuts
    assert p.cut_frames and p.cut_frames[-1].endswith("\n" + frames[-1][2]), p.cut_frames
    assert str(p.exception) == "ValueError"


@pytest.mark.parametrize("old", [False, True])
def test_a_notebooks_traceback_cut_in_the_users_code_or_a_pass_through_frame_is_unanswered(old: bool) -> None:
    _none(_ipython(("/work/proj/train.py", "main", "loss = model(batch)"), old=old))
    _none(_ipython((SITE + "torch/utils/data/dataloader.py", "_next_data", "return self._process_data(data)"),
                   old=old))
    for setting, frames in CUT_NO_SETTING:
        _none(setting + "\n" + _ipython(*frames, old=old))


def test_a_notebooks_complete_traceback_keeps_its_message_and_is_not_cut() -> None:
    log = _ipython((C10D, "barrier", "work = default_pg.barrier()")) + "\n\nKeyError: 'input_ids'"
    p = parse(log)
    assert not p.cut_frames and str(p.exception) == "KeyError: 'input_ids'"




# -- prose -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("control", PROSE_CONTROLS)
def test_a_hang_in_words_under_a_launch_of_several_processes_ranks_the_p2p_hang(control: str) -> None:
    assert _likely("The job hangs forever after `torchrun --nproc_per_node 2 sft.py`")[0] == "nccl_p2p_hang"
    _none(control)


# -- facts that must not take a user's own names ---------------------------------------------------------------------

MM_OOM = "\n".join([
    "python main.py --model llava-7b --bs 8",
    "Traceback (most recent call last):",
    '  File "/work/proj/mm/model.py", line 88, in forward',
    "    h = self.llm(inputs_embeds=emb, attention_mask=mask)",
    f'  File "{SITE}transformers/models/llama/modeling_llama.py", line 1190, in forward',
    "    logits = self.lm_head(hidden_states)",
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of 79.15 GiB "
    "of which 1.02 GiB is free."])


def test_a_models_own_llm_attribute_is_not_a_serving_engine() -> None:
    facts = load_knowledge().facts
    assert "inference_engine" not in parse(MM_OOM, facts).facts
    assert analyze(MM_OOM).likely[0].category == "oom_activation_not_sharded"
    assert "inference_engine" in parse('llm = LLM(model="Qwen/Qwen2-7B", tensor_parallel_size=2)', facts).facts


def test_fsdps_own_file_is_not_dataparallels() -> None:
    facts = load_knowledge().facts
    fsdp = _frames(("/work/proj/train.py", "<module>", "model = FSDP(model, use_orig_params=False)"),
                   (SITE + "torch/distributed/fsdp/fully_sharded_data_parallel.py", "__init__", "_auto_wrap("),
                   (SITE + "torch/distributed/fsdp/_wrap_utils.py", "_auto_wrap", "_recursive_wrap(**kwargs)"))
    assert "sym_dp" not in parse(fsdp, facts).facts
    # FSDP's wrapping calls the user's policy: a cut there is any error of it, no cause's
    _none("torchrun --nproc_per_node 8 train.py --fsdp\n" + fsdp)
    dp = _frames(("/work/proj/train.py", "<module>", "out = model(x)"),
                 (SITE + "torch/nn/parallel/data_parallel.py", "forward", "outputs = self.parallel_apply(replicas)"))
    assert "sym_dp" in parse(dp, facts).facts


def test_a_watchdog_timeout_late_in_training_is_not_p2p() -> None:
    log = ("torchrun --nproc_per_node 4 sft.py\n{'loss': 0.64, 'grad_norm': 1.2, 'epoch': 1.0}\n"
           "[rank2]:[E ProcessGroupNCCL.cpp:616] [Rank 2] Watchdog caught collective operation timeout: "
           "WorkNCCL(SeqNum=48211, OpType=ALLREDUCE, NumelIn=1, Timeout(ms)=1800000) ran for 1800412 milliseconds "
           "before timing out.")
    assert "nccl_p2p_hang" not in [x.category for x in analyze(log).likely]


# -- a cut in a frame every ordinary error of that call passes through (review of round 9) ----------------------------

LLAMA = SITE + "transformers/models/llama/modeling_llama.py"
FA = SITE + "flash_attn/flash_attn_interface.py"
BNB = SITE + "bitsandbytes/"
C10D = SITE + "torch/distributed/distributed_c10d.py"
DDP_INIT = (SITE + "torch/nn/parallel/distributed.py", "__init__",
            "_verify_param_shape_across_processes(self.process_group, parameters)")

# ordinary errors (a shape, a dtype, an OOM, a second init, a missing package) whose traceback the paste cuts inside
# an extension's runtime call or a process group's set-up: an import that failed, a GPU too old, a rendezvous that
# found no one, or a port taken is not what these frames show, so none of them may be a likely cause
CUT_ORDINARY = (
    # flash-attn's forward on an H100 with bf16 (the arch is fine; a head dim or a layout is wrong)
    ("torchrun --nproc_per_node 8 sft.py --bf16 --attn_implementation flash_attention_2  # 8x H100 80GB HBM3", [
        (LLAMA, "forward", "attn_output, attn_weights = attention_interface("),
        (SITE + "transformers/integrations/flash_attention.py", "flash_attention_forward",
         "attn_output = _flash_attention_forward("),
        (FA, "flash_attn_varlen_func", "return FlashAttnVarlenFunc.apply("),
        (FA, "forward", "out_padded, softmax_lse, S_dmask, rng_state = _wrapped_flash_attn_varlen_forward("),
        (FA, "_flash_attn_varlen_forward", "out, softmax_lse, S_dmask, rng_state = flash_attn_gpu.varlen_fwd(")],
     {"extension_abi_mismatch", "gpu_arch_unsupported"}),
    ("python train.py --model Qwen/Qwen2.5-7B --bf16  # A100-SXM4-80GB", [
        (SITE + "transformers/models/qwen2/modeling_qwen2.py", "forward", "attn_output = _flash_attention_forward("),
        (FA, "flash_attn_func", "return FlashAttnFunc.apply(")],
     {"extension_abi_mismatch", "gpu_arch_unsupported"}),
    # flash-attn's padding helpers are plain torch code: an attention mask of the wrong shape
    ("accelerate launch --num_processes 4 train.py --packing", [
        (SITE + "transformers/modeling_flash_attention_utils.py", "_upad_input",
         "indices_k, cu_seqlens_k, max_seqlen_in_batch_k = _get_unpad_data(attention_mask)"),
        (SITE + "flash_attn/bert_padding.py", "unpad_input",
         "indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()")],
     {"extension_abi_mismatch"}),
    # a QLoRA step: bitsandbytes' runtime Python, past the import that went through
    ("python qlora.py --load_in_4bit --bnb_4bit_compute_dtype bfloat16  # RTX 4090", [
        (SITE + "peft/tuners/lora/bnb.py", "forward", "result = self.base_layer(x, *args, **kwargs)"),
        (BNB + "nn/modules.py", "forward", "return bnb.matmul_4bit(x, self.weight.t(), bias=bias, "
                                           "quant_state=self.weight.quant_state).to(inp_dtype)"),
        (BNB + "autograd/_functions.py", "matmul_4bit", "return MatMul4Bit.apply(A, B, out, bias, quant_state)"),
        (BNB + "autograd/_functions.py", "forward",
         "output = torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(), bias)"),
        (BNB + "functional.py", "dequantize_4bit", "out = torch.empty(shape, dtype=dtype, device=A.device)")],
     {"extension_abi_mismatch", "gpu_arch_unsupported"}),
    ("python load.py --load_in_4bit  # quantizing a 70B model onto one 24 GB card", [
        (SITE + "transformers/modeling_utils.py", "from_pretrained", "model = model.to(device)"),
        (BNB + "nn/modules.py", "_quantize", "w_4bit, quant_state = bnb.functional.quantize_4bit("),
        (BNB + "functional.py", "quantize_4bit", "out = torch.zeros(((n + 1) // mod, 1), dtype=quant_storage, "
                                                 "device=A.device)")],
     {"extension_abi_mismatch", "gpu_arch_unsupported"}),
    # a script that calls init_process_group twice, and DeepSpeed looking for MPI without mpi4py
    ("torchrun --nproc_per_node 2 train.py", [
        ("/work/proj/train.py", "setup", "dist.init_process_group('nccl')"),
        (C10D, "init_process_group", 'raise ValueError("trying to initialize the default process group twice!")')],
     {"rendezvous_unreachable", "dist_port_in_use"}),
    ("deepspeed --num_gpus 8 train.py --deepspeed ds.json", [
        (SITE + "deepspeed/comm/comm.py", "init_distributed",
         "mpi_discovery(distributed_port=distributed_port, verbose=verbose)")],
     {"rendezvous_unreachable"}),
    # env:// with no launcher: the variables are missing, no port is taken
    ("python train.py", [
        (C10D, "init_process_group", "store, rank, world_size = next(rendezvous_iterator)"),
        (SITE + "torch/distributed/rendezvous.py", "_env_rendezvous_handler",
         'rank = int(_get_env_or_raise("RANK"))')],
     {"dist_port_in_use"}),
)


@pytest.mark.parametrize(("setting", "frames", "wrong"), CUT_ORDINARY)
def test_an_ordinary_error_cut_in_an_extension_or_a_group_set_up_is_not_its_loader(setting: str, frames: list,
                                                                                    wrong: set) -> None:
    log = setting + "\n" + _frames(("/work/proj/train.py", "main", "trainer.train()"), *frames)
    assert parse(log).cut_frames
    cats = [x.category for x in analyze(log).likely]
    assert not wrong & set(cats), cats


# the frames of each mechanism itself still rank it: an import, the loader, an old GPU in a kernel call, the store
@pytest.mark.parametrize(("setting", "frames", "first"), [
    ("python train.py --attn_implementation flash_attention_2", [
        (SITE + "transformers/utils/import_utils.py", "_get_module", "return importlib.import_module('.' + name)"),
        (SITE + "flash_attn/__init__.py", "<module>", "from flash_attn.flash_attn_interface import ("),
        (FA, "<module>", "import flash_attn_2_cuda as flash_attn_gpu")], "extension_abi_mismatch"),
    ("python qlora.py --load_in_4bit", [
        (BNB + "__init__.py", "<module>", "from . import research, utils"),
        (BNB + "cextension.py", "get_native_library", "dll = ct.cdll.LoadLibrary(str(binary_path))")],
     "extension_abi_mismatch"),
    ("python train.py --fp16  # Tesla V100-SXM2-32GB", [
        (FA, "flash_attn_func", "return FlashAttnFunc.apply("),
        (FA, "_flash_attn_forward", "out, softmax_lse, S_dmask, rng_state = flash_attn_gpu.fwd(")],
     "gpu_arch_unsupported"),
    ("torchrun --nproc_per_node 8 train.py", [
        (C10D, "init_process_group", "store, rank, world_size = next(rendezvous_iterator)"),
        (SITE + "torch/distributed/rendezvous.py", "_create_c10d_store", "return TCPStore(")], "dist_port_in_use"),
])
def test_a_cut_in_a_mechanisms_own_frame_still_ranks_it(setting: str, frames: list, first: str) -> None:
    log = setting + "\n" + _frames(("/work/proj/train.py", "main", "trainer.train()"), *frames)
    assert _likely(log)[0] == first


# -- a traceback cut in DDP's first collective -----------------------------------------------------------------------

def _ddp_cut(setting: str, frame: tuple[str, str, str] = DDP_INIT) -> str:
    return setting + "\n" + _frames(
        ("/work/proj/train.py", "main", "model = DDP(model.cuda(), device_ids=[dev])"), frame)


def test_a_cut_in_ddps_first_collective_ranks_what_fails_or_waits_there() -> None:
    a = analyze(_ddp_cut(TORCHRUN))
    cats = [x.category for x in a.likely]
    # an error there with no hang in words: NCCL's set-up first, P2P and a rank that never came after it
    assert a.answer == "likely" and cats == ["nccl_env_setup", "nccl_p2p_hang", "peer_rank_failed"], cats
    assert all("every rank" in x.check and "NCCL_P2P_DISABLE" in x.check for x in a.likely), a.likely[0].check
    # a hang there on consumer cards is P2P; a rank still tokenizing leaves the others waiting in DDP's collective
    assert _likely(_ddp_cut(TORCHRUN + "  # 2x RTX 4090\nIt hangs here forever."))[0] == "nccl_p2p_hang"
    prep = TORCHRUN + "\nRunning tokenizer on dataset (num_proc=16):  41%|####      | 410000/1000000"
    assert _likely(_ddp_cut(prep))[0] == "nccl_timeout_preprocessing"
    # one process has no other rank to wait for
    _none(_ddp_cut("python train.py"))


def test_a_cut_in_ddps_own_checks_is_not_its_collective() -> None:
    # DDP refusing a model on the CPU (or spread over GPUs) raises from __init__ itself, before any collective
    log = _ddp_cut(TORCHRUN, (SITE + "torch/nn/parallel/distributed.py", "__init__", "self._log_and_throw("))
    cats = [x.category for x in analyze(log).likely]
    assert not {"nccl_p2p_hang", "nccl_env_setup"} & set(cats), cats
