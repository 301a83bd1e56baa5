"""`shardfit diagnose` on ordinary pastes that name no known cause (a healthy log, the user's own mistake, a hub
typo), and on pastes whose right cause must stay first: the broad hints of round 6 must not turn them into a wrong
"likely" answer. Each paste is made up, after a review that ran 44 of them; each fix keeps the case it was made for.
"""

from __future__ import annotations

import pytest

from tests.helpers import likely_categories as _cats

LORA_STEP = "{'loss': 1.0874, 'grad_norm': 0.7011, 'learning_rate': 4.95e-05, 'epoch': 0.06}"
PIP_UPGRADE = (
    "$ pip install -U transformers accelerate\n"
    "Requirement already satisfied: filelock in ./venv/lib/python3.11/site-packages (from transformers) (3.16.1)\n"
    "Collecting transformers\n  Downloading transformers-4.57.1-py3-none-any.whl (12.0 MB)\n"
    "Collecting accelerate\n  Downloading accelerate-1.10.1-py3-none-any.whl (374 kB)\n"
    "Installing collected packages: accelerate, transformers\n"
    "  Attempting uninstall: accelerate\n    Found existing installation: accelerate 0.34.2\n"
    "    Uninstalling accelerate-0.34.2:\n      Successfully uninstalled accelerate-0.34.2\n"
    "  Attempting uninstall: transformers\n    Found existing installation: transformers 4.44.2\n"
    "    Uninstalling transformers-4.44.2:\n      Successfully uninstalled transformers-4.44.2\n"
    "Successfully installed accelerate-1.10.1 transformers-4.57.1\n")
# the same kind of upgrade through uv, poetry and conda: each tool's own report that the install went through
UV_UPGRADE = (
    "$ uv pip install -U transformers==4.57.1 peft\n"
    "Resolved 41 packages in 1.18s\nPrepared 3 packages in 2.40s\nUninstalled 2 packages in 131ms\n"
    "Installed 3 packages in 52ms\n - peft==0.13.2\n + peft==0.17.1\n + safetensors==0.6.2\n"
    " - transformers==4.46.3\n + transformers==4.57.1\n")
POETRY_UPDATE = (
    "$ poetry update transformers accelerate\nUpdating dependencies\nResolving dependencies... (4.1s)\n\n"
    "Package operations: 1 install, 2 updates, 0 removals\n\n"
    "  - Updating accelerate (0.34.2 -> 1.10.1)\n  - Installing safetensors (0.6.2)\n"
    "  - Updating transformers (4.44.2 -> 4.57.1)\n\nWriting lock file\n")
CONDA_UPDATE = (
    "(ft) $ conda update transformers\nChannels:\n - conda-forge\nPlatform: linux-64\n"
    "Collecting package metadata (repodata.json): done\nSolving environment: done\n\n## Package Plan ##\n\n"
    "  environment location: /opt/conda/envs/ft\n\n  added / updated specs:\n    - transformers\n\n"
    "The following packages will be UPDATED:\n\n"
    "  transformers                 4.44.2-pyhd8ed1ab_0 --> 4.57.1-pyhd8ed1ab_0\n\n"
    "Proceed ([y]/n)? y\n\n\nDownloading and Extracting Packages:\n\n"
    "Preparing transaction: done\nVerifying transaction: done\nExecuting transaction: done\n")
# a release's changed attribute, raised in the library's own frame: a real regression after an upgrade
ATTR_AFTER = ("$ torchrun --nproc_per_node 2 train.py\nTraceback (most recent call last):\n"
              "  File \"/srv/ft/.venv/lib/python3.11/site-packages/peft/tuners/lora/model.py\", line 212, in "
              "_create_and_replace\n    target.update_layer(adapter_name, r, lora_alpha=alpha)\n"
              "AttributeError: 'LoraModel' object has no attribute 'prefix'\n")
# the HF Trainer's loop down to the call of the user's training_step (an installed transformers)
TRAINER_LOOP = (
    "[rank0]: Traceback (most recent call last):\n"
    "[rank0]:   File \"{pkg}/transformers/trainer.py\", line 2325, in train\n"
    "[rank0]:     return inner_training_loop(\n"
    "[rank0]:   File \"{pkg}/transformers/trainer.py\", line 2674, in _inner_training_loop\n"
    "[rank0]:     tr_loss_step = self.training_step(model, inputs, num_items_in_batch)\n")

# label "none": no cause fits, the ranked list must stay empty; otherwise the label must come first and the causes
# under `not` must stay out of the list
CASES = [
    {"id": "snake_case_config_missing", "label": "none", "log": (
        "accelerate launch train.py --config cfg.yaml\n"
        "WARNING: eval_dataset is missing, evaluation will be skipped\n"
        "WARNING: tokenizer_config not found in the output dir, using the base tokenizer\n" + LORA_STEP + "\n"
        "Training ends fine but the output folder has no tokenizer files. How do I get them saved?")},
    {"id": "hub_repo_id_typo", "label": "none", "log": (
        "$ python prep.py --dataset AcmeLab/ClinicalQADataset\n"
        "Repository AcmeLab/ClinicalQADataset not found. Check the repo id, or log in if it is private.")},
    {"id": "latest_checkpoint_is_no_upgrade", "label": "none", "log": (
        "Resuming on the same 4 GPUs. Switching to the latest checkpoint automatically (checkpoint-1500).\n"
        + LORA_STEP + "\nHow do I keep only the two newest checkpoints on disk?")},
    {"id": "users_own_logger_call", "label": "none", "log": (
        "$ torchrun --nproc_per_node 2 train.py\n"
        "[rank0]:     logger.log(f\"step {step} loss {loss:.3f}\")\n"
        "[rank0]: TypeError: Logger.log() missing 1 required positional argument: 'msg'")},
    {"id": "users_own_toy_model", "label": "none", "log": (
        "$ python toy.py\nTraceback (most recent call last):\n"
        "  File \"/home/u/toy.py\", line 30, in <module>\n    y = model(x)\n"
        "TypeError: Model.forward() missing 1 required positional argument: 'mask'")},
    {"id": "cpu_adam_destructor_after_empty_params", "label": "none", "log": (
        "$ deepspeed --num_gpus 2 train.py --deepspeed ds_zero2_offload.json --lora_r 0\n"
        "    raise ValueError(\"optimizer got an empty parameter list\")\n"
        "ValueError: optimizer got an empty parameter list\n"
        "Exception ignored in: <function DeepSpeedCPUAdam.__del__ at 0x7f00aa11bb20>\n"
        "Traceback (most recent call last):\n"
        "    self.ds_opt_adam.destroy_adam(self.opt_id)\n"
        "AttributeError: 'DeepSpeedCPUAdam' object has no attribute 'ds_opt_adam'")},
    {"id": "zero2_healthy_question_zh", "label": "none", "log": (
        LORA_STEP + "\n训练正常，显存占用 62G 左右，保存的时候会保存部分优化器状态吗？\n"
        "用的是 deepspeed zero2，8 张 A800，checkpoint 目录里为什么没有 global_step 文件夹？")},
    {"id": "illegal_access_in_zero2_hook", "label": "none", "log": (
        "$ deepspeed train.py --deepspeed zero2.json --gradient_checkpointing true\n"
        "  File \"/opt/ds/deepspeed/runtime/zero/stage_1_and_2.py\", line 930, in reduce_partition_and_remove_grads\n"
        "    self.reduce_ready_partitions_and_remove_grads(param, i)\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered")},
    {"id": "fsdp_learning_rate_zero", "label": "none", "log": (
        "accelerate launch --config_file fsdp.yaml train.py --learning_rate 0\n"
        "distributed_type: FSDP\n"
        "{'loss': 2.4012, 'grad_norm': 1.13, 'learning_rate': 0.0, 'epoch': 0.01}\n"
        "{'loss': 2.4013, 'grad_norm': 1.20, 'learning_rate': 0.0, 'epoch': 0.02}\n"
        "The loss does not change at all. My sweep script passed --learning_rate 0, is that it?")},
    {"id": "fsdp_grad_norm_zero_once", "label": "none", "log": (
        "accelerate launch --use_fsdp --fsdp_sharding_strategy 1 sft.py --warmup_steps 100\n"
        "{'loss': 11.93, 'grad_norm': 0.0, 'learning_rate': 0.0, 'epoch': 0.0}\n"
        "{'loss': 3.10, 'grad_norm': 4.51, 'learning_rate': 2e-06, 'epoch': 0.01}\n"
        "Traceback (most recent call last):\n    batch = next(it)\nStopIteration")},
    {"id": "vllm_as_backend_zh", "label": "none", "log": (
        "用 vllm 作为后端推理时报错，训练没问题：\n"
        "ValueError: The model's max seq len (32768) is larger than the maximum number of tokens that can be stored "
        "in KV cache (20480). Try increasing `gpu_memory_utilization` or decreasing `max_model_len`.")},
    {"id": "works_on_a_different_gpu", "label": "none", "log": (
        "The model loads fine on a different GPU (an A100 box), but on our V100 server it generates only \"!!!!\".\n"
        "No error, no warning. transformers 4.43.1, torch 2.3.1+cu121.")},
    {"id": "nccl_timeout_on_save_zh", "label": "nccl_timeout_save", "not": ["zero3_save_empty_params"], "log": (
        "deepspeed zero2 训练，8卡，保存checkpoint时部分rank一直卡住，然后超时退出：\n"
        "[rank3]:[E ProcessGroupNCCL.cpp:607] [Rank 3] Watchdog caught collective operation timeout: "
        "WorkNCCL(SeqNum=88213, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=1800000) ran for 1800104 "
        "milliseconds before timing out.\nSaving model checkpoint to output/checkpoint-2000")},
    {"id": "lora_saved_as_expected", "label": "tokenizer_embedding_mismatch", "not": ["zero3_save_empty_params"],
     "log": (
        "deepspeed --num_gpus 4 finetune.py --deepspeed zero2.json --use_lora\n"
        "Only the trainable LoRA parameters are saved (adapter_model.safetensors, 33 MB), as expected.\n"
        "Loading it for inference after adding 2 special tokens:\n"
        "RuntimeError: Error(s) in loading state_dict for PeftModelForCausalLM:\n"
        "\tsize mismatch for base_model.model.model.embed_tokens.weight: copying a param with shape "
        "torch.Size([32002, 4096]) from checkpoint, the shape in current model is torch.Size([32000, 4096]).")},
    {"id": "use_cache_warning_is_no_version_conflict", "label": "none", "log": (
        "$ torchrun --nproc_per_node 4 train.py --bf16 --gradient_checkpointing --deepspeed ds_z2.json\n"
        "`use_cache=True` is incompatible with gradient checkpointing. Setting `use_cache=False`.\n" + LORA_STEP + "\n"
        "Training finishes, but my eval accuracy is below the paper's. Which data split did the authors use?")},
    {"id": "cublas_not_supported_on_a_current_build", "label": "none", "log": (
        "$ python bench_mm.py\nRuntimeError: CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx( "
        "handle, opa, opb, m, n, k, &falpha, a, CUDA_R_16F, lda, b, CUDA_R_16F, ldb)`\n"
        "GPU: H100 80GB, torch 2.4.0+cu124, driver 550")},
    # an upgrade that went through: pip's transcript names old and new versions, but nothing failed
    {"id": "clean_pip_upgrade_with_notices", "label": "none", "log": (
        "# pip install -U deepspeed==0.17.2\nCollecting deepspeed==0.17.2\n"
        "  Downloading deepspeed-0.17.2.tar.gz (1.6 MB)\n  Preparing metadata (setup.py) ... done\n"
        "Building wheels for collected packages: deepspeed\n  Building wheel for deepspeed (setup.py) ... done\n"
        "Successfully built deepspeed\nInstalling collected packages: deepspeed\n"
        "  Attempting uninstall: deepspeed\n    Found existing installation: deepspeed 0.14.4\n"
        "    Uninstalling deepspeed-0.14.4:\n      Successfully uninstalled deepspeed-0.14.4\n"
        "Successfully installed deepspeed-0.17.2\n"
        "WARNING: Running pip as the 'root' user can result in broken permissions and conflicting behaviour with the "
        "system package manager.\n\n[notice] A new release of pip is available: 24.2 -> 25.3\n"
        "[notice] To update, run: pip install --upgrade pip")},
    # the user's own Trainer subclass calls its own methods with the wrong arguments, from its training_step
    {"id": "own_compute_loss_called_wrongly", "label": "none", "log": (
        "$ accelerate launch --num_processes 4 distill.py\n" + TRAINER_LOOP.format(pkg="/work/kd/.venv/lib/"
        "python3.10/site-packages").replace("[rank0]: ", "") + "  File \"/work/kd/distill.py\", line 96, in "
        "training_step\n    loss = self.compute_loss(model, inputs, True)\n"
        "TypeError: DistillTrainer.compute_loss() takes 3 positional arguments but 4 were given")},
    {"id": "own_helper_missing_argument_tail", "label": "none", "log": (
        "[rank1]:   File \"/data/proj/sft/run.py\", line 77, in training_step\n"
        "[rank1]:     scaled = self.weighted_loss(outputs.logits, inputs[\"labels\"])\n"
        "[rank1]:              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        "[rank1]: TypeError: WeightedLossTrainer.weighted_loss() missing 1 required positional argument: 'weights'")},
]


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_ordinary_pastes_get_no_wrong_cause(case: dict) -> None:
    cats = _cats(case["log"])
    if case["label"] == "none":
        assert cats == [], cats
        return
    assert cats[:1] == [case["label"]], cats
    assert not set(case.get("not", [])) & set(cats), cats


def test_a_version_question_must_name_a_library() -> None:
    """"Which versions did you use for the numbers?" is a reproduction question, and a CUDA mismatch the reporter
    says is harmless is no failure; naming the library keeps the question a version hint."""
    env = ("- `transformers` version: 4.44.2\n- PyTorch version (GPU?): 2.4.0+cu121 (True)\n"
           "The CUDA version 12.1 in torch does not match the system nvcc 12.4 but everything works. Which versions "
           "did you use for the benchmark numbers?\n"
           "FileNotFoundError: Couldn't find a dataset script at /data/wikitext/wikitext.py")
    assert _cats(env) == []
    asked = ("TypeError: LlamaAttention.forward() got an unexpected keyword argument 'padding_mask'\n"
             "Which version of transformers did you use?")
    assert "library_version_regression" in _cats(asked)[:1]
    own = ("I suspect the deepspeed release I have. Could you specify which version you used for the experiments? "
           "Mine is `0.17.2`.")
    assert _cats(own)[:1] == ["library_version_regression"]


def test_load_is_a_word_not_part_of_download() -> None:
    """`load` inside "download" or "dataloader" is no reload with another world size."""
    log = ("I downloaded the tokenizer again and ran it on a different number of GPUs; the output is the same.\n"
           "KeyError: 'input_ids'")
    assert "resume_world_size_mismatch" not in _cats(log)
    resumed = ("Loading the checkpoint with a different number of GPUs than it was saved with:\n"
               "RuntimeError: Error(s) in loading state_dict")
    assert "resume_world_size_mismatch" in _cats(resumed)


def test_fp16_off_counts_only_with_an_outcome() -> None:
    """"Running without mixed precision" is a setting; "it works without fp16" is the reporter's own test."""
    healthy = ("INFO Running without mixed precision (fp32 everywhere)\nINFO 1 GPU (RTX 3090)\n"
               "epoch 1 | step 100 | loss 4.12\nThe loss falls slower than in the paper, no GPU memory issues at all.")
    assert _cats(healthy) == []
    oom = ("$ python train.py --no-amp --bs 32\nI turned off AMP because of a warning, now training without fp16 "
           "takes twice the memory:\ntorch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB")
    assert "fp16_nan_loss" not in _cats(oom)
    told = ("$ python train.py --fp16\n{'loss': 0.0, 'grad_norm': nan, 'epoch': 0.3}\n"
            "The loss is fine without fp16.")
    assert _cats(told)[:1] == ["fp16_nan_loss"]


def test_no_gpu_memory_issue_is_no_oom() -> None:
    """A negated memory complaint is no out-of-memory symptom; the plain one still is."""
    assert _cats("Training is slow, but no GPU memory issues.\nHow can I speed it up?") == []
    assert "oom_activation_not_sharded" in _cats("After step 200 I get GPU memory issues with long samples.")


def test_a_met_architecture_requirement_is_no_arch_failure() -> None:
    fine = ("pip install flash-attn==2.5.8 fails on the login node (no GPU there):\n"
            "RuntimeError: FlashAttention is only supported on CUDA 11.6 and above.\n"
            "The compute nodes are A100 (sm_80 is needed, fine). nvcc is not installed on the login node.")
    assert "gpu_arch_unsupported" not in _cats(fine)
    old = ("RuntimeError: CUDA error: invalid device function\nOur cards are V100; the kernel says sm_80 or higher "
           "is needed.")
    assert "gpu_arch_unsupported" in _cats(old)[:1]


def test_one_rank_sharing_a_gpu_is_not_too_many_ranks() -> None:
    """Another user's process on the GPU of a one-rank launch is not a second rank; two ranks on GPU 0 are."""
    oom = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 768.00 MiB. GPU 0 has a total capacity "
           "of 47.54 GiB of which 402.06 MiB is free. Process 31882 has 30.11 GiB memory in use. Process 40121 has "
           "17.01 GiB memory in use. Of the allocated memory 16.2 GiB is allocated by PyTorch.")
    one = _cats("$ torchrun --nproc_per_node 1 train.py --model gpt2-large\nOur lab shares the server.\n" + oom)
    assert one and one[0] != "more_ranks_than_gpus", one
    two = _cats("$ torchrun --nproc_per_node 2 train.py\nmodel = model.to('cuda')\n" + oom)
    assert "more_ranks_than_gpus" in two, two


def test_cudnn_without_an_engine_also_points_at_memory() -> None:
    """cuDNN finds no engine when there is no room for its workspace: a smaller batch that trains fine says so."""
    log = ("$ python train_unet.py --batch 64 --img 1024\n"
           "  File \"/opt/conda/lib/python3.10/site-packages/torch/nn/modules/conv.py\", line 456, in _conv_forward\n"
           "RuntimeError: GET was unable to find an engine to execute this computation\n"
           "With --batch 16 it trains fine; nvidia-smi shows 23.9/24 GB used right before the crash.")
    cats = _cats(log)
    assert {"oom_activation_not_sharded", "nccl_env_setup"} <= set(cats), cats


def test_cpu_adam_destructor_alone_still_points_at_the_build() -> None:
    """The tail of a paste with only the destructor's AttributeError keeps the op-build cause first; with the error
    that made __init__ fail shown above it, neither the build nor a library change is the cause."""
    tail = ("Exception ignored in: <function DeepSpeedCPUAdam.__del__ at 0x7f00aa11bb20>\n"
            "    self.ds_opt_adam.destroy_adam(self.opt_id)\n"
            "AttributeError: 'DeepSpeedCPUAdam' object has no attribute 'ds_opt_adam'")
    assert _cats(tail)[:1] == ["env_deepspeed_op_build"]
    shown = "ValueError: optimizer got an empty parameter list\n" + tail
    assert _cats(shown) == []


def test_a_clean_upgrade_is_no_failure_but_a_conflict_is() -> None:
    """pip's transcript of an upgrade that went through names old and new versions but no failure; pip's resolver
    naming a conflict, or a failure after the upgrade, still points at the versions."""
    assert _cats(PIP_UPGRADE) == []
    conflict = (PIP_UPGRADE.replace("Successfully installed", "ERROR: pip's dependency resolver does not currently "
                "take into account all the packages that are installed.\nllamafactory 0.9.1 requires "
                "transformers<=4.46.1,>=4.41.2, but you have transformers 4.57.1 which is incompatible.\n"
                "Successfully installed"))
    assert _cats(conflict)[:1] == ["library_version_regression"]
    after = (PIP_UPGRADE + "$ python train.py\nTraceback (most recent call last):\n  File \"/home/u/train.py\", "
             "line 40, in <module>\n    trainer = Trainer(model, args, tokenizer=tok)\n"
             "TypeError: Trainer.__init__() got an unexpected keyword argument 'tokenizer'")
    assert _cats(after)[:1] == ["library_version_regression"]


def test_an_own_call_is_no_version_change_but_the_librarys_is() -> None:
    """A TypeError raised where the user's training_step calls its own helper is the user's mistake; the library
    calling the user's hook with a new argument, or the hook calling the library's with one, is a version change."""
    pkg = "/home/mei/venv/lib/python3.11/site-packages"
    own = (TRAINER_LOOP.format(pkg=pkg) + "[rank0]:   File \"/home/mei/rm/train_rm.py\", line 58, in training_step\n"
           "[rank0]:     margin = self.margin_fn(chosen, rejected, self.args.margin_scale)\n"
           "[rank0]: TypeError: PairwiseTrainer.margin_fn() takes 3 positional arguments but 4 were given")
    assert _cats("$ torchrun --nproc_per_node 2 train_rm.py --bf16\n" + own) == []
    hook = TRAINER_LOOP.format(pkg=pkg) + ("[rank0]: TypeError: PairwiseTrainer.training_step() takes 3 positional "
                                           "arguments but 4 were given")
    assert _cats(hook)[:1] == ["library_version_regression"]
    base = (TRAINER_LOOP.format(pkg=pkg) + "[rank0]:   File \"/home/mei/rm/train_rm.py\", line 60, in training_step\n"
            "[rank0]:     return super().training_step(model, inputs, num_items_in_batch)\n"
            "[rank0]: TypeError: Trainer.training_step() takes 3 positional arguments but 4 were given")
    assert _cats(base)[:1] == ["library_version_regression"]


@pytest.mark.parametrize(("log", "question"), [
    (UV_UPGRADE, "Should I pin these in requirements.txt as well?"),
    (POETRY_UPDATE, "Is a poetry.lock with these versions safe to commit?"),
    (CONDA_UPDATE, "conda 的环境里还需要重新装 flash-attn 吗？"),
    (PIP_UPGRADE, "Do I also need to upgrade accelerate before the 8-GPU run, or is this enough?"),
], ids=["uv", "poetry", "conda", "pip"])
def test_a_clean_install_by_any_manager_is_no_failure(log: str, question: str) -> None:
    """uv, poetry and conda report an install that went through in their own words ("Installed 3 packages",
    "Writing lock file", "Executing transaction: done"), and a user may type a question after it: old and new
    releases are named, nothing failed. An error after the transcript, even below such a question, is what the
    upgrade may have caused: the version answer stays first."""
    assert _cats(log) == []
    assert _cats(log + "\n" + question + "\n") == []
    # conda's own `#` lines after a create (how to activate the environment) are no prose of the user's
    assert _cats(log + "#\n# To activate this environment, use\n#\n#     $ conda activate ft\n#\n") == []
    assert _cats(log + ATTR_AFTER)[:1] == ["library_version_regression"]
    said = log + "Since then the same script fails at the first step, what changed?\n"
    assert _cats(said + ATTR_AFTER.split("\n")[-2])[:1] == ["library_version_regression"]
    # poetry ends its run with the lock-file line even when a package failed to build on the way
    failed = log.replace("  - Installing safetensors (0.6.2)\n",
                         "  - Installing flash-attn (2.8.3): Failed\n\nChefBuildError\n")
    if failed != log:
        assert _cats(failed)[:1] == ["library_version_regression"]



@pytest.mark.parametrize(("line", "label"), [
    # a user's own class and method, pasted without its frame: the user's mistake
    ("TypeError: RewardHead.forward() got an unexpected keyword argument 'chosen_ids'", "none"),
    ("TypeError: TinyVisionEncoder.__init__() got an unexpected keyword argument 'patch_size'", "none"),
    ("TypeError: SpanDataset.__init__() got an unexpected keyword argument 'max_len'", "none"),
    ("TypeError: FocalLossModel.forward() missing 1 required positional argument: 'labels'", "none"),
    # a hook the framework calls on the user's subclass, with another release's arguments
    ("TypeError: compute_loss() got an unexpected keyword argument 'num_items_in_batch'", "library_version_regression"),
    ("TypeError: RankTrainer.compute_loss() takes 3 positional arguments but 4 were given",
     "library_version_regression"),
    ("TypeError: GradLogCallback.on_step_end() missing 1 required positional argument: 'control'",
     "library_version_regression"),
    ("TypeError: KDTrainer.create_accelerator_and_postprocess() got an unexpected keyword argument 'plugin'",
     "library_version_regression"),
    # TRL's loop methods, and subclasses named after the trainer anywhere in the name
    ("TypeError: DistillTrainerKL.get_batch_loss_metrics() got an unexpected keyword argument 'train_eval'",
     "library_version_regression"),
    ("TypeError: PatchedGRPO._generate_and_score_completions() got an unexpected keyword argument 'inputs'",
     "library_version_regression"),
    ("TypeError: MyCollator.__call__() got an unexpected keyword argument 'return_tensors'",
     "library_version_regression"),
    ("TypeError: PatchedGRPO.rescale_advantages() got an unexpected keyword argument 'group_size'",
     "library_version_regression"),
    ("TypeError: DistillTrainerKL.kl_term() got an unexpected keyword argument 'temperature'",
     "library_version_regression"),
    # the user's own module or dataset named after the method stays the user's
    ("TypeError: SFTDataset.__init__() got an unexpected keyword argument 'max_len'", "none"),
    # a library's class (a model family's, peft's tuner, a collator) or a keyword the libraries renamed
    ("TypeError: Qwen2Model.forward() got an unexpected keyword argument 'labels'", "library_version_regression"),
    ("TypeError: BaseTuner.__init__() got an unexpected keyword argument 'low_cpu_mem_usage'",
     "library_version_regression"),
    ("TypeError: DataCollatorForSeq2Seq.__init__() got an unexpected keyword argument 'pad_to_multiple'",
     "library_version_regression"),
    ("TypeError: RewardHead.forward() got an unexpected keyword argument 'cache_position'",
     "library_version_regression"),
], ids=lambda x: x.split("(")[0][11:] if x.startswith("TypeError") else x)
def test_a_bare_argument_typeerror_names_its_side(line: str, label: str) -> None:
    """Pasted without its frame, an argument TypeError says whose call it was by its names alone: a method of the
    user's own class that no framework calls is the user's mistake; a framework hook on the user's subclass, a
    library's class, or a keyword the libraries renamed is a version change."""
    cats = _cats(line)
    assert (cats[:1] if label != "none" else cats) == ([label] if label != "none" else []), cats


# A failure the user reports outside the install transcript: above the command, in a `#` note of their own after it,
# or in the words of a symptom other than an error (memory, loss) typed below it
@pytest.mark.parametrize("log", [
    ("It worked with peft 0.12.0. Since upgrading, loading my adapter gives KeyError: 'base_model.model.lm_head'\n"
     "$ pip install -U peft\nCollecting peft\n  Downloading peft-0.13.0-py3-none-any.whl (320 kB)\n"
     "Installing collected packages: peft\nSuccessfully installed peft-0.13.0\n"
     "WARNING: Running pip as the 'root' user can result in broken permissions and conflicting behaviour with the "
     "system package manager.\nAny idea?"),
    ("after upgrading transformers to 4.46 my loss is 10x larger with gradient accumulation (it worked with 4.45.2)\n"
     "$ poetry add transformers@4.46.0\nUpdating dependencies\nResolving dependencies... (2.3s)\n\n"
     "Package operations: 0 installs, 1 update, 0 removals\n\n  - Updating transformers (4.45.2 -> 4.46.0)\n\n"
     "Writing lock file\nshould I pin it back?"),
    ("$ pip install -U peft\nCollecting peft\nInstalling collected packages: peft\n"
     "  Attempting uninstall: peft\n    Found existing installation: peft 0.12.0\n"
     "    Uninstalling peft-0.12.0:\n      Successfully uninstalled peft-0.12.0\nSuccessfully installed peft-0.13.0\n"
     "# after this upgrade, training errors out with KeyError: 'base_model.model.lm_head'\n"
     "# it worked with peft 0.12.0"),
    ("I upgraded transformers from 4.44.2 to 4.46.0:\n" + PIP_UPGRADE.split("\n", 1)[1]
     + "Now the same config goes out of memory on step 1 with the same batch size, what changed?"),
], ids=["above_command", "poetry_loss", "hash_note", "oom_below"])
def test_a_failure_told_outside_the_transcript_keeps_the_version_answer(log: str) -> None:
    """install_ok_end is for a transcript nothing failed around: a failure in any prose line outside the
    manager's own output (before the command, a comment of the user's, an OOM or a loss typed after) keeps the
    version answer first."""
    assert _cats(log)[:1] == ["library_version_regression"]



def test_a_version_question_wrapped_before_the_users_version_keeps_the_version_answer() -> None:
    """sym_version is matched line by line; a question whose answer (the user's own release) a terminal wrapped onto
    the next line still points at the versions."""
    log = ("RuntimeError: CUDA error: an illegal memory access was encountered\n"
           "What version of liger-kernel did you use in the paper? I'm using\n0.3.1 with the recipe's config")
    assert _cats(log)[:1] == ["library_version_regression"]
